"""Multi-head latent attention (the absorbed form) on the H200: ``python -m bench.mla``.

Cells (bf16 queries and outputs, a latent cache of 576 columns a token, page size 64 unless named,
a shuffled page table; sm_scale 1 / sqrt(192)):

* decode B=64 over 4096 keys at 128 heads (DeepSeek V3 on one GPU: tensor-core bound) and at 16
  heads (TP 8: memory bound), over a bf16 and an fp8 cache;
* decode B=1 over 32768 keys at 128 and 16 heads;
* verify q=4 B=64 over 4096 keys (4096 + 4: the drafts' rows appended) at 128 and 16 heads;
* decode B=64 L=4096 at 16 heads with page size 1 (SGLang's default page for MLA).

Each beside FlashInfer's ``BatchMLAPagedAttentionWrapper`` (backend "auto": its fa3 kernels on
sm_90a), when FlashInfer imports, over the same cache (its ``ckv`` / ``kpe`` column views), and against
the ceilings measured in the same run: streaming reads (bench/ceilings.py, 16-byte loads) and a bf16
GEMM (torch, 8192^3). Figures: microseconds a step; TB/s of the bytes a step must read (the latent rows
once, q and out once) and its fraction of the read ceiling; TFLOP/s of 2 x H x (576 + 512) per
visible key per query token (causal exact for verify) and its fraction of the GEMM ceiling; ours /
FlashInfer as a speed ratio (FlashInfer's time over ours).

Every cell is held to float64 (cupy_fa.reference.mla_attention) on four requests before it is timed;
a cell over the bf16 bar is reported, not timed. Timing: CUDA-graph replays of 10 launches rotating
over input sets larger than L2 together (bench/timing.py), medians of ``--reps`` replays. Host time:
one ``run`` (and one ``plan`` with host lengths) timed alone after a sync, the median of 100
(bench.timing.host_us; ours with CuPy arrays, FlashInfer's ``run`` with torch tensors).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import sys
import time

import numpy as np

D_LATENT, D_V = 576, 512
SM_SCALE = 1.0 / math.sqrt(192)
FP8 = "float8_e4m3fn"
FP8_SCALE = 4.0 / 448
CELLS = [  # (name, heads, batch, q_len, kv_len, page, kv dtype)
    ("decode B=64 L=4096 H=128", 128, 64, 1, 4096, 64, "bfloat16"),
    ("decode B=64 L=4096 H=16", 16, 64, 1, 4096, 64, "bfloat16"),
    ("decode B=1 L=32768 H=128", 128, 1, 1, 32768, 64, "bfloat16"),
    ("decode B=1 L=32768 H=16", 16, 1, 1, 32768, 64, "bfloat16"),
    ("verify q=4 B=64 L=4096 H=128", 128, 64, 4, 4100, 64, "bfloat16"),
    ("verify q=4 B=64 L=4096 H=16", 16, 64, 4, 4100, 64, "bfloat16"),
    ("decode B=64 L=4096 H=16 page 1", 16, 64, 1, 4096, 1, "bfloat16"),
    ("fp8 decode B=64 L=4096 H=128", 128, 64, 1, 4096, 64, FP8),
    ("fp8 decode B=64 L=4096 H=16", 16, 64, 1, 4096, 64, FP8),
]


def build(heads, batch, q_len, kv_len, page, kv_dtype, n_sets, seed):
    """(page table, [input sets]): each set a latent cache holding every request's keys, q, out."""
    import cupy
    import cupy_fa

    from .inputs import elem_dtype, fill_normal

    rng = np.random.default_rng(seed)
    cupy.random.seed(seed)
    pages_per = -(-kv_len // page)
    table = rng.permutation(batch * pages_per).astype(np.int32).reshape(batch, pages_per)
    sets = []
    for _ in range(n_sets):
        values = fill_normal(cupy.empty((batch * pages_per, page, D_LATENT), elem_dtype("bfloat16")))
        if kv_dtype == FP8:
            cache = cupy_fa.PagedLatentCache.allocate(batch * pages_per, page, FP8, scale=FP8_SCALE)
            flat = values.reshape(-1, D_LATENT)
            cache.append(flat[:, :D_V], flat[:, D_V:], cupy.arange(flat.shape[0], dtype=cupy.int64))
            del values
        else:
            cache = cupy_fa.PagedLatentCache(values)
        q = fill_normal(cupy.empty((batch * q_len, heads, D_LATENT), elem_dtype("bfloat16")))
        out = cupy.empty((batch * q_len, heads, D_V), elem_dtype("bfloat16"))
        sets.append(dict(cache=cache, q=q, out=out))
    return table, sets


def check(cache, q, table, q_lens, kv_lens, rows_of):
    """Relative error against float64 over four requests (their pages gathered on the device first)."""
    import cupy
    from cupy_fa import reference

    from .inputs import bf16_dtype, to_host_f64

    picks = sorted({0, len(q_lens) // 3, 2 * len(q_lens) // 3, len(q_lens) - 1})
    cu = np.concatenate([[0], np.cumsum(q_lens)])
    num = den = 0.0
    page = cache.page_size
    for b in picks:
        n = -(-int(kv_lens[b]) // page)
        # gathered as raw bits (no bf16 arithmetic asked of CuPy), read as values on the host
        bits = (cache.latent if cache.is_fp8 else cache.latent.view(cupy.uint16))[cupy.asarray(table[b, :n])].get()
        latent = bits if cache.is_fp8 else bits.view(bf16_dtype()).astype(np.float64)
        rows = slice(cu[b], cu[b + 1])
        ref = reference.mla_attention(to_host_f64(q[rows]), latent, q_lens[b:b + 1], kv_lens[b:b + 1],
                                      np.arange(n)[None], sm_scale=SM_SCALE, scale=cache.scale)
        got = rows_of(rows)
        num += float(np.sum((got - ref) ** 2))
        den += float(np.sum(ref ** 2))
    return math.sqrt(num / den) if den else float("inf")


def ours_attention(heads, kv_dtype, q_lens, kv_lens):
    """An MLAAttention for the cell with a workspace that holds the batch's splits at their fixed
    positions (decode == verify bits kept), as an engine that serves such batches sizes it (the
    default holds 8 splits a token)."""
    import cupy_fa
    from cupy_fa import _build
    from cupy_fa.mla import plan as mla_plan, schedule as mla_schedule
    from cupy_fa.schedule import partial_row_bytes

    wanted = mla_schedule.schedule_step(heads, kv_dtype != "bfloat16", _build.current_arch(), q_lens=q_lens,
                                        kv_lens=kv_lens).partial_rows
    workspace = max(mla_plan.WORKSPACE_BYTES, wanted * partial_row_bytes(heads, mla_plan.VALUE_DIM, 2))
    return cupy_fa.MLAAttention(heads, "bfloat16", kv_dtype=None if kv_dtype == "bfloat16" else kv_dtype,
                                workspace_bytes=workspace)


def time_ours(heads, kv_dtype, table, sets, q_lens, kv_lens, n_launch, reps):
    import cupy
    from cupy_fa import reference

    from . import timing
    from .inputs import to_host_f64

    attn = ours_attention(heads, kv_dtype, q_lens, kv_lens)
    t0 = time.perf_counter()
    attn.plan(q_lens, kv_lens, table, sm_scale=SM_SCALE)
    attn.run(sets[0]["q"], sets[0]["cache"], out=sets[0]["out"])
    cupy.cuda.Device().synchronize()
    first = time.perf_counter() - t0
    sched = attn.planned.schedule
    cell = {"kernels": [f"{type(x.tile).__name__}{getattr(x.tile, 'warps_m', '')} x{x.work_grid}" for x in sched.launches]
            + (["merge"] if sched.needs_merge else []), "first_call_s": first}
    out = sets[0]["out"]
    cell["digest"] = hashlib.sha1(out.view(cupy.uint16).get().tobytes()).hexdigest()[:12]
    cell["err"] = check(sets[0]["cache"], sets[0]["q"], table, q_lens, kv_lens, lambda r: to_host_f64(out[r]))
    if not cell["err"] <= reference.TOL["bfloat16"]:
        cell["status"] = f"WRONG: rel err {cell['err']:.3g}: not timed"
        return cell
    n = len(sets)
    launches = [lambda i=i: attn.run(sets[i % n]["q"], sets[i % n]["cache"], out=sets[i % n]["out"])
                for i in range(n_launch)]
    t = timing.cupy_graph(launches, warmup=5, reps=reps)
    cell.update(status="ok", us=t.time_us, min_us=t.min_us, max_us=t.max_us)
    # host time of one call, alone after a sync (CuPy arrays; host lengths for plan)
    sync = cupy.cuda.Device().synchronize
    cell["run_host_us"] = timing.host_us(lambda: attn.run(sets[0]["q"], sets[0]["cache"], out=out), sync, repeats=100)
    cell["plan_host_us"] = timing.host_us(lambda: attn.plan(q_lens, kv_lens, table, sm_scale=SM_SCALE), sync,
                                          repeats=100)
    return cell


def flashinfer_runner(heads, kv_dtype, table, sets, q_lens, kv_lens, page):
    """(call, args, how): FlashInfer's MLA wrapper planned for the cell, ``call(i)`` running it over
    input set i (``args[i]``: its q_nope, q_pe, c_kv, k_pe, out), over the caches' column views (or,
    where it refuses them, contiguous copies: ``how`` says which). Raises what FlashInfer raises."""
    import importlib

    import torch

    from .inputs import as_torch

    dev = dict(dtype=torch.int32, device="cuda")
    pages = [-(-int(kv) // page) for kv in kv_lens]
    qo_indptr = torch.as_tensor(np.concatenate([[0], np.cumsum(q_lens)]), **dev)
    kv_indptr = torch.as_tensor(np.concatenate([[0], np.cumsum(pages)]), **dev)
    kv_indices = torch.as_tensor(np.concatenate([table[b, :n] for b, n in enumerate(pages)]), **dev)
    kv_len_arr = torch.as_tensor(np.asarray(kv_lens), **dev)
    fp8 = kv_dtype == FP8
    wrapper = importlib.import_module("flashinfer.mla").BatchMLAPagedAttentionWrapper(
        torch.empty(128 << 20, dtype=torch.uint8, device="cuda"), backend="auto")
    wrapper.plan(qo_indptr, kv_indptr, kv_indices, kv_len_arr, heads, D_V, D_LATENT - D_V, page,
                 bool(q_lens.max() > 1), SM_SCALE, torch.bfloat16, torch.float8_e4m3fn if fp8 else torch.bfloat16)

    def views(s, copies):
        c = s["cache"]
        lat = torch.from_dlpack(c.latent).view(torch.float8_e4m3fn) if fp8 else as_torch(c.latent)
        q = as_torch(s["q"])
        ckv, kpe = lat[..., :D_V], lat[..., D_V:]
        if copies:
            ckv, kpe = ckv.contiguous(), kpe.contiguous()
        return q[..., :D_V].contiguous(), q[..., D_V:].contiguous(), ckv, kpe, torch.empty(
            q.shape[0], heads, D_V, dtype=torch.bfloat16, device="cuda")

    extra = dict(ckv_scale=FP8_SCALE, kpe_scale=FP8_SCALE) if fp8 else {}

    def call(i):
        qn, qp, ckv, kpe, out = args[i]
        return wrapper.run(qn, qp, ckv, kpe, out=out, **extra)

    how = "the cache's column views"
    try:
        args = [views(s, False) for s in sets]
        call(0)
    except Exception as e:  # noqa: BLE001 - e.g. contiguous caches required: copies of its columns
        how = f"contiguous copies of the cache's columns (views refused: {type(e).__name__}: {str(e)[:120]})"
        args = [views(s, True) for s in sets]
        call(0)
    torch.cuda.synchronize()
    return call, args, f"BatchMLAPagedAttentionWrapper(backend={getattr(wrapper, '_backend', 'auto')}) over {how}"


def flashinfer_cell(fi, heads, kv_dtype, table, sets, q_lens, kv_lens, page, n_launch, reps):
    """FlashInfer's MLA wrapper over the same caches (their c_kv / k_pe column views)."""
    from cupy_fa import reference

    from . import timing

    try:
        t0 = time.perf_counter()
        call, args, how = flashinfer_runner(heads, kv_dtype, table, sets, q_lens, kv_lens, page)
        cell = {"how": how, "first_use_s": time.perf_counter() - t0}
    except Exception as e:  # noqa: BLE001 - a peer that cannot run this cell is a recorded cell
        return {"status": f"n/a: {type(e).__name__}: {str(e)[:300]}"}
    out0 = args[0][4]
    cell["err"] = check(sets[0]["cache"], sets[0]["q"], table, q_lens, kv_lens,
                        lambda r: out0[r].float().cpu().numpy().astype(np.float64))
    if not cell["err"] <= reference.TOL["bfloat16"]:
        cell["status"] = f"WRONG: rel err {cell['err']:.3g}: not timed"
        return cell
    n = len(sets)
    t = timing.torch_graph([lambda i=i: call(i % n) for i in range(n_launch)], warmup=5, reps=reps)
    cell.update(status="ok", us=t.time_us, min_us=t.min_us, max_us=t.max_us, method=t.method)
    import torch

    cell["run_host_us"] = timing.host_us(lambda: call(0), torch.cuda.synchronize, repeats=100)
    return cell


def figures(heads, batch, q_len, kv_len, kv_dtype, us):
    """(TB/s of the bytes a step must read, TFLOP/s of its products) at ``us`` microseconds."""
    elem = 1 if kv_dtype == FP8 else 2
    bytes_ = batch * kv_len * D_LATENT * elem + batch * q_len * heads * (D_LATENT + D_V) * 2
    prefix = kv_len - q_len
    keys = sum(prefix + i + 1 for i in range(q_len))  # causal: query i sees prefix + i + 1 keys
    flops = 2 * heads * (D_LATENT + D_V) * keys * batch
    return bytes_ / (us * 1e6), flops / (us * 1e6)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--no-peers", action="store_true")
    parser.add_argument("--only", default="", help="cells whose name holds this text")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--launches", type=int, default=10)
    parser.add_argument("--json", default=None)
    parser.add_argument("--digest", action="store_true",
                        help="print a digest of our first output's bits beside the name (trees compared bit for bit)")
    args = parser.parse_args(argv)
    from . import refuse_here

    if refuse_here("bench.mla"):
        return 1
    import cupy

    from . import ceilings
    from .peers import load_flashinfer

    results = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "cells": {}}
    read = ceilings.measure_read(4 << 30)
    cupy.get_default_memory_pool().free_all_blocks()
    try:
        gemm = ceilings.measure_gemm(8192, reps=20)["tflops"]
    except Exception as e:  # noqa: BLE001
        gemm = float("nan")
        print(f"gemm ceiling: {type(e).__name__}: {e}")
    results.update(read_ceiling_tbps=read["tbps"], gemm_ceiling_tflops=gemm)
    print(f"ceilings: streaming read {read['tbps']:.2f} TB/s, bf16 GEMM {gemm:.0f} TFLOP/s")
    fi, why = (None, "--no-peers") if args.no_peers else load_flashinfer()
    if fi is None:
        print(f"flashinfer: not available ({why})")

    lines = []
    for name, heads, batch, q_len, kv_len, page, kv_dtype in CELLS:
        if args.only and args.only not in name:
            continue
        q_lens, kv_lens = np.full(batch, q_len), np.full(batch, kv_len)
        latent_bytes = batch * kv_len * D_LATENT * 2
        n_sets = max(2, -(-(150 << 20) // latent_bytes))  # more than L2 (60 MB) together
        table, sets = build(heads, batch, q_len, kv_len, page, kv_dtype, n_sets, seed=7)
        row = {"ours": time_ours(heads, kv_dtype, table, sets, q_lens, kv_lens, args.launches, args.reps)}
        if fi is not None:
            row["flashinfer"] = flashinfer_cell(fi, heads, kv_dtype, table, sets, q_lens, kv_lens, page,
                                                args.launches, args.reps)
        for who, cell in row.items():
            if cell.get("status") == "ok":
                tbps, tflops = figures(heads, batch, q_len, kv_len, kv_dtype, cell["us"])
                cell.update(tbps=tbps, tflops=tflops, read_fraction=tbps / read["tbps"], gemm_fraction=tflops / gemm)
        results["cells"][name] = row
        ours, peer = row["ours"], row.get("flashinfer", {})
        text = f"{name:34s}"
        if args.digest:
            text += f" bits {ours.get('digest', '-'):12s}"
        if ours.get("status") == "ok":
            text += (f" ours {ours['us']:8.1f} us {ours['tbps']:5.2f} TB/s ({100 * ours['read_fraction']:3.0f}% read) "
                     f"{ours['tflops']:6.1f} TFLOP/s ({100 * ours['gemm_fraction']:3.0f}% gemm) err {ours['err']:.1e}")
        else:
            text += f" ours {ours.get('status')}"
        if peer.get("status") == "ok":
            text += (f" | FlashInfer {peer['us']:8.1f} us {peer['tbps']:5.2f} TB/s {peer['tflops']:6.1f} TFLOP/s "
                     f"err {peer['err']:.1e} | ours x{peer['us'] / ours['us']:.2f}" if ours.get("status") == "ok"
                     else f" | FlashInfer {peer['us']:8.1f} us")
        elif peer:
            text += f" | FlashInfer {peer.get('status')}"
        if "run_host_us" in ours:
            text += f" | host run {ours['run_host_us']:.1f} plan {ours['plan_host_us']:.1f} us"
            if "run_host_us" in peer:
                text += f" (FlashInfer run {peer['run_host_us']:.1f})"
        text += f"   [{', '.join(ours.get('kernels', []))}]"
        print(text, flush=True)
        lines.append(text)
        del sets
        cupy.get_default_memory_pool().free_all_blocks()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
