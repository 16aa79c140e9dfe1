"""The sm_90a prefill family (kernels/prefill_sm90.cu) on an H200, in one call.

    python3 lab/probe_prefill_sm90.py [--quick] [--only NAME,...] [--ncu NAME,...]
                                          [--ab [--rounds N] [--ab-impls NAME,...]]

(from the repository root, PYTHONPATH at it, CUPY_CACHE_DIR empty for cold compile times;
about 80 s on an H200, 90 s with one --ncu variant.)

1. compile: the first prefill call cold (compile + plan + run), the shipped variants one by
   one through cupy.RawModule on an empty cache (cold NVRTC seconds), then every variant's
   cubin from the device's NVRTC (registers, spills) disassembled by cuobjdump (or nvdisasm):
   HGMMA count, local memory, and the instructions of one consumer step and one producer
   tile (lab/sass_steps.py);
2. correct: each variant on ragged batches (odd lengths, extends over prefixes, splits merged
   by merge_kernel, causal / non-causal / custom mask, page sizes 1, 16, 64, 48, shuffled page
   tables, G = 1, 4, 5, 8), outputs and lse poisoned with NaN, every element compared with
   cupy_fa.reference (float64): per-request |out - ref| / |ref| under 1e-2 (bf16) / 3e-3
   (fp16), lse likewise; a failure prints its pattern (rows, columns, heads) and runs the
   same case with V = 1 and with K = 0 to tell the Q K^T side from the P V side;
3. time: the bench shapes (bf16, H_q 32 / H_kv 8, D 128, causal) at page sizes 16 and 1 and a
   few more (non-causal, D 64 / 256, fp16): every variant that passed, the mma.sync path
   (BatchAttention) and PyTorch SDPA (cuDNN, flash) on a dense copy, each checked against the
   fp64 reference on two windows of rows, then timed as CUDA-graph replays of 5 launches over
   input sets rotated past the L2 (median); TFLOP/s = 4 H_q D x visible keys.

With --ab, stage 3 is instead the interleaved A/B of AB_CELLS: per cell (the three bench
workloads at page sizes 16 and 1 with AB_D128, prefill_b2_l8192_d64 at page 16 with AB_D64) the
implementations that passed stage 2 and SDPA cuDNN, every graph captured once and replayed in
turn for --rounds rounds (order rotated); median, min-max and the median per-round ratios to
the round-2 default, to this tree's default and to cuDNN. A CUDA error names its implementation
and the remaining cells run without it (in a new child); a round under the 800 TFLOP/s floor
is an error, not a figure; each graph's output is checked again after its rounds. Stages 1-2
then cover the A/B's variants, AB_CORRECT_EXTRA and the shipped defaults (about 150 s in all:
see bench/NOTES.md for the command and what it should print).

Each stage runs in a child process with a time limit (a hung kernel costs its stage only);
the parent prints the correctness and timing tables last. Logs and JSON go under $OUT.
"""

import argparse
import dataclasses
import json
import math
import os
import subprocess
import sys
import time

if "--child" not in sys.argv:  # the parent's fp64 references run in 14 processes of one BLAS thread each
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
import numpy as np  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from cupy_fa import prefill_sm90 as s9  # noqa: E402  (no CUDA at import)

OUT = os.environ.get("OUT") or os.path.join(ROOT, "probe_out")
WORK = "/tmp/probe18"
TOL = {"bfloat16": 1e-2, "float16": 3e-3}
T = s9.Sm90Tile

# name -> (dtype, tile). "d128", "d64", ... are the shipped defaults (DEFAULT_TILES); the others
# are tuning variants, named by what they add to their head dim's default: _r2 the round-2
# default (no uniform_wg / joint_rows), _l lean_copy, _x1 / _x2 poly_exp2 1 / 2, _p persistent.
D128, D64, D256 = (s9.DEFAULT_TILES[d] for d in (128, 64, 256))
R = dataclasses.replace
VARIANTS = {
    "d128": ("bfloat16", D128),
    "d128_r2": ("bfloat16", T(128, 128, 2)),  # the round-2 default (2026-12-01's A/B yardstick)
    "d128_l": ("bfloat16", R(D128, lean_copy=True)),
    "d128_lx1": ("bfloat16", R(D128, lean_copy=True, poly_exp2=1)),
    "d128_lx2": ("bfloat16", R(D128, lean_copy=True, poly_exp2=2)),
    "d128_lp": ("bfloat16", R(D128, lean_copy=True, persistent=True)),
    "d128_l_f16": ("float16", R(D128, lean_copy=True)),
    # 3 consumer warpgroups (192 rows) at 160 registers: S, O and P fit with tiles of 64 / 80 keys
    "d128_lw3n64": ("bfloat16", R(D128, block_n=64, lean_copy=True, consumer_wgs=3, producer_regs=32)),
    "d128_lw3n80": ("bfloat16", R(D128, block_n=80, lean_copy=True, consumer_wgs=3, producer_regs=32)),
    "d128_lw3n80_f16": ("float16", R(D128, block_n=80, lean_copy=True, consumer_wgs=3, producer_regs=32)),
    "d128_lx2_f16": ("float16", R(D128, lean_copy=True, poly_exp2=2)),
    # 3 consumer warpgroups in the serial order (S, softmax, P V of a tile in turn; no intra-
    # warpgroup overlap): S and P are not live at once, so wider tiles fit 160 registers
    "d128_s96": ("bfloat16", R(D128, block_n=96, overlap=False)),
    "d128_s112": ("bfloat16", R(D128, block_n=112, overlap=False)),
    "d128_s128": ("bfloat16", R(D128, block_n=128, overlap=False)),
    "d128_s128_nopp": ("bfloat16", R(D128, block_n=128, overlap=False, pingpong=False)),
    "d128_s80": ("bfloat16", R(D128, overlap=False)),
    "d128_s96s3": ("bfloat16", R(D128, block_n=96, stages=3, overlap=False)),
    "d64_s128": ("bfloat16", R(D64, overlap=False)),
    "d128_s80_hooks": ("bfloat16", R(D128, overlap=False, variants=True)),
    "d128_s96_hooks": ("bfloat16", R(D128, block_n=96, overlap=False, variants=True)),
    "d128_s128_hooks": ("bfloat16", R(D128, block_n=128, overlap=False, variants=True)),
    "d64_s192": ("bfloat16", R(D64, block_n=192, stages=3, overlap=False)),
    "d64_s256": ("bfloat16", R(D64, block_n=256, stages=2, overlap=False)),
    # earlier versions of the kernel (lab/sm90_snapshots/<commit>.cu, see SNAPSHOTS) with
    # that commit's default D = 128 tile, behind today's launcher (--ab-names to time them)
    "v1_af55a79": ("bfloat16", T(128, 128, 2)),
    "v3_37ed792": ("bfloat16", T(128, 128, 2)),
    "d128_uw": ("bfloat16", T(128, 128, 2, uniform_wg=True)),
    "d128_p": ("bfloat16", R(D128, persistent=True)),
    "d128_bn176": ("bfloat16", T(128, 176, 2, producer_regs=40)),  # consumers at 232 registers
    "d128_qr": ("bfloat16", T(128, 128, 2, q_in_regs=True)),
    "d128_nopp": ("bfloat16", R(D128, pingpong=False)),
    "d128_noov": ("bfloat16", R(D128, overlap=False)),
    "d128_f16": ("float16", D128),
    "d64": ("bfloat16", D64),
    "d64_r2": ("bfloat16", T(64, 128, 4)),
    "d64_l": ("bfloat16", R(D64, lean_copy=True)),
    "d64_lx2": ("bfloat16", R(D64, lean_copy=True, poly_exp2=2)),
    "d64_bn192": ("bfloat16", T(64, 192, 3, producer_regs=40)),
    # 3 consumer warpgroups (192 rows); with the lean producer at 32 registers the consumers get 160
    "d64_lw3": ("bfloat16", R(D64, lean_copy=True, consumer_wgs=3, producer_regs=32)),
    "d64_f16": ("float16", D64),
    "d256": ("bfloat16", D256),
    "d256_l": ("bfloat16", R(D256, lean_copy=True)),
    "d256_f16": ("float16", D256),
}
DEFAULTS = ("d128", "d128_f16", "d64", "d64_f16", "d256", "d256_f16")  # what ships: cold-compiled one by one
# The interleaved A/B (--ab): per cell (workload, page size) the implementations timed in turn
# with SDPA cuDNN; AB_D128 on the three bench workloads at page sizes 16 and 1, AB_D64 on
# prefill_b2_l8192_d64 at page size 16.
# (2026-12-02: the serial step order at 80-128 keys a tile against the shipped overlapped 80)
AB_D128 = ("d128", "d128_s80", "d128_s96", "d128_s96s3", "d128_s112", "d128_s128", "d128_s128_nopp")
AB_D64 = ("d64", "d64_s128")
AB_CELLS = ([(w, ps, AB_D128) for w in ("prefill_b4_l4096", "prefill_b2_l8192", "extend_b4_q1024_l16384")
             for ps in (16, 1)] + [("prefill_b2_l8192_d64", 16, AB_D64)])
