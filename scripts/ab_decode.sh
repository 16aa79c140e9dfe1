#!/usr/bin/env bash
# A/B of the decode tuning knobs in one GPU run: for each setting of
# (CUPY_FA_DECODE_STAGES, CUPY_FA_SPLIT_SIZE, CUPY_FA_DECODE_WARPS_M[, CUPY_FA_SPLITS_PER_CTA[, CUPY_FA_PDL
# [, CUPY_FA_FOLD_SPLITS]]]) runs the
# decode-like bench workloads (ours only, fp64-checked, --quick) and prints one
# table; the best setting (geomean TB/s) is written to $1 as shell exports.
# Usage: bash scripts/ab_decode.sh BEST_FILE [settings ...]   (a setting: "stages split warps_m [per_cta [pdl [fold]]]")
set -uo pipefail
best_file=$1; shift
settings=("$@"); [ ${#settings[@]} -gt 0 ] || settings=("2 512 auto 1 1" "2 768 auto 1 1" "2 1024 auto 1 1")
work=${AB_WORKLOADS:-"decode_b64_l4096 decode_b16_l32768 decode_b1_l131072 decode_b1_l4096 verify_q4_b64_l4096 verify_q8_b64_l4096"}  # AB_ARGS: more bench flags
rm -rf /tmp/ab_* "$best_file"  # a stale pick from an earlier call must never be applied
for setting in "${settings[@]}"; do
  set -- $setting
  tag="s$1_k$2_w$3_c${4:-1}_p${5:-1}_f${6:-auto}"
  CUPY_FA_DECODE_STAGES=$1 CUPY_FA_SPLIT_SIZE=$2 CUPY_FA_DECODE_WARPS_M=$3 CUPY_FA_SPLITS_PER_CTA=${4:-1} CUPY_FA_PDL=${5:-1} \
    CUPY_FA_FOLD_SPLITS=${6:-auto} \
    python3 -m bench $work ${AB_ARGS:-} --quick \
    --no-peers --no-ceilings --no-plot --out /tmp/ab_$tag > /tmp/ab_$tag.log 2>&1 || echo "setting $setting failed"
done
python3 - "$best_file" <<'PY'
import glob, json, math, sys
best, header = None, False
for path in sorted(glob.glob("/tmp/ab_*/bench_*.json")):
    d = json.load(open(path))
    tag = path.split("/")[2][3:]
    cells = [(f"{r['workload'][:20]} ps{r['page_size']}", r["impls"].get("ours", {})) for r in d["rows"]]
    if not header:
        print(f"{'setting':>12s}  " + "  ".join(f"{c:>20s}" for c, _ in cells) + "   geomean TB/s")
        header = True
    vals = [o.get("value") for _, o in cells if o.get("status") == "ok"]
    if len(vals) < len(cells) or not vals:
        print(tag, "incomplete:", [o.get("status") for _, o in cells]); continue
    g = math.exp(sum(math.log(v) for v in vals) / len(vals))
    print(f"{tag:>12s}  " + "  ".join(f"{v:20.2f}" for v in vals) + f"   {g:.3f}")
    if best is None or g > best[0]:
        best = (g, tag)
if best:
    s, k, w, c, pdl, fold = (x[1:] for x in best[1].split("_"))
    open(sys.argv[1], "w").write(f"export CUPY_FA_DECODE_STAGES={s} CUPY_FA_SPLIT_SIZE={k} CUPY_FA_DECODE_WARPS_M={w} "
                                 f"CUPY_FA_SPLITS_PER_CTA={c} CUPY_FA_PDL={pdl} CUPY_FA_FOLD_SPLITS={fold}\n")
    print(f"best: {best[1]} (geomean {best[0]:.3f} TB/s)")
PY
