"""``make demo`` / ``python -m cupy_fa.demo``: what cupy_fa does on this machine.

With a GPU: a self-check of engine-like batches against the float64 reference,
then a small timing table beside PyTorch SDPA, and decode step time under
CUDA-graph replay vs eager. Without one: the kernels an sm_90a GPU compiles on first
use (``cupy_fa.warmup``'s set; ``--all``: every kernel) compiled through NVRTC on every
core, with registers and spills (the table is cached, keyed by the kernel sources, the
NVRTC version and the options, so a second run prints it at once), and a plain
statement of what is missing. Without CuPy: what to install.
"""

import argparse
import hashlib
import json
import os
import pathlib
import sys
import time

import numpy as np

from ._arrays import cuda_problem


def _random_case(rng, q_lens, kv_lens, page_size, h_q=32, h_kv=8, d=128, dtype="bfloat16"):
    import cupy
    import cupy_fa
    from cupy_fa import _arrays

    q_lens, kv_lens = np.asarray(q_lens), np.asarray(kv_lens)
    pages_per = -(-kv_lens // page_size)
    num_pages = int(pages_per.sum())
    perm = rng.permutation(num_pages).astype(np.int32)
    table = np.zeros((len(q_lens), int(pages_per.max())), np.int32)
    start = 0
    for b, n in enumerate(pages_per):
        table[b, :n] = perm[start:start + n]
        start += n
    elem = _arrays.DTYPES[dtype]
    k = cupy.asarray(rng.standard_normal((num_pages, page_size, h_kv, d), dtype=np.float32)).astype(elem)
    v = cupy.asarray(rng.standard_normal((num_pages, page_size, h_kv, d), dtype=np.float32)).astype(elem)
    q = cupy.asarray(rng.standard_normal((int(q_lens.sum()), h_q, d), dtype=np.float32)).astype(elem)
    return cupy_fa.PagedKVCache(k, v), q, q_lens, kv_lens, table


def self_check(rng):
    import cupy
    import cupy_fa
    from cupy_fa import reference

    batches = {
        "decode B=8, L up to 6000": ([1] * 8, rng.integers(1, 6000, 8)),
        "prefill 3 x q=kv": ([200, 37, 512], [200, 37, 512]),
        "mixed decode + chunked prefill": ([1, 64, 1, 300, 1], [900, 1064, 33, 2300, 4097]),
        "verify q=4, q=8": ([4, 8, 4, 8], [130, 2000, 4, 8200]),
    }
    rows = []
    for name, (q_lens, kv_lens) in batches.items():
        for page_size in (1, 16):
            for dtype, tol in reference.TOL.items():
                cache, q, ql, kl, table = _random_case(rng, q_lens, kv_lens, page_size, dtype=dtype)
                attn = cupy_fa.BatchAttention(32, 8, 128, dtype)
                attn.plan(ql, kl, table)
                out = cupy.full_like(q, np.nan)
                attn.run(q, cache, out=out)
                ref = reference.paged_attention(q.get(), cache.k.get(), cache.v.get(), ql, kl, table)
                err = reference.relative_error(out.get().astype(np.float64), ref)
                rows.append((name, page_size, dtype, err, err < tol))
    print(f"\n{'batch':34s} {'page':>4s} {'dtype':>9s} {'rel err':>9s}  ok")
    for name, page_size, dtype, err, ok in rows:
        print(f"{name:34s} {page_size:4d} {dtype:>9s} {err:9.2e}  {'yes' if ok else 'NO'}")
    return all(ok for *_, ok in rows)


def _graph_time_us(launch, launches=20, replays=30):
    """Per-launch time of `launch` captured `launches` times in one cupy graph."""
    from ._timing import graph_replays_ms

    return float(np.median(graph_replays_ms([launch] * launches, warmup=3, reps=replays))) * 1000 / launches


def perf_table(rng):
    import cupy
    import cupy_fa

    try:
        import torch
        import torch.nn.functional as F
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except ImportError:
        torch = None
    rows = []
    shapes = [("decode B=64 L=4096", 64, 1, 4096, False), ("decode B=16 L=32768", 16, 1, 32768, False),
              ("prefill causal B=4 L=4096", 4, 4096, 4096, True)]
    for name, batch, q_len, kv_len, causal in shapes:
        cache, q, ql, kl, table = _random_case(rng, [q_len] * batch, [kv_len] * batch, 16)
        attn = cupy_fa.BatchAttention(32, 8, 128, "bfloat16")
        attn.plan(ql, kl, table, causal=True)
        out = cupy.empty_like(q)
        us = _graph_time_us(lambda: attn.run(q, cache, out=out))
        kv_bytes = 2 * batch * kv_len * 8 * 128 * 2
        flops = 4 * batch * 32 * 128 * (q_len * kv_len - (q_len * (q_len - 1) // 2 if causal else 0))
        if q_len > 8:
            def metric(t):
                return f"{flops / t / 1e6:7.1f} TFLOP/s"
        else:
            def metric(t):
                return f"{kv_bytes / t / 1e6:7.2f} TB/s"
        peer = {}
        if torch is not None:
            qt = torch.randn(batch, 32, q_len, 128, device="cuda", dtype=torch.bfloat16)
            kt = torch.randn(batch, 8, kv_len, 128, device="cuda", dtype=torch.bfloat16)
            vt = torch.randn_like(kt)
            for label, backend in (("cuDNN", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION)):
                try:
                    with sdpa_kernel(backend):
                        def call():
                            F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal and q_len == kv_len,
                                                           enable_gqa=True)
                        for _ in range(3):
                            call()
                        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                        ts = []
                        for _ in range(20):
                            s.record()
                            call()
                            e.record()
                            e.synchronize()
                            ts.append(s.elapsed_time(e) * 1000)
                        peer[label] = metric(float(np.median(ts)))
                except Exception as exc:  # a backend that refuses the shape
                    peer[label] = f"n/a ({type(exc).__name__})"
        rows.append((name, f"{us:8.1f}", metric(us), peer.get("cuDNN", "n/a"), peer.get("flash", "n/a")))
    print(f"\n{'workload (bf16, 32/8 heads, D128, page 16)':44s} {'us':>8s} {'cupy_fa':>16s} "
          f"{'SDPA cuDNN':>16s} {'SDPA flash':>16s}")
    for r in rows:
        print(f"{r[0]:44s} {r[1]:>8s} {r[2]:>16s} {r[3]:>16s} {r[4]:>16s}")
    return rows


def decode_replay_vs_eager(rng):
    import cupy
    import cupy_fa

    print(f"\n{'decode step, L=4096, page 16':30s} {'eager us/step':>14s} {'graph replay us/step':>21s}")
    rows = []
    # one runner for all batches: its graphs are per bucket and cache already
    runner = cupy_fa.GraphRunner(32, 8, 128, "bfloat16", max_batch_size=64, max_q_len=8,
                                 max_pages_per_request=4096 // 16, page_size=16)
    for batch in (1, 8, 64):
        cache, q, ql, kl, table = _random_case(rng, [1] * batch, [4096] * batch, 16)
        ql_d, kl_d, t_d = (cupy.asarray(x, np.int32) for x in (ql, kl, table))
        timings = {}
        for use_graph in (False, True):
            for _ in range(3):
                runner.run("decode", q, cache, ql_d, kl_d, t_d, use_graph=use_graph)
            cupy.cuda.get_current_stream().synchronize()
            start = time.perf_counter()
            for _ in range(100):
                runner.run("decode", q, cache, ql_d, kl_d, t_d, use_graph=use_graph)
            cupy.cuda.get_current_stream().synchronize()
            timings[use_graph] = (time.perf_counter() - start) / 100 * 1e6
        print(f"{'batch ' + str(batch):30s} {timings[False]:14.1f} {timings[True]:21.1f}")
        rows.append((batch, timings[False], timings[True]))
    return rows


def compile_cache_dir():
    """``CUPY_FA_CACHE_DIR``, else ``$XDG_CACHE_HOME/cupy_fa`` (``~/.cache/cupy_fa``)."""
    from .knobs import knobs

    base = knobs().cache_dir
    if base:
        return pathlib.Path(base)
    return pathlib.Path(os.environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache") / "cupy_fa"


def demo_kernels(arch="sm_90a", every=False):
    """What the no-GPU demo compiles: the kernels a GPU of ``arch`` compiles on first use for both
    dtypes and every head dim (``catalog.warmup_kernels``: what ``cupy_fa.warmup()`` compiles
    there; 75 for sm_90a), or with ``every`` every kernel the library can launch there
    (``catalog.all_kernels``: what CI compiles)."""
    from . import catalog

    if every:
        return catalog.all_kernels(arch)
    return catalog.warmup_kernels(smem_limit=catalog.smem_limit_of(arch), arch=arch)


def _compile_key(arch, kernels):
    import cupy
    from cupy.cuda import nvrtc

    from . import _compile

    # the options without their -I paths: one key wherever the checkout or the venv lies
    options = [o for o in _compile.compile_options(arch) if not o.startswith("-I")]
    facts = (_compile.source_hash(), arch, nvrtc.getVersion(), cupy.__version__, options, _compile.RAWMODULE_OPTIONS,
             [v.expression for v in kernels])
    return hashlib.sha256(repr(facts).encode()).hexdigest()[:16]


def compile_table(arch="sm_90a", recompile=False, every=False):
    """The demo's kernels (:func:`demo_kernels`) compiled for ``arch`` without a GPU: (rows,
    seconds, cached?), rows as ``compile_check.compile_all`` gives them."""
    from . import compile_check

    wanted = demo_kernels(arch, every)
    path = compile_cache_dir() / f"compile_check-{arch}-{_compile_key(arch, wanted)}.json"
    kernels = {k.expression: k for k in wanted}
    if not recompile and path.is_file():
        try:
            saved = json.loads(path.read_text())
            rows = [(kernels[r["expression"]], r["resources"], r["seconds"]) for r in saved["rows"]]
            return rows, saved["seconds"], True
        except (KeyError, ValueError, TypeError):
            pass  # an unreadable entry: compile again
    start = time.perf_counter()
    rows = compile_check.compile_all(arch, kernels=wanted)
    seconds = time.perf_counter() - start
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"seconds": seconds, "rows": [
            {"expression": v.expression, "resources": res, "seconds": t} for v, res, t in rows]}))
    except OSError:
        pass  # a read-only home: the next run compiles again
    return rows, seconds, False


def _no_gpu(problem, args):
    from . import compile_check

    print(f"No usable GPU: {problem}.")
    what = ("every kernel the library can launch there" if args.all else
            "the kernels a GPU of that arch compiles on first use, both dtypes, every head dim (--all: every kernel)")
    print(f"Compiling for {args.arch} with NVRTC instead (no GPU needed, every core): {what}.", flush=True)
    rows, seconds, cached = compile_table(args.arch, args.recompile, args.all)
    if args.table:
        print(compile_check.format_table(rows))
    regs = [res["registers"] for _, res, _ in rows]
    _, spilled, stacked = compile_check.summary(rows, args.arch)
    figures = f"registers {min(regs)}-{max(regs)}, {len(spilled)} with spills, {len(stacked)} with a stack frame"
    more = "" if args.table else "; --table for each kernel"
    if cached:
        print(f"{len(rows)} kernels compile for {args.arch}: {figures} (the table of an earlier {seconds:.0f} s "
              f"compile of the same sources, NVRTC and options; --recompile to compile again{more})")
    else:
        print(f"{len(rows)} kernels compiled for {args.arch} in {seconds:.0f} s: {figures} (kept for the next "
              f"run{more})")
    print("\nNothing was run: the kernels compile. Run `make demo` on a machine with an NVIDIA GPU "
          "(sm_80 or newer) and its driver to see them checked and timed.")
    return 0


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        prog="python -m cupy_fa.demo", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", default="sm_90a", help="target of the no-GPU compile (default sm_90a)")
    parser.add_argument("--recompile", action="store_true", help="ignore the cached no-GPU compile table")
    parser.add_argument("--table", action="store_true",
                        help="without a GPU: print each kernel's registers, spills and shared memory")
    parser.add_argument("--all", action="store_true",
                        help="without a GPU: every kernel the library can launch (what CI compiles), not only "
                             "those a GPU compiles on first use")
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    problem = cuda_problem()
    if problem is not None and problem.startswith("CuPy is not installed"):
        print(f"cupy_fa needs CuPy, even to compile its kernels without a GPU. {problem}.\n"
              "`make demo` builds a venv with it.", file=sys.stderr)
        return 1
    if problem is not None:
        return _no_gpu(problem, args)
    import cupy

    rng = np.random.default_rng()
    props = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)
    print(f"GPU: {props['name'].decode()}  ({props['multiProcessorCount']} SMs)")
    ok = self_check(rng)
    perf = perf_table(rng)
    steps = decode_replay_vs_eager(rng)
    print("\n== summary")
    print(f"self-check vs float64 reference: {'PASS' if ok else 'FAIL'}")
    for r in perf:
        print(f"{r[0]:30s} ours {r[2].strip():>14s} | SDPA cuDNN {r[3].strip():>14s} | SDPA flash {r[4].strip():>14s}")
    for batch, eager, graph in steps:
        print(f"decode B={batch:<3d} L=4096 step: eager {eager:7.1f} us, graph replay {graph:7.1f} us")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