# checked for correctness in an --ab run besides every timed one and the shipped defaults
AB_CORRECT_EXTRA = ("d128_f16",)
AB_NAMES = tuple(dict.fromkeys(n for _, _, names in AB_CELLS for n in names))
# commit -> the traits of its default D = 128 tile and its kernel's shared memory (that
# version's Sm90Tile.smem_bytes); the source is lab/sm90_snapshots/<commit>.cu, which the
# tree does not keep (the A/B of 2026-12-01 found v1 = v3 = today's d128 within 1%): make it with
# `sh lab/sm90_snapshots/make_snapshot.sh <commit>` to time that version again
SNAPSHOTS = {
    "v1_af55a79": ("af55a79", "cupy_fa::Sm90PrefillTraits<128, 128, 2, true, true, 56>",
                   1024 + 128 * 128 * 2 + 2 * 2 * 128 * 128 * 2 + (4 * 2 + 1) * 8),
    "v3_37ed792": ("37ed792", "cupy_fa::Sm90PrefillTraits<128, 128, 2, true, true, 56, false>",
                   1024 + 128 * 128 * 2 + 2 * 2 * 128 * 128 * 2 + (4 * 2 + 1) * 8 + 256 * 4),
}
for _name, (_commit, _, _) in SNAPSHOTS.items():  # a snapshot is a variant only where its file was made
    if not os.path.exists(os.path.join(ROOT, "lab", "sm90_snapshots", f"{_commit}.cu")):
        VARIANTS.pop(_name, None)


def kernel_variant(name):
    """The _build.Variant of a probe variant: the current tree's, or an earlier commit's snapshot."""
    from cupy_fa import _build

    dtype, tile = VARIANTS[name]
    if name not in SNAPSHOTS:
        return s9.variant(dtype, tile)
    commit, traits, smem = SNAPSHOTS[name]
    ctype = _build.CTYPES[dtype]
    source = os.path.join(ROOT, "lab", "sm90_snapshots", f"{commit}.cu")  # absolute: NVRTC opens it as is
    return _build.Variant(source, f"cupy_fa::prefill_sm90_kernel<{ctype}, {ctype}, {ctype}, {traits}>", s9.THREADS,
                          smem, (f"{traits}::kSmemBytes == {smem}",))


def prefill_for(name, hq, hkv, d):
    """An Sm90Prefill running variant `name` (a snapshot runs behind the same host launcher:
    the work layout and AttentionParams are unchanged since af55a79)."""
    dtype, tile = VARIANTS[name]
    pf = s9.Sm90Prefill(hq, hkv, d, dtype, tile)
    if name in SNAPSHOTS:
        pf.variant = kernel_variant(name)
    return pf


def log(msg):
    print(msg, flush=True)


# ---- correctness cases (host data, fp64 references) ---------------------------------------

def case_list(quick):
    """(name, H_q, H_kv, D, dtype, page_size, causal, q_lens, kv_lens, custom mask)."""
    base = [
        # prefill + extends + a split request (q 17 over 2000: 4 splits, merged) + a 1-token row
        ("mix_ps16", 16, 4, 16, True, [300, 77, 129, 17, 650, 1], [300, 1377, 129, 2000, 650, 40]),
        # page size 1, a 3-split extend (q 40 over 4000)
        ("ext_ps1", 16, 4, 1, True, [255, 513, 40], [255, 900, 4000]),
        # non-power-of-two pages, non-causal
        ("nc_ps48", 16, 4, 48, False, [100, 333, 19], [700, 333, 2500]),
    ]
    more = [
        ("g5_ps64", 10, 2, 64, True, [257, 61, 200], [1000, 61, 201]),   # G = 5 (FastDiv, odd rows)
        ("g1_ps16", 8, 8, 16, True, [130, 3, 64], [130, 50, 64]),        # G = 1
        ("g8_ps1_nc", 16, 2, 1, False, [150, 33], [150, 1033]),          # G = 8, non-causal
        ("tree_ps16", 16, 4, 16, "custom", [40, 23], [600, 23]),         # custom mask over the q_len newest keys
    ]
    cases = []
    for d in (128, 64, 256):
        for dtype in ("bfloat16", "float16"):
            chosen = base + (more if (d == 128 and dtype == "bfloat16") else [])
            if quick:
                chosen = chosen[:1]
            for name, hq, hkv, ps, causal, ql, kl in chosen:
                cases.append(dict(name=f"{name}_d{d}_{'bf16' if dtype == 'bfloat16' else 'f16'}", hq=hq, hkv=hkv,
                                  d=d, dtype=dtype, ps=ps, causal=causal, q_lens=ql, kv_lens=kl))
    return cases


def to_bits(x, dtype):
    import ml_dtypes

    np_dtype = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.float16
    return x.astype(np_dtype)


