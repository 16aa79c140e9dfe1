#!/usr/bin/env bash
# fp8 decode A/B in one GPU run: the GPU fp8 tests on this tree, then `python -m bench.fp8`
# (ours only, no prefill) on each tree in turn, ROUNDS times interleaved (A B A B ...), then one
# table of the decode cells per (tree, round) and each later tree's mean against the first's.
# A tree is a directory holding cupy_fa/, kernels/ and bench/ (e.g. exp/fp8-base/ from
# `git archive 36b36b3 | tar -x -C exp/fp8-base`, untracked); "." is this one. A tree may carry
# knobs for its runs after an `@`: ".@CUPY_FA_SPLIT_SIZE=1024" (several: comma-separated), named
# in the table by the tree and the knobs' values. AB=1 adds this tree's `--ab` sweep (keys per
# tile, depth, fold) after the rounds.
# Usage: bash lab/ab_fp8.sh "TREE[@VAR=VALUE,...] ..."   (ROUNDS, default 3; TESTS=0 skips the tests)
set -uo pipefail
trees=($1)
rm -rf /tmp/abf8_*
if [ "${TESTS:-1}" != 0 ]; then
  PYTHONPATH=$PWD python3 -m pytest -q -p no:cacheprovider tests/test_fp8_gpu.py 2>&1 | tail -15
fi
name() {  # a tree entry's name in the table: its directory, then its knobs' values
  local dir=${1%%@*} knobs=""; [[ $1 == *@* ]] && knobs=${1#*@}
  local n; n=$(basename "$(cd "$dir" && pwd)")
  [ -n "$knobs" ] && n="$n-$(echo "$knobs" | sed 's/[^,]*=//g; s/,/-/g')"
  echo "$n"
}
for round in $(seq 1 "${ROUNDS:-3}"); do
  for tree in "${trees[@]}"; do
    dir=${tree%%@*}; knobs=(); [[ $tree == *@* ]] && IFS=',' read -r -a knobs <<< "${tree#*@}"
    tag="$(name "$tree")_r$round"
    (cd "$dir" && env "${knobs[@]}" PYTHONPATH=$PWD python3 -m bench.fp8 --no-peers --no-prefill \
      --json /tmp/abf8_$tag.json > /tmp/abf8_$tag.log 2>&1) \
      || { echo "tree $tree round $round failed:"; tail -20 /tmp/abf8_$tag.log; }
  done
done
order="$(for tree in "${trees[@]}"; do name "$tree"; done)"
ORDER="$order" python3 - <<'PY'
import collections, glob, json, os
order = os.environ["ORDER"].split()
rows = collections.defaultdict(dict)  # (tree, cell) -> round -> (us, of ceiling, x bf16)
for path in sorted(glob.glob("/tmp/abf8_*.json")):
    tree, rnd = os.path.basename(path)[5:-5].rsplit("_r", 1)
    d = json.load(open(path))
    for cell, c in d["cells"]["decode B=64 L=4096"].items():
        if "us" in c:
            rows[(tree, cell)][int(rnd)] = (c["us"], c["of_ceiling"], c.get("tokens_vs_ours_bf16", float("nan")),
                                            c["err"])
print("decode B=64 L=4096, H 32/8, D 128, bf16 q/out, page 16: us / of the read ceiling / x ours bf16 tokens/s")
means = {}
for (tree, cell), by_round in sorted(rows.items(), key=lambda kv: (order.index(kv[0][0]), kv[0][1])):
    vals = [by_round[r] for r in sorted(by_round)]
    text = "  ".join(f"{us:7.1f} {of:6.1%} {x:5.2f}x" for us, of, x, _ in vals)
    mean = sum(v[0] for v in vals) / len(vals)
    means[(tree, cell)] = mean
    print(f"  {tree:12s} {cell:22s} {text}   err {max(v[3] for v in vals):.1e}   mean {mean:7.1f} us")
for tree in order[1:]:
    for (t, cell), m in means.items():
        if t == tree and (order[0], cell) in means:
            base = means[(order[0], cell)]
            print(f"  {tree} vs {order[0]}, {cell}: {m:.1f} us vs {base:.1f} us ({base / m - 1:+.1%} speed)")
PY
if [ "${AB:-0}" = 1 ]; then
  PYTHONPATH=$PWD python3 -m bench.fp8 --no-peers --no-prefill --ab 2>&1 | sed -n '/^A\/B/,$p'
fi
