"""Adapters that plug cupy_fa into inference engines.

``cupy_fa.integrations.transformers``: Hugging Face transformers (5.x) attention
implementations, ``"paged|cupy_fa"`` for continuous batching and ``"cupy_fa"`` for
``generate``. Each adapter imports its engine lazily: importing this package
imports neither torch nor transformers.
"""