def make_case(args):
    """Draws one case's inputs (seeded), computes the fp64 reference, saves it as npz."""
    index, case, seed = args
    from cupy_fa import reference

    rng = np.random.default_rng(seed)
    q_lens, kv_lens = np.array(case["q_lens"]), np.array(case["kv_lens"])
    ps, d, hq, hkv = case["ps"], case["d"], case["hq"], case["hkv"]
    pages_needed = -(-kv_lens // ps)
    num_pages = int(pages_needed.sum()) + 7  # a few pages nobody owns
    perm = rng.permutation(num_pages)
    width = int(pages_needed.max())
    page_table = np.full((len(q_lens), width), num_pages - 1, np.int32)  # unread columns: some page
    at = 0
    for b, n in enumerate(pages_needed):
        page_table[b, :n] = perm[at:at + n]
        at += n
    q = to_bits(rng.standard_normal((int(q_lens.sum()), hq, d), np.float32), case["dtype"])
    k = to_bits(rng.standard_normal((num_pages, ps, hkv, d), np.float32), case["dtype"])
    v = to_bits(rng.standard_normal((num_pages, ps, hkv, d), np.float32), case["dtype"])
    mask = None
    if case["causal"] == "custom":
        mask = np.concatenate([(rng.random(n * n) < 0.5) | np.eye(n, dtype=bool).ravel() for n in q_lens])
    ref, lse = reference.paged_attention(q, k, v, q_lens, kv_lens, page_table, causal=bool(case["causal"]),
                                         custom_mask=mask, return_lse=True)
    path = os.path.join(WORK, f"case_{index}.npz")
    np.savez(path, q=q.view(np.uint16), k=k.view(np.uint16), v=v.view(np.uint16), page_table=page_table,
             q_lens=q_lens, kv_lens=kv_lens, ref=ref, lse=lse,
             mask=mask if mask is not None else np.zeros(0, bool), seed=seed)
    return path


# ---- child: compile ------------------------------------------------------------------------

def device_sass(path):
    """(SASS text, note) of a cubin: cuobjdump --dump-sass, else nvdisasm (both of the device's toolkit)."""
    notes = []
    for cmd in (["cuobjdump", "--dump-sass", path], ["nvdisasm", "-c", path]):
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
        except (OSError, subprocess.TimeoutExpired) as e:
            notes.append(f"{cmd[0]}: {type(e).__name__}")
            continue
        if proc.returncode == 0 and "HGMMA" in proc.stdout:
            return proc.stdout, f"{cmd[0]} ok"
        notes.append(f"{cmd[0]} rc {proc.returncode} {proc.stderr.strip()[:120]}")
    return "", "; ".join(notes)


def compile_one(name):
    """Cold RawModule compile (the user's path), then the device NVRTC's cubin (the binary the
    RawModule loads) disassembled: HGMMA, local memory, the instructions of one consumer step
    and of one producer tile (lab/sass_steps.py)."""
    import cupy

    from cupy_fa import _build

    sys.path.insert(0, os.path.join(ROOT, "lab"))
    import sass_steps

    v = kernel_variant(name)
    t0 = time.perf_counter()
    _build.get_function(v)
    cold = time.perf_counter() - t0
    t0 = time.perf_counter()
    cubin, resources = _build.compile_cubin(v, _build.device_arch(cupy.cuda.Device()))  # padded to its whole ELF
    nvrtc_s = time.perf_counter() - t0
    path = os.path.join(WORK, f"{name}.cubin")
    with open(path, "wb") as f:
        f.write(cubin)
    sass, note = device_sass(path)
    step = prod = None
    if sass:
        tile = VARIANTS[name][1]
        ins, labels = sass_steps.parse(sass)
        path_ = sass_steps.step_path(ins, labels, tile.head_dim // 16 + tile.block_n // 16)
        if path_:
            summary = sass_steps.summarise(path_)
            step = dict(instructions=summary["instructions"], mufu=summary["mufu"][0] + summary["mufu"][1],
                        ops=dict(summary["ops"].most_common(8)))
        prod = sass_steps.producer_tile(ins, labels, tile.block_n * tile.head_dim // 8 // 128)
    return name, dict(cold_s=cold, nvrtc_s=nvrtc_s, hgmma=sass.count("HGMMA"), local=sass.count("LDL") + sass.count("STL"),
                      setmaxreg=sass.count("SETMAXREG"), sass_lines=sass.count("\n"), note=note, step=step,
                      producer=prod, **resources)


def child_compile(names):
    import cupy

    from cupy_fa.kv_cache import PagedKVCache

    res = {}
    # the first prefill call, cold: the plan and prefill kernels compile on first use
    t0 = time.perf_counter()
    pf = s9.Sm90Prefill(32, 8, 128, "bfloat16")
    cache = PagedKVCache.allocate(8, 16, 8, 128, "bfloat16")
    q = cupy.zeros((100, 32, 128), cache.k.dtype)
    pf.plan([100], [100], np.arange(7, dtype=np.int32)[None]).run(q, cache, cupy.empty_like(q))
    cupy.cuda.Device().synchronize()
    res["first_call_s"] = time.perf_counter() - t0
    log(f"first prefill call, cold (plan + prefill kernel compiled, run): {res['first_call_s']:.2f} s")
    # the shipped variants one after another (cold compile times as a user sees them: the
    # RawModule path), then every variant's NVRTC cubin, SASS and step counts, and the tuning
    # variants' cold RawModule compiles, in processes of their own at once (16 cores)
    from cupy_fa import _build

    cold = {}
    for n in names:
        if n in DEFAULTS:
            t0 = time.perf_counter()
            _build.get_function(kernel_variant(n))
            cold[n] = time.perf_counter() - t0
    from concurrent.futures import ProcessPoolExecutor
    import multiprocessing

    with ProcessPoolExecutor(min(len(names), 12), mp_context=multiprocessing.get_context("spawn")) as pool:
        res["variants"] = dict(pool.map(compile_one, names))
    for n, t in cold.items():
        res["variants"][n]["cold_s"] = t  # (the worker's RawModule was a cache hit)
    for name, info in res["variants"].items():
        log(f"compile {name:12s} cold {info['cold_s']:5.2f} s (RawModule{'; compiled by the first call' if name == 'd128' else ''}"
            f"{'' if name in DEFAULTS else '; in parallel'}), NVRTC {info['nvrtc_s']:4.2f} s, regs {info['registers']}, "
            f"spills {info['spill_stores']}/{info['spill_loads']}, HGMMA {info['hgmma']}, LDL/STL {info['local']}, "
            f"setmaxreg {info['setmaxreg']}, step {(info['step'] or {}).get('instructions')} instructions, "
            f"producer tile {(info['producer'] or {}).get('instructions')} ({info['note']})")
    return res


# ---- child: correctness -----------------------------------------------------------------------

def rel(a, b):
    from cupy_fa import reference

    return reference.relative_error(a, b)


def upload(data, case):
    import cupy

    from cupy_fa import _arrays
    from cupy_fa.kv_cache import PagedKVCache

    dt = _arrays.DTYPES[case["dtype"]]
    k = cupy.asarray(data["k"]).view(dt)
    v = cupy.asarray(data["v"]).view(dt)
    q = cupy.asarray(data["q"]).view(dt)
    return q, PagedKVCache(k, v)


def run_variant_on(name, case, data, q, cache, v_override=None, k_override=None):
    """(out float64 host, lse host, nan count) of variant `name` on the case."""
    import cupy

    dtype, tile = VARIANTS[name]
    pf = prefill_for(name, case["hq"], case["hkv"], case["d"])
    mask = data["mask"] if case["causal"] == "custom" else None
    pf.plan(data["q_lens"], data["kv_lens"], data["page_table"], causal=bool(case["causal"]), custom_mask=mask)
    from cupy_fa.kv_cache import PagedKVCache

    if v_override is not None or k_override is not None:
        cache = PagedKVCache(k_override if k_override is not None else cache.k,
                             v_override if v_override is not None else cache.v)
    out = cupy.empty_like(q)
    out.view(cupy.uint16).fill(0x7FC0 if dtype == "bfloat16" else 0x7E00)  # NaN
    lse = cupy.full((q.shape[0], case["hq"]), np.nan, np.float32)
    pf.run(q, cache, out, lse)
    cupy.cuda.Device().synchronize()
    host = cupy.asnumpy(out.view(cupy.uint16))
    import ml_dtypes

    o = host.view(ml_dtypes.bfloat16 if dtype == "bfloat16" else np.float16).astype(np.float64)
    return o, cupy.asnumpy(lse).astype(np.float64), int(np.isnan(o).sum()), int(np.isnan(cupy.asnumpy(lse)).sum())


def per_request(o, ref, q_lens):
    cu = np.concatenate([[0], np.cumsum(q_lens)])
    return [rel(o[cu[b]:cu[b + 1]], ref[cu[b]:cu[b + 1]]) for b in range(len(q_lens)) if q_lens[b] > 0]


def diagnose(name, case, data, q, cache, o, lse):
    """Patterns of a failure, and the case rerun with V = 1 and with K = 0."""
    import cupy

    ref, ref_lse = data["ref"], data["lse"]
    q_lens = data["q_lens"]
    g = case["hq"] // case["hkv"]
    cu = np.concatenate([[0], np.cumsum(q_lens)])
    err_rows = np.linalg.norm(np.nan_to_num(o - ref, nan=1e3), axis=2) / (np.linalg.norm(ref, axis=2) + 1e-30)
    lines = [f"  DIAG {name} on {case['name']}: per-request out err "
             f"{[f'{e:.2e}' for e in per_request(o, ref, q_lens)]}, lse err "
             f"{[f'{rel(lse[cu[b]:cu[b+1]], ref_lse[cu[b]:cu[b+1]]):.2e}' for b in range(len(q_lens))]}"]
    for b in range(len(q_lens)):
        e = err_rows[cu[b]:cu[b + 1]]  # [q_len, H_q]
        n, hq = e.shape
        packed = (np.arange(n)[:, None] * g + (np.arange(hq)[None, :] % g))  # row in the request's packed layout
        bad = e > TOL[case["dtype"]]
        if not bad.any():
            continue
        rit = packed % 128
        lines.append(f"   req {b} (q {q_lens[b]}, kv {data['kv_lens'][b]}): {bad.mean() * 100:.1f}% rows bad; "
                     f"first bad token {np.argwhere(bad)[0].tolist()}; err by tile row // 16: "
                     f"{[round(float(e[rit // 16 == i].mean()), 3) for i in range(8)]}; by (row % 16) // 8: "
                     f"{[round(float(e[(rit % 16) // 8 == i].mean()), 3) for i in range(2)]}; by token // 32: "
                     f"{[round(float(x.mean()), 3) for x in np.array_split(e, min(8, n))]}; by head: "
                     f"{[round(float(e[:, h].mean()), 3) for h in range(min(hq, 8))]}")
        db = np.abs(np.nan_to_num(o[cu[b]:cu[b + 1]] - ref[cu[b]:cu[b + 1]], nan=1e3)).mean(axis=(0, 1))
        lines.append(f"   req {b} mean |err| by column // 8: {[round(float(x), 3) for x in db.reshape(-1, 8).mean(1)]}")
    # V = 1: out must be 1 wherever a key is visible (tests P, l, the epilogue; not V's layout)
    ones = cupy.empty_like(cache.v)
    ones.view(cupy.uint16).fill(0x3F80 if case["dtype"] == "bfloat16" else 0x3C00)
    o1, l1, _, _ = run_variant_on(name, case, data, q, cache, v_override=ones)
    lines.append(f"   V=1: max |out - 1| {float(np.nanmax(np.abs(o1 - 1))):.3e}, NaN {int(np.isnan(o1).sum())}, "
                 f"lse err {rel(l1, ref_lse):.2e}")
    # K = 0: uniform weights over the visible keys (tests the mask, P V and V's layout, not Q K^T)
    from cupy_fa import reference

    zeros = cupy.empty_like(cache.k)
    zeros.view(cupy.uint16).fill(0)
    k0 = np.zeros_like(data["k"])
    import ml_dtypes

    dt = ml_dtypes.bfloat16 if case["dtype"] == "bfloat16" else np.float16
    ref0 = reference.paged_attention(data["q"].view(dt), k0.view(dt), data["v"].view(dt), q_lens, data["kv_lens"],
                                     data["page_table"], causal=bool(case["causal"]),
                                     custom_mask=data["mask"] if case["causal"] == "custom" else None)
    o0, l0, _, _ = run_variant_on(name, case, data, q, cache, k_override=zeros)
    lines.append(f"   K=0: out err per request {[f'{x:.2e}' for x in per_request(o0, ref0, q_lens)]}")
    return lines


def child_correct(names, case_paths, cases):
    results = {}
    diagnosed = 0
    for name in names:
        dtype, tile = VARIANTS[name]
        for path, case in zip(case_paths, cases):
            if case["d"] != tile.head_dim or case["dtype"] != dtype:
                continue
            data = dict(np.load(path))
            q, cache = upload(data, case)
            t0 = time.perf_counter()
            try:
                o, lse, nan_o, nan_l = run_variant_on(name, case, data, q, cache)
            except Exception as e:  # noqa: BLE001
                results[f"{name}|{case['name']}"] = dict(ok=False, error=f"{type(e).__name__}: {str(e)[:300]}")
                log(f"correct {name:12s} {case['name']:22s} ERROR {type(e).__name__}: {str(e)[:300]}")
                continue
            errs = per_request(o, data["ref"], data["q_lens"])
            lerr = rel(lse, data["lse"])
            ok = max(errs) < TOL[dtype] and lerr < TOL[dtype] and nan_o == 0 and nan_l == 0
            results[f"{name}|{case['name']}"] = dict(ok=ok, err=max(errs), lse_err=lerr, nan=nan_o, nan_lse=nan_l)
            # what is known so far survives a hang in a later case (the parent kills this child)
            with open(os.path.join(WORK, "correct_out.json"), "w") as f:
                json.dump(results, f)
            log(f"correct {name:12s} {case['name']:22s} {'ok  ' if ok else 'FAIL'} max req err {max(errs):.2e} "
                f"lse {lerr:.2e} NaN {nan_o}/{nan_l} ({time.perf_counter() - t0:.1f} s)")
            if not ok and diagnosed < 3:
                diagnosed += 1
                try:
                    for line in diagnose(name, case, data, q, cache, o, lse):
                        log(line)
                except Exception as e:  # noqa: BLE001
                    log(f"  DIAG failed: {type(e).__name__}: {str(e)[:300]}")
    return results


# ---- child: timing ------------------------------------------------------------------------

WORKLOADS = [  # name, B, q_len, kv_len, causal, D, dtype, page sizes, variants
    ("prefill_b4_l4096", 4, 4096, 4096, True, 128, "bfloat16", (16, 1), "d128*"),
    ("prefill_b2_l8192", 2, 8192, 8192, True, 128, "bfloat16", (16, 1), "d128*"),
    ("extend_b4_q1024_l16384", 4, 1024, 16384, True, 128, "bfloat16", (16, 1), "d128*"),
    ("prefill_b2_l8192_nc", 2, 8192, 8192, False, 128, "bfloat16", (16,), "d128"),
    ("prefill_b2_l8192_f16", 2, 8192, 8192, True, 128, "float16", (16,), "d128_f16"),
    ("prefill_b2_l8192_d64", 2, 8192, 8192, True, 64, "bfloat16", (16,), "d64*"),
    ("prefill_b2_l8192_d256", 2, 8192, 8192, True, 256, "bfloat16", (16,), "d256"),
]
H_Q, H_KV = 32, 8


def visible_keys(q, kv, causal):
    return q * (kv - q) + q * (q + 1) // 2 if causal else q * kv


def fill_random(arr, dtype):
    import cupy

    if dtype == "bfloat16":
        from bench.inputs import fill_normal

        return fill_normal(arr)
    arr[...] = cupy.random.standard_normal(arr.shape, dtype=cupy.float32).astype(cupy.float16)
    return arr


def child_time(passed, quick):
    import cupy

    from bench import timing
    from bench.workloads import num_sets
    from cupy_fa import _arrays, reference
    import cupy_fa
    from cupy_fa.kv_cache import PagedKVCache

    try:
        from bench.ceilings import measure_gemm

        gemm = measure_gemm(8192, reps=10)
        log(f"bf16 GEMM ceiling (torch.matmul 8192^3): {gemm}")
    except Exception as e:  # noqa: BLE001
        gemm = {"error": str(e)[:200]}
    l2 = cupy.cuda.Device().attributes["L2CacheSize"]
    warmup, reps = (2, 5) if quick else (3, 15)
    rows = []
    for wname, B, ql, kl, causal, D, dtype, page_sizes, pattern in WORKLOADS:
        if quick and wname != "prefill_b2_l8192":
            continue
        flops = 4 * B * H_Q * D * visible_keys(ql, kl, causal)
        names = [n for n in passed if (n == pattern or (pattern.endswith("*") and n.startswith(pattern[:-1])
                                                         and VARIANTS[n][0] == dtype and VARIANTS[n][1].head_dim == D))]
        dt = _arrays.DTYPES[dtype]
        sdpa_done = {}
        for ps in page_sizes:
            ppr = -(-kl // ps)
            set_bytes = 2 * B * ppr * ps * H_KV * D * 2 + 2 * B * ql * H_Q * D * 2
            n_sets = num_sets(set_bytes, l2, 5)
            rng = np.random.default_rng(1234 + ps)
            cupy.random.seed(1234 + ps)
            page_table = rng.permutation(B * ppr).astype(np.int32).reshape(B, ppr)
            sets = []
            for _ in range(n_sets):
                k = fill_random(cupy.empty((B * ppr, ps, H_KV, D), dt), dtype)
                v = fill_random(cupy.empty((B * ppr, ps, H_KV, D), dt), dtype)
                q = fill_random(cupy.empty((B * ql, H_Q, D), dt), dtype)
                sets.append((q, PagedKVCache(k, v), cupy.empty_like(q)))
            cupy.cuda.Device().synchronize()
            q_lens, kv_lens = np.full(B, ql), np.full(B, kl)
            # fp64 reference on two windows of set 0: the first 32 rows of request 0, the last 32 of request B-1
            import ml_dtypes

            hdt = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.float16
            q0, c0, _ = sets[0]
            windows = {}
            for b, r0, r1 in ((0, 0, 32), (B - 1, ql - 32, ql)):
                kv_eff = kl - ql + r1 if causal else kl
                n_pages = -(-kv_eff // ps)
                pages = cupy.asarray(page_table[b, :n_pages].astype(np.int64))
                kk = cupy.asnumpy(c0.k.view(cupy.uint16)[pages]).view(hdt)
                vv = cupy.asnumpy(c0.v.view(cupy.uint16)[pages]).view(hdt)
                qq = cupy.asnumpy(q0.view(cupy.uint16)[b * ql + r0: b * ql + r1]).view(hdt)
                windows[(b, r0, r1)] = reference.paged_attention(
                    qq, kk, vv, np.array([r1 - r0]), np.array([kv_eff]), np.arange(n_pages)[None], causal=causal)

            def check(out_rows):
                return max(reference.relative_error(out_rows(b * ql + r0, b * ql + r1), ref)
                           for (b, r0, r1), ref in windows.items())

            def host_rows(arr):
                return lambda lo, hi: cupy.asnumpy(arr.view(cupy.uint16)[lo:hi]).view(hdt).astype(np.float64)

            def time_cupy(make_launch, label):
                try:
                    err = check(make_launch(0)())
                    launches = [make_launch(i % n_sets) for i in range(5)]
                    t = timing.cupy_graph([lambda f=f: f() for f in launches], warmup=warmup, reps=reps)
                    ok = err < TOL[dtype]
                    rows.append(dict(workload=wname, ps=ps, impl=label, us=t.time_us, tflops=flops / t.time_us / 1e6,
                                     err=err, ok=ok))
                    log(f"time {wname:24s} ps {ps:2d} {label:14s} {t.time_us:9.1f} us {flops / t.time_us / 1e6:6.1f} "
                        f"TFLOP/s  err {err:.2e}{'' if ok else ' FAIL'}")
                except Exception as e:  # noqa: BLE001
                    rows.append(dict(workload=wname, ps=ps, impl=label, error=f"{type(e).__name__}: {str(e)[:200]}"))
                    log(f"time {wname:24s} ps {ps:2d} {label:14s} ERROR {type(e).__name__}: {str(e)[:200]}")

            for name in names:
                pf = prefill_for(name, H_Q, H_KV, D).plan(q_lens, kv_lens, page_table, causal=causal)

                def make(i, pf=pf):
                    q, c, o = sets[i]

                    def go():
                        pf.run(q, c, o)
                        return host_rows(o)
                    return go
                time_cupy(make, name)
            # the mma.sync path
            attn = cupy_fa.BatchAttention(H_Q, H_KV, D, dtype=dtype)
            attn.plan(q_lens, kv_lens, page_table, causal=causal)

            def make_ours(i):
                q, c, o = sets[i]

                def go():
                    attn.run(q, c, out=o)
                    return host_rows(o)
                return go
            time_cupy(make_ours, "mma.sync")
            # SDPA on a dense copy (no pages: once per workload)
            if not sdpa_done:
                sdpa_done.update(time_sdpa(wname, sets, page_table, B, ql, kl, causal, D, dtype, flops, check,
                                           warmup, reps, rows, ps))
            del sets
            cupy.get_default_memory_pool().free_all_blocks()
    return dict(rows=rows, gemm=gemm)


def time_sdpa(wname, sets, page_table, B, ql, kl, causal, D, dtype, flops, check, warmup, reps, rows, ps):
    try:
        import torch
        import torch.nn.functional as F
        from torch.nn.attention import SDPBackend, sdpa_kernel
        from torch.nn.attention.bias import causal_lower_right

        from bench import timing
        from bench.inputs import as_torch
    except Exception as e:  # noqa: BLE001
        log(f"sdpa unavailable: {e}")
        return {"done": True}
    tdt = torch.bfloat16 if dtype == "bfloat16" else torch.float16
    pt = torch.as_tensor(page_table, dtype=torch.long, device="cuda")

    def torch_view(x):
        t = as_torch(x) if dtype == "bfloat16" else torch.from_dlpack(x)
        return t.view(tdt) if t.dtype != tdt else t

    dense = []
    for q, c, _ in sets:
        def gather(arr):
            tok = torch_view(arr)[pt].reshape(B, -1, H_KV, D)[:, :kl]
            return tok.transpose(1, 2).contiguous()
        dense.append((torch_view(q).view(B, ql, H_Q, D).transpose(1, 2).contiguous(), gather(c.k), gather(c.v)))
    torch.cuda.synchronize()
    for label, backend in (("sdpa_cudnn", SDPBackend.CUDNN_ATTENTION), ("sdpa_flash", SDPBackend.FLASH_ATTENTION)):
        kw = {}
        if causal and ql == kl:
            kw = {"is_causal": True}
        elif causal:
            kw = {"attn_mask": causal_lower_right(ql, kl)} if label == "sdpa_flash" else \
                {"attn_mask": torch.ones(ql, kl, dtype=torch.bool, device="cuda").tril(kl - ql)}

        def call(i, kw=kw, backend=backend):
            with sdpa_kernel([backend]):
                return F.scaled_dot_product_attention(*dense[i], enable_gqa=True, **kw)
        try:
            o = call(0)
            torch.cuda.synchronize()
            flat = o.transpose(1, 2).reshape(B * ql, H_Q, D)
            err = check(lambda lo, hi: flat[lo:hi].double().cpu().numpy())
            t = timing.torch_graph([lambda i=i: call(i % len(dense)) for i in range(5)], warmup=warmup, reps=reps)
            ok = err < TOL[dtype]
            rows.append(dict(workload=wname, ps="-", impl=label, us=t.time_us, tflops=flops / t.time_us / 1e6, err=err,
                             ok=ok, method=t.method))
            log(f"time {wname:24s} ps  - {label:14s} {t.time_us:9.1f} us {flops / t.time_us / 1e6:6.1f} TFLOP/s  "
                f"err {err:.2e}{'' if ok else ' FAIL'} ({t.method})")
        except Exception as e:  # noqa: BLE001
            rows.append(dict(workload=wname, ps="-", impl=label, error=f"{type(e).__name__}: {str(e)[:200]}"))
            log(f"time {wname:24s} ps  - {label:14s} ERROR {type(e).__name__}: {str(e)[:200]}")
        torch.cuda.synchronize()
    del dense
    torch.cuda.empty_cache()
    return {"done": True}


# ---- child: interleaved A/B ----------------------------------------------------------------

def capture_cupy(launches):
    """One CUDA graph of `launches` on a non-blocking CuPy stream (after an eager pass): a replay
    callable and its stream."""
    from cupy_fa import _timing

    graph, stream = _timing.capture_graph(launches)
    return lambda: graph.launch(stream), stream


AB_FLOOR_TFLOPS = 800.0  # above any H200's bf16 dense GEMM rate (748-796 measured): a time under it is an error


def ab_floor_us(flops):
    """The shortest time a launch of `flops` can take: under it, a timing is an error, not a figure."""
    return flops / (AB_FLOOR_TFLOPS * 1e12) * 1e6


def ab_cells(d128_impls=""):
    """AB_CELLS, with AB_D128 replaced by the names in `d128_impls` (a comma list) if given."""
    if not d128_impls:
        return AB_CELLS
    chosen = tuple(n for n in d128_impls.split(",") if n)
    unknown = [n for n in chosen if n not in VARIANTS]
    if unknown:
        raise SystemExit(f"--ab-impls: unknown variants {unknown} (see VARIANTS)")
    return [(w, ps, chosen if names == AB_D128 else names) for w, ps, names in AB_CELLS]


def _save(path, obj):
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f)
    os.replace(tmp, path)


def child_ab(cells, rounds, replays, skip):
    """The interleaved A/B of AB_CELLS' implementations and SDPA cuDNN, cell by cell: every
    implementation's graph (5 launches over rotated input sets) captured once, then `rounds`
    rounds in which each is replayed `replays` times in turn (the order rotated every round), so
    drift in clocks or temperature falls on all of them alike.

    Each implementation keeps its Sm90Prefill (the plan buffers its graph reads) alive for as long
    as its graph is replayed. Every turn ends with a synchronize: a CUDA error there is charged to
    that implementation; the child then saves what it has (the finished cells, the failure) and
    exits, and the parent starts another child for the remaining cells without it (the context is
    lost after a kernel fault). The turn about to run is written to ab_progress.json first, so a
    child that dies without a word still names its culprit. After the rounds each graph is
    replayed once more over poisoned outputs and checked against the fp64 windows again."""
    import cupy

    from bench.workloads import num_sets
    from cupy_fa import _arrays, reference
    from cupy_fa.kv_cache import PagedKVCache

    try:
        import torch
        import torch.nn.functional as F
        from torch.nn.attention import SDPBackend, sdpa_kernel

        from bench.inputs import as_torch
    except Exception as e:  # noqa: BLE001
        torch = None
        log(f"sdpa unavailable: {e}")
    import ml_dtypes

    out_path, progress_path = os.path.join(WORK, "ab_out.json"), os.path.join(WORK, "ab_progress.json")
    result = dict(cells={}, failure=None)
    workloads = {w[0]: w for w in WORKLOADS}
    l2 = cupy.cuda.Device().attributes["L2CacheSize"]

    def fail(key, label, where, exc):
        result["failure"] = dict(cell=key, impl=label, where=where, error=f"{type(exc).__name__}: {str(exc)[:300]}")
        log(f"ab {key} {label}: CUDA ERROR in {where}: {result['failure']['error']} -- this child stops; the parent "
            f"runs the remaining cells without {label}")
        _save(out_path, result)
        os._exit(3)

    def context_alive():
        try:
            cupy.cuda.runtime.deviceSynchronize()
            return True
        except Exception:  # noqa: BLE001
            return False

    for wname, ps, names in cells:
        key = f"{wname}|{ps}"
        _, B, ql, kl, causal, D, dtype, _, _ = workloads[wname]
        flops = 4 * B * H_Q * D * visible_keys(ql, kl, causal)
        floor_us = ab_floor_us(flops)
        dt = _arrays.DTYPES[dtype]
        hdt = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.float16
        poison = 0x7FC0 if dtype == "bfloat16" else 0x7E00
        t_cell = time.perf_counter()
        ppr = -(-kl // ps)
        n_sets = num_sets(2 * B * ppr * ps * H_KV * D * 2 + 2 * B * ql * H_Q * D * 2, l2, 5)
        rng = np.random.default_rng(4321 + ps)
        cupy.random.seed(4321 + ps)
        page_table = rng.permutation(B * ppr).astype(np.int32).reshape(B, ppr)
        sets = []
        for _ in range(n_sets):
            k = fill_random(cupy.empty((B * ppr, ps, H_KV, D), dt), dtype)
            v = fill_random(cupy.empty((B * ppr, ps, H_KV, D), dt), dtype)
            q = fill_random(cupy.empty((B * ql, H_Q, D), dt), dtype)
            sets.append((q, PagedKVCache(k, v), cupy.empty_like(q)))
        cupy.cuda.Device().synchronize()
        # fp64 reference windows of set 0 (first 32 rows of request 0, last 32 of request B-1)
        q0, c0, o0 = sets[0]
        windows = {}
        for b, r0, r1 in ((0, 0, 32), (B - 1, ql - 32, ql)):
            kv_eff = kl - ql + r1 if causal else kl
            n_pages = -(-kv_eff // ps)
            pages = cupy.asarray(page_table[b, :n_pages].astype(np.int64))
            kk = cupy.asnumpy(c0.k.view(cupy.uint16)[pages]).view(hdt)
            vv = cupy.asnumpy(c0.v.view(cupy.uint16)[pages]).view(hdt)
            qq = cupy.asnumpy(q0.view(cupy.uint16)[b * ql + r0: b * ql + r1]).view(hdt)
            windows[(b, r0, r1)] = reference.paged_attention(
                qq, kk, vv, np.array([r1 - r0]), np.array([kv_eff]), np.arange(n_pages)[None], causal=causal)

        def check(rows_of):
            return max(reference.relative_error(rows_of(b * ql + r0, b * ql + r1), ref)
                       for (b, r0, r1), ref in windows.items())

        def rows_of_set0(lo, hi):
            return cupy.asnumpy(o0.view(cupy.uint16)[lo:hi]).view(hdt).astype(np.float64)

        impls = {}  # label -> dict(replay, stream, err, keep): keep holds what the graph reads
        q_lens, kv_lens = np.full(B, ql), np.full(B, kl)
        for name in names:
            if name in skip:
                log(f"ab {key} {name}: skipped (a CUDA error in an earlier child)")
                continue
            _save(progress_path, dict(cell=key, impl=name, where="plan, eager run, capture"))
            try:
                pf = prefill_for(name, H_Q, H_KV, D).plan(q_lens, kv_lens, page_table, causal=causal)
                o0.view(cupy.uint16).fill(poison)
                pf.run(q0, c0, o0)
                cupy.cuda.Device().synchronize()
                err = check(rows_of_set0)
                replay, stream = capture_cupy([lambda i=i, pf=pf: pf.run(*sets[i % n_sets]) for i in range(5)])
                impls[name] = dict(replay=replay, stream=stream, err=err, keep=pf)
            except Exception as e:  # noqa: BLE001
                if not context_alive():
                    fail(key, name, "plan, eager run or capture", e)
                log(f"ab {key} {name}: ERROR {type(e).__name__}: {str(e)[:200]}")
        if torch is not None:
            _save(progress_path, dict(cell=key, impl="sdpa_cudnn", where="capture"))
            try:
                pt = torch.as_tensor(page_table, dtype=torch.long, device="cuda")
                tdt = torch.bfloat16 if dtype == "bfloat16" else torch.float16

                def tv(x):
                    t = as_torch(x) if dtype == "bfloat16" else torch.from_dlpack(x)
                    return t.view(tdt) if t.dtype != tdt else t
                dense = []
                for q, c, _ in sets:
                    gather = lambda arr: tv(arr)[pt].reshape(B, -1, H_KV, D)[:, :kl].transpose(1, 2).contiguous()
                    dense.append((tv(q).view(B, ql, H_Q, D).transpose(1, 2).contiguous(), gather(c.k), gather(c.v)))
                kw = {"is_causal": True} if causal and ql == kl else (
                    {"attn_mask": torch.ones(ql, kl, dtype=torch.bool, device="cuda").tril(kl - ql)} if causal else {})

                def sdpa(i, kw=kw):
                    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                        return F.scaled_dot_product_attention(*dense[i % len(dense)], enable_gqa=True, **kw)
                o = sdpa(0)
                torch.cuda.synchronize()
                flat = o.transpose(1, 2).reshape(B * ql, H_Q, D)
                err = check(lambda lo, hi: flat[lo:hi].double().cpu().numpy())
                ts = torch.cuda.Stream()
                ts.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(ts):
                    for i in range(5):
                        sdpa(i)
                torch.cuda.current_stream().wait_stream(ts)
                torch.cuda.synchronize()
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    for i in range(5):
                        sdpa(i)
                impls["sdpa_cudnn"] = dict(replay=g.replay, stream=None, err=err, keep=(g, dense))
            except Exception as e:  # noqa: BLE001
                if not context_alive():
                    fail(key, "sdpa_cudnn", "capture", e)
                log(f"ab {key} sdpa_cudnn: ERROR {type(e).__name__}: {str(e)[:200]}")

        def turn(label, times):
            """`times` replays of one implementation's graph, synchronised: ms."""
            it = impls[label]
            if it["stream"] is None:  # torch graph on torch's current stream
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                for _ in range(times):
                    it["replay"]()
                b.record()
                b.synchronize()
                return a.elapsed_time(b)
            a, b = cupy.cuda.Event(), cupy.cuda.Event()
            a.record(it["stream"])
            for _ in range(times):
                it["replay"]()
            b.record(it["stream"])
            b.synchronize()
            return cupy.cuda.get_elapsed_time(a, b)

        labels = list(impls)
        per_round = {k: [] for k in labels}
        for label in labels:  # warm-up: two replays each
            _save(progress_path, dict(cell=key, impl=label, where="warm-up replays"))
            try:
                turn(label, 2)
            except Exception as e:  # noqa: BLE001
                fail(key, label, "warm-up replays", e)
        for r in range(rounds):
            order = labels[r % len(labels):] + labels[:r % len(labels)]
            for label in order:
                _save(progress_path, dict(cell=key, impl=label, where=f"round {r}"))
                try:
                    per_round[label].append(1e3 * turn(label, replays) / (5 * replays))
                except Exception as e:  # noqa: BLE001
                    fail(key, label, f"round {r}", e)
        cell = {}
        for label in labels:
            it, us = impls[label], per_round[label]
            err_graph = None
            if it["stream"] is not None:  # the graph's own output, after all its replays
                _save(progress_path, dict(cell=key, impl=label, where="graph output check"))
                try:
                    o0.view(cupy.uint16).fill(poison)
                    turn(label, 1)
                    err_graph = check(rows_of_set0)
                except Exception as e:  # noqa: BLE001
                    fail(key, label, "graph output check", e)
            below = sum(u < floor_us for u in us)
            ok = it["err"] < TOL[dtype] and (err_graph is None or err_graph < TOL[dtype]) and below == 0
            cell[label] = dict(us=us, err=it["err"], err_graph=err_graph, below_floor=below, ok=ok,
                               tflops=flops / float(np.median(us)) / 1e6 if us else float("nan"))
            log(f"ab {wname:24s} ps {ps:2d} {label:12s} median {np.median(us):8.1f} us ({min(us):.1f}-{max(us):.1f}) "
                f"{cell[label]['tflops']:6.1f} TFLOP/s err {it['err']:.2e}"
                + ("" if err_graph is None else f" / graph {err_graph:.2e}")
                + (f"  {below} ROUNDS BELOW THE {AB_FLOOR_TFLOPS:.0f} TFLOP/s FLOOR ({floor_us:.1f} us)" if below else ""))
        result["cells"][key] = dict(flops=flops, floor_us=floor_us, impls=cell, order=labels)
        _save(out_path, result)
        log(f"ab cell {wname} ps {ps}: {time.perf_counter() - t_cell:.1f} s")
        sets = impls = o0 = None  # the cell's inputs, graphs and plans go before the next cell's
        if torch is not None:
            torch.cuda.empty_cache()
        cupy.get_default_memory_pool().free_all_blocks()
    return result


def run_ab(cells, rounds, replays, timeout):
    """child_ab over `cells`, again without an implementation that raised a CUDA error (or was
    the turn in flight when a child died), until every cell is done or the time is up."""
    done, failures, skip = {}, [], []
    t_end = time.perf_counter() + timeout
    status = "not run"
    progress_path = os.path.join(WORK, "ab_progress.json")
    while True:
        remaining = [c for c in cells if f"{c[0]}|{c[1]}" not in done]
        left = t_end - time.perf_counter()
        if not remaining or left < 15:
            break
        if os.path.exists(progress_path):
            os.remove(progress_path)
        res, status = run_child("ab", {"cells": remaining, "rounds": rounds, "replays": replays, "skip": list(skip)},
                                int(left))
        res = res or {}
        done.update(res.get("cells", {}))
        failure = res.get("failure")
        if failure is None and status != "exit 0" and os.path.exists(progress_path):
            with open(progress_path) as f:
                last = json.load(f)
            failure = dict(cell=last["cell"], impl=last["impl"], where=last["where"],
                           error=f"the child died ({status}) during this turn")
        if failure is None:
            break
        failures.append(failure)
        if failure["impl"] in skip:  # the same culprit twice: stop rather than loop
            break
        skip.append(failure["impl"])
    return dict(cells=done, failures=failures), status


def ab_table(ab):
    """The A/B summary, one line per cell and implementation: median TFLOP/s over the rounds,
    its spread (min-max of the per-round TFLOP/s), and the medians over rounds of its speed
    ratio to the cell's first implementation (the round-2 default), to this tree's default
    (d128 / d64) and to SDPA cuDNN measured in the same round. A failed check or a time under
    the floor prints instead of a figure."""
    lines = [f"  {'cell':24s} {'ps':>2s} {'impl':12s} {'TFLOP/s':>7s} {'[min - max]':>15s} {'/base':>6s} {'/dflt':>6s} "
             f"{'/cudnn':>6s}"]

    def ratio(r, other):
        if other is None or not other["us"]:
            return float("nan")
        return float(np.median([b / u for u, b in zip(r["us"], other["us"])]))

    for key, c in ab["cells"].items():
        wname, ps = key.split("|")
        order = c.get("order") or list(c["impls"])
        impls = c["impls"]
        base = impls.get(order[0]) if order else None
        dflt = next((impls[n] for n in order if n in DEFAULTS), None)
        cudnn = impls.get("sdpa_cudnn")
        for label in order:
            r = impls[label]
            if not r["us"]:
                lines.append(f"  {wname:24s} {ps:>2s} {label:12s} (no rounds)")
                continue
            if r.get("below_floor"):
                lines.append(f"  {wname:24s} {ps:>2s} {label:12s} ERROR: {r['below_floor']} rounds under the "
                             f"{AB_FLOOR_TFLOPS:.0f} TFLOP/s floor ({c['floor_us']:.1f} us): not a measurement")
                continue
            tf = [c["flops"] / u / 1e6 for u in r["us"]]
            note = "" if r["ok"] else (f"  FAILED fp64 window check (eager {r['err']:.2e}"
                                       + ("" if r.get("err_graph") is None else f", graph {r['err_graph']:.2e}") + ")")
            lines.append(f"  {wname:24s} {ps:>2s} {label:12s} {np.median(tf):7.1f} [{min(tf):6.1f} - {max(tf):6.1f}] "
                         f"{ratio(r, base):6.3f} {ratio(r, dflt):6.3f} {ratio(r, cudnn):6.3f}{note}")
    for f in ab.get("failures", []):
        lines.append(f"  CUDA ERROR: {f['impl']} on {f['cell']} ({f['where']}): {f['error']}; later cells ran without it")
    return lines


# ---- child: ncu (run under ncu by the parent) ---------------------------------------------

NCU_SECTIONS = ["SpeedOfLight", "ComputeWorkloadAnalysis", "WarpStateStats", "MemoryWorkloadAnalysis"]
NCU_METRICS = ",".join(
    ["sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active",
     "sm__inst_executed_pipe_tensor_op_gmma.avg.pct_of_peak_sustained_active",
     "smsp__warps_eligible.avg.per_cycle_active", "smsp__issue_active.avg.pct_of_peak_sustained_active",
     "l1tex__data_pipe_lsu_wavefronts_mem_shared.sum.pct_of_peak_sustained_elapsed",
     "lts__t_sectors.avg.pct_of_peak_sustained_elapsed", "sm__cycles_elapsed.avg.per_second"]
    + [f"smsp__average_warps_issue_stalled_{r}_per_issue_active.ratio" for r in
       ("long_scoreboard", "short_scoreboard", "barrier", "membar", "mio_throttle", "math_pipe_throttle", "wait",
        "lg_throttle", "not_selected", "selected", "no_instruction", "dispatch_stall", "sleeping", "branch_resolving")])


def child_ncu(names):
    """One launch of each variant on prefill_b2_l8192, page 16 (the parent runs this under ncu)."""
    import cupy

    from cupy_fa import _arrays
    from cupy_fa.kv_cache import PagedKVCache

    B, ql, kl, ps, D = 2, 8192, 8192, 16, 128
    ppr = kl // ps
    dt = _arrays.DTYPES["bfloat16"]
    k = fill_random(cupy.empty((B * ppr, ps, H_KV, D), dt), "bfloat16")
    v = fill_random(cupy.empty((B * ppr, ps, H_KV, D), dt), "bfloat16")
    q = fill_random(cupy.empty((B * ql, H_Q, D), dt), "bfloat16")
    out = cupy.empty_like(q)
    page_table = np.random.default_rng(7).permutation(B * ppr).astype(np.int32).reshape(B, ppr)
    for name in names:
        pf = prefill_for(name, H_Q, H_KV, D).plan(np.full(B, ql), np.full(B, kl), page_table)
        pf.run(q, PagedKVCache(k, v), out)
        cupy.cuda.Device().synchronize()
    return {}


def run_ncu(names, timeout):
    """Two ncu passes over one launch per variant: sections, then metrics (a name this ncu lacks
    fails only its pass). Returns the lines worth reading."""
    lines = []
    base = ["ncu", "--clock-control", "none", "-k", "regex:prefill_sm90", "-c", str(len(names))]
    child = [sys.executable, os.path.abspath(__file__), "--child", "ncu"]
    with open(os.path.join(WORK, "ncu_in.json"), "w") as f:
        json.dump({"names": names}, f)
    keep = ("prefill_sm90_kernel", "Duration", "Throughput", "Pipe", "Issue", "Eligible", "Active Warps", "L2 Hit",
            "L1/TEX Hit", "Bank", "stall", "Stall", "cycles being", "gmma", "warps_", "issue_active", "wavefronts",
            "lts__", "per_second", "SM Busy", "Executed Ipc")
    for label, extra in (("sections", sum((["--section", x] for x in NCU_SECTIONS), [])),
                         ("metrics", ["--metrics", NCU_METRICS])):
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(base + extra + child, capture_output=True, text=True, timeout=timeout)
            text = proc.stdout + proc.stderr
        except (subprocess.TimeoutExpired, OSError) as e:
            text = f"ncu {label}: {type(e).__name__}: {e}"
        with open(os.path.join(OUT, f"ncu_{label}.txt"), "w") as f:
            f.write(text)
        lines.append(f"-- ncu {label} ({time.perf_counter() - t0:.0f} s)")
        lines += [ln.rstrip()[:200] for ln in text.splitlines() if any(k in ln for k in keep)][:80]
    return lines


# ---- parent -------------------------------------------------------------------------------

def run_child(stage, payload, timeout):
    path = os.path.join(WORK, f"{stage}_in.json")
    with open(path, "w") as f:
        json.dump(payload, f)
    out_path = os.path.join(WORK, f"{stage}_out.json")
    if os.path.exists(out_path):
        os.remove(out_path)
    t0 = time.perf_counter()
    try:
        env = dict(os.environ, OPENBLAS_NUM_THREADS="8")  # the children's window references use threads
        proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", stage], timeout=timeout, env=env)
        status = f"exit {proc.returncode}"
    except subprocess.TimeoutExpired:
        status = f"TIMEOUT after {timeout} s (a hang?)"
    log(f"== stage {stage}: {status}, {time.perf_counter() - t0:.1f} s")
    if os.path.exists(out_path):
        with open(out_path) as f:
            return json.load(f), status
    return None, status


def child_main(stage):
    with open(os.path.join(WORK, f"{stage}_in.json")) as f:
        payload = json.load(f)
    if stage == "compile":
        res = child_compile(payload["names"])
    elif stage == "correct":
        res = child_correct(payload["names"], payload["paths"], payload["cases"])
    elif stage == "ncu":
        res = child_ncu(payload["names"])
    elif stage == "ab":
        res = child_ab(payload["cells"], payload["rounds"], payload["replays"], payload["skip"])
    else:
        res = child_time(payload["passed"], payload["quick"])
    with open(os.path.join(WORK, f"{stage}_out.json"), "w") as f:
        json.dump(res, f)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--quick", action="store_true", help="one case per dtype and head dim, one timing workload")
    ap.add_argument("--only", default="", help="comma list of variant names (default: all)")
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--ncu", default="", help="comma list of variants to profile once each on prefill_b2_l8192")
    ap.add_argument("--ab", action="store_true",
                    help="interleaved A/B of AB_CELLS (the round-2 default, this tree's default and the new traits "
                         "beside SDPA cuDNN on the three bench workloads at page sizes 16 and 1, and D = 64), after "
                         "compiling and checking them, AB_CORRECT_EXTRA and the shipped defaults for correctness")
    ap.add_argument("--ab-impls", default="", help="--ab: comma list replacing AB_D128 (e.g. with v1_af55a79, "
                    "v3_37ed792: earlier commits' kernels, once lab/sm90_snapshots/make_snapshot.sh made them)")
    ap.add_argument("--ab-timeout", type=int, default=150, help="--ab: seconds for all the A/B cells")
    ap.add_argument("--rounds", type=int, default=21, help="--ab: rounds of alternation per cell")
    ap.add_argument("--replays", type=int, default=3, help="--ab: graph replays (of 5 launches) per turn")
    args = ap.parse_args()
    if args.child:
        return child_main(args.child)
    os.makedirs(WORK, exist_ok=True)
    os.makedirs(OUT, exist_ok=True)
    if args.ab:
        wanted = {n for _, _, ns in ab_cells(args.ab_impls) for n in ns} | set(AB_CORRECT_EXTRA) | set(DEFAULTS)
        names = [n for n in VARIANTS if n in wanted]
    else:
        names = [n for n in VARIANTS if not args.only or n in args.only.split(",")]
    seed = args.seed if args.seed is not None else int(time.time()) % 100000
    log(f"probe_prefill_sm90: seed {seed}, variants {names}")
    try:
        subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,clocks.sm,clocks.mem", "--format=csv,noheader"])
    except OSError as e:
        log(f"nvidia-smi: {e}")

    # compile (GPU child) while the CPU draws the cases and their fp64 references
    cases = case_list(args.quick)
    if args.ab:  # the A/B variants' head dims and types only
        kinds = {(VARIANTS[n][1].head_dim, VARIANTS[n][0]) for n in names}
        cases = [c for c in cases if (c["d"], c["dtype"]) in kinds]
    with open(os.path.join(WORK, "compile_in.json"), "w") as f:
        json.dump({"names": names}, f)
    t0 = time.perf_counter()
    compile_proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--child", "compile"])
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(min(14, os.cpu_count() or 2)) as pool:
        paths = list(pool.map(make_case, [(i, c, seed + i) for i, c in enumerate(cases)]))
    log(f"== {len(cases)} cases and their fp64 references: {time.perf_counter() - t0:.1f} s")
    try:
        compile_proc.wait(timeout=120)
        status = f"exit {compile_proc.returncode}"
    except subprocess.TimeoutExpired:
        compile_proc.kill()
        status = "TIMEOUT"
    log(f"== stage compile: {status}, {time.perf_counter() - t0:.1f} s")
    compiled = None
    if os.path.exists(os.path.join(WORK, "compile_out.json")):
        with open(os.path.join(WORK, "compile_out.json")) as f:
            compiled = json.load(f)

    correct, c_status = run_child("correct", {"names": names, "paths": paths, "cases": cases}, 150)
    passed = []
    for n in names:  # every case of its kind run (none lost to a hang) and within tolerance
        expected = [c for c in cases if c["d"] == VARIANTS[n][1].head_dim and c["dtype"] == VARIANTS[n][0]]
        cells = [r for k, r in (correct or {}).items() if k.startswith(n + "|")]
        if cells and len(cells) == len(expected) and all(r.get("ok") for r in cells):
            passed.append(n)
    timed, t_status, ab, ab_status = None, "skipped (--ab)", None, "not run"
    if args.ab:
        cells = [(w, ps, [n for n in names_ if n in passed]) for w, ps, names_ in ab_cells(args.ab_impls)]
        ab, ab_status = run_ab(cells, args.rounds, args.replays, args.ab_timeout)
    else:
        timed, t_status = run_child("time", {"passed": passed, "quick": args.quick}, 240 if not args.quick else 120)
    ncu_names = [n for n in args.ncu.split(",") if n in passed] if args.ncu else []
    ncu_lines = run_ncu(ncu_names, 90) if ncu_names else []

    with open(os.path.join(OUT, "probe.json"), "w") as f:
        json.dump(dict(seed=seed, compiled=compiled, correct=correct, timed=timed, ab=ab, cases=cases, ncu=ncu_lines,
                       statuses=dict(correct=c_status, time=t_status, ab=ab_status)), f, indent=1)

    # ---- the tables, last -------------------------------------------------------------------
    log("\n==== compile (cold RawModule s / NVRTC s / regs / spills / HGMMA / LDL+STL / SASS of a consumer step, "
        "of a producer tile)")
    if compiled:
        log(f"first prefill call cold: {compiled['first_call_s']:.2f} s")
        for n, r in compiled["variants"].items():
            log(f"  {n:12s} {r['cold_s']:5.2f} {r['nvrtc_s']:5.2f} {r['registers']} {r['spill_stores']}/{r['spill_loads']} "
                f"{r['hgmma']} {r['local']} {(r.get('step') or {}).get('instructions')} "
                f"{(r.get('producer') or {}).get('instructions')}")
    log(f"\n==== correctness ({c_status}; seed {seed}): variant: cases ok / run, worst out err, worst lse err")
    for n in names:
        cells = {k.split("|")[1]: r for k, r in (correct or {}).items() if k.startswith(n + "|")}
        bad = [k for k, r in cells.items() if not r.get("ok")]
        worst = max((r.get("err", math.inf) for r in cells.values()), default=math.nan)
        worst_l = max((r.get("lse_err", math.inf) for r in cells.values()), default=math.nan)
        n_cases = sum(c["d"] == VARIANTS[n][1].head_dim and c["dtype"] == VARIANTS[n][0] for c in cases)
        log(f"  {n:12s} {len(cells) - len(bad)}/{n_cases} ok, out {worst:.2e}, lse {worst_l:.2e}"
            f"{'  FAILED: ' + ', '.join(bad) if bad else ''}")
    if ncu_lines:
        log("\n==== ncu (prefill_b2_l8192, page 16; whole reports in $OUT/ncu_*.txt)")
        for line in ncu_lines:
            log(line)
    if args.ab:
        log(f"\n==== interleaved A/B ({ab_status}; {args.rounds} rounds x {args.replays} replays of 5 launches "
            f"per implementation and cell)")
        if ab:
            for line in ab_table(ab):
                log(line)
    log(f"\n==== timing ({t_status}): TFLOP/s (us), fp64 window check")
    if timed:
        rows = timed["rows"]
        impls = []
        for r in rows:
            if r["impl"] not in impls:
                impls.append(r["impl"])
        keys = []
        for r in rows:
            if r["ps"] != "-" and (r["workload"], r["ps"]) not in keys:
                keys.append((r["workload"], r["ps"]))
        log(f"  {'workload':24s} {'ps':>2s} " + " ".join(f"{i:>12s}" for i in impls))
        for wname, ps in keys:
            cells = []
            for impl in impls:
                hit = [r for r in rows if r["workload"] == wname and r["impl"] == impl and r["ps"] in (ps, "-")]
                if not hit:
                    cells.append(f"{'':>12s}")
                elif "error" in hit[0]:
                    cells.append(f"{'error':>12s}")
                else:
                    cells.append(f"{hit[0]['tflops']:7.1f}{'' if hit[0]['ok'] else '!'}".rjust(12))
            log(f"  {wname:24s} {ps:>2d} " + " ".join(cells))
        log("  (! = failed its fp64 check; sdpa_* on a dense copy, same on both page sizes)")


if __name__ == "__main__":
    sys.exit(main())
