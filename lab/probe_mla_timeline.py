"""Where the MLA seesaw kernel's CTAs spend their time (diagnosis only, GPU; lab).

Runs in a tree whose seesaw kernel carries the stamps of lab/mla_trace_stamp.py
(`mla_trace[cta][24]`: start / done ns, SM, and per warpgroup the cycles spent in the S issue
(its mbarrier waits), the loop-top S wait, the exchange barriers, the P V products and the fills,
and the prologue's steps), over one launch of each cell (or those whose name holds the first
argument), and prints the means per CTA. (The kernel with runs of splits of cc59e88 had its own
stamps and per-split form of this probe: both at 6b46f41.)

    cd exp/trace && PYTHONPATH=$PWD python3 ../../lab/probe_mla_timeline.py ["decode B=64 L=4096 H=128"]
"""

import sys

import numpy as np

import cupy
import cupy_fa
from cupy_fa import _build

from bench import mla as B

CELLS = [("decode B=64 L=4096 H=128", 128, 64, 1, 4096), ("verify q=4 B=64 L=4096 H=128", 128, 64, 4, 4100),
         ("decode B=1 L=32768 H=128", 128, 1, 1, 32768), ("decode B=64 L=4096 H=16", 16, 64, 1, 4096)]
WG = ("issue S (load waits)", "top S wait", "exchange barriers", "P V products", "fills")


def trace_array():
    for kernel in _build.compiled_kernels():
        if "mla_wgmma_kernel" in kernel.expression:
            module = _build._modules[(_build._device_id(None), kernel)]
            return cupy.ndarray((8192, 24), cupy.uint64, module.get_global("mla_trace"))
    raise RuntimeError("no traced mla_wgmma_kernel compiled (run in a tree with the trace patch)")


def main(argv=None):
    only = (argv if argv is not None else sys.argv[1:])[:1]
    for name, heads, batch, q_len, kv_len in CELLS:
        if only and only[0] not in name:
            continue
        table, sets = B.build(heads, batch, q_len, kv_len, 64, "bfloat16", 2, seed=7)
        q_lens, kv_lens = np.full(batch, q_len), np.full(batch, kv_len)
        attn = cupy_fa.MLAAttention(heads, "bfloat16", workspace_bytes=1 << 30)
        attn.plan(q_lens, kv_lens, table, sm_scale=B.SM_SCALE)
        for _ in range(3):
            attn.run(sets[0]["q"], sets[0]["cache"], out=sets[0]["out"])
        cupy.cuda.Device().synchronize()
        tr = trace_array()
        tr.fill(0)
        attn.run(sets[1]["q"], sets[1]["cache"], out=sets[1]["out"])
        cupy.cuda.Device().synchronize()
        t = cupy.asnumpy(tr).astype(np.int64)
        t = t[t[:, 1] > 0]
        n = len(t)
        start, done, sm = t[:, 0], t[:, 1], t[:, 2]
        dur_ns = done - start
        cyc_end, cyc_loop, cyc_first = t[:, 8], t[:, 14], t[:, 15]
        ghz = float(np.median(cyc_end / np.maximum(dur_ns, 1)))
        print(f"== {name}: {n} CTAs, span {(done.max() - start.min()) / 1e3:.1f} us, CTA {np.mean(dur_ns) / 1e3:.2f} us "
              f"(median {np.median(dur_ns) / 1e3:.2f}), clock ~{ghz:.2f} GHz, SMs {len(set(sm.tolist()))}")
        print(f"   cycles a CTA from its start: barriers set {np.mean(t[:, 18]):.0f}, query copies issued "
              f"{np.mean(t[:, 19]):.0f}, first pair's copies issued {np.mean(t[:, 20]):.0f}, query landed "
              f"{np.mean(t[:, 21]):.0f}, first S issued {np.mean(cyc_first):.0f}, loop's end {np.mean(cyc_loop):.0f}, "
              f"end {np.mean(cyc_end):.0f} (epilogue {np.mean(cyc_end - cyc_loop):.0f})")
        for wg in range(2):
            parts = [np.mean(t[:, 3 + 6 * wg + k]) for k in range(5)]
            print(f"   warpgroup {wg}: " + ", ".join(f"{w} {x:.0f}" for w, x in zip(WG, parts))
                  + f" (loop {np.mean(cyc_loop - cyc_first):.0f})")
        # idle gaps of an SM between one CTA's end and the next one's start
        gaps = []
        for s_id in set(sm.tolist()):
            idx = np.argsort(start[sm == s_id])
            st, dn = start[sm == s_id][idx], done[sm == s_id][idx]
            gaps += list(st[1:] - dn[:-1])
        if gaps:
            g = np.array(gaps) / 1e3
            print(f"   SM gaps between CTAs: mean {g.mean():.2f} us, median {np.median(g):.2f}, max {g.max():.2f}")
        if t[:, 22].any() and t[:, 23].any():  # (stamps of 2026-12-06: the entry and the last warp's exit)
            entry, out = t[:, 22], t[:, 23]
            launch = []
            for s_id in set(sm.tolist()):
                idx = np.argsort(entry[sm == s_id])
                launch += list(entry[sm == s_id][idx][1:] - out[sm == s_id][idx][:-1])
            print(f"   work lookup (entry to start) {np.mean(start - entry) / 1e3:.2f} us, last warp out after thread "
                  f"0's end {np.mean(out - done) / 1e3:.2f} us, an SM's last warp out to its next CTA's entry "
                  f"{np.mean(launch) / 1e3:.2f} us (median {np.median(launch) / 1e3:.2f})")
        del sets
        cupy.get_default_memory_pool().free_all_blocks()
    return 0


if __name__ == "__main__":
    sys.exit(main())
