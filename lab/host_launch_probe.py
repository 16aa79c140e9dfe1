"""Where `run`'s host time goes on a GPU machine, launch by launch: for each bench cell, its plan and
one run, then (after a sync each time, the median of many) the whole `run`, and each of the step's
launches alone through `_build.launch_packed` (the attention kernels, plain or hooked as the run takes
them, then the split merge, a programmatic launch). Written 2026-12-06 (issue 41: the cells whose
`run` read 20-60 us on a busy host).

    PYTHONPATH=. python3 lab/host_launch_probe.py [CELL ...]      (a GPU machine)
"""

import statistics
import sys
import time

CELLS = ("decode_b64_l4096", "decode_b1_l4096", "decode_b16_l32768", "decode_b1_l131072", "prefill_b4_l4096",
         "prefill_b4_l4096_cap50", "mixed_q2048_d63_l4096", "extend_b4_q1024_l16384")


def host_us(fn, sync, repeats=200):
    times = []
    for _ in range(repeats + 5):
        sync()
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return 1e6 * statistics.median(times[5:]), 1e6 * min(times[5:])


def main(argv):
    import cupy

    import cupy_fa
    from bench import host, workloads as W
    from cupy_fa import _build

    sync = cupy.cuda.Device().synchronize
    stream = cupy.cuda.get_current_stream().ptr
    print(f"{'cell':28s} {'run med/min':>14s}   launches (med/min us each)")
    for name in argv or CELLS:
        w = W.BY_NAME[name]
        inp = host.zero_inputs(w, 16)
        attn = cupy_fa.BatchAttention(W.H_Q, W.H_KV, w.head_dim, w.dtype)
        attn.plan(inp.q_lens, inp.kv_lens, inp.page_table, causal=w.causal, window=w.window or None,
                  logits_soft_cap=w.soft_cap or None)
        s = inp.sets[0]
        run = lambda: attn.run(s.q, s.cache, out=s.out, sinks=inp.sinks_dev)
        run()
        sync()
        whole = host_us(run, sync)
        prepared = attn.planned.prepared
        hooked = prepared.always_hooked or inp.sinks_dev is not None
        parts = []
        for plain, with_hooks, _ in prepared.attention:
            launch = with_hooks if hooked else plain
            parts.append((launch.kernel.expression.split("<")[0].split("::")[-1], host_us(lambda: _build.launch_packed(launch, stream), sync)))
        if prepared.merge is not None:
            merge = next(iter(prepared.merge[2].values()))
            parts.append(("merge (programmatic)", host_us(lambda: _build.launch_packed(merge, stream), sync)))
        print(f"{name:28s} {whole[0]:6.1f}/{whole[1]:6.1f}   "
              + "; ".join(f"{k} {m:.1f}/{n:.1f}" for k, (m, n) in parts), flush=True)
        del attn, inp, s
        cupy.get_default_memory_pool().free_all_blocks()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
