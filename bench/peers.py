"""Peers on the same shapes and the same input sets: PyTorch SDPA (cuDNN, flash) on a dense
copy of the paged cache, and FlashInfer's paged wrappers when FlashInfer imports.

Every peer is checked against the same fp64 reference windows as ours before it is timed,
and wrapped so that a failure becomes a recorded cell, never a stopped bench.
"""

from __future__ import annotations

import os
import tempfile
import time
import traceback

import numpy as np

from . import timing
from .inputs import Inputs, as_torch, max_error, to_host_f64
from .workloads import H_KV, H_Q
from cupy_fa import reference

DEVICE = "cuda"  # a CPU smoke test may point it elsewhere
SDPA_BACKENDS = {"sdpa_cudnn": "CUDNN_ATTENTION", "sdpa_flash": "FLASH_ATTENTION"}


def cell(status, **kw):
    return {"status": status, **kw}


def _failed(e) -> dict:
    return cell("error", error=f"{type(e).__name__}: {str(e)[:400]}",
                where=traceback.format_exc(limit=3)[-600:])


def _finish(w, fn_for_set, n_sets, n_launch, rows_of, refs, inp, opts, method_note=""):
    """Check set 0 against the reference, then time n_launch launches rotating the sets."""
    err = max_error(inp, rows_of, refs)
    limit = reference.TOL[w.dtype]
    if not err <= limit:
        return cell("wrong", err=err, note=f"max rel err {err:.3g} > {limit}: not timed. {method_note}")
    launches = [lambda i=i: fn_for_set(i % n_sets) for i in range(n_launch)]
    t = timing.torch_graph(launches, warmup=opts["warmup"], reps=opts["reps"])
    return cell("ok", err=err, value=w.figure(t.time_us), note=method_note, sets=n_sets, **t.as_dict())


# ---- PyTorch SDPA on a dense copy -------------------------------------------------------

def dense_copy(inp: Inputs, s):
    """(q [B, H_q, q_len, D], k, v [B, H_kv, kv_len, D]) torch copies of one input set,
    gathered through the shuffled page table."""
    import torch

    w = inp.workload
    pt = torch.as_tensor(inp.page_table, dtype=torch.long, device=DEVICE)

    def gather(cache_arr):
        paged = as_torch(cache_arr)  # [pages, page_size, H_kv, D]
        tok = paged[pt].reshape(w.batch, -1, H_KV, w.head_dim)[:, : w.kv_len]
        return tok.transpose(1, 2).contiguous()

    q = as_torch(s.q).view(w.batch, w.q_len, H_Q, w.head_dim).transpose(1, 2).contiguous()
    return q, gather(s.cache.k), gather(s.cache.v)


def bench_sdpa(inp: Inputs, refs: dict, opts: dict, n_launch: int) -> dict:
    """Both SDPA backends; returns {peer name: cell}. Inputs are dense copies of inp.sets."""
    try:
        import torch
        import torch.nn.functional  # noqa: F401 - what sdpa_runner calls: here, whether it imports
        from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: F401
        from torch.nn.attention.bias import causal_lower_right  # noqa: F401
    except Exception as e:  # noqa: BLE001
        return {name: cell("n/a", error=f"torch SDPA unavailable: {e}") for name in SDPA_BACKENDS}

    w = inp.workload
    if not w.uniform:
        why = "n/a: a ragged batch (dense SDPA runs one q_len / kv_len per call)"
        return {name: cell("n/a", error=why) for name in SDPA_BACKENDS}
    if w.variant:
        why = "n/a: SDPA's flash and cuDNN backends take no soft-cap, sinks or sliding window (only a dense mask)"
        return {name: cell("n/a", error=why) for name in SDPA_BACKENDS}
    if w.fp8:
        why = "n/a: SDPA's flash and cuDNN backends take no fp8 K / V beside 16-bit queries"
        return {name: cell("n/a", error=why) for name in SDPA_BACKENDS}
    if w.dim_vo != w.head_dim:
        why = "n/a: this bench's dense copy for SDPA holds one head dim for K and V"
        return {name: cell("n/a", error=why) for name in SDPA_BACKENDS}
    dense = [dense_copy(inp, s) for s in inp.sets]
    torch.cuda.synchronize()
    results = {}
    for name, backend_name in SDPA_BACKENDS.items():
        backend = getattr(SDPBackend, backend_name)
        try:
            results[name] = _sdpa_one(w, inp, refs, opts, n_launch, dense, backend)
        except Exception as e:  # noqa: BLE001
            results[name] = _failed(e)
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    del dense
    torch.cuda.empty_cache()
    return results


