"""Interleaved A/B of the MLA seesaw kernel's experiments (families.mla.MlaWgmmaTile.early_pv: warpgroup
1's P0 V0 before S1; merge_in_cta: the last CTA of a row block merges; and both) on the bench's sm_90a
cells (bench/mla.py: its inputs, its float64 check, its timing), with every point's output bytes held
to the shipped tile's on the same inputs (neither may change a bit).

    PYTHONPATH=. python3 lab/ab_mla.py [--only "H=128"] [--rounds 3] [--json PATH]   (an sm_90a GPU)
"""

import argparse
import json
import sys

import numpy as np


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--only", default="H=128", help="bench.mla cells whose name holds this text")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    import cupy

    from bench import mla as bench
    from cupy_fa.families import mla as family

    points = {"shipped": family.MlaWgmmaTile(), "early_pv": family.MlaWgmmaTile(early_pv=True),
              "merge_in_cta": family.MlaWgmmaTile(merge_in_cta=True), "both": family.MlaWgmmaTile(True, True)}
    results = {}
    for name, heads, batch, q_len, kv_len, page, kv_dtype in bench.CELLS:
        if args.only not in name or kv_dtype != "bfloat16":
            continue
        q_lens, kv_lens = np.full(batch, q_len), np.full(batch, kv_len)
        n_sets = max(2, -(-(150 << 20) // (batch * kv_len * bench.D_LATENT * 2)))
        table, sets = bench.build(heads, batch, q_len, kv_len, page, kv_dtype, n_sets, seed=7)
        times = {p: [] for p in points}
        bits = {}
        for r in range(args.rounds):
            for point in (points if r % 2 == 0 else reversed(list(points))):
                family.WGMMA_TILE = points[point]
                cell = bench.time_ours(heads, kv_dtype, table, sets, q_lens, kv_lens, 10, args.reps)
                if cell.get("status") != "ok":
                    print(f"{name} {point}: {cell.get('status')}", flush=True)
                    continue
                times[point].append(cell["us"])
                out = cupy.asnumpy(sets[0]["out"]).view(np.uint16)
                bits.setdefault(point, out)
        family.WGMMA_TILE = points["shipped"]
        same = len(bits) == len(points) and all(np.array_equal(b, bits["shipped"]) for b in bits.values())
        med = {p: float(np.median(t)) if t else float("nan") for p, t in times.items()}
        line = (f"ab {name:32s} " + "  ".join(f"{p} {med[p]:7.1f} us x{med['shipped'] / med[p]:.3f}" for p in points)
                + f"  out bits {'equal' if same else 'DIFFER'}")
        print(line, flush=True)
        results[name] = dict(median_us=med, us=times, bits_equal=bool(same))
        del sets
        cupy.get_default_memory_pool().free_all_blocks()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0 if all(r["bits_equal"] for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
