"""`python -m bench.host`: host time per call, ours beside FlashInfer's, in one process.

For each cell (a bench workload at one page size): ``BatchAttention.run`` (out given) and
``BatchAttention.plan`` (host NumPy lengths and page table) against FlashInfer's ``run`` and
``plan`` on the same step, each timed alone after a sync (bench.timing.host_us: sync, one call on
the host clock, the median of many); ours with torch tensors (as FlashInfer, and an engine) and
with CuPy arrays. Then ``GraphRunner.run("decode", ...)`` at B = 1 / 8 / 64 over L = 4096, page
16, device lengths (as ``python -m cupy_fa.demo`` runs it): graph replay and eager, the host time of
one step and the step time of 100 back to back. The kernels' outputs are not checked here (the
bench does that); the inputs are zeros. Prints the table; ``--json PATH`` writes the figures.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np

from . import timing
from . import workloads as W

DEFAULT_CELLS = ("decode_b1_l4096", "decode_b64_l4096", "decode_b1_l131072", "decode_b16_l32768", "verify_q4_b64_l4096",
                 "draft_extend_q4_b64_l4096", "prefill_b4_l4096", "extend_b4_q1024_l16384", "mixed_q2048_d63_l4096",
                 "decode_b64_l4096_w1024", "decode_b64_l4096_sinks", "prefill_b4_l4096_cap50")


def zero_inputs(w, page_size):
    """One input set of workload ``w`` (q, out, a cache of its pages) in zeros, the page table a
    shuffled permutation, as bench.inputs lays it out."""
    import cupy
    import cupy_fa

    from .inputs import InputSet, Inputs, elem_dtype

    rng = np.random.default_rng(0)
    perm = rng.permutation(w.num_pages(page_size)).astype(np.int32)
    table = np.zeros((w.batch, w.pages_per_request(page_size)), np.int32)
    start = 0
    for b, n in enumerate(w.pages_of(page_size)):
        table[b, :n] = perm[start:start + n]
        start += n
    cache = cupy_fa.PagedKVCache.allocate(w.num_pages(page_size), page_size, W.H_KV, w.head_dim, dtype=w.dtype)
    q = cupy.zeros((w.num_q_rows, W.H_Q, w.head_dim), elem_dtype(w.dtype))
    sinks = np.zeros(W.H_Q, np.float32) if w.sinks else None
    return Inputs(w, page_size, np.array(w.q_lens, np.int32), np.array(w.kv_lens, np.int32), table,
                  [InputSet(cache, q, cupy.zeros_like(q))], sinks, None if sinks is None else cupy.asarray(sinks))


def cell(w, page_size, fi, repeats):
    import cupy
    import cupy_fa

    from . import ours, peers

    inp = zero_inputs(w, page_size)
    attn = cupy_fa.BatchAttention(W.H_Q, W.H_KV, w.head_dim, w.dtype)
    attn.plan(inp.q_lens, inp.kv_lens, inp.page_table, causal=w.causal, window=w.window or None,
              logits_soft_cap=w.soft_cap or None)
    s = inp.sets[0]
    attn.run(s.q, s.cache, out=s.out, sinks=inp.sinks_dev)  # compiled and loaded before anything is timed
    cupy.cuda.Device().synchronize()
    row = {"workload": w.name, "page_size": page_size, "ours": ours.host_times(attn, inp, repeats)}
    if fi is not None:
        import torch

        try:
            start = time.perf_counter()
            plan, run, _, how = peers.flashinfer_step(fi, inp)
            run(0)
            torch.cuda.synchronize()
            row["flashinfer"] = {"run_us": timing.host_us(lambda: run(0), torch.cuda.synchronize, repeats),
                                 "plan_us": timing.host_us(plan, torch.cuda.synchronize, max(repeats // 4, 10)),
                                 "how": how, "first_use_s": time.perf_counter() - start}
        except Exception as e:  # noqa: BLE001 - recorded, the table goes on
            row["flashinfer"] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
    del inp, s, attn
    cupy.get_default_memory_pool().free_all_blocks()
    return row


def graph_runner_steps(repeats, batches=(1, 8, 64), kv_len=4096, page_size=16):
    """GraphRunner decode steps, device lengths: host us of one step (sync, one call) and the
    step time of 100 back to back (what the demo prints), replay and eager."""
    import cupy
    import cupy_fa

    runner = cupy_fa.GraphRunner(W.H_Q, W.H_KV, W.HEAD_DIM, W.DTYPE, max_batch_size=max(batches), max_q_len=8,
                                 max_pages_per_request=kv_len // page_size, page_size=page_size)
    rows = []
    for batch in batches:
        w = W.Workload(f"graph_decode_b{batch}", batch, 1, kv_len)
        inp = zero_inputs(w, page_size)
        s = inp.sets[0]
        lens = [cupy.asarray(x, np.int32) for x in (inp.q_lens, inp.kv_lens, inp.page_table)]
        row = {"batch": batch}
        for use_graph, name in ((True, "replay"), (False, "eager")):
            step = lambda: runner.run("decode", s.q, s.cache, *lens, use_graph=use_graph)
            for _ in range(3):
                step()
            sync = cupy.cuda.Device().synchronize
            row[f"{name}_host_us"] = timing.host_us(step, sync, repeats)
            sync()
            start = time.perf_counter()
            for _ in range(100):
                step()
            sync()
            row[f"{name}_step_us"] = (time.perf_counter() - start) / 100 * 1e6
        rows.append(row)
    return rows


def table(rows, steps) -> str:
    f = lambda d, k: f"{d[k]:.1f}" if d and d.get(k) is not None else "-"
    lines = [f"{'cell':34s} {'ours run':>9s} {'(cupy)':>7s} {'FI run':>7s} {'ours plan':>10s} {'FI plan':>8s}"]
    for r in rows:
        o, fi = r["ours"], r.get("flashinfer") or {}
        lines.append(f"{r['workload'] + ' ps=' + str(r['page_size']):34s} {f(o, 'run_us'):>9s} {f(o, 'run_us_cupy'):>7s} "
                     f"{f(fi, 'run_us'):>7s} {f(o, 'plan_us'):>10s} {f(fi, 'plan_us'):>8s}"
                     + (f"  FI: {fi['error'][:80]}" if fi.get("error") else ""))
    lines.append("")
    lines.append(f"{'GraphRunner decode, L=4096, page 16':36s} {'replay host':>11s} {'eager host':>10s} "
                 f"{'replay step':>11s} {'eager step':>10s}")
    for r in steps:
        lines.append(f"{'B=' + str(r['batch']):36s} {r['replay_host_us']:11.1f} {r['eager_host_us']:10.1f} "
                     f"{r['replay_step_us']:11.1f} {r['eager_step_us']:10.1f}")
    lines.append("us of host time per call: sync, one call timed alone, median (bench.timing.host_us); ours with "
                 "torch tensors (cupy: CuPy arrays); plan with host NumPy lengths and page table (FlashInfer: its "
                 "plan as the bench calls it); step: 100 steps back to back over the wall clock")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.host", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("workloads", nargs="*", help=f"workloads (default: {', '.join(DEFAULT_CELLS)})")
    parser.add_argument("--page-size", type=int, action="append", choices=W.PAGE_SIZES, dest="page_sizes",
                        help="page size (repeatable; default 16)")
    parser.add_argument("--repeats", type=int, default=300, help="timed calls per figure (median; default 300)")
    parser.add_argument("--no-flashinfer", action="store_true")
    parser.add_argument("--no-graph", action="store_true", help="skip the GraphRunner steps")
    parser.add_argument("--passes", type=int, default=1,
                        help="run every cell this many times in this process, a table each pass; the JSON's "
                             "figures are the last pass's, the earlier ones under 'passes' (default 1)")
    parser.add_argument("--json", help="also write the figures here")
    args = parser.parse_args(argv)
    from . import refuse_here

    if refuse_here("bench.host"):
        return 1
    from . import peers

    chosen = W.select(args.workloads) if args.workloads else [W.BY_NAME[n] for n in DEFAULT_CELLS]
    fi, reason = (None, "--no-flashinfer") if args.no_flashinfer else peers.load_flashinfer()
    print(f"flashinfer: {getattr(fi, '__version__', '?') if fi else 'not used (' + str(reason)[:200] + ')'}", flush=True)
    passes = []
    for p in range(max(args.passes, 1)):
        rows = []
        for w in chosen:
            for ps in args.page_sizes or [16]:
                start = time.perf_counter()
                rows.append(cell(w, ps, fi if not w.variant else None, args.repeats))
                print(f"[{time.perf_counter() - start:5.1f} s] {w.name} ps={ps}: {json.dumps(rows[-1])[:300]}",
                      flush=True)
        steps = [] if args.no_graph else graph_runner_steps(args.repeats)
        title = f" (pass {p + 1} of {args.passes})" if args.passes > 1 else ""
        print(f"\n{table(rows, steps)}{title}", flush=True)
        passes.append({"cells": rows, "graph_runner": steps})
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**passes[-1], "passes": passes[:-1], "flashinfer": getattr(fi, "__version__", None)}, f,
                      indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
