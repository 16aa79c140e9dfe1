"""The compile cache on a GPU: eight processes (tensor-parallel ranks on one machine) start their
first step at the same moment over one empty cache directory. Each compiles or loads every kernel
its step needs, runs it and checks it against the float64 reference; all succeed, every kernel is
one whole entry on disk that each process's loaded bytes equal, and the eight outputs are the same
bits (one binary, one result). The CPU half (damaged entries rebuilt, an unwritable directory, four
processes over the plan kernel) is tests/test_compile_cache_cpu.py."""

import hashlib
import json
import os
import subprocess
import sys
import textwrap
import time

import pytest

pytestmark = pytest.mark.gpu

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RANKS = 8

CHILD = textwrap.dedent("""
    import hashlib, json, os, sys, time
    import numpy as np
    import cupy
    import cupy_fa
    from cupy_fa import _build, _cache, _compile, reference

    cupy.cuda.Device(0).use()
    cupy.zeros(1).sum()  # the context first: the race is over the kernels
    loaded, real = {}, _compile.binary

    def binary(kernel, arch):  # what this rank hands the loader, kernel by kernel
        lowered, cubin = real(kernel, arch)
        loaded[kernel.expression] = [_compile._task(kernel, arch, _cache.cache_dir())["key"],
                                     hashlib.sha256(cubin).hexdigest()]
        return lowered, cubin

    _compile.binary = binary
    rng = np.random.default_rng(1234)  # every rank the same step
    q_lens, kv_lens, page = np.array([1, 1, 4, 1]), np.array([700, 3000, 1500, 9000]), 16
    pages = -(-kv_lens // page)
    table = np.zeros((4, pages.max()), np.int32)
    perm, start = rng.permutation(int(pages.sum())).astype(np.int32), 0
    for b, n in enumerate(pages):
        table[b, :n] = perm[start:start + n]
        start += n
    k = rng.standard_normal((int(pages.sum()), page, 2, 128), dtype=np.float32).astype(np.float16)
    v = rng.standard_normal(k.shape, dtype=np.float32).astype(np.float16)
    q = rng.standard_normal((int(q_lens.sum()), 8, 128), dtype=np.float32).astype(np.float16)
    cache = cupy_fa.PagedKVCache(cupy.asarray(k), cupy.asarray(v))
    attn = cupy_fa.BatchAttention(8, 2, 128, "float16")
    open(sys.argv[1] + "." + str(os.getpid()), "w").close()  # ready
    while not os.path.exists(sys.argv[1]):  # start together
        time.sleep(0.002)
    start = time.perf_counter()
    out = attn.plan(q_lens, kv_lens, table).run(cupy.asarray(q), cache)
    cupy.cuda.Device().synchronize()
    seconds = time.perf_counter() - start
    got = out.get()
    ref = reference.paged_attention(q, k, v, q_lens, kv_lens, table)
    err = reference.relative_error(got.astype(np.float64), ref)
    assert set(loaded) == {k.expression for k in _build.compiled_kernels(device_id=0)}
    print("RESULT " + json.dumps({"seconds": seconds, "err": err, "finite": bool(np.isfinite(got).all()),
                                  "out": hashlib.sha256(got.tobytes()).hexdigest(), "loaded": loaded}))
""")


def test_eight_processes_compile_into_one_empty_cache(tmp_path):
    from cupy_fa import _cache
    from cupy_fa.reference import TOL

    directory, go = tmp_path / "cache", tmp_path / "go"
    env = dict(os.environ, CUPY_FA_CACHE_DIR=str(directory), PYTHONPATH=ROOT)
    procs = [subprocess.Popen([sys.executable, "-c", CHILD, str(go)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(RANKS)]
    deadline = time.monotonic() + 120
    while len(list(tmp_path.glob("go.*"))) < RANKS and time.monotonic() < deadline:
        time.sleep(0.01)  # every rank has its context and its inputs, waiting at the start line
    assert len(list(tmp_path.glob("go.*"))) == RANKS
    go.write_text("")
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=180)
        assert proc.returncode == 0, err[-3000:]
        results.append(json.loads([x for x in out.splitlines() if x.startswith("RESULT ")][-1][len("RESULT "):]))
    print("first step of each rank (s):", ", ".join(f"{r['seconds']:.2f}" for r in results))
    for r in results:
        assert r["finite"] and r["err"] < TOL["float16"], r
    assert len({r["out"] for r in results}) == 1  # one binary, one result: the same bits in every rank
    kernels = {name for r in results for name in r["loaded"]}
    assert len(kernels) >= 2 and all(set(r["loaded"]) == kernels for r in results)  # the plan kernel and attention
    for name in kernels:
        (key,), (sha,) = {r["loaded"][name][0] for r in results}, {r["loaded"][name][1] for r in results}
        entry = _cache.load(str(directory), key)  # one whole entry, the bytes every rank loaded
        assert entry is not None and hashlib.sha256(entry[1]).hexdigest() == sha, name
    cubins = [p for p in os.listdir(directory) if p.endswith(".cubin")]
    assert len(cubins) == len(kernels) and not [p for p in os.listdir(directory) if p.endswith(".tmp")]
