"""MLA host time per call (lab probe, 2026-12-08): ``MLAAttention.run`` (out given) and ``plan`` (host
lengths) of the bench.mla cells' shapes, each call timed alone after a sync, the median of 200
(bench.timing.host_us), for the cupy_fa on PYTHONPATH; zeros in, outputs not checked. Run it once
per tree, interleaved, to compare trees:

    PYTHONPATH=exp/base python3 lab/mla_host_ab.py; PYTHONPATH=$PWD python3 lab/mla_host_ab.py
"""

import os
import sys

import numpy as np

CELLS = [("decode B=64 L=4096 H=128", 128, 64, 1, 4096), ("decode B=64 L=4096 H=16", 16, 64, 1, 4096),
         ("decode B=1 L=32768 H=128", 128, 1, 1, 32768), ("verify q=4 B=64 L=4096 H=128", 128, 64, 4, 4096)]


def main():
    import cupy
    import cupy_fa
    from cupy_fa import _arrays

    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    sys.path.insert(0, here)  # bench.timing from this tree
    from bench import timing

    sync = cupy.cuda.Device().synchronize
    print(f"cupy_fa from {os.path.dirname(cupy_fa.__file__)}")
    for name, heads, b, q_len, kv_len in CELLS:
        pages = -(-kv_len // 64)
        table = np.random.default_rng(0).permutation(b * pages).astype(np.int32).reshape(b, pages)
        q_lens, kv_lens = np.full(b, q_len, np.int64), np.full(b, kv_len, np.int64)
        cache = cupy_fa.PagedLatentCache.allocate(b * pages, 64, "bfloat16")
        attn = cupy_fa.MLAAttention(heads, "bfloat16")
        q = cupy.zeros((b * q_len, heads, 576), _arrays.DTYPES["bfloat16"])
        out = cupy.empty((b * q_len, heads, 512), _arrays.DTYPES["bfloat16"])
        attn.plan(q_lens, kv_lens, table)
        attn.run(q, cache, out=out)
        run = timing.host_us(lambda: attn.run(q, cache, out=out), sync)
        plan = timing.host_us(lambda: attn.plan(q_lens, kv_lens, table), sync)
        print(f"{name:32s} run {run:7.1f} us  plan {plan:7.1f} us", flush=True)


if __name__ == "__main__":
    main()
