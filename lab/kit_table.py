"""SGLang kit results (tests/sglang_harness/run_kit.py --json files) as one markdown table per config:
case, mode, graph or eager, and each backend's result and max error side by side; then the totals.

    python3 lab/kit_table.py kit_a.json kit_cupy_fa.json kit_triton.json
"""

import json
import sys


def main(paths):
    rows = [r for p in paths for r in json.load(open(p))]
    backends = sorted({r["backend"] for r in rows}, key=lambda b: (b != "triton", b))
    by_config = {}
    for r in rows:
        by_config.setdefault(r["config"], {}).setdefault((r["mode"], r["graph"], r["case"]), {})[r["backend"]] = r
    for config, cases in by_config.items():
        print(f"\n### {config}\n")
        print("| case | mode | path | " + " | ".join(backends) + " |")
        print("|---|---|---|" + "---|" * len(backends))
        for (mode, graph, case), got in cases.items():
            cells = []
            for b in backends:
                r = got.get(b)
                err = "" if r is None or r.get("max_err") is None else f" {r['max_err']:.1e}"
                cells.append("-" if r is None else f"{r['result']}{err}")
            print(f"| {case} | {mode} | {graph} | " + " | ".join(cells) + " |")
        totals = []
        for b in backends:
            results = [got[b]["result"] for got in cases.values() if b in got]
            if results:
                counts = {x: results.count(x) for x in sorted(set(results))}
                totals.append(f"{b}: " + ", ".join(f"{k} {v}" for k, v in counts.items()))
        print("\n" + "; ".join(totals))


if __name__ == "__main__":
    main(sys.argv[1:])
