"""Placeholder modules for packages SGLang imports at module level but the attention kit never calls
(the compiled ``sgl_kernel`` / ``flashinfer`` built against another torch; ``torchvision`` on the CPU
box). A test harness only: nothing here ships in the package.

Every attribute and submodule of a placeholder package resolves to a :class:`Missing` that raises
``NotImplementedError`` naming itself when called or instantiated, so a real use fails loudly. The
few real bodies a package needs are given to :func:`install` (``sgl_kernel.fast_topk`` in torch,
``sgl_kernel.utils.is_arch_support_pdl`` -> False). ``calls`` counts what was called.
:func:`install_cpu_mla_writer` gives the MLA pool's row writer (a GPU kernel) a torch stand-in for CPU
tensors.
"""

import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types

calls = {}


class Missing:
    """Stands for ``qualname`` of a package that is not installed."""

    def __init__(self, qualname):
        object.__setattr__(self, "_qualname", qualname)
        object.__setattr__(self, "__name__", qualname.rsplit(".", 1)[-1])
        object.__setattr__(self, "__qualname__", self.__name__)

    def __call__(self, *args, **kwargs):
        calls[self._qualname] = calls.get(self._qualname, 0) + 1
        raise NotImplementedError(f"{self._qualname} is a test placeholder: the package is not installed here")

    def __getattr__(self, name):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return Missing(f"{self._qualname}.{name}")

    def __mro_entries__(self, bases):  # `class X(pkg.Base)` -> a class whose instances refuse to exist
        qualname = self._qualname
        return (type(self.__name__, (), {"__init__": lambda s, *a, **k: Missing(qualname)()}),)

    def __bool__(self):
        return False

    def __repr__(self):
        return f"<placeholder {self._qualname}>"


class _Module(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        value = Missing(f"{self.__name__}.{name}")
        setattr(self, name, value)
        return value


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, root, bodies):
        self.root, self.bodies = root, bodies

    def find_spec(self, fullname, path, target=None):
        if fullname.startswith(self.root + "."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        return _new_module(spec.name, self.bodies, self)

    def exec_module(self, module):
        pass


def _new_module(name, bodies, finder=None):
    module = _Module(name)
    module.__path__ = []
    # a spec, so importlib.util.find_spec (transformers' availability checks) sees the package
    module.__spec__ = importlib.machinery.ModuleSpec(name, finder, is_package=True)
    module.__version__ = "0.0.0+placeholder"
    module.__dict__.update(bodies.get(name, {}))
    return module


def install(root, bodies=None, *, only_if_missing=True):
    """Makes ``root`` (and any ``root.x.y``) importable as a placeholder; ``bodies`` maps a module
    name to the real attributes it gets. Returns False (and does nothing) where ``only_if_missing``
    and the real package is importable."""
    if only_if_missing and root not in sys.modules and importlib.util.find_spec(root) is not None:
        return False
    bodies = bodies or {}
    finder = _Finder(root, bodies)
    sys.modules[root] = _new_module(root, bodies, finder)
    sys.meta_path.insert(0, finder)
    return True


def fast_topk(values, topk, dim):
    """``sgl_kernel.fast_topk`` in torch: (values, indices) of the ``topk`` largest along ``dim``
    (SGLang's own fallback takes ``max`` for top-1, as this does)."""
    import torch

    if topk == 1:
        return torch.max(values, dim=dim, keepdim=True)
    return torch.topk(values, topk, dim=dim)


def install_all():
    """The placeholders the kit's import needs; returns the names installed."""
    done = []
    if install("sgl_kernel", {"sgl_kernel": {"fast_topk": fast_topk},
                              "sgl_kernel.utils": {"is_arch_support_pdl": lambda *a, **k: False}}):
        done.append("sgl_kernel")
    for name in ("flashinfer", "torchvision"):
        if install(name):
            done.append(name)
    return done


def install_cpu_mla_writer():
    """SGLang's MLA pool writes a step's (c_kv, k_pe) rows with ``set_mla_kv_buffer_triton``, a GPU
    kernel: on CPU tensors the same scatter in torch takes its place (CUDA tensors keep the kernel).
    Returns the function installed in ``sglang.srt.mem_cache.memory_pool``."""
    import sglang.srt.mem_cache.memory_pool as memory_pool

    original = memory_pool.set_mla_kv_buffer_triton
    if getattr(original, "cpu_stand_in", False):
        return original

    def set_mla_kv_buffer(kv_buffer, loc, cache_k_nope, cache_k_rope):
        if kv_buffer.is_cuda:
            return original(kv_buffer, loc, cache_k_nope, cache_k_rope)
        nope = cache_k_nope.shape[-1]
        kv_buffer[loc.long(), ..., :nope] = cache_k_nope.reshape(-1, 1, nope).to(kv_buffer.dtype)
        kv_buffer[loc.long(), ..., nope:] = cache_k_rope.reshape(-1, 1, cache_k_rope.shape[-1]).to(kv_buffer.dtype)
        return None

    set_mla_kv_buffer.cpu_stand_in = True
    memory_pool.set_mla_kv_buffer_triton = set_mla_kv_buffer
    return set_mla_kv_buffer