def sdpa_runner(w, dense, backend):
    """``(run, out0, note)`` for PyTorch SDPA's ``backend`` (an ``SDPBackend``) over the dense input
    sets ``dense`` (:func:`dense_copy`) of workload ``w``: ``run(i)`` runs set i with the workload's
    mask, GQA in the call or, where the backend refuses it, the KV heads expanded; ``out0`` is set
    0's output (the call that chose between the two); ``note`` says which mask and which GQA path.
    (lab/probe_clocks.py holds the cuDNN cell through it too.)"""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right

    # Masking: decode sees every key (no mask); prefill q_len == kv_len is plain is_causal;
    # otherwise bottom-right causal: flash through CausalBias (lower right), cuDNN through an
    # explicit boolean mask (the CausalBias path would materialise one on every call).
    mask_kw, how = {}, "no mask"
    if not w.causal:
        how = "no mask (non-causal)"
    elif w.q_len == w.kv_len:
        mask_kw, how = {"is_causal": True}, "is_causal"
    elif w.q_len > 1:
        if backend.name == "FLASH_ATTENTION":
            mask_kw, how = {"attn_mask": causal_lower_right(w.q_len, w.kv_len)}, "causal_lower_right"
        else:
            m = torch.ones(w.q_len, w.kv_len, dtype=torch.bool, device=DEVICE).tril(w.kv_len - w.q_len)
            mask_kw, how = {"attn_mask": m}, "explicit bottom-right bool mask"

    def call(q, k, v, gqa):
        with sdpa_kernel([backend]):
            if gqa:
                return F.scaled_dot_product_attention(q, k, v, enable_gqa=True, **mask_kw)
            return F.scaled_dot_product_attention(q, k, v, **mask_kw)

    sets, gqa, note = dense, True, f"enable_gqa=True, {how}"
    try:
        out0 = call(*sets[0], True)
    except Exception as e:  # noqa: BLE001 - retry with the KV heads expanded
        first = f"{type(e).__name__}: {str(e)[:200]}"
        group = H_Q // H_KV
        sets = [(q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)) for q, k, v in dense]
        gqa, note = False, (f"KV heads expanded to {H_Q} (enable_gqa failed: {first}); {how}; "
                            f"KV bytes still counted for H_kv={H_KV}")
        try:
            out0 = call(*sets[0], False)
        except Exception as e2:
            raise RuntimeError(f"with enable_gqa: {first} | with expanded KV heads: "
                               f"{type(e2).__name__}: {str(e2)[:200]}") from e2
    return (lambda i: call(*sets[i], gqa)), out0, note


def _sdpa_one(w, inp, refs, opts, n_launch, dense, backend):
    import torch

    run, out0, note = sdpa_runner(w, dense, backend)
    torch.cuda.synchronize()
    flat = out0.transpose(1, 2).reshape(w.num_q_rows, H_Q, w.head_dim)
    rows_of = lambda lo, hi: to_host_f64(flat[lo:hi])
    return _finish(w, run, len(dense), n_launch, rows_of, refs, inp, opts, note)


# ---- FlashInfer -------------------------------------------------------------------------

def load_flashinfer():
    """(module, None) or (None, reason). Sets FLASHINFER_WORKSPACE_BASE to a temp dir first."""
    os.environ.setdefault("FLASHINFER_WORKSPACE_BASE", tempfile.mkdtemp(prefix="fiws-"))
    try:
        import flashinfer

        return flashinfer, None
    except Exception as e:  # noqa: BLE001
        return None, f"{type(e).__name__}: {str(e)[:300]}"


