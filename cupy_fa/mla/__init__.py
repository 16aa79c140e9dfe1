"""Multi-head latent attention (DeepSeek V2 / V3 / R1, Kimi K2), the absorbed form engines run for
decode-like steps: :class:`PagedLatentCache` (one ``[num_pages, page_size, 576]`` array of c_kv and
k_pe rows, 16-bit or fp8 with a scale) and :class:`MLAAttention` (``plan`` a step, ``run`` it per
layer: q ``[T, H, 576]`` -> out ``[T, H, 512]`` and LSE). docs/usage.md, "Multi-head latent attention",
says which call an engine makes for which step, and how the non-absorbed prefill joins it.

The kernels compile without spills; their host side and softmax schedules are tested on the CPU,
the kernels against float64 on the GPU (``tests/test_mla_gpu.py``; ``bash lab/mla_check.sh`` runs
those tests and the bench)."""

from .attention import DEFAULT_SM_SCALE, MLAAttention
from .cache import PagedLatentCache
from .warm import warmup

__all__ = ["DEFAULT_SM_SCALE", "MLAAttention", "PagedLatentCache", "warmup"]
