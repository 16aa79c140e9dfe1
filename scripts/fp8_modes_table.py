"""The table of fp8 attention's error per mode, from the rows tests/test_fp8_gpu.py appends to
``$CUPY_FA_FP8_REPORT`` (one JSON line per engine step: mode, fp8 against the same step over the
16-bit cache, fp8 against float64 on the dequantised cache, the 16-bit step against float64).
Usage: python3 scripts/fp8_modes_table.py REPORT.jsonl (lab/fp8_check.sh, scripts/device_check.sh)."""

import collections
import json
import sys


def table(lines):
    rows = [json.loads(line) for line in lines if line.strip()]
    if not rows:
        return "fp8 vs 16-bit cache: no rows reported"
    by = collections.defaultdict(list)
    for r in rows:
        by[r["mode"]].append(r)
    out = ["fp8 attention per mode (largest over the engine configs): rel err vs the same step over the 16-bit "
           "cache, vs float64 on the dequantised cache, and the 16-bit step's own vs float64"]
    for mode, rs in by.items():
        out.append(f"  {mode:22s} fp8 vs 16-bit {max(r['fp8_vs_16bit'] for r in rs):.2e}   fp8 vs f64 "
                   f"{max(r['fp8_vs_ref'] for r in rs):.2e}   16-bit vs f64 {max(r['ref16'] for r in rs):.2e}   "
                   f"({len(rs)} steps)")
    return "\n".join(out)


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        print(table(f))
