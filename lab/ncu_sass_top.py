"""The hottest SASS lines of an ncu source page (``ncu --import R --page source --csv --print-source
sass``, plain or gzipped): the 25 instructions with the most warp-stall samples, and the samples summed
by opcode and by region of 64 lines; where the page has the executed-instruction counts
(SourceCounters), the same for those.

    python3 lab/ncu_sass_top.py sass.csv[.gz]
"""

import csv
import gzip
import sys
from collections import Counter


def number(text):
    try:
        return float(str(text).replace(",", ""))
    except ValueError:
        return 0.0


def main(path):
    opener = gzip.open if path.endswith(".gz") else open
    lines = [x for x in opener(path, "rt", encoding="utf-8", errors="replace") if x.count(",") > 3]
    lines = lines[next((i for i, x in enumerate(lines) if x.startswith('"Address"')), 0):]  # past a "Kernel Name" line
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
    print(f"{len(rows)} SASS lines")
    ranked(rows, source, samples, f"samples ({samples})")
    executed = next((n for n in names if n.strip() == "Instructions Executed"), None)
    if executed:
        ranked(rows, source, executed, "executed warp instructions")
    return 0


def opcode(text):
    words = text.split()
    if words and words[0].startswith("@"):
        words = words[1:]
    return words[0].split(".")[0] if words else "?"


def ranked(rows, source, column, what):
    """The lines and opcodes with the most of `column`, and its sum over runs of 64 lines (regions)."""
    total = sum(number(r[column]) for r in rows) or 1.0
    print(f"{total:.0f} {what}")
    for r in sorted(rows, key=lambda r: -number(r[column]))[:25]:
        print(f"  {100 * number(r[column]) / total:5.1f}%  {r.get('Address', '')[-6:]:>6s}  {r[source][:90]}")
    by_op = Counter()
    for r in rows:
        by_op[opcode(r[source])] += number(r[column])
    print("by opcode:", ", ".join(f"{op} {100 * n / total:.1f}%" for op, n in by_op.most_common(16)))
    print("by region of 64 lines (first address, share, its top opcodes):")
    for start in range(0, len(rows), 64):
        part = rows[start:start + 64]
        n = sum(number(r[column]) for r in part)
        if n / total >= 0.01:
            ops = Counter()
            for r in part:
                ops[opcode(r[source])] += number(r[column])
            print(f"  {part[0].get('Address', '')[-6:]:>6s}  {100 * n / total:5.1f}%  "
                  + ", ".join(f"{op} {100 * k / n:.0f}%" for op, k in ops.most_common(5)))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
