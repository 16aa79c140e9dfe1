"""What makes verify q=4 slower than decode on the same grid (diagnosis only, GPU).

B=64, L=4096, page 16, bf16, H_kv = 8, D = 128, one shuffled cache. Every config below runs
the one-row folding tile over the same 512 CTAs and reads the same K/V bytes; they differ in
how many of a tile's 16 rows are real and where those rows come from:
  decode, H_q = 32:         1 token x 4 heads    =  4 real rows
  decode, H_q = 64 / 128:   1 token x 8 / 16     =  8 / 16 real rows (one query per row, no mask)
  verify q = 4, H_q = 32:   4 tokens x 4 heads   = 16 real rows, causal (the bench's shape)
  verify q = 4, not causal: the same rows, no mask
Printed: graph-replay time per launch (20 launches over 2 rotating q/out sets, median of the
slices replayed for ~2 s) and TB/s of K/V read, each config twice in interleaved rounds.
"""

import dataclasses
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import cupy  # noqa: E402

import cupy_fa  # noqa: E402
from cupy_fa import knobs  # noqa: E402
from cupy_fa._timing import per_launch_us_for  # noqa: E402
from bench.inputs import empty_bf16, fill_normal, count_nan  # noqa: E402

B, L, PAGE, H_KV, D = 64, 4096, 16, 8, 128
CONFIGS = [("decode H_q 32 (4 rows)", 1, 32, True), ("decode H_q 64 (8 rows)", 1, 64, True),
           ("decode H_q 128 (16 rows)", 1, 128, True), ("verify q4 H_q 32 causal", 4, 32, True),
           ("verify q4 H_q 32 not causal", 4, 32, False)]
# PROBE_SPLITS="512 1024": each config planned at each split size (CUPY_FA_SPLIT_SIZE): how the
# per-split epilogue's cost scales with the real rows
SPLITS = os.environ.get("PROBE_SPLITS", "512").split()


def main():
    rng = np.random.default_rng(int(time.time()))
    pages = B * L // PAGE
    cache = cupy_fa.PagedKVCache.allocate(pages, PAGE, H_KV, D, dtype="bfloat16")
    fill_normal(cache.k)
    fill_normal(cache.v)
    table = rng.permutation(pages).astype(np.int32).reshape(B, L // PAGE)
    kv_bytes = B * L * H_KV * D * 2 * 2
    runs = {}
    for split in SPLITS:
        knobs.use(dataclasses.replace(knobs.knobs(), split_size=int(split)))  # plans below take it
        for name, q_len, h_q, causal in CONFIGS:
            attn = cupy_fa.BatchAttention(h_q, H_KV, D, dtype="bfloat16")
            attn.plan(np.full(B, q_len, np.int32), np.full(B, L, np.int32), table, causal=causal)
            sets = [(fill_normal(empty_bf16((B * q_len, h_q, D))), empty_bf16((B * q_len, h_q, D)))
                    for _ in range(2)]
            launches = [lambda i=i, a=attn, s=sets: a.run(s[i % 2][0], cache, out=s[i % 2][1]) for i in range(20)]
            runs[f"S={split} {name}"] = (attn, sets, launches)
    for rnd in (1, 2):
        for name in runs:
            attn, sets, launches = runs[name]
            for _, out in sets:
                out.view(cupy.uint16).fill(0)
            per = per_launch_us_for(launches, 2.0)
            cupy.cuda.Device().synchronize()
            bad = sum(count_nan(out) for _, out in sets)
            print(f"round {rnd}  {name:37s} {per:7.1f} us  {kv_bytes / per / 1e6:.3f} TB/s  tile "
                  f"{attn.planned.tile}  NaN outputs {bad}", flush=True)


if __name__ == "__main__":
    main()
