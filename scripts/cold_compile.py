"""First use, timed: what NVRTC costs a program that starts with an empty kernel cache.

Usage (repo root): python3 scripts/cold_compile.py [--json PATH]           (a GPU machine)
                   python3 scripts/cold_compile.py --nvrtc [--json PATH]   (no device needed)

--nvrtc, on the CPU with NVRTC alone (cupy_fa._compile, the options the cached build uses): where
NVRTC's time goes for the first decode variant (D 128, group 4, fp16), the first prefill
variant (the sm_90a wgmma family at D 128), the plan kernel and merge_states (each timed as a
cubin, as PTX only, as a syntax check only, and by NVRTC's own --time phases: front end, NVVM
optimizer, PTX translation = ptxas); NVRTC's automatic precompiled header (--pch) on a second
program of the same source; then warmup_variants() of one dtype (bf16, sm_90a) compiled into an
empty cache on one process and on every core (cupy_fa._compile.compile_many).

On a GPU:

Each measurement runs in a fresh process, so nothing is compiled or loaded before it:

1. first calls, cold: a new CUDA context, then the first prefill call (BatchAttention plan + run of
   one 4096-token prompt, fp16, 32 / 8 heads, D 128: the plan kernel and the prefill family's
   kernel compile), then the first decode call in the same process (the small-q kernels), then a
   first mixed step (a 2048-token chunk beside decodes: both families, the merge); and in other
   fresh processes over other empty caches a decode call first, and an MLA decode call first;
2. ``cupy_fa.warmup()`` with an empty cache on every core (its compile processes), then
   ``cupy_fa.warmup()`` in a new process over the cache it filled (a warm start);
3. with another empty cache, one kernel at a time in one process (``jobs=1``: the single-core
   time, each kernel timed; ``--serial-limit`` stops it, reporting the kernels done by then).

Every process gets its own empty cache directory (CUPY_FA_CACHE_DIR, and CUPY_CACHE_DIR for
CuPy's own kernels), removed afterwards; the NVRTC and CuPy versions are printed with the
figures, the table last.
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile

FIRST_CALLS = r"""
import cProfile, io, json, os, pstats, sys, time
import numpy as np
t0 = time.perf_counter()
import cupy
cupy.cuda.Device(0).use()
cupy.zeros(1).sum()
cupy.cuda.Device().synchronize()
t_ctx = time.perf_counter() - t0
import cupy_fa
from cupy_fa import families

