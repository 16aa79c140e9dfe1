"""Interleaved A/B of the wgmma family's tile choices on its new cells (fp8 K/V, head dims 96 / 192,
separate qk / vo head dims 192 / 128, the soft-cap's tanh forms; tuning only; lab probe).

Each point is a bench workload (bench/workloads.py) run through ``bench.ours.bench_ours`` (checked
against float64 on its row windows first, then timed by CUDA-graph replays) with the family's tile
tables patched for that point (``families.sm90.DEFAULT_TILES`` / ``FP8_TILES`` / ``PAIR_TILES``, the soft-cap's tanh
``SOFT_CAP_TANH``, the hooked tile's keys), restored after. Written 2026-12-05. Inputs are built
once per workload and shared by its points; the points of a workload run in turn, ``--rounds``
times, odd rounds in reverse (A B C C B A ...).

    python3 lab/ab_hopper.py                    # every point of POINTS
    python3 lab/ab_hopper.py --only fp8 --rounds 3
    python3 lab/ab_hopper.py --once --exact --only prefill_b4_l4096,prefill_b4_l4096_cap50  # once each, for ncu
"""

import argparse
import contextlib
import dataclasses
import json
import sys
import time

import pathlib

from cupy_fa import _build, _compile, catalog
from cupy_fa.families import sm90

R = dataclasses.replace
T128, F128 = sm90.DEFAULT_TILES[128], sm90.FP8_TILES[128]
P192 = sm90.PAIR_TILES[(192, 128)]
# two consumer warpgroups of 128 keys (FlashAttention-3's D 128 shape; the consumers at 224 registers)
T2W = R(T128, consumer_wgs=2, producer_regs=56, block_n=128)
F2W = R(F128, consumer_wgs=2, producer_regs=56, block_n=128)


@contextlib.contextmanager
def patched(default=None, fp8=None, tanh=None, hooked_block_n=None, hooked=None, pair=None, kernels=None):
    """The family's tables with ``default`` / ``fp8`` ({head dim: tile}) and ``pair`` ({(qk, vo):
    tile, or None to drop the pair's tile: the mma.sync prefill tile then}) merged in, the kernel
    sources of another tree (``kernels``: its kernels/ folder; a source experiment A/B'd in one
    process, its own compile cache key by the sources' hash), the soft-cap's
    tanh form, the hooked tiles' keys a tile and other fields of theirs (``hooked``: a dict for
    ``dataclasses.replace``; None: as shipped); restored on exit. The hooked kernel runs the plain
    tile's plan, so a hooked tile of other rows per CTA (consumer warpgroups) needs ``default``'s
    tile of those rows too."""
    saved = dict(sm90.DEFAULT_TILES), dict(sm90.FP8_TILES), sm90.SOFT_CAP_TANH, sm90.Sm90Tile.with_variants
    saved_pairs = dict(sm90.PAIR_TILES)
    saved_dir = _compile.KERNEL_DIR
    try:
        if kernels:
            _compile.KERNEL_DIR = pathlib.Path(kernels).resolve()
            _clear_source_caches()
        sm90.DEFAULT_TILES.update(default or {})
        sm90.FP8_TILES.update(fp8 or {})
        for key, tile in (pair or {}).items():
            if tile is None:
                sm90.PAIR_TILES.pop(key, None)
            else:
                sm90.PAIR_TILES[key] = tile
        if tanh is not None:
            sm90.SOFT_CAP_TANH = tanh
        if hooked_block_n is not None or hooked:
            shipped = saved[3]
            fields = dict(hooked or {}, **({} if hooked_block_n is None else {"block_n": hooked_block_n}))
            sm90.Sm90Tile.with_variants = lambda self: R(shipped(self), **fields)
        catalog.attention_kernel.cache_clear()
        yield
    finally:
        sm90.DEFAULT_TILES.clear(), sm90.DEFAULT_TILES.update(saved[0])
        sm90.FP8_TILES.clear(), sm90.FP8_TILES.update(saved[1])
        sm90.SOFT_CAP_TANH, sm90.Sm90Tile.with_variants = saved[2], saved[3]
        sm90.PAIR_TILES.clear(), sm90.PAIR_TILES.update(saved_pairs)
        catalog.attention_kernel.cache_clear()
        if kernels:
            _compile.KERNEL_DIR = saved_dir
            _clear_source_caches()


