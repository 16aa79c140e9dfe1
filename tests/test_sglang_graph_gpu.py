"""The SGLang backend inside a real ``torch.cuda.graph``: forward_decode / forward_extend captured once
per mode (decode, target verify chain and tree, DRAFT_EXTEND_V2; fp16, bf16 and an fp8 pool), then
replayed over new lengths and new page placements; every replay is held to the same step run eagerly
(the same bits: one kernel path) and to the float64 reference over the pool's own pages.

SGLang's kit checks the metadata protocol without recording a graph; these record one. The KV pool,
the layer and the forward batch are SGLang 0.5.17's own (the kit's fixture machinery), with the
harness of tests/sglang_harness (placeholders for sgl_kernel / flashinfer).
"""

import types

import numpy as np
import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.torch]

MAX_BS, N, HEAD_DIM, H_Q, H_KV, CONTEXT = 8, 4, 128, 8, 2, 384
BARS = {"float16": 3e-3, "bfloat16": 1e-2}  # |out - ref| / |ref| against float64


@pytest.fixture(scope="module")
def kit():
    global torch
    import torch

    import sglang_harness

    sglang_harness.prepare()
    from sglang.srt.model_executor.forward_batch_info import ForwardMode
    from sglang.test.kits.attention_unittest.attention_methods import dense_attention as dense

    return types.SimpleNamespace(dense=dense, M=ForwardMode)


def _tree_mask(rng, n, topk):
    """A draft tree's [n, n] mask: each draft sees itself and its ancestors (a chain for topk 1)."""
    mask = np.eye(n, dtype=bool)
    for i in range(1, n):
        parent = i - 1 if topk == 1 else int(rng.integers(0, i))
        mask[i] |= mask[parent]
    return mask


class Step:
    """One replay's batch: lengths, shuffled slots, random K/V of the prefixes, the step's q/k/v."""

    def __init__(self, fixture, mode, rng, dtype, topk):
        self.mode, self.topk = mode, topk
        runner = fixture.runner
        pool, r2t = runner.token_to_kv_pool, runner.req_to_token_pool.req_to_token
        dev = r2t.device
        new = 1 if mode == "decode" else N
        self.prefix = rng.integers(1, CONTEXT - N - 1, MAX_BS)
        total = self.prefix + new
        slots = rng.permutation(np.arange(1, pool.size))[:int(total.sum())]  # fresh placements each step
        r2t.zero_()
        rows = np.split(slots, np.cumsum(total)[:-1])
        for b, row in enumerate(rows):
            r2t[b, :len(row)] = torch.from_numpy(row.astype(np.int32)).to(dev)
        layer = fixture.actual_module.attn
        pre = np.concatenate([row[:p] for row, p in zip(rows, self.prefix)])
        kv_shape = (len(pre), H_KV, HEAD_DIM)
        pool.set_kv_buffer(layer, torch.from_numpy(pre).to(dev), torch.randn(kv_shape, device=dev, dtype=dtype),
                           torch.randn(kv_shape, device=dev, dtype=dtype), layer.k_scale, layer.v_scale)
        t = MAX_BS * new
        self.q = torch.randn(t, H_Q * HEAD_DIM, device=dev, dtype=dtype)
        self.k = torch.randn(t, H_KV * HEAD_DIM, device=dev, dtype=dtype)
        self.v = torch.randn(t, H_KV * HEAD_DIM, device=dev, dtype=dtype)
        self.out_cache_loc = torch.from_numpy(np.concatenate([row[p:] for row, p in zip(rows, self.prefix)])).to(dev)
        seq = self.prefix + (new if mode in ("decode", "draft_extend_v2") else 0)  # SGLang's seq_lens
        self.seq_lens = torch.tensor(seq, dtype=torch.int32, device=dev)
        self.seq_lens_cpu = torch.tensor(seq, dtype=torch.int32)
        self.q_lens = np.full(MAX_BS, new)
        self.kv_lens = total
        self.masks = [_tree_mask(rng, N, topk) for _ in range(MAX_BS)] if mode.startswith("verify") else None
        if self.masks is not None:  # SGLang's layout: per request [N, P + N], the prefix columns True
            flat = [np.concatenate([np.ones((N, p), bool), m], 1).reshape(-1) for m, p in zip(self.masks, self.prefix)]
            self.custom_mask = torch.from_numpy(np.concatenate(flat)).to(dev)

    def reference(self, fixture):
        from cupy_fa import reference

        pool, r2t = fixture.runner.token_to_kv_pool, fixture.runner.req_to_token_pool.req_to_token
        k, v = pool.get_key_buffer(0), pool.get_value_buffer(0)
        fp8 = k.dtype == torch.float8_e4m3fn
        as_np = (lambda x: x.detach().view(torch.uint8).cpu().numpy()) if fp8 else (lambda x: x.detach().float().cpu().numpy())
        layer = fixture.actual_module.attn
        scales = dict(k_scale=float(layer.k_scale), v_scale=float(layer.v_scale)) if fp8 else {}
        table = r2t[:MAX_BS].cpu().numpy()
        return reference.paged_attention(
            self.q.float().cpu().numpy().reshape(-1, H_Q, HEAD_DIM), as_np(k)[:, None], as_np(v)[:, None],
            self.q_lens, self.kv_lens, table, sm_scale=HEAD_DIM ** -0.5,
            custom_mask=None if self.masks is None else [m for m in self.masks], **scales)


