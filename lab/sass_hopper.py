"""The wgmma family's kernels in SASS (lab probe): each compiled with the package's own NVRTC, then
cuobjdump's disassembly counted: HGMMA (the 16-bit tensor-core instruction; QGMMA would be fp8's),
local-memory traffic (STL / LDL: spills), the special-function operations a score takes (MUFU.EX2,
MUFU.RCP, MUFU.TANH), the fp8 widening (F2FP ... E4M3, or PRMT / LOP3 / SHF by integer operations)
and the FMA pipe's FFMA, beside ptxas' registers and spill bytes.

    python3 lab/sass_hopper.py [--only SUBSTRING] [--cuobjdump PATH] [--jobs N]
    python3 lab/sass_hopper.py --ab cap50,fp8    # the kernels of lab/ab_hopper.py's points instead

Needs cuobjdump on PATH (or --cuobjdump); without it, prints ptxas' figures alone.
"""

import argparse
import concurrent.futures
import os
import re
import shutil
import subprocess
import sys
import tempfile

from cupy_fa import _compile, catalog

OPS = ("HGMMA", "QGMMA", "STL", "LDL", "MUFU.EX2", "MUFU.RCP", "MUFU.TANH", "F2FP.F16.E4M3", "PRMT", "LOP3", "SHF",
       "FFMA")


def kernels(only=""):
    return [k for k in catalog.all_kernels("sm_90a") if k.source == "sm90/prefill.cu" and only in k.expression]


def ab_kernels(only):
    """The kernels of lab/ab_hopper.py's points whose workload names hold one of ``only``'s
    comma-separated substrings, with bf16 and fp16 queries: the family's tile for the workload
    under the point's patch (with the hooks where the workload takes a variant)."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import ab_hopper

    from bench import workloads as W
    from cupy_fa.families import common, sm90

    out = {}
    for name, point, patch in ab_hopper.POINTS:
        if not any(x in name for x in only.split(",")):
            continue
        w = W.BY_NAME[name]
        with ab_hopper.patched(**patch):
            tile = sm90.prefill_tile(w.head_dim, 1 if w.kv_dtype == common.FP8 else 2)
            if w.soft_cap or w.sinks or w.window:
                tile = tile.with_variants()
            for q in ("bfloat16", "float16"):
                k = sm90.kernel(common.ElementTypes(q, w.kv_dtype or q, q), tile)
                out.setdefault(k.expression, k)
    return list(out.values())


def one(task):
    kernel, tool = task
    cubin, res = _compile.compile_cubin(kernel, "sm_90a")
    counts = {}
    if tool:
        with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
            f.write(cubin)
        try:
            sass = subprocess.run([tool, "-sass", f.name], capture_output=True, text=True, check=True).stdout
        finally:
            os.unlink(f.name)
        for op in OPS:
            counts[op] = len(re.findall(r"\b" + re.escape(op) + r"\b", sass))
    return kernel.expression, res, counts


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default="")
    parser.add_argument("--cuobjdump", default=shutil.which("cuobjdump"))
    parser.add_argument("--jobs", type=int, default=os.cpu_count())
    parser.add_argument("--ab", default="", help="lab/ab_hopper.py's points of these workloads (substrings)")
    args = parser.parse_args(argv)
    ks = [k for k in ab_kernels(args.ab) if args.only in k.expression] if args.ab else kernels(args.only)
    print(f"{len(ks)} wgmma kernels, NVRTC {_compile.nvrtc_version()}, cuobjdump {args.cuobjdump or 'absent'}")
    bad = 0
    with concurrent.futures.ProcessPoolExecutor(max(1, args.jobs)) as pool:
        for expr, res, counts in pool.map(one, [(k, args.cuobjdump) for k in ks]):
            q, kv = (x.strip().replace("cupy_fa::", "") for x in expr.split("<")[1].split(",")[:2])
            name = expr.split("Sm90PrefillTraits")[1] + f" {q}/{kv}"
            ops = "  ".join(f"{op} {n}" for op, n in counts.items() if n)
            spills = res["spill_stores"] + res["spill_loads"]
            flag = "" if not spills and (not counts or counts.get("HGMMA")) else "  <-- CHECK"
            bad += bool(flag)
            print(f"{name:80s} regs {res['registers']:3d} spill {res['spill_stores']}/{res['spill_loads']}  {ops}{flag}")
    print(f"{len(ks)} kernels, {bad} with spills or without HGMMA")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
