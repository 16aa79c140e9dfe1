"""Our kernel: check against the fp64 reference, then time as cupy graph replays."""

from __future__ import annotations

import traceback

from . import timing
from .inputs import Inputs, count_nan, max_error, poison, to_host_f64
from .workloads import H_KV, H_Q
from cupy_fa import reference
from cupy_fa import families


def bench_ours(inp: Inputs, refs_by_set: dict, opts: dict, n_launch: int) -> dict:
    """refs_by_set: {set index: reference windows}. Returns a cell with status 'ok' or 'FAIL'."""
    import cupy
    import cupy_fa

    w, sets = inp.workload, inp.sets
    limit = reference.TOL[w.dtype]
    res = {"status": "FAIL"}
    try:
        attn = cupy_fa.BatchAttention(H_Q, H_KV, w.head_dim, dtype=w.dtype, kv_dtype=w.kv_dtype or None,
                                      head_dim_vo=w.head_dim_vo or None)
        attn.plan(inp.q_lens, inp.kv_lens, inp.page_table, causal=w.causal, window=w.window or None,
                  logits_soft_cap=w.soft_cap or None)
        sinks = inp.sinks_dev  # the attention variants (a plan's window and soft-cap, a run's sinks)
        res["families"] = [f"{families.family_of(x.tile).name} {x.work_grid} items"
                           for x in attn.planned.schedule.launches]  # what ran (cupy_fa.schedule)
        errs, unwritten = {}, 0
        for i, refs in refs_by_set.items():  # several input sets against one plan
            s = sets[i]
            poison(s.out)
            attn.run(s.q, s.cache, out=s.out, sinks=sinks)
            cupy.cuda.Device().synchronize()
            unwritten += count_nan(s.out)
            errs[i] = max_error(inp, lambda lo, hi, s=s: to_host_f64(s.out[lo:hi]), refs)
        err = max(errs.values())
        res.update(err=err, err_by_set={str(k): v for k, v in errs.items()}, nan_or_unwritten=unwritten)
        ok = err <= limit and unwritten == 0
        if not ok:
            res["error"] = f"max rel err {err:.3g} (limit {limit}), {unwritten} NaN/unwritten outputs"

        n = len(sets)
        launches = [lambda i=i: attn.run(sets[i % n].q, sets[i % n].cache, out=sets[i % n].out, sinks=sinks)
                    for i in range(n_launch)]
        t = timing.cupy_graph(launches, warmup=opts["warmup"], reps=opts["reps"])
        res.update(t.as_dict(), value=w.figure(t.time_us), sets=n)
        res["host"] = host_times(attn, inp, opts["cpu_repeat"])
        res["status"] = "ok" if ok else "FAIL"
    except Exception as e:  # noqa: BLE001 - recorded as FAIL, the bench goes on
        res["error"] = f"{type(e).__name__}: {str(e)[:400]}"
        res["where"] = traceback.format_exc(limit=4)[-800:]
    return res


def host_times(attn, inp: Inputs, repeats: int) -> dict:
    """Host time of ``attn``'s run (set 0, out given) and plan (host lengths and page table, as an
    engine gives them), as bench.timing.host_us takes it for every implementation: with torch
    tensors where torch imports (what FlashInfer runs on, and an engine passes), CuPy arrays
    otherwise (``run_us_cupy`` beside it either way)."""
    import cupy

    w, s, sync = inp.workload, inp.sets[0], cupy.cuda.Device().synchronize
    out = {"run_us_cupy": timing.host_us(lambda: attn.run(s.q, s.cache, out=s.out, sinks=inp.sinks_dev), sync, repeats)}
    try:
        from .inputs import as_torch

        q, o = as_torch(s.q), as_torch(s.out)
        sinks = as_torch(inp.sinks_dev) if inp.sinks_dev is not None else None
        out["arrays"] = "torch"
    except Exception:  # noqa: BLE001 - no torch: CuPy arrays
        q, o, sinks = s.q, s.out, inp.sinks_dev
        out["arrays"] = "cupy"
    out["run_us"] = timing.host_us(lambda: attn.run(q, s.cache, out=o, sinks=sinks), sync, repeats)
    plan = lambda: attn.plan(inp.q_lens, inp.kv_lens, inp.page_table, causal=w.causal, window=w.window or None,
                             logits_soft_cap=w.soft_cap or None)
    out["plan_us"] = timing.host_us(plan, sync, max(repeats // 4, 10))
    return out