def _batch(kit, fixture, mode, step, static=None):
    """An SGLang-shaped forward batch of ``step`` (into ``static``'s tensors when given: the graph's)."""
    M = kit.M
    forward_mode = {"decode": M.DECODE, "verify_chain": M.TARGET_VERIFY, "verify_tree": M.TARGET_VERIFY,
                    "draft_extend_v2": M.DRAFT_EXTEND_V2}[mode]
    spec = None
    if step.masks is not None:
        spec = types.SimpleNamespace(custom_mask=step.custom_mask, draft_token_num=N, topk=step.topk)
    fb = types.SimpleNamespace(
        batch_size=MAX_BS, forward_mode=forward_mode, seq_lens=step.seq_lens, seq_lens_cpu=step.seq_lens_cpu,
        req_pool_indices=torch.arange(MAX_BS, dtype=torch.int64, device=step.q.device),
        out_cache_loc=step.out_cache_loc, extend_seq_lens=torch.full((MAX_BS,), N, dtype=torch.int32,
                                                                     device=step.q.device),
        extend_seq_lens_cpu=[N] * MAX_BS, spec_info=spec, input_ids=step.q[:, 0])
    if static is None:
        return fb
    for name in ("seq_lens", "out_cache_loc"):
        getattr(static, name).copy_(getattr(fb, name))
    static.seq_lens_cpu.copy_(fb.seq_lens_cpu)
    if spec is not None:
        static.spec_info.custom_mask.zero_()
        static.spec_info.custom_mask[:spec.custom_mask.numel()].copy_(spec.custom_mask)
    return static


def _fixture(kit, mode, dtype, kv_dtype):
    M, dense = kit.M, kit.dense
    forward_mode = M.DECODE if mode == "decode" else (M.DRAFT_EXTEND_V2 if mode == "draft_extend_v2"
                                                      else M.TARGET_VERIFY)
    extend = () if mode == "decode" else (N,) * MAX_BS
    case = dense.DenseAttentionCase(name=f"graph_{mode}", backend="cupy_fa", forward_mode=forward_mode,
                                    num_heads=H_Q, num_kv_heads=H_KV, page_size=1, prefix_lens=(8,) * MAX_BS,
                                    extend_lens=extend)

    class TC:
        def skipTest(self, why):
            raise AssertionError(why)

    fixture = dense.build_dense_attention_fixture(TC(), case, head_dim=HEAD_DIM, hidden_size=2 * HEAD_DIM,
                                                  max_context_len=CONTEXT, dtype=dtype, device="cuda",
                                                  disable_cuda_graph=False, runner_batch_size=MAX_BS)
    if kv_dtype is not None:  # the same pool, holding fp8 (e4m3) with the layer's scales
        from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

        old = fixture.runner.token_to_kv_pool
        pool = MHATokenToKVPool(size=old.size, page_size=1, dtype=kv_dtype, head_num=H_KV, head_dim=HEAD_DIM,
                                layer_num=1, device="cuda", enable_memory_saver=False, enable_alt_stream=False)
        fixture.runner.token_to_kv_pool = fixture.backend.token_to_kv_pool = pool
        layer = fixture.actual_module.attn
        layer.k_scale = torch.tensor(0.75, device="cuda")
        layer.v_scale = torch.tensor(1.5, device="cuda")
    return fixture


