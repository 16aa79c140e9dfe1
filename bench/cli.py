"""`python -m bench`: ceilings, then every selected workload at every page size: ours and the
peers, checked then timed; a JSON file, a PNG, and the table printed last."""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import time
import traceback

from . import workloads as W


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bench",
        description="cupy_fa paged attention against its ceilings and peers (H_q 32, H_kv 8; bf16, D 128, causal "
                    "unless the workload says otherwise).",
        epilog="workloads: " + ", ".join(W.BY_NAME) + ". Patterns: exact name, prefix ('decode'), glob.")
    p.add_argument("workloads", nargs="*", help="workloads to run (default: all)")
    p.add_argument("--page-size", type=int, action="append", choices=W.PAGE_SIZES, dest="page_sizes",
                   help="page size (repeatable; default: 16 and 1)")
    p.add_argument("--quick", action="store_true",
                   help="short run: 3 warm-up + 10 timed replays, smaller ceilings")
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"),
                   help="results folder (default: bench/results/)")
    p.add_argument("--launches", type=int, default=20,
                   help="launches per graph for decode-like workloads (default 20); prefill/extend use a "
                        "quarter of it (at least 4): each launch is over 0.5 ms there")
    p.add_argument("--reps", type=int, help="timed graph replays, median taken (default 30; --quick 10)")
    p.add_argument("--warmup", type=int, help="untimed replays first (default 10; --quick 3)")
    p.add_argument("--seed", type=int, help="random seed (default: from the clock; recorded in the JSON)")
    p.add_argument("--no-peers", action="store_true", help="ours only")
    p.add_argument("--no-flashinfer", action="store_true", help="skip FlashInfer even if importable")
    p.add_argument("--no-ceilings", action="store_true",
                   help=f"skip measuring ceilings; use the reference {W.REFERENCE_READ_TBPS} TB/s, "
                        f"{W.REFERENCE_GEMM_TFLOPS:.0f} TFLOP/s")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--budget", type=float, default=0,
                   help="seconds: start no new workload after this much time (0: no limit); the JSON "
                        "is rewritten after every cell either way")
    p.add_argument("--list", action="store_true", help="list the workloads with bytes, flops and floors; no GPU")
    return p


def list_workloads() -> str:
    head = (f"{'workload':27s} {'shape':23s} {'B':>3s} {'q_len':>6s} {'kv_len':>7s} {'KV MB':>9s} {'q+o MB':>8s} "
            f"{'GFLOP':>9s} {'bytes floor us':>15s} {'flop floor us':>14s}  metric")
    lines = [head]
    for w in W.WORKLOADS:
        fb, ff = w.floors_us()
        lengths = (f"{w.q_len:6d} {w.kv_len:7d}" if w.uniform else
                   f"{'/'.join(str(q) for _, q, _ in w.ragged):>6s} {'/'.join(str(kv) for _, _, kv in w.ragged):>7s}")
        lines.append(f"{w.name:27s} {w.shape:23s} {w.batch:3d} {lengths} {w.kv_bytes() / 1e6:9.1f} "
                     f"{w.qo_bytes() / 1e6:8.1f} {w.flops() / 1e9:9.1f} {fb:15.1f} {ff:14.1f}  {w.metric}")
    lines.append(f"floors: min bytes (KV + q + out) / {W.REFERENCE_READ_TBPS} TB/s; "
                 f"flops / {W.REFERENCE_GEMM_TFLOPS:.0f} TFLOP/s")
    lines.append("ragged (mixed) batches list each group's q_len / kv_len: " + "; ".join(
        f"{w.name} = " + " + ".join(f"{n} x (q {q}, kv {kv})" for n, q, kv in w.ragged)
        for w in W.WORKLOADS if not w.uniform))
    return "\n".join(lines)


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def _free() -> None:
    import cupy

    cupy.get_default_memory_pool().free_all_blocks()
    if "torch" in sys.modules:
        sys.modules["torch"].cuda.empty_cache()


