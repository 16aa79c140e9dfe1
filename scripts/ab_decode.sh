#!/usr/bin/env bash
# A/B of the decode tuning knobs in one device call: for each (pipeline stages,
# min split keys) runs the decode-like bench workloads (ours only, fp64-checked),
# prints one table, and writes the best setting to $1 (sourced by device_check.sh).
set -uo pipefail
best_file=$1; shift
work="decode_b64_l4096 decode_b1_l131072 verify_q8_b64_l4096"
for setting in "2 512" "3 512" "4 512"; do
  set -- $setting
  CUPY_FA_DECODE_STAGES=$1 CUPY_FA_MIN_SPLIT_KEYS=$2 python3 -m bench $work --quick --no-peers --no-ceilings \
    --no-plot --out /tmp/ab_s$1_m$2 > /tmp/ab_s$1_m$2.log 2>&1 || echo "setting $setting failed"
done
python3 - "$best_file" <<'PY'
import glob, json, math, sys
best = None
print(f"{'stages':>6s} {'min split':>9s}  " + "  ".join(f"{w:>8s}" for w in ["b64 ps16", "b64 ps1", "b1 ps16", "b1 ps1", "vq8 ps16", "vq8 ps1"]) + "   geomean TB/s")
for path in sorted(glob.glob("/tmp/ab_s*_m*/bench_*.json")):
    d = json.load(open(path))
    tag = path.split("/")[2]
    stages, split = tag[4:].split("_m")
    vals = [r["impls"]["ours"].get("value") for r in d["rows"] if r["impls"].get("ours", {}).get("status") == "ok"]
    if len(vals) < 6:
        print(tag, "incomplete"); continue
    g = math.exp(sum(math.log(v) for v in vals) / len(vals))
    print(f"{stages:>6s} {split:>9s}  " + "  ".join(f"{v:8.2f}" for v in vals) + f"   {g:.3f}")
    if best is None or g > best[0]:
        best = (g, stages, split)
if best:
    open(sys.argv[1], "w").write(f"export CUPY_FA_DECODE_STAGES={best[1]} CUPY_FA_MIN_SPLIT_KEYS={best[2]}\n")
    print(f"best: stages={best[1]} min_split_keys={best[2]} (geomean {best[0]:.3f} TB/s)")
PY