CASES = [("decode", "float16", None), ("decode", "bfloat16", None), ("decode", "bfloat16", "fp8"),
         ("verify_chain", "float16", None), ("verify_tree", "bfloat16", None), ("verify_tree", "float16", "fp8"),
         ("draft_extend_v2", "bfloat16", None), ("draft_extend_v2", "float16", None)]


def _kv(x):
    return x.view(-1, H_KV, HEAD_DIM)


@pytest.mark.parametrize("mode,dtype_name,kv", CASES, ids=[f"{m}-{d}-{k or 'kv16'}" for m, d, k in CASES])
def test_captured_forward_replays_new_lengths_and_pages(kit, mode, dtype_name, kv):
    with torch.no_grad():  # the kit's fixture writes its prefix through nn.Linear projections
        _captured_forward_replays(kit, mode, getattr(torch, dtype_name), dtype_name, kv)


def _captured_forward_replays(kit, mode, dtype, dtype_name, kv):
    seed = int(np.random.SeedSequence().entropy % 2**31)
    print(f"seed {seed}")
    rng = np.random.default_rng(seed)
    torch.manual_seed(seed)
    fixture = _fixture(kit, mode, dtype, torch.float8_e4m3fn if kv else None)
    backend, layer = fixture.backend, fixture.actual_module.attn
    topk = 2 if mode == "verify_tree" else 1
    first = Step(fixture, mode, rng, dtype, topk)
    static = _batch(kit, fixture, mode, first)
    static.seq_lens, static.out_cache_loc = static.seq_lens.clone(), static.out_cache_loc.clone()
    static.seq_lens_cpu = static.seq_lens_cpu.clone()
    if static.spec_info is not None:
        static.spec_info.custom_mask = torch.zeros(MAX_BS * N * (CONTEXT + N), dtype=torch.bool, device="cuda")
        _batch(kit, fixture, mode, first, static)
    q, k, v = first.q.clone(), first.k.clone(), first.v.clone()
    backend.init_cuda_graph_state(MAX_BS, MAX_BS * N)
    backend.init_forward_metadata_out_graph(static, in_capture=True)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up: instances made, kernels compiled, outside the capture
        backend.init_forward_metadata_in_graph(static)
        backend.forward(q, _kv(k), _kv(v), layer, static)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        backend.init_forward_metadata_in_graph(static)
        out = backend.forward(q, _kv(k), _kv(v), layer, static)
    for _ in range(3):  # new lengths, new slots, new values; the graph is replayed, never recaptured
        step = Step(fixture, mode, rng, dtype, topk)
        for dst, src in ((q, step.q), (k, step.k), (v, step.v)):
            dst.copy_(src)
        backend.init_forward_metadata_out_graph(_batch(kit, fixture, mode, step, static))
        out.fill_(float("nan"))  # poison: every element must be written
        graph.replay()
        torch.cuda.synchronize()
        replayed = out.clone()
        assert not torch.isnan(replayed).any(), "the replay left rows unwritten"
        ref = step.reference(fixture)
        rel = float(np.linalg.norm(replayed.double().cpu().numpy().reshape(ref.shape) - ref) / np.linalg.norm(ref))
        assert rel < BARS[dtype_name], f"replay vs float64: |out-ref|/|ref| = {rel:.2e}"
        backend.init_forward_metadata(_batch(kit, fixture, mode, step))  # the same step, eagerly
        eager = backend.forward(step.q, _kv(step.k), _kv(step.v), layer, _batch(kit, fixture, mode, step))
        torch.cuda.synchronize()
        assert torch.equal(eager, replayed), (f"eager and replay differ: max |diff| "
                                              f"{float((eager.float() - replayed.float()).abs().max()):.3e}")
        print(f"{mode} {dtype_name} {kv or 'kv16'}: replay vs float64 {rel:.2e}, eager == replay bit for bit")
