"""Where a call's host time goes on a GPU machine: cProfile of BatchAttention.run (torch tensors,
out given), BatchAttention.plan (host NumPy lengths) and a GraphRunner decode replay, 2000 calls
each with a sync every 50, the top functions by own time. The probe behind the host-time cuts
(lab/NOTES.md, 2026-12-05); the figures themselves come from `python -m bench.host`.

    PYTHONPATH=. python lab/host_profile_gpu.py     (a GPU machine, torch installed)
"""

import cProfile
import io
import pstats
import sys

import numpy as np


def profile(label, fn, sync, calls=2000):
    for _ in range(20):
        fn()
    sync()
    prof = cProfile.Profile()
    prof.enable()
    for i in range(calls):
        fn()
        if i % 50 == 49:
            sync()
    prof.disable()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(14)
    print(f"\n== {label}: {calls} calls\n" + "\n".join(text.getvalue().splitlines()[4:]))


def main():
    import cupy
    import torch

    import cupy_fa

    rng = np.random.default_rng(0)
    b, kv, page = 64, 4096, 16
    pages = kv // page
    table = rng.permutation(b * pages).astype(np.int32).reshape(b, pages)
    cache = cupy_fa.PagedKVCache.allocate(b * pages, page, 8, 128, dtype="bfloat16")
    q_lens, kv_lens = np.ones(b, np.int32), np.full(b, kv, np.int32)
    q = torch.zeros((b, 32, 128), dtype=torch.bfloat16, device="cuda")
    out = torch.empty_like(q)
    attn = cupy_fa.BatchAttention(32, 8, 128, "bfloat16")
    attn.plan(q_lens, kv_lens, table)
    sync = torch.cuda.synchronize
    profile("run, decode B=64 L=4096, torch tensors", lambda: attn.run(q, cache, out=out), sync)
    profile("plan, decode B=64 L=4096, host NumPy lengths", lambda: attn.plan(q_lens, kv_lens, table), sync)
    runner = cupy_fa.GraphRunner(32, 8, 128, "bfloat16", max_batch_size=64, max_q_len=8, max_pages_per_request=pages,
                                 page_size=page)
    qc = cupy.zeros((b, 32, 128), cupy_fa._arrays.DTYPES["bfloat16"])
    lens = [cupy.asarray(x) for x in (q_lens, kv_lens, table)]
    profile("GraphRunner decode B=64 replay, CuPy device lengths", lambda: runner.run("decode", qc, cache, *lens),
            cupy.cuda.Device().synchronize)
    profile("GraphRunner decode B=64 eager", lambda: runner.run("decode", qc, cache, *lens, use_graph=False),
            cupy.cuda.Device().synchronize)
    return 0


if __name__ == "__main__":
    sys.exit(main())
