#!/usr/bin/env bash
# One GPU call (prepared 2026-12-08, twenty-seventh stop) for the MLA host path (branch mla-host-path, merged): the MLA GPU tests of
# this tree, then MLA host time per call (lab/mla_host_ab.py) of main's tree (exp/base: made before the call
# by `rm -rf exp && mkdir -p exp/base && git archive 0e83f75 | tar -x -C exp/base`: main before the merge; untracked, it travels) and
# this one, interleaved, two rounds; then bench.mla of both with digests (the same bits) and this tree's
# host columns. About 200 s. MLA_TESTS=0: the host A/B and the bench only (the tests ran in the call's check).
CALL_DEFAULT=${CALL_SECONDS:-240} . lab/call_begin.sh
[ "${MLA_TESTS:-1}" = 1 ] && tree_tests . mla_tests 100 tests/test_mla_gpu.py
for round in 1 2; do
  for tree in exp/base .; do
    fits 25 "host $tree r$round" && (cd $tree && PYTHONPATH=$PWD timeout 25 python3 $OLDPWD/lab/mla_host_ab.py 2>&1 \
      | sed "s|^|r$round $tree: |")
  done
done
for tree in exp/base .; do
  fits 60 "bench.mla $tree" && (cd $tree && PYTHONPATH=$PWD timeout 55 python3 -m bench.mla --no-peers --digest 2>&1 \
    | grep -E "^(decode|verify|fp8)" | cut -c1-250 | sed "s|^|$tree: |")
done
echo "== done at $(( $(date +%s) - t0 )) s"
