"""Imports examples/engine.py by path (a top-level name 'examples' may belong to
another package); shared by the CPU and GPU engine tests."""

import importlib.util
import sys
from pathlib import Path

ENGINE_PATH = Path(__file__).resolve().parents[1] / "examples" / "engine.py"


def load_engine():
    name = "cupy_fa_example_engine"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, ENGINE_PATH)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]
