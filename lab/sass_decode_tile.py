"""SASS instructions per KV tile of the mma.sync family's decode tiles (CPU only).

    python lab/sass_decode_tile.py [--kv-bytes 1 2] [--head-dim 128] [--group 4] [--list]

For each K/V element size, the tile `schedule.schedule_step` picks for decode B=64 L=4096 (the
`python -m bench.fp8` cell; bf16 queries) is compiled for sm_90a with nvcc 13.0 and the defines
NVRTC gets (lab/sass_steps.py compile_sass), disassembled, and its tile loop (the backward
branch holding 2 x D / 8 HMMA per 16 keys of a warp: S = Q K^T and O += P V) walked along the path of an
unmasked steady-state tile with page size 16: the loads of the tile STAGES - 1 ahead (the shift
path of the page arithmetic, not the division), no mask, no O rescale, no split end. Prints per
warp per tile: the producer's instructions (loop head to the cp.async wait), the compute's
(wait to the last barrier) and its opcode mix; registers / spills from ptxas.
"""

import argparse
import collections
import os
import pathlib
import sys

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "lab"))

import sass_steps as ss  # noqa: E402

CONVERSIONS = ("PRMT", "F2FP", "HMUL2", "HADD2", "HFMA2", "LOP3", "SHF", "I2F")


def tile_path(ins, labels, head, tail):
    """The steady-state path through the loop [head, tail] (instruction indices)."""
    at = {a: i for i, (a, _) in enumerate(ins)}
    last_mma = max(k for k in range(head, tail + 1) if "HMMA" in ins[k][1])
    path, i = [], head
    while i <= tail:
        a, text = ins[i]
        t = ss.target_of(text, labels)
        if i == tail or t is None or not (t in at and head <= at[t] <= tail):
            path.append(text)
            i += 1
            continue
        j = at[t]
        path.append(text)
        if j < i:  # an inner backward branch: not taken
            i += 1
            continue
        skipped = [x for _, x in ins[i + 1:j]]
        ops = collections.Counter(map(ss.opcode, skipped))
        has_mma = any("HMMA" in x for x in skipped)
        first_tile_q = len(skipped) == 9 and ops["LDSM"] == 8  # Q's fragments, loaded with the first tile
        division = ops["I2F"] > 0 and ops["MUFU"] > 0 and len(skipped) < 400  # a page size not a power of two (8 rows at 128 keys: ~250)
        optional = not has_mma and (first_tile_q or division or ops["FSEL"] >= 8 or ops["FMUL"] >= 16 or i > last_mma)
        i = j if (not text.startswith("@") or optional) else i + 1
    return path


def count(sass, mmas=32):
    ins, labels = ss.parse(sass)
    at = {a: i for i, (a, _) in enumerate(ins)}
    for i, (a, text) in enumerate(ins):
        t = ss.target_of(text, labels)
        if t is not None and t < a and t in at and sum("HMMA" in x for _, x in ins[at[t]:i + 1]) == mmas:
            path = tile_path(ins, labels, at[t], i)
            break
    else:
        return None
    i0 = next(k for k, x in enumerate(path) if x.startswith("DEPBAR"))
    i1 = max(k for k, x in enumerate(path) if x.startswith("BAR.SYNC"))
    return path, path[:i0], path[i0:i1 + 1]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kv-bytes", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--list", action="store_true", help="print the tile's instructions too")
    args = ap.parse_args(argv)
    from cupy_fa import schedule

    os.environ.setdefault("CUDA_TOOLS_BIN", "/tmp/nvdis/nvidia/cu13/bin")
    for kv_bytes in args.kv_bytes:
        step = schedule.schedule_step(args.head_dim, args.group, 8, q_lens=np.ones(64, int),
                                      kv_lens=np.full(64, 4096), arch="sm_90a", kv_bytes=kv_bytes)
        tile = step.small.tile
        kv = "cupy_fa::fp8_e4m3" if kv_bytes == 1 else "__nv_bfloat16"
        expr = f"cupy_fa::attention_kernel<__nv_bfloat16, {kv}, __nv_bfloat16, {tile.traits()}>"
        variant = next(v for v in schedule.all_variants() if v.expression == expr)
        sass, res = ss.compile_sass(variant, False)
        mmas = 2 * (args.head_dim // 8) * (tile.block_n // tile.warps_n // 16)  # S and P V per 16 keys
        got = count(sass, mmas)
        if got is None:
            print(f"{expr}: no tile loop of {mmas} HMMA found")
            continue
        path, producer, compute = got
        ops = collections.Counter(map(ss.opcode, compute))
        conv = sum(ops[o] for o in CONVERSIONS)
        tile_bytes = 2 * tile.block_n * args.head_dim * kv_bytes
        warps = tile.warps_m * tile.warps_n
        print(f"{tile.traits()}: regs {res['registers']} spills {res['spill_stores']}/{res['spill_loads']}, "
              f"{tile.min_ctas_per_sm} CTAs/SM, smem {tile.smem_bytes} B; per warp per tile {len(path)} "
              f"instructions = producer {len(producer)} ({sum('LDGSTS' in x for x in producer)} LDGSTS) + "
              f"compute {len(compute)} (conversion-class {conv}); "
              f"{warps * len(path) / tile_bytes:.4f} warp-instructions per K/V byte\n    "
              + " ".join(f"{op} {n}" for op, n in ops.most_common(24)))
        if args.list:
            for x in path:
                print("      " + x)


if __name__ == "__main__":
    sys.exit(main())