def run_cell(w, ps, ctx) -> dict:
    """One (workload, page size): inputs, reference, ours, peers."""
    from . import inputs, ours, peers

    opts = ctx["opts"]
    n_launch = ctx["launches"] if w.kind == "memory" else max(4, ctx["launches"] // 4)  # compute, mixed: > 0.3 ms
    n_sets = W.num_sets(w.min_bytes(), ctx["l2"], n_launch)
    seed = ctx["seed"] + 1000 * W.WORKLOADS.index(w) + ps
    inp = inputs.make_inputs(w, ps, n_sets, seed)
    windows = W.check_windows(w)
    t0 = time.perf_counter()
    refs = {0: inputs.reference_windows(inp, inp.sets[0], windows)}
    refs[len(inp.sets) - 1] = inputs.reference_windows(inp, inp.sets[-1], windows[:1])
    ref_s = time.perf_counter() - t0

    impls = {"ours": ours.bench_ours(inp, refs, opts, n_launch)}
    if not ctx["no_peers"]:
        calling = tuple(peers.SDPA_BACKENDS)  # the cells of the peer being called, for its FAIL below
        try:  # a peer that raises past its own handler (a fault that loses the CUDA context) is its FAIL
            if w.name not in ctx["sdpa"]:  # dense SDPA has no pages: timed once per workload
                ctx["sdpa"][w.name] = {k: dict(v, timed_at_page_size=ps) for k, v in
                                       peers.bench_sdpa(inp, refs[0], opts, n_launch).items()}
            impls.update(ctx["sdpa"][w.name])
            calling = ("flashinfer",)
            if ctx["fi"] is not None:
                impls["flashinfer"] = peers.bench_flashinfer(ctx["fi"], inp, refs[0], opts, n_launch)
            else:
                impls["flashinfer"] = peers.cell("n/a", error=ctx["fi_reason"])
        except Exception as e:  # noqa: BLE001
            ctx["lost"] = f"a peer's call in {w.name} ps={ps} raised {type(e).__name__}: {str(e)[:200]}"
            for name in calling:
                impls.setdefault(name, peers.cell("FAIL", error=ctx["lost"]))
            impls.setdefault("flashinfer", peers.cell("n/a", error=f"not run: {ctx['lost']}"))
            return _row_of(w, ps, ctx, impls, 0.0, ())
    del inp
    _free()
    return _row_of(w, ps, ctx, impls, ref_s, windows)


def _row_of(w, ps, ctx, impls, ref_s, windows) -> dict:
    read_c, gemm_c = ctx["ceilings_used"]["read_tbps"], ctx["ceilings_used"]["gemm_tflops"]
    floor_bytes_us, floor_flops_us = w.floors_us(read_c, gemm_c)
    o, fi = impls["ours"], impls.get("flashinfer", {})
    row = {
        "workload": w.name, "page_size": ps, "kind": w.kind, "metric": w.metric,
        "batch": w.batch, "q_len": w.q_len, "kv_len": w.kv_len, "note": w.note,
        "head_dim": w.head_dim, "dtype": w.dtype, "causal": w.causal, "ragged": [list(g) for g in w.ragged],
        "kv_bytes": w.kv_bytes(), "min_bytes": w.min_bytes(), "flops": w.flops(),
        "floor_bytes_us": floor_bytes_us, "floor_flops_us": floor_flops_us,
        "check_windows": windows, "reference_s": ref_s, "impls": impls,
        "ours_frac_ceiling": (w.floor_fraction(o["time_us"], read_c, gemm_c) if w.kind == "mixed" else
                              o["value"] / (read_c if w.kind == "memory" else gemm_c)) if o.get("value") else None,
        "ours_over_flashinfer": (fi["time_us"] / o["time_us"])
        if fi.get("status") == "ok" and o.get("time_us") else None,
    }
    return row


def _cell_line(row) -> str:
    parts = []
    for name, c in row["impls"].items():
        if c.get("value") is not None:
            err = c.get("err", float("nan"))
            flag = "" if c.get("status") == "ok" else f" [{c['status']}]"
            parts.append(f"{name} {c['time_us']:.1f} us {c['value']:.2f} {row['metric']} err {err:.1e}{flag}")
        else:
            parts.append(f"{name} {c.get('status')}: {c.get('error') or c.get('note', '')}"[:220])
    return f"{row['workload']} ps={row['page_size']}: " + " | ".join(parts)


def main(argv=None) -> int:
    t_start = time.perf_counter()
    args = build_parser().parse_args(argv)
    if args.list:
        print(list_workloads())
        return 0
    try:
        chosen = W.select(args.workloads)
    except ValueError as e:
        print(e, file=sys.stderr)
        return 2
    from . import refuse_here

    if refuse_here("bench"):  # one line, not CuPy's traceback (--list needs no GPU)
        return 1
    page_sizes = args.page_sizes or list(W.PAGE_SIZES)
    q = args.quick
    opts = {"warmup": args.warmup if args.warmup is not None else (3 if q else 10),
            "reps": args.reps or (10 if q else 30), "cpu_repeat": 50 if q else 200}
    launches = args.launches
    seed = args.seed if args.seed is not None else int(time.time()) % 100000

    import cupy

    from . import ceilings, peers, plot, report

    cupy.cuda.Device(0).use()
    fi, fi_reason = (None, "disabled (--no-flashinfer)") if (args.no_flashinfer or args.no_peers) \
        else peers.load_flashinfer()
    if fi is None:
        print(f"flashinfer: not importable ({fi_reason})" if "disabled" not in fi_reason
              else f"flashinfer: {fi_reason}", flush=True)
    else:
        print(f"flashinfer: {getattr(fi, '__version__', '?')} from {os.path.dirname(fi.__file__)}", flush=True)
    machine = report.machine_info(getattr(fi, "__version__", None) if fi else None)
    log(f"machine: {machine}")

    measured = {} if args.no_ceilings else ceilings.measure_all(quick=q, log=log)
    read_tbps = (measured.get("read") or {}).get("tbps")
    gemm_tflops = (measured.get("gemm") or {}).get("tflops")
    ceilings_used = {"read_tbps": read_tbps or W.REFERENCE_READ_TBPS,
                     "gemm_tflops": gemm_tflops or W.REFERENCE_GEMM_TFLOPS,
                     "read_from": "measured" if read_tbps else "reference (docs/performance.md)",
                     "gemm_from": "measured" if gemm_tflops else "reference (docs/performance.md)"}

    ctx = {"opts": opts, "launches": launches, "seed": seed, "l2": machine["l2_bytes"], "fi": fi,
           "fi_reason": fi_reason, "no_peers": args.no_peers, "sdpa": {}, "ceilings_used": ceilings_used}
    stamp = datetime.datetime.now()
    base = os.path.join(args.out, f"bench_{stamp.strftime('%Y%m%d-%H%M%S')}")
    rows, skipped = [], []
    results = {
        "date": stamp.isoformat(timespec="seconds"), "argv": sys.argv[1:] if argv is None else list(argv),
        "seed": seed, "opts": dict(opts, launches=launches, page_sizes=page_sizes),
        "shape": {"dtype": W.DTYPE, "H_q": W.H_Q, "H_kv": W.H_KV, "D": W.HEAD_DIM,
                  "note": "the default; each row has its own head_dim, dtype and causal"},
        "machine": machine, "ceilings": measured, "ceilings_used": ceilings_used,
        "flashinfer": {"version": getattr(fi, "__version__", None) if fi else None, "reason": fi_reason},
        "rows": rows, "skipped": skipped, "failures": [],
    }
    for w in chosen:
        for ps in page_sizes:
            if args.budget and time.perf_counter() - t_start > args.budget:
                skipped.append(f"{w.name} ps={ps}")
                continue
            if ctx.get("lost"):  # the process's CUDA context is gone: nothing after it can run
                skipped.append(f"{w.name} ps={ps}")
                continue
            log(f"{w.name} page_size={ps} ...")
            try:
                rows.append(run_cell(w, ps, ctx))
            except Exception as e:  # noqa: BLE001 - inputs or reference failed: a FAIL row, go on
                rows.append({"workload": w.name, "page_size": ps, "kind": w.kind, "metric": w.metric,
                             "impls": {"ours": {"status": "FAIL", "error": f"{type(e).__name__}: {str(e)[:400]}",
                                                "where": traceback.format_exc(limit=4)[-800:]}}})
                _free()
            log(_cell_line(rows[-1]))
            results["failures"] = [f"{r['workload']} ps={r['page_size']}: {r['impls']['ours'].get('error', '')}"
                                   for r in rows if r["impls"]["ours"].get("status") != "ok"]
            report.write_json(results, base + ".json")
    results["wall_s"] = time.perf_counter() - t_start
    report.write_json(results, base + ".json")
    print(f"wrote {base}.json", flush=True)
    if not args.no_plot:
        try:
            png = plot.plot(results, base + ".png")
            if png:
                print(f"wrote {png}", flush=True)
        except Exception as e:  # noqa: BLE001
            print(f"plot failed: {type(e).__name__}: {e}", flush=True)
    for f in results["failures"]:
        print(f"FAIL {f}", flush=True)
    if skipped:
        why = f"after {ctx['lost']}" if ctx.get("lost") else "over --budget"
        print(f"skipped ({why}): {', '.join(skipped)}", flush=True)
    print(f"\n{report.legend(results)}")
    print(report.table(rows), flush=True)
    return 1 if results["failures"] else 0
