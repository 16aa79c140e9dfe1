"""One bench.mla cell run once by cupy_fa and once by FlashInfer's MLA wrapper, each after a
warm-up, between cudaProfilerStart and cudaProfilerStop, so that `ncu --profile-from-start off`
profiles exactly those launches (ours: the plan, attention and merge kernels; FlashInfer's: its
own) over the same cache and queries. The lab's `ncu-mla-peer` stage (lab/suite_kit_check.sh)
runs it under ncu for the 128- and 16-head decode cells (2026-12-06).

    PYTHONPATH=$PWD:/tmp/fi python3 lab/probe_mla_peer.py --cell "decode B=64 L=4096 H=128"
"""

import argparse
import sys

import numpy as np


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cell", default="decode B=64 L=4096 H=128", help="a bench.mla cell's name")
    args = parser.parse_args(argv)
    import cupy

    from bench import mla

    found = [c for c in mla.CELLS if c[0] == args.cell]
    if not found:
        parser.error(f"--cell must name a bench.mla cell: {', '.join(c[0] for c in mla.CELLS)}")
    _, heads, batch, q_len, kv_len, page, kv_dtype = found[0]
    q_lens, kv_lens = np.full(batch, q_len), np.full(batch, kv_len)
    table, sets = mla.build(heads, batch, q_len, kv_len, page, kv_dtype, 1, seed=7)
    s = sets[0]
    attn = mla.ours_attention(heads, kv_dtype, q_lens, kv_lens)
    attn.plan(q_lens, kv_lens, table, sm_scale=mla.SM_SCALE)

    def ours():
        attn.plan(q_lens, kv_lens, table, sm_scale=mla.SM_SCALE)
        attn.run(s["q"], s["cache"], out=s["out"])

    call, _, how = mla.flashinfer_runner(heads, kv_dtype, table, sets, q_lens, kv_lens, page)
    for _ in range(3):  # compiled, loaded and warm before the profiled launches
        ours()
        call(0)
    cupy.cuda.Device().synchronize()
    print(f"{args.cell}: ours {[type(x.tile).__name__ for x in attn.planned.schedule.launches]}, "
          f"merge {attn.planned.schedule.needs_merge}; FlashInfer {how}", flush=True)
    cupy.cuda.runtime.profilerStart()
    ours()
    cupy.cuda.Device().synchronize()
    call(0)
    cupy.cuda.Device().synchronize()
    cupy.cuda.runtime.profilerStop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
