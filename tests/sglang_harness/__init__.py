"""Test harness for SGLang's attention kit (sglang 0.5.17): ``prepare()`` readies the import.

Never shipped: the package imports none of this. ``prepare()`` (idempotent):

1. transformers >= 5.13 already registers the ``qwen3_asr`` config that sglang 0.5.17 registers
   again without ``exist_ok`` (it pins transformers 5.12.1): registration is made tolerant of that.
2. ``sgl_kernel``, ``flashinfer`` (and, on the CPU box, ``torchvision``) become placeholders when they
   are not installed (placeholders.py), with a working ``sgl_kernel.fast_topk`` in torch.
3. cupy_fa is registered with SGLang (``cupy_fa.integrations.sglang.register()``).
4. The MLA pool's row writer (a GPU kernel) gets a torch stand-in for CPU tensors
   (``placeholders.install_cpu_mla_writer``).
"""

import functools


@functools.lru_cache(maxsize=None)
def prepare():
    from . import placeholders

    installed = placeholders.install_all()  # before transformers asks whether torchvision is there
    import transformers.utils.import_utils as availability
    from transformers import AutoConfig

    for name in ("is_torchvision_available", "is_vision_available"):
        getattr(getattr(availability, name, None), "cache_clear", lambda: None)()

    original = AutoConfig.register

    def register(model_type, config, exist_ok=False):
        return original(model_type, config, exist_ok=True)

    AutoConfig.register = staticmethod(register)
    import cupy_fa.integrations.sglang as cupy_fa_sgl

    cupy_fa_sgl.register()
    placeholders.install_cpu_mla_writer()
    return installed