def flashinfer_wrapper_kind(w) -> str:
    """Which FlashInfer wrapper runs workload ``w``: "sinks" (its attention-sink wrapper), "decode" (one
    query token a request) or "prefill" (prefill, extend and ragged batches)."""
    return "sinks" if w.sinks else "decode" if w.q_len == 1 else "prefill"


def flashinfer_step(fi, inp: Inputs, workspace=None):
    """FlashInfer's wrapper for workload ``inp`` (its q and caches as torch views): ``(plan, run,
    outs, how)``, ``plan()`` its plan with this step's metadata (device tensors, as the bench has
    always given them), ``run(i)`` its run on input set i into ``outs[i]``. ``plan`` is called once
    here (the first call JIT-builds FlashInfer's kernels)."""
    import torch

    w, ps = inp.workload, inp.page_size
    pages = w.pages_of(ps)
    dev = dict(dtype=torch.int32, device=DEVICE)
    if workspace is None:
        workspace = torch.empty(256 << 20, dtype=torch.uint8, device=DEVICE)
    kv_indptr = torch.as_tensor([0] + list(np.cumsum(pages)), **dev)
    kv_indices = torch.as_tensor(np.concatenate([inp.page_table[b, :n] for b, n in enumerate(pages)]), **dev)
    last_page_len = torch.as_tensor([kv - (n - 1) * ps for kv, n in zip(w.kv_lens, pages)], **dev)
    qo_indptr = torch.as_tensor([0] + list(np.cumsum(w.q_lens)), **dev)
    # [pages, 2, page_size, H_kv, D], same shuffled page order as ours (an fp8 cache's bytes as e4m3)
    if w.fp8:
        kv_sets = [torch.stack([torch.from_dlpack(s.cache.k), torch.from_dlpack(s.cache.v)], dim=1)
                   .view(torch.float8_e4m3fn) for s in inp.sets]
    elif w.dim_vo != w.head_dim:  # separate K / V widths: the (k, v) tuple form of a paged cache, V a view
        # of the first dim_vo columns of rows as wide as K's (FlashInfer wants one page stride for both)
        def padded_v(v):
            wide = torch.empty(v.shape[:-1] + (w.head_dim,), dtype=v.dtype, device=v.device)
            wide[..., : w.dim_vo] = v
            return wide[..., : w.dim_vo]
        kv_sets = [(as_torch(s.cache.k), padded_v(as_torch(s.cache.v))) for s in inp.sets]
    else:
        kv_sets = [torch.stack([as_torch(s.cache.k), as_torch(s.cache.v)], dim=1) for s in inp.sets]
    q_sets = [as_torch(s.q) for s in inp.sets]
    outs = [q.new_empty(q.shape[:2] + (w.dim_vo,)) for q in q_sets]
    elem = {"bfloat16": torch.bfloat16, "float16": torch.float16}[w.dtype]
    dt = dict(q_data_type=elem, kv_data_type=torch.float8_e4m3fn if w.fp8 else elem)
    # an fp8 cache: its per-tensor scales, to run()
    scales = dict(k_scale=float(inp.sets[0].cache.k_scale[0]), v_scale=float(inp.sets[0].cache.v_scale[0])) \
        if w.fp8 else {}
    # the variants: FlashInfer's window_left is W - 1 (a query sees itself and W - 1 keys before it)
    if w.window:
        dt["window_left"] = w.window - 1
    if w.soft_cap:
        dt["logits_soft_cap"] = w.soft_cap
    extra = ()
    kind = flashinfer_wrapper_kind(w)
    if kind == "sinks":  # its attention-sink variant (a JIT module of its own), prefill and decode alike
        wrapper = fi.BatchAttentionWithAttentionSinkWrapper(
            workspace, "NHD", q_data_type=elem, kv_data_type=elem, head_dim_qk=w.head_dim, head_dim_vo=w.dim_vo,
            window_left=dt.get("window_left", -1))
        plan = lambda: wrapper.plan(qo_indptr, kv_indptr, kv_indices, last_page_len, H_Q, H_KV, w.head_dim, ps,
                                    causal=w.causal, **dt)
        extra = (torch.as_tensor(inp.sinks, device=DEVICE), 1.0 / np.sqrt(w.head_dim))
        how = f"BatchAttentionWithAttentionSinkWrapper(causal={w.causal}) run(q, kv, sinks, sm_scale)"
    elif kind == "decode":
        wrapper = fi.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD", use_tensor_cores=True)
        plan = lambda: wrapper.plan(kv_indptr, kv_indices, last_page_len, H_Q, H_KV, w.head_dim, ps, **dt)
        how = "BatchDecodeWithPagedKVCacheWrapper(use_tensor_cores=True)"
    else:  # prefill, extend and ragged (mixed) batches: one call, its own schedule
        wrapper = fi.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD")
        if w.dim_vo != w.head_dim:
            dt["head_dim_vo"] = w.dim_vo
        plan = lambda: wrapper.plan(qo_indptr, kv_indptr, kv_indices, last_page_len, H_Q, H_KV, w.head_dim, ps,
                                    causal=w.causal, **dt)
        how = f"BatchPrefillWithPagedKVCacheWrapper(causal={w.causal})"
    knobs = [f"{k}={v}" for k, v in dt.items() if k in ("window_left", "logits_soft_cap", "head_dim_vo")]
    knobs += ["kv_data_type=float8_e4m3fn, k_scale / v_scale per tensor"] if w.fp8 else []
    how += f" with {', '.join(knobs)}" if knobs else ""
    plan()

    def run(i):
        if extra:  # the sink variant's run takes its extra tensor and scalar positionally
            return wrapper.run(q_sets[i], kv_sets[i], *extra, out=outs[i])
        return wrapper.run(q_sets[i], kv_sets[i], out=outs[i], **scales)
    return plan, run, outs, how


