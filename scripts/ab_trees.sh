#!/usr/bin/env bash
# A/B of source trees in one device call: the bench's decode-like workloads, ours only
# (fp64-checked, --quick), for each tree in turn, ROUNDS times interleaved (A B A B ...),
# then one table of TB/s per (tree, round). A tree is a directory holding cupy_fa/ and
# kernels/ (a copy of another branch, e.g. exp/<name>/, untracked); "." is this one.
# Usage: bash scripts/ab_trees.sh "TREE ..." [bench args ...]   (ROUNDS, default 2)
set -uo pipefail
trees=($1); shift
rm -rf /tmp/abt_*
for round in $(seq 1 "${ROUNDS:-2}"); do
  for tree in "${trees[@]}"; do
    tag="$(basename "$(cd "$tree" && pwd)")_r$round"
    (cd "$tree" && PYTHONPATH=$PWD python3 -m bench "$@" --quick --no-peers --no-ceilings --no-plot \
      --out /tmp/abt_$tag > /tmp/abt_$tag.log 2>&1) || echo "tree $tree round $round failed (/tmp/abt_$tag.log)"
  done
done
python3 - <<'PY'
import glob, json
header = False
for path in sorted(glob.glob("/tmp/abt_*/bench_*.json"), key=lambda p: (p.split("/")[2].rsplit("_r", 1)[1], p)):
    d = json.load(open(path))
    tag = path.split("/")[2][4:]
    cells = [(f"{r['workload'][:22]} ps{r['page_size']}", r["impls"].get("ours", {})) for r in d["rows"]]
    if not header:
        print(f"{'tree':>14s}  " + "  ".join(f"{c:>27s}" for c, _ in cells))
        header = True
    print(f"{tag:>14s}  " + "  ".join(f"{o.get('value', float('nan')):27.3f}" if o.get("status") == "ok"
                                       else f"{o.get('status', 'missing'):>27s}" for _, o in cells))
PY
