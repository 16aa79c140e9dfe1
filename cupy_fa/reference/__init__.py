"""Float64 NumPy paged attention: the truth the tests compare the kernels against.

Shapes (B requests, T = sum(q_lens) query rows):

- ``q``: ``[T, H_q, D]``; request b owns rows ``cu[b] .. cu[b] + q_len[b] - 1``
  where ``cu`` is the exclusive cumulative sum of ``q_lens``.
- ``k_cache``, ``v_cache``: ``[num_pages, page_size, H_kv, D]`` (NHD).
- ``q_lens``, ``kv_lens``: ``[B]`` int; ``kv_len`` counts the KV tokens AFTER this
  step's K/V were written, so query i of b sits at position ``kv_len[b] - q_len[b] + i``.
- ``page_table``: ``[B, max_pages]`` int; logical token j of b lives at page
  ``page_table[b, j // page_size]``, offset ``j % page_size``.

Inputs may be NumPy, CuPy or torch arrays of any float dtype (bfloat16 via ml_dtypes
included); everything is computed in float64 on the host. Per request it is a few BLAS
calls (33 requests x kv_len 8192 take about a second); on a small, busy machine set
``OPENBLAS_NUM_THREADS=1`` (``make test`` does) or the BLAS threads' waits dominate.

The package's modules: :mod:`.attention` (paged attention, the merge of two states), :mod:`.mla`
(multi-head latent attention over a paged latent cache),
:mod:`.fp8` (the e4m3 quantiser and its inverse), :mod:`.check` (the error bars and the
per-request checker).
"""

from ._host import to_numpy
from .attention import merge_states, paged_attention
from .check import ABS_FLOOR, LSE_TOL, MAX_ABS, TOL, AttentionCheck, check_attention, relative_error
from .fp8 import E4M3_MAX, dequantize_e4m3, quantize_e4m3
from .mla import mla_attention

__all__ = ["paged_attention", "merge_states", "relative_error", "check_attention", "AttentionCheck", "TOL", "MAX_ABS",
           "LSE_TOL", "ABS_FLOOR", "quantize_e4m3", "dequantize_e4m3", "E4M3_MAX", "to_numpy", "mla_attention"]