def _clear_source_caches():
    """Every memo that holds a kernel source's hash, its include folder or a module built from it."""
    for module in (_compile, _build, catalog):
        for value in vars(module).values():
            if hasattr(value, "cache_clear"):
                value.cache_clear()


def add_lab_workloads(W):
    """Adds to bench.workloads ``W``'s names the lab-only cells (not in the bench's table): fp16
    queries beside bf16 ones, over a 16-bit and an fp8 cache (2026-12-07), whether the fp8 tile's
    cost is its bf16 queries' rewrite as fp16 with a scale per row (fp16 queries skip both)."""
    for extra in (W.Workload("prefill_b4_l4096_fp16", 4, 4096, 4096, "fp16", dtype="float16"),
                  W.Workload("prefill_b4_l4096_fp8_fp16", 4, 4096, 4096, "fp16 queries, fp8 KV cache",
                             dtype="float16", kv_dtype=W.FP8)):
        W.BY_NAME.setdefault(extra.name, extra)


# (workload, point name, patch): the first point of a workload is the table's
POINTS = [
    ("prefill_b4_l4096", "shipped", {}),
    ("prefill_b4_l4096", "bn64 (the hooked tile's shape, no hooks)", dict(default={128: R(T128, block_n=64)})),
    # (every fp8 and cap50 point below: 0 spill bytes under NVRTC 12.9, sm_90a, bf16 and fp16 queries;
    # the hooked tanh newton at 3 wg 64 keys spills 40 / 96 bytes with the warp-uniform warpgroup index)
    # fp8 K / V (0.87x the 16-bit cell on the H100): the producer widens each tile after its ring
    # stage's `empty`, so its copy and widening latency sits between the consumers and `full`
    ("prefill_b4_l4096_fp8", "table (3 wg, 80 keys, 2 stages)", {}),
    # (2026-12-07) the producer over N staging slots (lab/patches/20261207-fp8-deep.patch, built as
    # exp/deep by lab/call_stages.sh mk) with the ring's stages: the first consumer waits 14-15 us a CTA
    # for K / V (bf16's: 2.8); a deeper copy alone and a third stage alone measured no gain, each leaving
    # the other latency in the producer's chain
    ("prefill_b4_l4096_fp8", "deep: table", dict(kernels="exp/deep/kernels")),
    ("prefill_b4_l4096_fp8", "deep: staging 4", dict(kernels="exp/deep/kernels", fp8={128: R(F128, staging=4)})),
    ("prefill_b4_l4096_fp8", "deep: 3 stages, staging 4",
     dict(kernels="exp/deep/kernels", fp8={128: R(F128, stages=3, staging=4)})),
    ("prefill_b2_l8192_fp8", "table", {}),
    ("prefill_b2_l8192_fp8", "deep: 3 stages, staging 4",
     dict(kernels="exp/deep/kernels", fp8={128: R(F128, stages=3, staging=4)})),
    ("prefill_b4_l4096_fp8", "3 stages", dict(fp8={128: R(F128, stages=3)})),
    ("prefill_b4_l4096_fp8", "ping-pong off", dict(fp8={128: R(F128, pingpong=False)})),
    ("prefill_b4_l4096_fp8", "3 stages, ping-pong off", dict(fp8={128: R(F128, stages=3, pingpong=False)})),
    ("prefill_b4_l4096_fp8", "2 wg, 128 keys", dict(fp8={128: F2W})),
    ("prefill_b4_l4096_fp8", "3 wg, 64 keys, 3 stages", dict(fp8={128: R(F128, block_n=64, stages=3)})),
    # (the widening by integer operations, 2026-12-05: x0.90 on the H100 on 2026-12-06, removed)
    # soft-cap 50 (the hooked tile; 0.68x the plain cell with the exact tanh, 0.82x with tanh.approx):
    # the tanh's special-function operations (form 0: 2^y and a reciprocal, 1: tanh.approx, 2: 2^y
    # and Newton steps on the FMA pipe) and the hooked tile's shape; 2 wg tiles take the plain 2 wg
    # tile too (the hooked kernel runs its plan)
    ("prefill_b4_l4096_cap50", "tanh.approx, 3 wg 64 keys (shipped)", dict(tanh=1)),
    # (the softmax's 2^x on the FMA pipe for 1 to 4 of every 8 columns, 2026-12-05: x0.88-0.97 on the
    # H100 on 2026-12-06, removed)
    ("prefill_b4_l4096_cap50", "tanh.approx, no uniform wg", dict(tanh=1, hooked=dict(uniform_wg=False))),
    ("prefill_b4_l4096_cap50", "tanh exact, 3 wg 64 keys (before)", dict(tanh=0)),
    ("prefill_b4_l4096_cap50", "tanh newton, 3 wg 64 keys, no uniform wg",
     dict(tanh=2, hooked=dict(uniform_wg=False))),
    ("prefill_b4_l4096_cap50", "tanh exact, 2 wg 128 keys", dict(tanh=0, default={128: T2W}, hooked_block_n=128)),
    ("prefill_b4_l4096_cap50", "tanh newton, 2 wg 128 keys", dict(tanh=2, default={128: T2W}, hooked_block_n=128)),
    ("prefill_b4_l4096_cap50", "tanh.approx, 2 wg 128 keys (reference)",
     dict(tanh=1, default={128: T2W}, hooked_block_n=128)),
    # the hooked tile at the plain tile's 80 keys (2026-12-06: 64 keys since 2026-12-02, when 80 spilled)
    ("prefill_b4_l4096_cap50", "tanh.approx, 3 wg 80 keys", dict(tanh=1, hooked_block_n=80)),
    ("prefill_b4_l4096_sinks", "shipped (hooked, 64 keys)", {}),
    ("prefill_b4_l4096_sinks", "hooked, 80 keys", dict(hooked_block_n=80)),
    ("prefill_b4_l4096_d96", "table (3 wg, 96 keys)", {}),
    ("prefill_b4_l4096_d96", "3 wg, 64 keys", dict(default={96: R(sm90.DEFAULT_TILES[96], block_n=64)})),
    ("prefill_b4_l4096_d192", "table (2 wg, 96 keys)", {}),
    ("prefill_b4_l4096_d192", "2 wg, 112 keys, plain options",
     dict(default={192: sm90.Sm90Tile(192, 112, stages=2, pingpong=False)})),
    ("prefill_b4_l4096_d192", "2 wg, 80 keys", dict(default={192: R(sm90.DEFAULT_TILES[192], block_n=80)})),
    # separate qk / vo head dims 192 / 128 (0 spill bytes at 96 / 112 / 128 keys, NVRTC 12.9, bf16 and fp16;
    # three consumer warpgroups spill 40+ bytes at 64 keys): the pair's wgmma tile against the mma.sync
    # prefill tile it replaced on sm_90a, and its keys a tile
    ("prefill_b4_l4096_qk192_vo128", "table (2 wg, 128 keys)", {}),
    ("prefill_b4_l4096_qk192_vo128", "2 wg, 96 keys", dict(pair={(192, 128): R(P192, block_n=96)})),
    ("prefill_b4_l4096_qk192_vo128", "2 wg, 112 keys", dict(pair={(192, 128): R(P192, block_n=112)})),
    ("prefill_b4_l4096_qk192_vo128", "mma.sync prefill tile (before)", dict(pair={(192, 128): None})),
    ("prefill_b2_l8192_d64", "shipped", {}),
    ("prefill_b2_l8192_d256", "shipped", {}),
]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default="", help="comma-separated substrings of the workload names to run")
    parser.add_argument("--exact", action="store_true", help="--only names whole workload names")
    parser.add_argument("--points", default="", help="comma-separated substrings of the point names to run (all: '')")
    parser.add_argument("--kernel-trees", default="",
                        help="comma-separated trees whose kernels/ run as extra points of each --only workload")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--once", action="store_true", help="run each point's kernel once, untimed (for ncu)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)

    import cupy

    from bench import inputs, ours, workloads as W
    add_lab_workloads(W)

    if args.kernel_trees and not args.points:
        args.points = "shipped,table"  # each workload's first point beside the trees
    results = []
    by_workload = {}
    wanted = args.only.split(",")
    for name, point, patch in POINTS:
        if any((name == x) if args.exact else (x in name) for x in wanted) and (
                not args.points or any(x in point for x in args.points.split(","))):
            by_workload.setdefault(name, []).append((point, patch))
    for name in list(by_workload) + [x for x in wanted if x in W.BY_NAME and x not in by_workload]:
        by_workload.setdefault(name, [("shipped", {})])
        by_workload[name] += [(tree, dict(kernels=f"{tree}/kernels")) for tree in args.kernel_trees.split(",") if tree]
    for name, points in by_workload.items():
        w = W.BY_NAME[name]
        inp = inputs.make_inputs(w, args.page_size, 2, seed=int(time.time()) % 100000)
        refs = {0: inputs.reference_windows(inp, inp.sets[0], W.check_windows(w))}
        for rnd in range(1 if args.once else args.rounds):
            # odd rounds in reverse (A B C, C B A, ...): a point's place in a round moves its timing
            # (2026-12-07, H100: byte-identical kernels run second read x0.97-0.99)
            for point, patch in (points if rnd % 2 == 0 else points[::-1]):
                with patched(**patch):
                    if args.once:
                        import cupy_fa

                        attn = cupy_fa.BatchAttention(W.H_Q, W.H_KV, w.head_dim, w.dtype, kv_dtype=w.kv_dtype or None,
                                                      head_dim_vo=w.head_dim_vo or None)
                        attn.plan(inp.q_lens, inp.kv_lens, inp.page_table, logits_soft_cap=w.soft_cap or None)
                        attn.run(inp.sets[0].q, inp.sets[0].cache, out=inp.sets[0].out)
                        cupy.cuda.Device().synchronize()
                        print(f"once {name} {point}: {attn.planned.long_tile}", flush=True)
                        continue
                    cell = ours.bench_ours(inp, refs, dict(warmup=5, reps=args.reps, cpu_repeat=1), n_launch=4)
                tile = cell.get("families", ["?"])[0]
                value = cell.get("value")
                line = (f"ab {name:28s} {point:40s} round {rnd}  " +
                        (f"{value:7.1f} TFLOP/s  {cell['time_us']:9.1f} us  err {cell['err']:.2e}  {cell['status']}"
                         if value else f"{cell.get('status')} {cell.get('error', '')[:300]}"))
                print(line, flush=True)
                results.append(dict(workload=name, point=point, round=rnd, tile=tile, **{
                    k: cell.get(k) for k in ("value", "time_us", "err", "status", "error")}))
        del inp
        cupy.get_default_memory_pool().free_all_blocks()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1, default=str)
    summary = {}
    for r in results:
        if r["value"]:
            summary.setdefault((r["workload"], r["point"]), []).append(r["value"])
    print("\nmeans over rounds (TFLOP/s), and against the workload's first point:")
    firsts = {}
    for (name, point), values in summary.items():
        mean = sum(values) / len(values)
        firsts.setdefault(name, mean)
        print(f"  {name:28s} {point:40s} {mean:7.1f}  x{mean / firsts[name]:.3f}  ({len(values)} rounds)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
