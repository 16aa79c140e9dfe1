"""SASS of every kernel variant of two source trees, compared instruction by instruction (CPU only).

Each tree (a directory holding cupy_fa/ and kernels/) lists its own variants and program texts
(what NVRTC compiles, through that tree's own cupy_fa), and each variant is compiled with nvcc to
an sm_90a cubin with the defines NVRTC gets (cupy_fa/_build.py compile_options and
RAWMODULE_OPTIONS: -std=c++17, -DCUPY_FA_REQUIRE_SM90A, -ftz=true), then disassembled with
cuobjdump --dump-sass. Variants are matched by kernel name, element type and template numbers
(so a renamed traits struct still matches); a variant's instruction stream is compared with
addresses and encodings stripped ("same instructions"), and its encodings too (which carry the
scheduling control bits: "same bytes"). Registers and spills come from ptxas -v.

Usage: python scripts/sass_diff.py BASE_TREE NEW_TREE [--only SUBSTRING] [-j 2] [--diff N]
       (scripts/sass_diff.sh BASE_REV builds BASE_TREE from a git revision)
Needs nvcc (CUDA 13.0: $NVCC or /usr/local/cuda-13.0/bin/nvcc) and cuobjdump + nvdisasm on PATH.
Compiled cubins are cached under $SASS_CACHE (default ~/.cache/cupy_fa_sass) by program text.
Exit status: 0 when every matched variant has the same instructions and none spills.
"""

import argparse
import concurrent.futures
import difflib
import hashlib
import json
import os
import pathlib
import re
import subprocess
import sys

LIST_VARIANTS = r"""
import json, sys
# the tree on PYTHONPATH, not an editable install of another checkout (its finder runs first)
sys.meta_path = [f for f in sys.meta_path if "editable" not in repr(f).lower()]
from cupy_fa import _build
try:  # where the program text is made: cupy_fa._compile, in older trees cupy_fa._build
    from cupy_fa import _compile
except ImportError:
    _compile = _build
try:  # the kernel catalog; trees from before it listed them in cupy_fa.schedule, or cupy_fa._build
    from cupy_fa import catalog
    kernels = catalog.all_kernels()
except ImportError:
    try:
        from cupy_fa import schedule
        kernels = schedule.all_variants()
    except (ImportError, AttributeError):
        kernels = _build.all_variants()
json.dump([{"expression": k.expression, "source": k.source, "text": _compile.program_text(k)} for k in kernels],
          sys.stdout)
"""

NVCC = os.environ.get("NVCC", "/usr/local/cuda-13.0/bin/nvcc")
FLAGS = ("-cubin", "-gencode=arch=compute_90a,code=sm_90a", "-std=c++17", "-DCUPY_FA_REQUIRE_SM90A", "-ftz=true",
         "-Xptxas", "-v")
CACHE = pathlib.Path(os.environ.get("SASS_CACHE", pathlib.Path.home() / ".cache" / "cupy_fa_sass"))


def list_variants(tree):
    env = dict(os.environ, PYTHONPATH=str(tree))
    out = subprocess.run([sys.executable, "-c", LIST_VARIANTS], env=env, check=True, capture_output=True, text=True,
                         cwd=tree)
    return json.loads(out.stdout)


def key_of(expression):
    """(kernel, element types, template numbers): a variant's identity across trees."""
    name = re.match(r"\s*([\w:]+)", expression).group(1).split("::")[-1]
    types = tuple(sorted(set(re.findall(r"__half|__nv_bfloat16|__nv_fp8_e4m3|__nv_fp8_e5m2|long long|\bint\b",
                                        expression))))
    numbers = tuple(re.findall(r"\b(\d+|true|false)\b", expression))
    found = re.search(r"Sm90PrefillTraits<([^<>]*)>", expression)
    if found and len(found.group(1).split(",")) >= 13:
        # the 13- / 14-parameter traits of trees before 2026-12-04 (with the overlap, Q-in-registers,
        # persistent-grid and polynomial-exp2 options no tile chose) as today's 10 parameters
        old = [x.strip() for x in found.group(1).split(",")] + ["false"]
        numbers = tuple(old[i] for i in (0, 1, 2, 4, 5, 7, 8, 10, 12, 13))
    return name, types, numbers


