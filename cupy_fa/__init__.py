"""cupy_fa: paged-KV attention for LLM inference on CuPy/NVRTC.

Public API:
    PagedKVCache      K/V pages [num_pages, page_size, H_kv, D] (fp16 / bf16, or fp8 e4m3fn with scales);
                      ``append`` writes new tokens at slots.
    BatchAttention    ``plan(q_lens, kv_lens, page_table, ...)`` then ``run(q, cache, out=None)``.
    ForwardMode, contract_lengths   serving modes -> the contract's q_len / kv_len (cupy_fa.modes).
    GraphRunner       CUDA-graph capture and replay per (mode, batch bucket) (cupy_fa.graph).
    MLAAttention, PagedLatentCache   multi-head latent attention (DeepSeek V2 / V3, Kimi K2), the absorbed
                      form, over a paged latent cache [num_pages, page_size, 576] (cupy_fa.mla).
    BatchInvarianceWarning   a batch whose split partials overflow the workspace (results may depend on it).
    merge_states      two attention states (out, natural-log lse) over disjoint keys into one (cupy_fa.merge).
    warmup            compile kernels ahead of time (cupy_fa.catalog).
    knobs             the CUPY_FA_* environment variables, read once (cupy_fa.knobs).
    reference         float64 NumPy truth (cupy_fa.reference.paged_attention, .merge_states).

Each name is imported on first use (PEP 562), so ``import cupy_fa`` is cheap and a compile worker
(``cupy_fa._compile``) loads only what it runs.
"""

import importlib

_WHERE = {"BatchAttention": "attention", "ForwardMode": "modes", "GraphRunner": "graph", "PagedKVCache": "kv_cache",
          "contract_lengths": "modes", "from_sglang": "modes", "merge_states": "merge", "warmup": "catalog",
          "MLAAttention": "mla", "PagedLatentCache": "mla", "BatchInvarianceWarning": "plan"}
_MODULES = ("knobs", "reference")

__all__ = ["BatchAttention", "BatchInvarianceWarning", "ForwardMode", "GraphRunner", "MLAAttention", "PagedKVCache",
           "PagedLatentCache", "contract_lengths", "from_sglang", "knobs", "merge_states", "reference", "warmup"]
__version__ = "0.1.0"


def __getattr__(name):
    if name in _WHERE:
        value = getattr(importlib.import_module(f".{_WHERE[name]}", __name__), name)
    elif name in _MODULES:
        value = importlib.import_module(f".{name}", __name__)
    else:
        raise AttributeError(f"module 'cupy_fa' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))
