"""The hottest SASS lines of an ncu source page (``ncu --import R --page source --csv --print-source
sass``): the 25 instructions with the most warp-stall samples, and the samples summed by opcode.

    python3 lab/ncu_sass_top.py sass.csv
"""

import csv
import sys
from collections import Counter


def number(text):
    try:
        return float(str(text).replace(",", ""))
    except ValueError:
        return 0.0


def main(path):
    lines = [x for x in open(path, encoding="utf-8", errors="replace") if x.count(",") > 3]
    rows = list(csv.DictReader(lines))
    if not rows:
        print(f"no rows in {path}")
        return 1
    names = list(rows[0])
    samples = next((n for n in names if "Warp Stall Sampling (All" in n), None) or \
        next((n for n in names if "Sampling" in n), None)
    source = next((n for n in names if n.strip().lower() == "source"), names[1])
    print("columns:", "; ".join(n[:40] for n in names[:24]))
    if samples is None:
        print("no stall-sampling column")
        return 1
    total = sum(number(r[samples]) for r in rows) or 1.0
    print(f"{len(rows)} SASS lines, {total:.0f} samples ({samples})")
    for r in sorted(rows, key=lambda r: -number(r[samples]))[:25]:
        print(f"  {100 * number(r[samples]) / total:5.1f}%  {r.get('Address', '')[-6:]:>6s}  {r[source][:90]}")
    by_op = Counter()
    for r in rows:
        op = r[source].split()[0] if r[source].split() else "?"
        if op.startswith("@"):
            op = r[source].split()[1] if len(r[source].split()) > 1 else op
        by_op[op.split(".")[0]] += number(r[samples])
    print("by opcode:", ", ".join(f"{op} {100 * n / total:.1f}%" for op, n in by_op.most_common(12)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
