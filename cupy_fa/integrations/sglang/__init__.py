"""SGLang (0.5.17) on cupy_fa: the attention backend ``"cupy_fa"``.

::

    pip install -e '.[cuda13]'       # beside sglang 0.5.17; the entry point below registers it
    sglang serve --model-path <model> --attention-backend cupy_fa

or, in a script that builds SGLang objects itself::

    import cupy_fa.integrations.sglang as cupy_fa_sgl
    cupy_fa_sgl.register()

:func:`register` (the package's ``sglang.srt.plugins`` entry point, which SGLang's ``load_plugins()`` runs
in every process before it parses the server arguments) adds ``"cupy_fa"`` to SGLang's attention
backends (``register_attention_backend``) and to ``--attention-backend``'s choices
(``add_attention_backend_choices``), hooks EAGLE's draft-backend factory (:mod:`.draft`), and gives
DeepSeek's MLA layers the absorbed path under ``"cupy_fa"`` (:mod:`.mla`).
Importing this package imports neither torch nor sglang; :func:`register` does.

What maps where: :mod:`.metadata` (SGLang's seq_lens conventions -> cupy_fa's contract, the page
table, the tree mask), :mod:`.backend` (``CupyFaAttnBackend``, the 0.5.17 metadata split),
:mod:`.draft` (EAGLE draft workers), :mod:`.mla` (MLA layers over ``MLATokenToKVPool``), :mod:`.kernels`
(cupy_fa's objects behind the backend).
docs/sglang.md has the whole mapping, the tested versions and the limits.
"""

NAME = "cupy_fa"
TESTED_SGLANG = "0.5.17"

__all__ = ["NAME", "TESTED_SGLANG", "create_backend", "register"]


def create_backend(model_runner):
    """SGLang's backend factory for ``"cupy_fa"``: ``CupyFaAttnBackend(model_runner)``."""
    from .backend import CupyFaAttnBackend

    return CupyFaAttnBackend(model_runner)


def register():
    """Registers ``"cupy_fa"`` with SGLang (idempotent); returns the name.

    Raises:
        ImportError: sglang (or torch) is not installed.
    """
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS, register_attention_backend
    from sglang.srt.server_args import ATTENTION_BACKEND_CHOICES, add_attention_backend_choices

    from .draft import install_draft_hook
    from .mla import install_dispatch

    if NAME not in ATTENTION_BACKEND_CHOICES:
        add_attention_backend_choices([NAME])
    if ATTENTION_BACKENDS.get(NAME) is not create_backend:
        register_attention_backend(NAME)(create_backend)
    install_draft_hook()
    install_dispatch(NAME)
    return NAME
