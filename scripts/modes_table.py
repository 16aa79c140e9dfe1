"""Summarises the rows tests/test_modes_graph_gpu.py reported (JSON lines):
max relative error per mode x path over every configuration."""
import collections
import json
import sys

rows = [json.loads(line) for line in open(sys.argv[1]) if line.strip()]
table = collections.defaultdict(lambda: [0.0, 0])
for r in rows:
    cell = table[(r["mode"], r["path"])]
    cell[0] = max(cell[0], r["err"])
    cell[1] += 1
print(f"{'mode':48s} {'path':6s} {'max rel err':>12s} {'runs':>5s}")
for (mode, path), (err, n) in sorted(table.items()):
    print(f"{mode:48s} {path:6s} {err:12.2e} {n:5d}")
