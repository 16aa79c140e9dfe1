#!/usr/bin/env bash
# A/B of source trees in one GPU run: bench workloads, ours only (fp64-checked, --quick), for
# each tree in turn, ROUNDS times interleaved (A B A B ...), then one table of each cell's figure
# (TB/s or TFLOP/s) per (tree, round), and each later tree's mean over the rounds against the first
# tree's, flagged where it is more than 1% slower on a memory-bound cell or 2% on a compute-bound one.
# A tree is a directory holding cupy_fa/, kernels/ and bench/ (a copy of another revision, e.g.
# exp/<name>/ from `git archive REV | tar -x -C exp/<name>`, untracked); "." is this one.
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
order="$(for tree in "${trees[@]}"; do basename "$(cd "$tree" && pwd)"; done)"
ORDER="$order" python3 - <<'PY'
import collections, glob, json, os
order = os.environ["ORDER"].split()
runs = collections.defaultdict(lambda: collections.defaultdict(dict))  # tree -> round -> {cell: (value, kind)}
cells = []
for path in glob.glob("/tmp/abt_*/bench_*.json"):
    tree, rnd = path.split("/")[2][4:].rsplit("_r", 1)
    for r in json.load(open(path))["rows"]:
        cell = f"{r['workload'][:22]} ps{r['page_size']}"
        if cell not in cells:
            cells.append(cell)
        o = r["impls"].get("ours", {})
        runs[tree][int(rnd)][cell] = (o.get("value") if o.get("status") == "ok" else None, r.get("kind", "memory"))
if not runs:
    raise SystemExit("no bench results")
print(f"{'tree':>14s}  " + "  ".join(f"{c:>27s}" for c in cells))
for rnd in sorted({r for t in runs.values() for r in t}):
    for tree in order:
        got = runs.get(tree, {}).get(rnd, {})
        print(f"{tree + '_r' + str(rnd):>14s}  " + "  ".join(
            f"{got[c][0]:27.3f}" if c in got and got[c][0] is not None else f"{'missing':>27s}" for c in cells))
def mean(tree, cell):
    vals = [r[cell][0] for r in runs.get(tree, {}).values() if cell in r and r[cell][0] is not None]
    return sum(vals) / len(vals) if vals else None
base = order[0]
for tree in order[1:]:
    print(f"\n{tree} against {base} (mean over rounds; higher is faster; limit -1% memory-bound, -2% compute-bound):")
    worst = []
    for cell in cells:
        a, b = mean(base, cell), mean(tree, cell)
        kind = next((r[cell][1] for r in runs[base].values() if cell in r), "memory")
        if a is None or b is None:
            print(f"  {cell:30s} missing")
            worst.append(cell)
            continue
        change = 100 * (b / a - 1)
        over = change < (-1.0 if kind == "memory" else -2.0)
        print(f"  {cell:30s} {a:9.3f} -> {b:9.3f}  {change:+6.2f}%{'  OVER THE LIMIT' if over else ''}")
        if over:
            worst.append(cell)
    print(f"  {len(cells) - len(worst)} of {len(cells)} cells within the limit")
PY