def compile_variant(tree, variant, extra_flags=()):
    """(sass text, ptxas resources) of one variant, from the cache when its text was compiled before."""
    text = variant["text"] + f"\nstatic auto cupy_fa_sass_instance = &{variant['expression']};\n"
    kernels = pathlib.Path(tree) / "kernels"
    digest = hashlib.sha256()
    for path in sorted(kernels.rglob("*.cu*")):  # the headers the text includes
        digest.update(path.relative_to(kernels).as_posix().encode() + path.read_bytes())
    digest.update(text.encode() + " ".join(FLAGS + tuple(extra_flags)).encode() + NVCC.encode())
    entry = CACHE / digest.hexdigest()[:24]
    if not (entry / "sass.txt").exists():
        entry.mkdir(parents=True, exist_ok=True)
        (entry / "prog.cu").write_text(text)
        run = subprocess.run([NVCC, *FLAGS, *extra_flags, f"-I{kernels}", "prog.cu", "-o", "prog.cubin"], cwd=entry,
                             capture_output=True, text=True)
        if run.returncode:
            raise RuntimeError(f"nvcc failed on {variant['expression']} in {tree}:\n{run.stderr[-3000:]}")
        (entry / "ptxas.txt").write_text(run.stderr)
        sass = subprocess.run(["cuobjdump", "--dump-sass", "prog.cubin"], cwd=entry, check=True,
                              capture_output=True, text=True).stdout
        (entry / "sass.txt").write_text(sass)
    return (entry / "sass.txt").read_text(), resources((entry / "ptxas.txt").read_text())


def resources(log):
    regs = re.search(r"Used (\d+) registers", log)
    spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    stack = re.search(r"(\d+) bytes stack frame", log)
    return {"registers": int(regs.group(1)) if regs else None,
            "spills": (int(spill.group(1)) + int(spill.group(2))) if spill else None,
            "stack": int(stack.group(1)) if stack else None}


_ADDRESS = re.compile(r"^\s*/\*[0-9a-f]{4,}\*/\s*")
_ENCODING = re.compile(r"/\*\s*(0x[0-9a-f]{16})\s*\*/")


def instructions(sass):
    """The instruction lines, addresses and encodings stripped (function names and headers dropped)."""
    out = []
    for line in sass.splitlines():
        if _ADDRESS.match(line):
            out.append(_ENCODING.sub("", _ADDRESS.sub("", line)).strip())
    return out


def encodings(sass):
    return _ENCODING.findall(sass)


# Instructions that move data or do the attention math: where two builds agree on these counts,
# they differ in integer address arithmetic, predicates and register moves only.
DATA_AND_MATH = re.compile(r"^(HMMA|LDSM|LDGSTS|LDGDEPBAR|DEPBAR|LDG|STG|LDS|STS|LD|ST|ATOM|RED|BAR|SHFL|VOTE|"
                           r"MUFU|FMUL|FADD|FFMA|FMNMX|F2FP|HADD2|HFMA2|WARPSYNC|EXIT|BRA)$")


def opcode(instruction):
    """The opcode without modifiers; ``@!PT`` instructions (never executed: ptxas's padding) count as NOP."""
    ins = instruction.split()
    if ins[0] == "@!PT":
        return "NOP"
    op = ins[1] if ins[0].startswith("@") else ins[0]
    return op.split(".")[0].rstrip(";")


def opcode_delta(ia, ib):
    """(opcode, new count - base count), largest changes first."""
    from collections import Counter

    ca, cb = Counter(map(opcode, ia)), Counter(map(opcode, ib))
    delta = [(op, cb[op] - ca[op]) for op in set(ca) | set(cb) if cb[op] != ca[op]]
    return sorted(delta, key=lambda d: (-abs(d[1]), d[0]))


def data_and_math_same(ia, ib):
    return all(not DATA_AND_MATH.match(op) for op, _ in opcode_delta(ia, ib))


_LINE = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s*(.*?)\s*;")
_BRANCH = re.compile(r"\bBRA\b.*?0x([0-9a-f]+)")