def case(q_lens, kv_lens, ps=16, h_q=32, h_kv=8, d=128):
    pages = [-(-kv // ps) for kv in kv_lens]
    table = np.zeros((len(q_lens), max(pages)), np.int32)
    start = 0
    for b, n in enumerate(pages):
        table[b, :n] = np.arange(start, start + n)
        start += n
    k = cupy.zeros((start, ps, h_kv, d), np.float16)
    cache = cupy_fa.PagedKVCache(k, cupy.zeros_like(k))
    q = cupy.zeros((sum(q_lens), h_q, d), np.float16)
    return q, cache, table

def mla_first():  # MLA decode, 8 x 1 over 4096 keys, 128 heads, fp16 latent pages of 64
    table = np.arange(8 * 64, dtype=np.int32).reshape(8, 64)
    cache = cupy_fa.PagedLatentCache(cupy.zeros((8 * 64, 64, 576), cupy.float16))
    q = cupy.zeros((8, 128, 576), cupy.float16)
    cupy.cuda.Device().synchronize()
    start = time.perf_counter()
    mla = cupy_fa.MLAAttention(128, "float16")
    mla.plan([1] * 8, [4096] * 8, table).run(q, cache)
    cupy.cuda.Device().synchronize()
    return time.perf_counter() - start

STEPS = {"prefill": ([4096], [4096]), "decode": ([1] * 8, [4096] * 8), "mixed": ([2048] + [1] * 7, [4096] * 8)}
out = {"context_s": t_ctx}
for name in sys.argv[1].split(","):
    if name == "mla":
        out["mla_s"] = mla_first()
        continue
    q_lens, kv_lens = STEPS[name]
    q, cache, table = case(q_lens, kv_lens)
    cupy.cuda.Device().synchronize()
    profile = cProfile.Profile() if os.environ.get("COLD_PROFILE") and not out.get("profile") else None
    start = time.perf_counter()
    profile and profile.enable()
    attn = cupy_fa.BatchAttention(32, 8, 128, "float16")
    attn.plan(q_lens, kv_lens, table).run(q, cache)
    cupy.cuda.Device().synchronize()
    out[name + "_s"] = time.perf_counter() - start
    if profile:  # where the process's first call spends its time (COLD_PROFILE=1)
        profile.disable()
        text = io.StringIO()
        pstats.Stats(profile, stream=text).sort_stats("cumulative").print_stats(28)
        out["profile"] = name + ": " + text.getvalue()
    out[name + "_families"] = [families.family_of(x.tile).name for x in attn.planned.schedule.launches]
print("RESULT " + json.dumps(out))
"""

WARMUP = r"""
import json, os, sys, time
import cupy
cupy.cuda.Device(0).use()
cupy.zeros(1).sum()
from cupy_fa import _build, _compile, catalog
from cupy.cuda import nvrtc
import cupy_fa
jobs = int(sys.argv[1]) if len(sys.argv) > 1 else None
arch = _build.device_arch(cupy.cuda.Device())
rows, last = [], [time.perf_counter()]
def progress(done, total, variant, status):  # one process (jobs=1): each kernel's own seconds, as it ends
    now = time.perf_counter()
    rows.append((variant.source, variant.expression, now - last[0]))
    print("KERNEL " + json.dumps(rows[-1]), flush=True)
    last[0] = now
start = time.perf_counter()
n = cupy_fa.warmup(jobs=jobs, progress=progress if jobs == 1 else False)
total = time.perf_counter() - start
start = time.perf_counter()
cupy_fa.warmup()  # all in memory now: what a second call in the process costs
print("RESULT " + json.dumps({"arch": arch, "kernels": n, "jobs": jobs or _compile.default_jobs(), "total_s": total,
                              "rows": rows, "again_in_process_s": time.perf_counter() - start,
                              "nvrtc": ".".join(map(str, nvrtc.getVersion())), "cupy": cupy.__version__}))
"""

WARM = r"""
import json, time
t0 = time.perf_counter()
import cupy
cupy.cuda.Device(0).use()
cupy.zeros(1).sum()
t_ctx = time.perf_counter() - t0
import cupy_fa
start = time.perf_counter()
n = cupy_fa.warmup()
print("RESULT " + json.dumps({"kernels": n, "warm_s": time.perf_counter() - start, "context_s": t_ctx}))
"""


def run(code, cache_dir, *args, limit=None):
    """A fresh process over ``cache_dir`` (its kernel cache; CuPy's own beside it), its RESULT line
    parsed; past ``limit`` seconds it is stopped and its KERNEL lines so far come back instead."""
    env = dict(os.environ, CUPY_FA_CACHE_DIR=cache_dir, CUPY_CACHE_DIR=os.path.join(cache_dir, "cupy"),
               PYTHONUNBUFFERED="1")
    try:
        proc = subprocess.run([sys.executable, "-c", code, *args], env=env, capture_output=True, text=True,
                              timeout=limit)
        stdout, stderr, code_ = proc.stdout, proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as exc:
        stdout = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        rows = [json.loads(x[len("KERNEL "):]) for x in stdout.splitlines() if x.startswith("KERNEL ")]
        return {"stopped_at_s": limit, "rows": rows, "kernels_done": len(rows)}
    for line in stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    raise RuntimeError(f"a measurement process failed (exit {code_}):\n{stdout[-2000:]}\n{stderr[-3000:]}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", help="also write the figures here")
    parser.add_argument("--nvrtc", action="store_true", help="the CPU figures: NVRTC alone, no device")
    parser.add_argument("--serial-limit", type=float, default=None,
                        help="seconds the one-process warmup may take (stopped there: the kernels done by then)")
    parser.add_argument("--no-serial", action="store_true", help="skip the one-process warmup")
    parser.add_argument("--keep", help="leave the cache the every-core warmup filled in this directory")
    args = parser.parse_args(argv)
    if args.nvrtc:
        return nvrtc_main(args.json)
    scratch = tempfile.mkdtemp(prefix="cupy_fa_cold_")
    warm_dir = args.keep or os.path.join(scratch, "warmup")
    try:
        first = run(FIRST_CALLS, os.path.join(scratch, "first"), "prefill,decode,mixed")
        decode_first = run(FIRST_CALLS, os.path.join(scratch, "decode_first"), "decode")
        mla_first = run(FIRST_CALLS, os.path.join(scratch, "mla_first"), "mla")
        cold = run(WARMUP, warm_dir)  # every core
        warm = run(WARM, warm_dir)  # the cache the cold warm-up filled
        serial = {"rows": [], "skipped": True} if args.no_serial else \
            run(WARMUP, os.path.join(scratch, "serial"), "1", limit=args.serial_limit)  # one process
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    by_source = {}
    for source, _, seconds in serial["rows"]:
        n, s = by_source.get(source, (0, 0.0))
        by_source[source] = (n + 1, s + seconds)
    print(f"NVRTC {cold['nvrtc']}, CuPy {cold['cupy']}, target {cold['arch']}")
    print("\nfirst use, cold cache (each line a fresh process over an empty cache but for the 'then' lines)  seconds")
    print(f"  CUDA context (and CuPy's first kernel)                {first['context_s']:7.2f}")
    print(f"  first prefill call (plan + run, q 4096)               {first['prefill_s']:7.2f}   "
          f"{'+'.join(first['prefill_families'])}")
    print(f"  then the first decode call (8 x 1 over 4096)          {first['decode_s']:7.2f}   "
          f"{'+'.join(first['decode_families'])}")
    print(f"  then the first mixed step (2048 + 7 decodes)          {first['mixed_s']:7.2f}   "
          f"{'+'.join(first['mixed_families'])}")
    print(f"  first decode call, the process's first call           {decode_first['decode_s']:7.2f}")
    print(f"  first MLA decode call (8 x 1 over 4096, 128 heads)    {mla_first['mla_s']:7.2f}")
    print(f"  warmup(): {cold['kernels']} kernels, empty cache, {cold['jobs']:2d} processes  {cold['total_s']:7.2f}")
    if "total_s" in serial:
        print(f"  warmup(jobs=1): the same, one process                 {serial['total_s']:7.2f}")
    elif serial.get("skipped"):
        print("  warmup(jobs=1): not measured here (--no-serial)")
    else:
        done = sum(r[2] for r in serial["rows"])
        print(f"  warmup(jobs=1): stopped at {serial['stopped_at_s']:.0f} s: {serial['kernels_done']} of "
              f"{cold['kernels']} kernels in {done:.2f} s")
    for source, (n, s) in sorted(by_source.items()):
        print(f"    {source:22s} {n:3d} kernels                      {s:7.2f}   ({s / n:.2f} s each)")
    print(f"  warmup() again in that process                        {cold['again_in_process_s']:7.2f}")
    print(f"  warmup() in a new process, warm disk cache            {warm['warm_s']:7.2f}")
    for result in (first, decode_first, mla_first):
        if result.get("profile"):  # COLD_PROFILE=1: the first call's profile, by cumulative time
            print("\nprofile of the process's first call, " + result["profile"])
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"first_calls": first, "decode_first": decode_first, "mla_first": mla_first,
                       "warmup_cold": cold, "warmup_serial": serial,
                       "warmup_warm": warm}, f, indent=1)
    return 0


# ---- --nvrtc: the CPU figures ---------------------------------------------------------------


def _timed_compile(variant, arch, extra=(), time_file=None):
    """(seconds, NVRTC's --time phases {phase: ms}) of one compile of ``variant`` with the cached
    build's options, the target replaced by ``arch`` (compute_90a: PTX only)."""
    import time

    from cupy_fa import _compile

    options = [o for o in _compile.build_options("sm_90a") if not o.startswith("-arch=")] + [f"-arch={arch}"]
    options += list(extra)
    if time_file:
        if os.path.exists(time_file):
            os.remove(time_file)
        options.append(f"--time={time_file}")
    from cupy_backends.cuda.libs import nvrtc

    prog = nvrtc.createProgram(_compile.program_text(variant), "cupy_fa.cu", [], [])
    try:
        nvrtc.addNameExpression(prog, variant.expression)
        start = time.perf_counter()
        nvrtc.compileProgram(prog, options)  # (what _compile._nvrtc_compile does, timed alone)
        seconds = time.perf_counter() - start
        log = nvrtc.getProgramLog(prog)
    finally:
        nvrtc.destroyProgram(prog)
    phases = {}
    if time_file and os.path.exists(time_file):
        for line in open(time_file).read().splitlines()[1:]:  # file, phase, metric, unit
            cells = [c.strip() for c in line.split(",")]
            if len(cells) == 4:
                phases[cells[1]] = phases.get(cells[1], 0) + float(cells[2])
    return seconds, phases, log


def nvrtc_main(json_path=None, repeats=3):
    import statistics
    import time

    from cupy_backends.cuda.libs import nvrtc

    from cupy_fa import _compile, catalog, families, schedule

    scratch = tempfile.mkdtemp(prefix="cupy_fa_nvrtc_")
    tf = os.path.join(scratch, "time.csv")
    out = {"nvrtc": ".".join(map(str, nvrtc.getVersion())), "cores": _compile.default_jobs(), "programs": {}}
    print(f"NVRTC {out['nvrtc']}, target sm_90a, {out['cores']} cores, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    decode = catalog.attention_kernel("float16", schedule.tile_for(128, 1, 4, families.common.SMEM_LIMIT, "sm_90a"))
    prefill = catalog.attention_kernel("float16", schedule.tile_for(128, 4096, 4, families.common.SMEM_LIMIT, "sm_90a"))
    programs = (("plan kernel", catalog.PLAN_KERNEL), ("merge_states", catalog.merge_states_kernel("float16")),
                ("first decode", decode), ("first prefill", prefill))
    try:
        first, _, _ = _timed_compile(catalog.PLAN_KERNEL, "sm_90a")  # NVRTC's first program in a process
        out["first_program_in_process_s"] = first
        print(f"\nthe first program in a process (the plan kernel; NVRTC loads its builtins): {first:.2f} s")
        print(f"\nper program, median of {repeats} (s); NVRTC --time phases (ms) of the cubin build:")
        print(f"  {'program':14s} {'cubin':>6s} {'PTX':>6s} {'syntax':>6s}   {'front end':>9s} {'NVVM opt':>9s} "
              f"{'ptxas':>9s}")
        for name, variant in programs:
            runs = [_timed_compile(variant, "sm_90a", time_file=tf) for _ in range(repeats)]
            cubin = statistics.median(r[0] for r in runs)
            phases = {k: statistics.median(r[1].get(k, 0) for r in runs) for k in runs[0][1]}
            ptx = statistics.median(_timed_compile(variant, "compute_90a")[0] for _ in range(repeats))
            syntax = statistics.median(_timed_compile(variant, "sm_90a", ("--fdevice-syntax-only",))[0]
                                       for _ in range(repeats))
            front, opt = phases.get("CUDA C++ Frontend", 0), phases.get("NVVM Optimizer", 0)
            ptxas = phases.get("PTX Translation", 0)
            print(f"  {name:14s} {cubin:6.2f} {ptx:6.2f} {syntax:6.2f}   {front:9.0f} {opt:9.0f} {ptxas:9.0f}")
            out["programs"][name] = {"expression": variant.expression, "cubin_s": cubin, "ptx_s": ptx,
                                     "syntax_s": syntax, "phases_ms": phases}
        print("\nNVRTC's automatic precompiled header (--pch): the second program of one source reuses the first's")
        out["pch"] = {}
        for name, pair in (("decode", (decode, catalog.attention_kernel(
                "float16", schedule.tile_for(64, 1, 4, families.common.SMEM_LIMIT, "sm_90a")))),
                           ("prefill", (prefill, catalog.attention_kernel(
                               "float16", schedule.tile_for(64, 4096, 4, families.common.SMEM_LIMIT, "sm_90a"))))):
            plain = _timed_compile(pair[1], "sm_90a", time_file=tf)
            os.chdir(scratch)  # where --pch writes its file
            _timed_compile(pair[0], "sm_90a", ("--pch",))
            used = _timed_compile(pair[1], "sm_90a", ("--pch",), time_file=tf)
            said = "using" if "using precompiled header" in used[2] else "NOT using"
            print(f"  {name} D64 after D128: without --pch {plain[0]:.2f} s (front end "
                  f"{plain[1].get('CUDA C++ Frontend', 0):.0f} ms), with {used[0]:.2f} s (front end "
                  f"{used[1].get('CUDA C++ Frontend', 0):.0f} ms; NVRTC says {said} the header)")
            out["pch"][name] = {"plain_s": plain[0], "pch_s": used[0], "plain_phases": plain[1],
                                "pch_phases": used[1], "used": said == "using"}
        wanted = catalog.warmup_kernels(("bfloat16",), families.common.HEAD_DIMS, families.common.SMEM_LIMIT, "sm_90a")
        print(f"\ncatalog.warmup_kernels(bf16, sm_90a): {len(wanted)} kernels into an empty cache")
        for jobs in (1, out["cores"]):
            directory = os.path.join(scratch, f"cache{jobs}")
            os.environ["CUPY_FA_CACHE_DIR"] = directory
            from cupy_fa import knobs

            knobs.reload()
            summary = _compile.compile_many(wanted, "sm_90a", jobs=jobs, progress=False)
            print(f"  {jobs:2d} process{'es' if jobs > 1 else '  '}: {summary['seconds']:6.1f} s "
                  f"({summary['compiled']} compiled)")
            out[f"warmup_bf16_jobs{jobs}_s"] = summary["seconds"]
        start = time.perf_counter()
        for variant in wanted:
            _compile.binary(variant, "sm_90a")
        out["warm_load_s"] = time.perf_counter() - start
        print(f"  then every entry read and checked from the cache: {out['warm_load_s']:.2f} s")
    finally:
        os.chdir(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        shutil.rmtree(scratch, ignore_errors=True)
    if json_path:
        with open(json_path, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
