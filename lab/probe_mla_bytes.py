"""How much of the MLA seesaw kernel's time its latent loads cost (diagnosis only, GPU; lab).

Times MLAAttention.run (CUDA events, median of 50 after 10, out not checked) on the 128-head cells in
the tree it runs in; run it in copies of the kernel whose fills load only some of each block's keys
(`lab/mla_bytes_tree.sh`: half the keys, or none) beside the kernel as it is: the time each keeps is
what loading fewer bytes could ever give.

    cd exp/half && PYTHONPATH=$PWD python3 ../../lab/probe_mla_bytes.py
"""

import sys

import numpy as np

import cupy
import cupy_fa

from bench import mla as B

CELLS = [("decode B=64 L=4096 H=128", 128, 64, 1, 4096), ("verify q=4 B=64 L=4096 H=128", 128, 64, 4, 4100),
         ("decode B=64 L=4096 H=16", 16, 64, 1, 4096)]


def main():
    for name, heads, batch, q_len, kv_len in CELLS:
        table, sets = B.build(heads, batch, q_len, kv_len, 64, "bfloat16", 2, seed=7)
        attn = cupy_fa.MLAAttention(heads, "bfloat16", workspace_bytes=1 << 30)
        attn.plan(np.full(batch, q_len), np.full(batch, kv_len), table, sm_scale=B.SM_SCALE)
        times = []
        for i in range(60):
            s = sets[i % 2]
            start, end = cupy.cuda.Event(), cupy.cuda.Event()
            start.record()
            attn.run(s["q"], s["cache"], out=s["out"])
            end.record()
            end.synchronize()
            if i >= 10:
                times.append(cupy.cuda.get_elapsed_time(start, end) * 1e3)
        print(f"{name:32s} {np.median(times):8.1f} us (min {np.min(times):.1f})", flush=True)
        del sets
        cupy.get_default_memory_pool().free_all_blocks()
    return 0


if __name__ == "__main__":
    sys.exit(main())