def main_loop_size(sass):
    """Instructions of the largest backward-branch loop that holds tensor-core work (the tile loop,
    its epilogue included), or None: a static proxy of the per-tile cost."""
    ins = [(int(m.group(1), 16), m.group(2)) for m in map(_LINE.match, sass.splitlines()) if m]
    at = {a: i for i, (a, _) in enumerate(ins)}
    best = None
    for i, (a, text) in enumerate(ins):
        m = _BRANCH.search(text)
        if m and int(m.group(1), 16) < a and int(m.group(1), 16) in at:
            body = ins[at[int(m.group(1), 16)]:i + 1]
            if any("HMMA" in t for _, t in body) and (best is None or len(body) > best):
                best = len(body)
    return best


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("base")
    parser.add_argument("new")
    parser.add_argument("--only", default="", help="substring of the variant expression")
    parser.add_argument("-j", type=int, default=2, help="nvcc processes at once")
    parser.add_argument("--diff", type=int, default=0, help="print the first N differing instruction lines")
    parser.add_argument("--trace", action="store_true", help="compile both with -DCUPY_FA_TRACE")
    parser.add_argument("--ops", type=int, default=6, help="opcode count changes shown per differing variant")
    args = parser.parse_args(argv)
    extra = ("-DCUPY_FA_TRACE",) if args.trace else ()

    trees = {"base": pathlib.Path(args.base).resolve(), "new": pathlib.Path(args.new).resolve()}
    listed = {side: {key_of(v["expression"]): v for v in list_variants(tree) if args.only in v["expression"]}
              for side, tree in trees.items()}
    keys = sorted(set(listed["base"]) | set(listed["new"]), key=lambda k: (k[0], k[1], tuple(map(str, k[2]))))
    jobs = {}
    with concurrent.futures.ThreadPoolExecutor(args.j) as pool:
        for key in keys:
            for side in trees:
                if key in listed[side]:
                    jobs[(key, side)] = pool.submit(compile_variant, trees[side], listed[side][key], extra)
    rows, bad = [], 0
    for key in keys:
        got = {side: jobs[(key, side)].result() for side in trees if (key, side) in jobs}
        name = (listed["new"].get(key) or listed["base"][key])["expression"]
        if len(got) < 2:
            rows.append((name, "only in " + next(iter(got)), "", ""))
            bad += 1
            continue
        (sa, ra), (sb, rb) = got["base"], got["new"]
        ia, ib = instructions(sa), instructions(sb)
        if ia == ib:
            verdict = "identical bytes" if encodings(sa) == encodings(sb) else "same instructions, other control bits"
        else:
            ops = lambda ins: sorted(i.split()[0] if not i.startswith("@") else i.split()[1] for i in ins)  # noqa: E731
            same_multiset = sorted(ia) == sorted(ib)
            verdict = (f"DIFFERENT ({len(ia)} vs {len(ib)} instructions; "
                       + ("same instructions reordered" if same_multiset else
                          "same opcodes, other operands" if ops(ia) == ops(ib) else
                          "same data/math opcode counts" if data_and_math_same(ia, ib) else "other opcodes") + ")")
            bad += 1
            delta = opcode_delta(ia, ib)
            verdict += "; " + (" ".join(f"{op}{n:+d}" for op, n in delta[:args.ops]) if delta else "same opcode counts")
            if args.diff:
                diff = list(difflib.unified_diff(ia, ib, "base", "new", n=1, lineterm=""))
                print(f"--- {name}\n" + "\n".join(diff[:args.diff]))
        la, lb = main_loop_size(sa), main_loop_size(sb)
        if la and lb and ia != ib:
            verdict += f"; tile loop {la} -> {lb} instructions"
        spills = ra["spills"] or rb["spills"]
        bad += bool(spills)
        rows.append((name, verdict, f"{ra['registers']} -> {rb['registers']}",
                     f"{ra['spills']} -> {rb['spills']}" + ("  SPILLS" if spills else "")))
    width = max(len(r[0]) for r in rows)
    print(f"{'variant':{width}s}  {'registers':>10s}  {'spill bytes':12s}  SASS (base vs new)")
    for r in rows:
        print(f"{r[0]:{width}s}  {r[2]:>10s}  {r[3]:12s}  {r[1]}")
    same = sum(r[1] == "identical bytes" for r in rows)
    print(f"{len(rows)} variants: {same} identical bytes, "
          f"{sum(r[1].startswith('same instructions') for r in rows)} same instructions (control bits differ), "
          f"{sum(r[1].startswith('DIFFERENT') for r in rows)} different, "
          f"{sum('only in' in r[1] for r in rows)} unmatched")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
