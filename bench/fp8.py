"""The fp8 (e4m3fn) KV cache beside the bf16 one, on the H200: ``python -m bench.fp8``.

Cells (H_q 32, H_kv 8, D 128, bf16 queries and outputs, page size 16, a shuffled page table):

* decode B=64 L=4096: ours over the bf16 cache, ours over an fp8 cache (scales per KV head, and
  per tensor), FlashInfer's ``BatchDecodeWithPagedKVCacheWrapper`` over the bf16 cache and over
  the per-tensor fp8 cache (``kv_data_type=float8_e4m3fn``, its ``k_scale`` / ``v_scale``), when
  FlashInfer imports. Figures: microseconds per step, tokens per second (B / time), TB/s of the
  bytes a step must read (its K/V once in the cache's element size, q once, out once) and that
  as a fraction of the read ceiling measured in the same run (bench/ceilings.py, a streaming
  16-byte-load kernel), and ours fp8 / ours bf16 in tokens per second.
* prefill B=4 L=4096 causal: ours over the bf16 cache (the sm_90a wgmma family) and over the
  fp8 cache (the wgmma family's fp8 tile), TFLOP/s.

Every cell is checked against float64 before it is timed: decode on four of its requests,
prefill on row windows (the first and the last 32 rows of two requests), on the dequantised
cache for fp8; a cell over the bar is reported, not timed. Timing: CUDA-graph replays of
launches rotating over two input sets (bench/timing.py), medians. The fp8 caches hold the
bf16 cache's values quantised by ``PagedKVCache.append`` (so the fp8 cells' error against the
bf16 ones is printed too).

``--warm-peers`` only runs FlashInfer's two decode wrappers once on a tiny batch (its JIT
compiles them), so a script can overlap that with other work; ``--no-peers`` times ours alone;
``--ab`` (tuning only) times the fp8 decode cell at the points of ``AB_POINTS``: keys per KV
tile, pipeline depth, the CTAs folding their splits or not, and the split size
(``families.mma_sync.FP8_BLOCK_N``, ``FP8_STAGES``, ``CUPY_FA_FOLD_SPLITS``, ``CUPY_FA_SPLIT_SIZE``), each
checked against float64 first.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np
from cupy_fa import families
from cupy_fa import catalog

H_Q, H_KV, D, PAGE = 32, 8, 128, 16
FP8 = "float8_e4m3fn"
SCALE = 6.0 / 448  # the N(0, 1) values' 6-sigma at 448: a per-tensor scale


def head_scales():
    return (SCALE * (1 + 0.05 * np.arange(H_KV))).astype(np.float32)


def build(batch, q_len, kv_len, seed, n_sets=2):
    """Input sets: (q, out, bf16 cache, fp8 cache per head, fp8 cache per tensor) each, one page table."""
    import cupy
    import cupy_fa

    from .inputs import elem_dtype, fill_normal

    rng = np.random.default_rng(seed)
    cupy.random.seed(seed)
    pages_per = -(-kv_len // PAGE)
    table = rng.permutation(batch * pages_per).astype(np.int32).reshape(batch, pages_per)
    sets = []
    for _ in range(n_sets):
        c16 = cupy_fa.PagedKVCache.allocate(batch * pages_per, PAGE, H_KV, D, "bfloat16")
        fill_normal(c16.k)
        fill_normal(c16.v)
        caches = {"bf16": c16}
        for name, scale in (("fp8 per-head", head_scales()), ("fp8 per-tensor", SCALE)):
            c8 = cupy_fa.PagedKVCache.allocate(batch * pages_per, PAGE, H_KV, D, FP8, k_scale=scale, v_scale=scale)
            slots = cupy.arange(c16.num_slots, dtype=cupy.int64)
            c8.append(c16.k.reshape(-1, H_KV, D), c16.v.reshape(-1, H_KV, D), slots)  # quantised on the device
            caches[name] = c8
        q = fill_normal(cupy.empty((batch * q_len, H_Q, D), elem_dtype("bfloat16")))
        sets.append({"q": q, "out": cupy.empty_like(q), "caches": caches})
    cupy.cuda.Device().synchronize()
    return table, sets


def reference_rows(cache, q, table, q_lens_all, kv_lens_all, windows):
    """float64 reference of row windows (b, r0, r1): rows r0..r1-1 of request b, over b's pages."""
    import cupy
    from cupy_fa import reference

    from .inputs import to_host_elems

    refs = {}
    cu = np.concatenate([[0], np.cumsum(q_lens_all)])
    for b, r0, r1 in windows:
        ql, kl = int(q_lens_all[b]), int(kv_lens_all[b])
        kv_eff = kl - ql + r1
        n = -(-kv_eff // PAGE)
        pages = cupy.asarray(table[b, :n].astype(np.int64))
        if cache.is_fp8:
            k, v = cache.k[pages].get(), cache.v[pages].get()
            scales = dict(k_scale=cache.k_scale, v_scale=cache.v_scale)
        else:
            k, v = to_host_elems(cache.k, pages), to_host_elems(cache.v, pages)
            scales = {}
        qh = to_host_elems(q[cu[b] + r0:cu[b] + r1])
        refs[(b, r0, r1)] = reference.paged_attention(qh, k, v, [r1 - r0], [kv_eff], np.arange(n)[None], **scales)
    return refs


def window_error(out, refs, q_lens_all):
    from cupy_fa import reference

    from .inputs import to_host_elems

    cu = np.concatenate([[0], np.cumsum(q_lens_all)])
    return max(reference.relative_error(to_host_elems(out[cu[b] + r0:cu[b] + r1]).astype(np.float64), ref)
               for (b, r0, r1), ref in refs.items())


def kv_bytes(batch, kv_len, elem):
    return batch * kv_len * H_KV * D * elem * 2


def qo_bytes(rows):
    return 2 * rows * H_Q * D * 2


def time_ours(kind, table, sets, q_lens, kv_lens, windows, n_launch, reps):
    import cupy
    import cupy_fa
    from cupy_fa import reference

    from . import timing

    fp8 = kind != "bf16"
    attn = cupy_fa.BatchAttention(H_Q, H_KV, D, "bfloat16", kv_dtype=FP8 if fp8 else None)
    attn.plan(q_lens, kv_lens, table)
    cell = {"families": [f"{families.family_of(x.tile).name} {x.tile}" for x in attn.planned.schedule.launches]}
    errs = []
    from .inputs import poison

    for s in sets:
        poison(s["out"])
        attn.run(s["q"], s["caches"][kind], out=s["out"])
        cupy.cuda.Device().synchronize()
        errs.append(window_error(s["out"], reference_rows(s["caches"][kind], s["q"], table, q_lens, kv_lens, windows),
                                 q_lens))
    cell["err"] = max(errs)
    if not cell["err"] <= reference.TOL["bfloat16"]:
        cell["status"] = f"WRONG: rel err {cell['err']:.3g} > {reference.TOL['bfloat16']}: not timed"
        return cell, None
    outs = [s["out"].copy() for s in sets]
    n = len(sets)
    launches = [lambda i=i: attn.run(sets[i % n]["q"], sets[i % n]["caches"][kind], out=sets[i % n]["out"])
                for i in range(n_launch)]
    t = timing.cupy_graph(launches, warmup=5, reps=reps)
    cell.update(status="ok", us=t.time_us, min_us=t.min_us, max_us=t.max_us)
    return cell, outs


def flashinfer_decode(fi, kind, table, sets, q_lens, kv_lens, windows, n_launch, reps, warm_only=False):
    """FlashInfer's paged decode over the bf16 cache or the per-tensor fp8 one (its k_scale / v_scale)."""
    import torch
    from cupy_fa import reference

    from . import timing
    from .inputs import as_torch

    fp8 = kind != "bf16"
    pages = [-(-int(kv) // PAGE) for kv in kv_lens]
    dev = dict(dtype=torch.int32, device="cuda")
    workspace = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    kv_indptr = torch.as_tensor([0] + list(np.cumsum(pages)), **dev)
    kv_indices = torch.as_tensor(np.concatenate([table[b, :n] for b, n in enumerate(pages)]), **dev)
    last = torch.as_tensor([int(kv) - (n - 1) * PAGE for kv, n in zip(kv_lens, pages)], **dev)

    def kv_of(s):  # [pages, 2, page_size, H_kv, D], the pages in our order
        c = s["caches"][kind]
        if fp8:  # stacked as bytes, then viewed as e4m3fn
            return torch.stack([torch.from_dlpack(c.k), torch.from_dlpack(c.v)], dim=1).view(torch.float8_e4m3fn)
        return torch.stack([as_torch(c.k), as_torch(c.v)], dim=1)

    cell, last_error = {}, None
    for tensor_cores in (True, False):
        try:
            wrapper = fi.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD", use_tensor_cores=tensor_cores)
            wrapper.plan(kv_indptr, kv_indices, last, H_Q, H_KV, D, PAGE, q_data_type=torch.bfloat16,
                         kv_data_type=torch.float8_e4m3fn if fp8 else torch.bfloat16)
            kvs = [kv_of(s) for s in sets]
            qs = [as_torch(s["q"]) for s in sets]
            outs = [torch.empty_like(q) for q in qs]
            scale = dict(k_scale=SCALE, v_scale=SCALE) if fp8 else {}

            def call(i):
                return wrapper.run(qs[i], kvs[i], out=outs[i], **scale)

            t0 = time.perf_counter()
            call(0)
            torch.cuda.synchronize()
            cell = {"how": f"BatchDecodeWithPagedKVCacheWrapper(use_tensor_cores={tensor_cores}, kv_data_type="
                           f"{'float8_e4m3fn' if fp8 else 'bfloat16'})", "first_use_s": time.perf_counter() - t0}
            break
        except Exception as e:  # noqa: BLE001 - try the other variant, then report
            last_error = f"{type(e).__name__}: {str(e)[:300]}"
    else:
        return {"status": f"n/a: {last_error}"}, None
    if warm_only:
        return cell, None
    s0 = sets[0]
    refs = reference_rows(s0["caches"][kind], s0["q"], table, q_lens, kv_lens, windows)
    import cupy

    err = window_error(cupy.from_dlpack(outs[0]), refs, q_lens)
    cell["err"] = err
    if not err <= reference.TOL["bfloat16"]:
        cell["status"] = f"WRONG: rel err {err:.3g}: not timed"
        return cell, None
    n = len(sets)
    t = timing.torch_graph([lambda i=i: call(i % n) for i in range(n_launch)], warmup=5, reps=reps)
    cell.update(status="ok", us=t.time_us, min_us=t.min_us, max_us=t.max_us, method=t.method)
    return cell, None


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--no-peers", action="store_true", help="ours only")
    parser.add_argument("--peers-only", action="store_true", help="FlashInfer's cells only (with the ceiling)")
    parser.add_argument("--warm-peers", action="store_true",
                        help="run FlashInfer's decode wrappers once (JIT) and exit")
    parser.add_argument("--no-prefill", action="store_true")
    parser.add_argument("--ab", action="store_true",
                        help="also time the fp8 decode tile at 64 / 128 keys per tile, each depth, folded or not")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    from . import refuse_here

    if refuse_here("bench.fp8"):
        return 1
    import cupy

    from . import ceilings
    from .peers import load_flashinfer

    fi, why = (None, "--no-peers") if args.no_peers else load_flashinfer()
    if args.warm_peers:
        if fi is None:
            print(f"flashinfer: not available ({why})")
            return 0
        table, sets = build(2, 1, 64, seed=3, n_sets=1)
        for kind in ("bf16", "fp8 per-tensor"):
            cell, _ = flashinfer_decode(fi, kind, table, sets, np.ones(2, int), np.full(2, 64), [], 1, 1,
                                        warm_only=True)
            print(f"flashinfer warm {kind}: {cell}")
        return 0

    results = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "cells": {}}
    read = ceilings.measure_read(4 << 30)
    cupy.get_default_memory_pool().free_all_blocks()
    ceiling = read["tbps"]
    results["read_ceiling_tbps"] = ceiling
    print(f"read ceiling (streaming 16-byte loads, 4 GiB): {ceiling:.2f} TB/s")

    batch, kv_len = 64, 4096
    q_lens, kv_lens = np.ones(batch, int), np.full(batch, kv_len)
    table, sets = build(batch, 1, kv_len, seed=1)
    windows = [(b, 0, 1) for b in (0, 21, 42, 63)]
    lines = []
    decode = {}
    kinds = [] if args.peers_only else ["bf16", "fp8 per-head", "fp8 per-tensor"]
    outs = {}
    for kind in kinds:
        cell, outs[kind] = time_ours(kind, table, sets, q_lens, kv_lens, windows, n_launch=20, reps=args.reps)
        decode[f"ours {kind}"] = cell
    if fi is not None:
        for kind in ("bf16", "fp8 per-tensor"):
            decode[f"flashinfer {kind}"], _ = flashinfer_decode(fi, kind, table, sets, q_lens, kv_lens, windows, 20,
                                                                args.reps)
    elif not args.no_peers:
        decode["flashinfer"] = {"status": f"n/a: {why}"}
    for name, cell in decode.items():
        if "us" in cell:
            elem = 1 if "fp8" in name else 2
            nbytes = kv_bytes(batch, kv_len, elem) + qo_bytes(batch)
            cell["tbps"] = nbytes / (cell["us"] * 1e-6) / 1e12
            cell["of_ceiling"] = cell["tbps"] / ceiling
            cell["tokens_per_s"] = batch / (cell["us"] * 1e-6)
    base = decode.get("ours bf16", {}).get("tokens_per_s")
    for name, cell in decode.items():
        if base and "tokens_per_s" in cell:
            cell["tokens_vs_ours_bf16"] = cell["tokens_per_s"] / base
    if "bf16" in outs and outs["bf16"] is not None:  # fp8 against the bf16 cache it was quantised from
        from cupy_fa import reference

        from .inputs import to_host_elems

        for kind in ("fp8 per-head", "fp8 per-tensor"):
            if outs.get(kind) is not None:
                decode[f"ours {kind}"]["err_vs_bf16_cache"] = reference.relative_error(
                    to_host_elems(outs[kind][0]).astype(np.float64), to_host_elems(outs["bf16"][0]).astype(np.float64))
    results["cells"]["decode B=64 L=4096"] = decode
    decode_case = (table, sets, q_lens, kv_lens, windows, batch, kv_len)

    lines.append(f"decode B=64 L=4096, H 32/8, D 128, bf16 q/out, page 16 (read ceiling {ceiling:.2f} TB/s):")
    lines.append(f"  {'cell':28s} {'us':>8s} {'tokens/s':>10s} {'TB/s':>6s} {'of ceil':>8s} {'x bf16':>7s} "
                 f"{'err f64':>8s}  notes")
    for name, cell in decode.items():
        if "us" in cell:
            extra = f"err vs bf16 cache {cell['err_vs_bf16_cache']:.2e}" if "err_vs_bf16_cache" in cell else ""
            lines.append(f"  {name:28s} {cell['us']:8.1f} {cell['tokens_per_s']:10.0f} {cell['tbps']:6.2f} "
                         f"{cell['of_ceiling']:8.1%} {cell.get('tokens_vs_ours_bf16', float('nan')):7.2f} "
                         f"{cell['err']:8.1e}  {extra}")
        else:
            lines.append(f"  {name:28s} {cell.get('status', '?')}")
    flush(lines)

    if not args.no_prefill and not args.peers_only:
        batch, kv_len = 4, 4096
        q_lens, kv_lens = np.full(batch, kv_len), np.full(batch, kv_len)
        table, sets = build(batch, kv_len, kv_len, seed=2)
        windows = [(b, r0, r0 + 32) for b in (0, 3) for r0 in (0, kv_len - 32)]
        flops = 4 * batch * (kv_len * (kv_len + 1) // 2) * H_Q * D  # causal: 2 GEMMs over the visible keys
        prefill = {}
        for kind in ("bf16", "fp8 per-head"):
            cell, _ = time_ours(kind, table, sets, q_lens, kv_lens, windows, n_launch=4, reps=max(5, args.reps // 2))
            if "us" in cell:
                cell["tflops"] = flops / (cell["us"] * 1e-6) / 1e12
            prefill[f"ours {kind}"] = cell
        results["cells"]["prefill B=4 L=4096 causal"] = prefill
        lines.append("prefill B=4 L=4096 causal, H 32/8, D 128, bf16 q/out, page 16:")
        for name, cell in prefill.items():
            if "us" in cell:
                lines.append(f"  {name:28s} {cell['us']:8.1f} us {cell['tflops']:6.1f} TFLOP/s  err {cell['err']:.1e}  "
                             f"({'; '.join(cell['families'])})")
            else:
                lines.append(f"  {name:28s} {cell.get('status', '?')}")
        del sets
        cupy.get_default_memory_pool().free_all_blocks()
        flush(lines)
    write_json(args.json, results)

    if args.ab and not args.peers_only:  # the fp8 decode tile's keys per tile, depth and fold (tuning only)
        table, sets, q_lens, kv_lens, windows, batch, kv_len = decode_case
        results["cells"]["decode B=64 L=4096 fp8 A/B"] = ab = {}
        lines.append("A/B, decode B=64 L=4096 over the fp8 cache (per-head scales), ours only:")
        import dataclasses

        from cupy_fa import knobs

        before, depth, keys = knobs.knobs(), families.mma_sync.FP8_STAGES, families.mma_sync.FP8_BLOCK_N
        try:
            for block_n, stages, fold, split in AB_POINTS:
                families.mma_sync.FP8_BLOCK_N, families.mma_sync.FP8_STAGES = block_n, stages
                catalog.attention_kernel.cache_clear()  # it caches by tile, whose block_n just changed
                knobs.use(dataclasses.replace(before, fold_splits=fold, split_size=split))
                cell, _ = time_ours("fp8 per-head", table, sets, q_lens, kv_lens, windows[:1], n_launch=20,
                                    reps=args.reps)
                name = f"block_n {block_n}, stages {stages}, fold {fold}, split {split}"
                ab[name] = cell
                if "us" in cell:
                    cell["tbps"] = (kv_bytes(batch, kv_len, 1) + qo_bytes(batch)) / (cell["us"] * 1e-6) / 1e12
                    tile = cell["families"][-1].split("MmaTile(")[-1][:100]
                    lines.append(f"  {name:46s} {cell['us']:8.1f} us {cell['tbps']:5.2f} TB/s "
                                 f"{cell['tbps'] / ceiling:6.1%}  {tile}")
                else:
                    lines.append(f"  {name:46s} {cell.get('status', '?')}")
                flush(lines)
        finally:
            families.mma_sync.FP8_STAGES, families.mma_sync.FP8_BLOCK_N = depth, keys
            catalog.attention_kernel.cache_clear()
            knobs.use(before)
        write_json(args.json, results)
    return 0


# --ab's points: (keys per KV tile, stages, CUPY_FA_FOLD_SPLITS, CUPY_FA_SPLIT_SIZE). The first is
# the shipped default (families.mma_sync.FP8_BLOCK_N, FP8_STAGES, FP8_SPLIT_SIZE); the split size sets how
# many split epilogues a folding CTA runs per row (B=64 L=4096: 8 at 512 keys, 4 at 1024, 2 at
# 2048), fold "1" forces the fold where "auto"'s wave-fill rule declines it (64 x 3: three CTAs per SM).
AB_POINTS = (
    (128, 2, "auto", 1024), (128, 2, "auto", 512), (128, 2, "auto", 2048), (128, 2, "0", 512),
    (64, 2, "auto", 512), (64, 2, "auto", 1024), (64, 3, "1", 512), (64, 3, "1", 1024), (64, 4, "auto", 1024),
)

_printed = [0]


def flush(lines):
    """Prints the lines not printed yet (a run cut short keeps what it measured)."""
    print("\n".join(lines[_printed[0]:]), flush=True)
    _printed[0] = len(lines)


def write_json(path, results):
    if path:
        with open(path, "w") as f:
            json.dump(results, f, indent=1, default=str)


if __name__ == "__main__":
    sys.exit(main())