# Head dims FlashInfer 0.7.4's paged prefill runs here: at 96 its JIT-built kernel faults with an
# illegal memory access on sm_90 (H100, 2026-12-07), which loses the process's CUDA context, so
# the bench does not call it outside these (the qk 192 / vo 128 pair is its DeepSeek shape: its sm90
# JIT build there fails at run time with "operation not supported", an error the cell records,
# the context intact; H100, 2026-12-07).
FLASHINFER_PREFILL_DIMS = ((64, 64), (128, 128), (256, 256), (192, 128))


def flashinfer_refuses(w) -> str | None:
    """Why FlashInfer is not run on workload ``w`` (None: it is)."""
    if w.q_len > 1 and (w.head_dim, w.dim_vo) not in FLASHINFER_PREFILL_DIMS:
        return (f"n/a: FlashInfer's paged prefill at head dims {w.head_dim} / {w.dim_vo} is not run (head dim 96 "
                "faults on sm_90, losing the process's CUDA context)")
    return None


def bench_flashinfer(fi, inp: Inputs, refs: dict, opts: dict, n_launch: int) -> dict:
    import torch

    refused = flashinfer_refuses(inp.workload)
    if refused:
        return cell("n/a", error=refused)
    try:
        t0 = time.perf_counter()
        plan, call, outs, how = flashinfer_step(fi, inp)
        call(0)
        torch.cuda.synchronize()
        first_use_s = time.perf_counter() - t0
        rows_of = lambda lo, hi: to_host_f64(outs[0][lo:hi])
        res = _finish(inp.workload, call, len(inp.sets), n_launch, rows_of, refs, inp, opts, how)
        res["first_use_s"] = first_use_s
        if res.get("status") == "ok":  # host time of its run and plan, as ours (bench/timing.host_us)
            res["host"] = {"run_us": timing.host_us(lambda: call(0), torch.cuda.synchronize, opts["cpu_repeat"]),
                           "plan_us": timing.host_us(plan, torch.cuda.synchronize, opts["cpu_repeat"] // 4)}
        return res
    except Exception as e:  # noqa: BLE001
        return _failed(e)
    finally:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
