"""One-off: the kit's per-case table, cupy_fa beside triton, from run_kit.py's JSON files.

    python3 lab/sglang_kit_table.py kit_a.json kit_b.json kit_c.json > table.md
"""

import json
import sys


def main(paths):
    rows = [r for p in paths for r in json.load(open(p))]
    by = {}
    for r in rows:
        by.setdefault((r["config"], r["mode"], r["graph"], r["case"]), {})[r["backend"]] = r
    print("| config | case | mode | graph / eager | triton | max err | cupy_fa | max err |")
    print("|---|---|---|---|---|---|---|---|")
    for (config, mode, graph, case), b in by.items():
        cells = []
        for name in ("triton", "cupy_fa"):
            r = b.get(name)
            if r is None:
                cells += ["not run", ""]
            else:
                cells += [r["result"] + (f" ({r['message']})" if r["result"] != "PASS" else ""),
                          "-" if r["max_err"] is None else f"{r['max_err']:.2e}"]
        print(f"| {config} | {case} | {mode} | {graph} | " + " | ".join(cells) + " |")
    totals = {}
    for r in rows:
        totals.setdefault((r["backend"], r["result"]), 0)
        totals[(r["backend"], r["result"])] += 1
    print()
    print(", ".join(f"{b} {res}: {n}" for (b, res), n in sorted(totals.items())))


if __name__ == "__main__":
    main(sys.argv[1:])
