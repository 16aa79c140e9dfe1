"""First use, timed (GPU): what NVRTC costs a program that starts with an empty kernel cache.

Usage (repo root, on a GPU machine): python3 scripts/cold_compile.py [--json PATH]

Each measurement runs in a fresh process, so nothing is compiled or loaded before it:

1. first calls, cold: a new CUDA context, then the first prefill call (BatchAttention plan + run of
   one 4096-token prompt, bf16, 32 / 8 heads, D 128: the plan kernel and the prefill family's
   variant compile), then the first decode call in the same process (the small-q variants), then a
   first mixed step (a 2048-token chunk beside decodes: both families, the merge);
2. ``cupy_fa.warmup()`` with an empty cache: every variant the device can select, each one timed,
   the prefill family's (the sm_90a wgmma variants on Hopper) listed one by one;
3. ``cupy_fa.warmup()`` again in a new process over the cache step 2 filled (a warm start).

Every process gets its own empty cache directory (CUPY_CACHE_DIR), removed afterwards; the
NVRTC and CuPy versions are printed with the figures, the table last.
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile

FIRST_CALLS = r"""
import json, time
import numpy as np
t0 = time.perf_counter()
import cupy
cupy.cuda.Device(0).use()
cupy.zeros(1).sum()
cupy.cuda.Device().synchronize()
t_ctx = time.perf_counter() - t0
import cupy_fa
from cupy_fa import schedule

def case(q_lens, kv_lens, ps=16, h_q=32, h_kv=8, d=128):
    pages = [-(-kv // ps) for kv in kv_lens]
    table = np.zeros((len(q_lens), max(pages)), np.int32)
    start = 0
    for b, n in enumerate(pages):
        table[b, :n] = np.arange(start, start + n)
        start += n
    k = cupy.zeros((start, ps, h_kv, d), np.float16)
    cache = cupy_fa.PagedKVCache(k, k.copy())
    q = cupy.zeros((sum(q_lens), h_q, d), np.float16)
    return q, cache, table

out = {"context_s": t_ctx}
for name, q_lens, kv_lens in (("prefill", [4096], [4096]), ("decode", [1] * 8, [4096] * 8),
                              ("mixed", [2048] + [1] * 7, [4096] * 8)):
    q, cache, table = case(q_lens, kv_lens)
    start = time.perf_counter()
    attn = cupy_fa.BatchAttention(32, 8, 128, "float16")
    attn.plan(q_lens, kv_lens, table).run(q, cache)
    cupy.cuda.Device().synchronize()
    out[name + "_s"] = time.perf_counter() - start
    out[name + "_families"] = [families.family_of(x.tile).name for x in attn.planned.schedule.launches]
print("RESULT " + json.dumps(out))
"""

WARMUP = r"""
import json, time
import cupy
cupy.cuda.Device(0).use()
cupy.zeros(1).sum()
from cupy_fa import _build, schedule
from cupy.cuda import nvrtc
arch = _build.device_arch(cupy.cuda.Device())
wanted = catalog.warmup_kernels(smem_limit=_build.device_smem_limit(), arch=arch)
rows = []
start = time.perf_counter()
for variant in wanted:
    t = time.perf_counter()
    _build.get_function(variant)
    rows.append((variant.source, variant.expression, time.perf_counter() - t))
total = time.perf_counter() - start
start = time.perf_counter()
import cupy_fa
n = cupy_fa.warmup()  # the public call, now all in memory: what a second call in the process costs
print("RESULT " + json.dumps({"arch": arch, "variants": len(wanted), "total_s": total, "rows": rows,
                              "again_in_process_s": time.perf_counter() - start, "again_n": n,
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
from cupy_fa import families
from cupy_fa import catalog
start = time.perf_counter()
n = cupy_fa.warmup()
print("RESULT " + json.dumps({"variants": n, "warm_s": time.perf_counter() - start, "context_s": t_ctx}))
"""


def run(code, cache_dir):
    env = dict(os.environ, CUPY_CACHE_DIR=cache_dir, PYTHONUNBUFFERED="1")
    env.pop("CUPY_FA_CACHE_DIR", None)
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    raise RuntimeError(f"a measurement process failed (exit {proc.returncode}):\n{proc.stdout[-2000:]}"
                       f"\n{proc.stderr[-3000:]}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", help="also write the figures here")
    args = parser.parse_args(argv)
    scratch = tempfile.mkdtemp(prefix="cupy_fa_cold_")
    try:
        first = run(FIRST_CALLS, os.path.join(scratch, "first"))
        cold = run(WARMUP, os.path.join(scratch, "warmup"))
        warm = run(WARM, os.path.join(scratch, "warmup"))  # the cache the cold warm-up filled
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    prefill_family = [r for r in cold["rows"] if r[0] == "sm90/prefill.cu"]
    print(f"NVRTC {cold['nvrtc']}, CuPy {cold['cupy']}, target {cold['arch']}")
    print("\nthe prefill family's variants, cold (each compiled alone, one after another):")
    for _, expression, seconds in prefill_family:
        print(f"  {seconds:6.2f} s  {expression}")
    by_source = {}
    for source, _, seconds in cold["rows"]:
        n, s = by_source.get(source, (0, 0.0))
        by_source[source] = (n + 1, s + seconds)
    print("\nfirst use, cold cache                                   seconds")
    print(f"  CUDA context (and CuPy's first kernel)                {first['context_s']:7.2f}")
    print(f"  first prefill call (plan + run, q 4096)               {first['prefill_s']:7.2f}   "
          f"{'+'.join(first['prefill_families'])}")
    print(f"  then the first decode call (8 x 1 over 4096)          {first['decode_s']:7.2f}   "
          f"{'+'.join(first['decode_families'])}")
    print(f"  then the first mixed step (2048 + 7 decodes)          {first['mixed_s']:7.2f}   "
          f"{'+'.join(first['mixed_families'])}")
    print(f"  warmup(): {cold['variants']} variants, empty cache               {cold['total_s']:7.2f}")
    for source, (n, s) in sorted(by_source.items()):
        print(f"    {source:20s} {n:3d} variants                     {s:7.2f}")
    print(f"  warmup() again in that process                        {cold['again_in_process_s']:7.2f}")
    print(f"  warmup() in a new process, warm disk cache            {warm['warm_s']:7.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"first_calls": first, "warmup_cold": cold, "warmup_warm": warm}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
