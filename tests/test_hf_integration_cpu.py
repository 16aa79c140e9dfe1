"""The transformers integration's argument mapping, on the CPU torch wheel (marker cpu_torch).

No kernel runs here. The mapping (transformers' arguments -> q_lens / kv_lens / page table /
zero-copy page views) is checked against hand-built arguments, and then end to end: a
pure-torch stand-in for the kernels, which reads exactly what cupy_fa's kernels read (the
page views, the lengths and the page table of each Step, rows packed by q_len), replaces
the backend, and transformers' generate_batch with "paged|cupy_fa" and generate with
"cupy_fa" must give the tokens of its own "paged|sdpa" and "sdpa". The GPU test's two
instruments (tests/hf_compare.py) run here on the stand-in too: the attention audit passes on
the mapping and fails on a deliberately wrong one (a kv_len one short, a dropped page), and the
token judge, in bfloat16 where runs part at near ties, passes on the mapping and fails on a
wrong one.
"""

import psutil  # noqa: F401  (transformers sizes its CPU paged cache from it)
import pytest
import torch
import transformers

import cupy_fa.integrations.transformers as hf
import hf_compare as C

pytestmark = pytest.mark.cpu_torch


class KernelStandIn:
    """What the kernels compute, in torch, from what they are given."""

    def __init__(self):
        self.steps, self.caches, self.writes, self.variants = [], [], 0, []

    def check(self, key, q, k_pages, variant=hf.PLAIN):
        self.variants.append(variant)

    def append(self, key, k_pages, v_pages, k_new, v_new, slots):
        self.caches.append(key)
        h, d = k_pages.shape[2:]
        k_pages.view(-1, h, d).index_copy_(0, slots, k_new)  # writes through the view: the cache itself
        v_pages.view(-1, h, d).index_copy_(0, slots, v_new)
        self.writes += 1

    def attention(self, key, step, q, k_pages, v_pages, scale, causal, pages_key=None, zero_fill=False,
                  variant=hf.PLAIN, return_lse=False):
        self.steps.append(step)
        out = torch.zeros_like(q) if zero_fill else torch.full_like(q, float("nan"))  # unwritten rows stay NaN
        if not variant.is_plain or return_lse:  # a window, soft-cap, sinks or the LSE: cupy_fa's float64 reference
            return self._variant_attention(out, step, q, k_pages, v_pages, scale, causal, variant, return_lse)
        page_size, h_kv, d = k_pages.shape[1:]
        group = q.shape[1] // h_kv
        start = 0
        for b, (q_len, kv_len) in enumerate(zip(step.q_lens.tolist(), step.kv_lens.tolist())):
            assert q_len == 0 or 1 <= q_len <= kv_len, (b, q_len, kv_len)
            if q_len == 0:
                continue
            pages = step.page_table[b, :-(-kv_len // page_size)].long()
            assert int(pages.min()) >= 0 and int(pages.max()) < k_pages.shape[0]
            k = k_pages[pages].reshape(-1, h_kv, d)[:kv_len].double().repeat_interleave(group, dim=1)
            v = v_pages[pages].reshape(-1, h_kv, d)[:kv_len].double().repeat_interleave(group, dim=1)
            s = torch.einsum("qhd,khd->hqk", q[start:start + q_len].double(), k) * scale
            if causal:
                i, j = torch.arange(q_len)[:, None], torch.arange(kv_len)[None, :]
                s = s.masked_fill(j > kv_len - q_len + i, float("-inf"))
            out[start:start + q_len] = torch.einsum("hqk,khd->qhd", s.softmax(-1), v).to(q.dtype)
            start += q_len
        assert start <= q.shape[0]
        return out

    @staticmethod
    def _variant_attention(out, step, q, k_pages, v_pages, scale, causal, variant, return_lse):
        from cupy_fa import reference

        q_lens, kv_lens = step.q_lens.numpy(), step.kv_lens.numpy()
        total = int(q_lens.sum())
        sinks = None if variant.sinks is None else variant.sinks.double().numpy()
        ref = reference.paged_attention(q[:total].double().numpy(), k_pages.double().numpy(), v_pages.double().numpy(),
                                        q_lens, kv_lens, step.page_table.numpy(), causal=causal, sm_scale=scale,
                                        window=variant.window or None, soft_cap=variant.soft_cap or None, sinks=sinks,
                                        return_lse=True)
        out[:total] = torch.from_numpy(ref[0]).to(q.dtype)
        if not return_lse:
            return out
        lse = torch.full(q.shape[:2], float("nan"), dtype=torch.float32)  # unwritten rows stay NaN
        lse[:total] = torch.from_numpy(ref[1]).float()
        return out, lse


@pytest.fixture
def stand_in(monkeypatch):
    hf.register()
    kernels = KernelStandIn()
    monkeypatch.setattr(hf, "backend", kernels)
    return kernels


def tiny_model(kind, seed):
    torch.manual_seed(seed)
    common = dict(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=3,
                  num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=512)
    if kind == "llama":
        config = transformers.LlamaConfig(head_dim=16, **common)
    else:  # Qwen2: biases on q/k/v, head dim from hidden / heads
        config = transformers.Qwen2Config(**common)
    return transformers.AutoModelForCausalLM.from_config(config).eval()


def random_prompts(seed, lengths):
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in lengths]
    return prompts + [prompts[3][:27] + [7, 8, 9]]  # shares three 8-token blocks with prompt 3


# ---- hand-built arguments --------------------------------------------------------------


def _slots(blocks, length, block_size):
    return [blocks[t // block_size] * block_size + t % block_size for t in range(length)]


def test_paged_step_maps_lengths_and_pages():
    """Chunked prefill, decode and a padding request (cumulative lengths plateau), blocks
    shuffled, read_index padded with the trash slot: lengths are the differences of the
    cumulative ones, row b's pages the blocks of its read slots, and only those are named."""
    bs = 4
    requests = [  # (past, new, blocks)
        (5, 3, [7, 2]),
        (0, 1, [5]),
        (9, 1, [0, 3, 6]),
    ]
    cu_q, cu_k, read, write = [0], [0], [], []
    for past, new, blocks in requests:
        cu_q.append(cu_q[-1] + new)
        cu_k.append(cu_k[-1] + past + new)
        slots = _slots(blocks, past + new, bs)
        read += slots
        write += slots[past:]
    cu_q.append(cu_q[-1])  # a padding request
    cu_k.append(cu_k[-1])
    trash = 10 * bs
    read += [trash] * 6
    step = hf.paged_step(bs, torch.tensor(cu_q, dtype=torch.int32), torch.tensor(cu_k, dtype=torch.int32),
                         torch.tensor(read), torch.tensor(write), max_seqlen_q=3, max_seqlen_k=10)
    assert step.q_lens.tolist() == [3, 1, 1, 0]
    assert step.kv_lens.tolist() == [8, 1, 10, 0]
    assert step.page_table.dtype == torch.int32 and step.page_table.shape == (4, 3)
    assert step.page_table.tolist() == [[7, 2, 0], [5, 0, 0], [0, 3, 6], [0, 0, 0]]
    assert (step.max_q_len, step.max_kv_len) == (3, 10)


def test_paged_step_of_fresh_prefills_reads_the_write_slots():
    """A batch with no cache to read has an empty read_index: the pages come from write_index."""
    bs = 8
    blocks = [[4], [1, 9]]
    lens = [6, 13]
    write = _slots(blocks[0], 6, bs) + _slots(blocks[1], 13, bs)
    cu = torch.tensor([0, 6, 19], dtype=torch.int32)
    step = hf.paged_step(bs, cu, cu, torch.zeros(0, dtype=torch.int64), torch.tensor(write), 13, 13)
    assert step.q_lens.tolist() == lens and step.kv_lens.tolist() == lens
    assert step.page_table.tolist() == [[4, 0], [1, 9]]


def test_paged_cache_views_are_the_cache_tensors():
    class Cache:
        block_size, num_key_value_heads, head_dim = 4, 2, 16
        layer_index_to_group_indices = {0: (0, 0), 1: (0, 1)}
        sliding_windows = {0: 1, 1: 1}
        key_cache = [torch.randn(6 * 4, 2, 16) for _ in range(2)]
        value_cache = [torch.randn(6 * 4, 2, 16) for _ in range(2)]

    k, v, group = hf.paged_cache_views(Cache, 1)
    assert group == 0 and k.shape == (6, 4, 2, 16) and v.shape == (6, 4, 2, 16)
    assert k.data_ptr() == Cache.key_cache[1].data_ptr() and v.data_ptr() == Cache.value_cache[1].data_ptr()
    assert k.is_contiguous() and torch.equal(k[3, 2], Cache.key_cache[1][3 * 4 + 2])
    Cache.sliding_windows = {0: 1, 1: 64}
    with pytest.raises(NotImplementedError, match="sliding-window"):
        hf.paged_cache_views(Cache, 1)


@pytest.mark.parametrize("layout", ["heads-major", "tokens-major"])
def test_dense_step_pages_name_the_valid_keys(layout):
    """Request b * H_kv + h lists batch row b's valid keys of head h in order, as page ids of
    the zero-copy one-vector-per-page view; live query rows come first."""
    b, h_kv, h_q, length, t, d = 3, 2, 6, 9, 3, 8
    if layout == "heads-major":  # what DynamicCache's concatenation makes
        key = torch.randn(b, h_kv, length, d)
    else:  # a fresh projection viewed [B, H, L, D]
        key = torch.randn(b, length, h_kv, d).transpose(1, 2)
    query = torch.randn(b, h_q, t, d)
    mask = torch.ones(b, length, dtype=torch.bool)
    mask[0, :4] = False  # left padding
    mask[2, 2] = False  # a hole
    mask[2, length - 2] = False  # a padded query position
    step = hf.dense_step(query, key, mask)
    pages = hf.dense_pages(key)
    assert pages.data_ptr() == key.data_ptr() and pages.shape[1:] == (1, 1, d)
    assert step.kv_lens.tolist() == [5, 5, 9, 9, 7, 7]
    assert step.q_lens.tolist() == [3, 3, 3, 3, 2, 2]
    for r in range(b * h_kv):
        row, head = divmod(r, h_kv)
        valid = torch.nonzero(mask[row]).flatten()
        for j, pos in enumerate(valid.tolist()):
            assert torch.equal(pages[step.page_table[r, j], 0, 0], key[row, head, pos])
    live = mask[:, length - t:][:, None, :].expand(b, h_kv, t).reshape(-1)
    assert live[step.rows].tolist() == sorted(live.tolist(), reverse=True)  # live rows first
    assert sorted(step.rows.tolist()) == list(range(b * h_kv * t))
    no_mask = hf.dense_step(query, key, None)
    assert no_mask.rows is None and no_mask.q_lens.tolist() == [t] * 6 and no_mask.kv_lens.tolist() == [length] * 6


def test_padding_mask_is_none_without_padding():
    full = torch.ones(2, 7, dtype=torch.bool)
    assert hf.padding_mask(2, 1, 7, attention_mask=full) is None
    assert hf.padding_mask(2, 1, 7, attention_mask=None) is None
    full[1, 0] = False
    assert torch.equal(hf.padding_mask(2, 1, 7, attention_mask=full), full)


def test_register_adds_both_names():
    names = hf.register()
    assert names == ("paged|cupy_fa", "cupy_fa")
    assert transformers.AttentionInterface._global_mapping["paged|cupy_fa"] is hf.paged_attention_forward
    assert transformers.AttentionInterface._global_mapping["cupy_fa"] is hf.attention_forward
    assert transformers.AttentionMaskInterface._global_mapping["cupy_fa"] is hf.padding_mask


# ---- refusals before anything is written ------------------------------------------------


class _Module:
    layer_idx, scaling, is_causal = 0, 0.25, True


def test_refusals_name_what_is_missing():
    q = torch.randn(1, 4, 3, 16)
    kv = torch.randn(1, 2, 3, 16)
    with pytest.raises(ValueError, match="without a paged attention cache"):
        hf.paged_attention_forward(_Module(), q, kv, kv, None)
    windowed = _Module()
    windowed.sliding_window = 128
    with pytest.raises(NotImplementedError, match="sliding-window layers .*'cupy_fa' \\(generate\\)"):
        hf.layer_variant(windowed, q, {}, hf.PAGED_ATTENTION, paged=True)  # a ring of window slots the writes overwrite
    with pytest.raises(ValueError, match="sinks .* one logit per query head, shape \\(4,\\)"):
        hf.layer_variant(_Module(), q, {"s_aux": torch.zeros(3)}, hf.ATTENTION, paged=False)
    with pytest.raises(ValueError, match="logits_soft_cap must be a positive"):
        hf.layer_variant(_Module(), q, {"softcap": -1.0}, hf.ATTENTION, paged=False)
    with pytest.raises(NotImplementedError, match="dropout"):
        hf.attention_forward(_Module(), q, kv, kv, None, dropout=0.1)
    with pytest.raises(NotImplementedError, match="value head dim"):
        hf.attention_forward(_Module(), q, kv, torch.randn(1, 2, 3, 8), None)
    with pytest.raises(ValueError, match="CUDA"):
        hf.CupyFABackend().check(None, torch.randn(3, 4, 64, dtype=torch.bfloat16), None)


# ---- end to end through transformers, the stand-in in place of the kernels ----------------


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_generate_batch_gives_paged_sdpa_tokens(stand_in, kind):
    model = tiny_model(kind, seed=1)
    prompts = random_prompts(2, (5, 23, 1, 40, 17, 8))
    gen = transformers.GenerationConfig(max_new_tokens=16, do_sample=False, eos_token_id=None, pad_token_id=0)
    tokens = {}
    for impl in ("paged|sdpa", "paged|cupy_fa"):
        model.set_attn_implementation(impl)
        cb = transformers.ContinuousBatchingConfig(block_size=8, num_blocks=64, max_batch_tokens=32)
        out = model.generate_batch(prompts, generation_config=gen, continuous_batching_config=cb)
        assert [o.error for o in out.values()] == [None] * len(prompts)
        tokens[impl] = [o.generated_tokens for o in out.values()]
    assert all(len(t) == 16 for t in tokens["paged|cupy_fa"])
    assert tokens["paged|cupy_fa"] == tokens["paged|sdpa"]
    # what ran: chunked prefill (32-token budget, a 40-token prompt), mixed and decode steps
    steps = stand_in.steps
    assert any(bool(((s.q_lens > 1) & (s.kv_lens > s.q_lens)).any()) for s in steps)
    assert any(bool((s.q_lens == 1).all()) for s in steps)
    assert stand_in.writes == len(steps)
    # the pages it read were transformers' cache tensors, not copies
    cache, layer = stand_in.caches[0]
    k_pages, v_pages, _ = hf.paged_cache_views(cache, layer)
    assert k_pages.data_ptr() == cache.key_cache[cache.layer_index_to_group_indices[layer][1]].data_ptr()


def generate_left_padded(model, prompts, implementations, new_tokens):
    """Greedy generate of the prompts, left-padded into one batch, once per implementation:
    {implementation: the sequences}."""
    longest = max(map(len, prompts))
    ids = torch.tensor([[0] * (longest - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p in prompts])
    gen = transformers.GenerationConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
    outputs = {}
    for impl in implementations:
        model.set_attn_implementation(impl)
        outputs[impl] = model.generate(ids, attention_mask=mask, generation_config=gen)
    return outputs


@pytest.mark.parametrize("padded", [True, False])
def test_generate_gives_sdpa_tokens(stand_in, padded):
    model = tiny_model("llama", seed=3)
    prompts = random_prompts(4, (5, 23, 1, 40, 17, 8)) if padded else random_prompts(4, (12,) * 6)[:6]
    outputs = generate_left_padded(model, prompts, ("sdpa", "cupy_fa"), 16)
    assert torch.equal(outputs["cupy_fa"], outputs["sdpa"])
    assert len(stand_in.steps) == 16 * 3  # every layer of every forward ran the stand-in
    assert len({id(s) for s in stand_in.steps}) == 16  # one Step per forward, shared by its 3 layers
    assert all((s.rows is not None) == padded for s in stand_in.steps)


@pytest.mark.parametrize("kind", ["gemma2", "gpt_oss"])
def test_generate_with_attention_variants_gives_eager_tokens(stand_in, kind):
    """Windows, soft-caps and sinks go to the kernels as cupy_fa's plan / run take them: with the
    float64 reference of those variants in the kernels' place, generate over "cupy_fa" gives the
    tokens of transformers' own "eager" (prompts longer than the window of 8, left-padded)."""
    model = C.tiny_variant_model(kind, seed=11)
    prompts = random_prompts(12, (5, 23, 1, 40, 17, 8))
    outputs = generate_left_padded(model, prompts, ("eager", "cupy_fa"), 12)
    assert torch.equal(outputs["cupy_fa"], outputs["eager"])
    layers = model.config.num_hidden_layers
    assert len(stand_in.variants) == 12 * layers  # every layer of every forward
    # a Step per forward for each kind of layer (sliding, full), shared by the layers of that kind
    assert len({id(s) for s in stand_in.steps}) == 12 * 2
    windows = {v.window for v in stand_in.variants}
    assert windows == {0, 8}  # sliding layers with their window, full layers without
    if kind == "gemma2":
        assert {v.soft_cap for v in stand_in.variants} == {2.0} and all(v.sinks is None for v in stand_in.variants)
    else:  # check() sees each layer's sinks; the dense path applies them by the LSE (with_sinks)
        sinks = [v.sinks for v in stand_in.variants[:layers]]
        assert all(s.dtype == torch.float32 and s.shape == (8,) for s in sinks)
        assert all(torch.equal(s, layer.self_attn.sinks.float()) for s, layer in zip(sinks, model.model.layers))


@pytest.mark.parametrize("kind", ["gemma2", "gpt_oss"])
def test_generate_batch_with_soft_cap_or_sinks_gives_their_tokens(stand_in, kind):
    """Continuous batching ("paged|cupy_fa") of a model whose layers are all full attention, with
    Gemma 2's soft-cap or gpt-oss's sinks (its sliding-window layers are refused there): with the
    float64 reference of the variant in the kernels' place, the tokens of transformers' own
    "paged|eager" (gpt-oss; it has the sinks) or, for the soft-cap it lacks, of "eager" forwards
    of the whole sequence, one token at a time (transformers 5.17's generate of this Gemma 2 gives
    other first-token logits than its forward of the same prompt, eager or not; the forward is the
    definition)."""
    model = C.tiny_variant_model(kind, seed=13, sliding=False)
    prompts = random_prompts(14, (5, 23, 1, 40, 17, 8))
    gen = transformers.GenerationConfig(max_new_tokens=10, do_sample=False, eos_token_id=None, pad_token_id=0)
    cb = transformers.ContinuousBatchingConfig(block_size=8, num_blocks=64, max_batch_tokens=32)
    model.set_attn_implementation("paged|cupy_fa")
    out = model.generate_batch(prompts, generation_config=gen, continuous_batching_config=cb)
    assert [o.error for o in out.values()] == [None] * len(prompts)
    ours = [o.generated_tokens for o in out.values()]
    if kind == "gpt_oss":
        model.set_attn_implementation("paged|eager")
        theirs = model.generate_batch(prompts, generation_config=gen, continuous_batching_config=cb)
        theirs = [o.generated_tokens for o in theirs.values()]
    else:  # one request at a time, no cache, no padding
        model.set_attn_implementation("eager")
        theirs = [greedy_forwards(model, p, 10) for p in prompts]
    assert ours == theirs
    if kind == "gemma2":
        assert {v.soft_cap for v in stand_in.variants} == {2.0} and all(v.sinks is None for v in stand_in.variants)
    else:
        assert all(v.sinks is not None and v.window == 0 for v in stand_in.variants)


def greedy_forwards(model, prompt, new_tokens):
    """Greedy tokens by a forward of the whole sequence for each (no cache)."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(new_tokens):
            ids.append(int(model(torch.tensor([ids]), use_cache=False).logits[0, -1].argmax()))
    return ids[len(prompt):]


def test_a_layer_variant_has_its_own_plan():
    """One BatchAttention per (window, soft-cap) of a step's layers: the sliding and full layers of
    one forward do not share a plan (the window is planned), layers of one kind do."""
    backend = hf.CupyFABackend()
    made = []

    class Recorder:
        def __init__(self, *args, **kwargs):
            made.append(args)

    import cupy_fa
    original = cupy_fa.BatchAttention
    cupy_fa.BatchAttention = Recorder
    try:
        q, pages = torch.empty(3, 4, 16), torch.empty(5, 1, 1, 16)
        owner = _Module()
        sliding, full = hf.Variant(window=8, soft_cap=20.0), hf.Variant(soft_cap=20.0)
        a = backend._instance((owner, "dense"), q, pages, sliding)
        b = backend._instance((owner, "dense"), q, pages, full)
        c = backend._instance((owner, "dense"), q, pages, hf.Variant(window=8, soft_cap=20.0, sinks=torch.zeros(4)))
    finally:
        cupy_fa.BatchAttention = original
    assert a is not b and a is c and len(made) == 2  # sinks are per run: the sliding layers' plan serves them


# ---- the GPU test's instruments, on the stand-in -----------------------------------------------


def _generate_batch(model, prompts, implementation, new_tokens, monkeypatch, audit=None, block_size=8,
                    max_batch_tokens=32):
    probe = C.BatchProbe(model.config.num_hidden_layers, audit).install(
        monkeypatch, implementation, hf.paged_attention_forward if audit is not None else None)
    model.set_attn_implementation(implementation)
    gen = transformers.GenerationConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
    cb = transformers.ContinuousBatchingConfig(block_size=block_size, num_blocks=256, max_batch_tokens=max_batch_tokens)
    out = model.generate_batch(prompts, generation_config=gen, continuous_batching_config=cb, progress_bar=False)
    assert [o.error for o in out.values()] == [None] * len(prompts)
    tokens = [o.generated_tokens for o in out.values()]
    assert not probe.failures, probe.failures[:5]
    lookup = probe.lookup(list(out.keys()), prompts)
    assert C.logits_match_tokens(tokens, lookup, implementation) == []  # the probe's bookkeeping holds
    return tokens, lookup, probe


@pytest.mark.parametrize("mutation", [None, *C.MUTATIONS])
def test_attention_audit_passes_the_mapping_and_fails_a_wrong_one(stand_in, monkeypatch, mutation):
    """Continuous batching (chunked prefill, mixed and decode steps, blocks of 8): every call
    checked against the float64 reference over transformers' read_index, and the step's K/V at
    its write_index. The mapping passes with rounding-only error; a wrong one fails."""
    model = tiny_model("qwen2", seed=5)
    if mutation is not None:
        C.mutate(monkeypatch, hf, mutation)
    audit = C.AttentionAudit(f"stand-in, {mutation}")
    _generate_batch(model, random_prompts(6, (5, 23, 1, 40, 17, 8)), "paged|cupy_fa", 6, monkeypatch, audit)
    print(audit.report(4))
    assert audit.calls == len(stand_in.steps) and audit.calls > 0
    for kind in ("prefill", "chunked prefill", "mixed", "decode"):
        assert audit.kinds[kind] > 0, (kind, audit.kinds)
    if mutation is None:
        assert audit.ok, audit.report()
        assert audit.worst["request_rel"][0] < 1e-6  # float64 rounded to float32: rounding only
    else:
        assert not audit.ok and audit.worst["request_rel"][0] > 1e-2, audit.report()


def test_attention_audit_sees_a_wrong_write(stand_in, monkeypatch):
    """K/V written one slot late: the write check names it (and the reads go wrong)."""
    real = stand_in.append

    def late(key, k_pages, v_pages, k_new, v_new, slots):
        return real(key, k_pages, v_pages, k_new, v_new, slots + 1)

    monkeypatch.setattr(stand_in, "append", late)
    audit = C.AttentionAudit("stand-in, late writes")
    _generate_batch(tiny_model("llama", seed=6), random_prompts(7, (5, 23, 9, 30)), "paged|cupy_fa", 3, monkeypatch,
                    audit)
    assert any("not at transformers' write_index" in f for f in audit.failures), audit.report()


@pytest.mark.parametrize("mutation", [None, "kv_len - 1"])
def test_dense_audit_passes_the_mapping_and_fails_a_wrong_one(stand_in, monkeypatch, mutation):
    """generate of a left-padded batch: every call checked over the keys past each row's padding."""
    model = tiny_model("llama", seed=3)
    prompts = random_prompts(4, (5, 23, 1, 40, 17, 8))
    longest = max(map(len, prompts))
    pad = [longest - len(p) for p in prompts]
    if mutation is not None:
        C.mutate(monkeypatch, hf, mutation)
    audit = C.AttentionAudit(f"stand-in, {mutation}")
    monkeypatch.setitem(transformers.AttentionInterface._global_mapping, hf.ATTENTION,
                        C.audited_dense(audit, hf.attention_forward, pad))
    ids = torch.tensor([[0] * n + p for n, p in zip(pad, prompts)])
    mask = torch.tensor([[0] * n + [1] * len(p) for n, p in zip(pad, prompts)])
    model.set_attn_implementation("cupy_fa")
    model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=0)
    print(audit.report(4))
    assert audit.calls == 6 * model.config.num_hidden_layers
    assert audit.ok == (mutation is None), audit.report()


@pytest.fixture(scope="module")
def bf16_case():
    """A tiny model of the GPU test's kind (2 layers, D 64, 16/4 heads) in bfloat16, its float32
    twin, and transformers' own paged|sdpa on 5 prompts (chunked in 64-token batches)."""
    hf.register()
    config = C.tiny_config("llama", 64, 16, 4)
    model = C.build_model(config, "cpu", torch.bfloat16, seed=11)
    prompts = C.random_prompts(12, (1, 33, 90, 129), config.vocab_size)
    with pytest.MonkeyPatch.context() as mp:
        theirs = _generate_batch(model, prompts, "paged|sdpa", 24, mp, block_size=32, max_batch_tokens=64)
    return model, C.Float32Twin(model), prompts, theirs


@pytest.mark.parametrize("mutation", [None, "kv_len - 1"])
def test_token_judge_passes_bf16_ties_and_fails_a_wrong_mapping(bf16_case, stand_in, monkeypatch, mutation):
    """bf16 runs of a correct mapping (the stand-in rounded to bf16) part from transformers' own at
    near ties, and the judge says ok; with a kv_len one short it says FAIL."""
    model, twin, prompts, (theirs, theirs_logits, _) = bf16_case
    if mutation is not None:
        C.mutate(monkeypatch, hf, mutation)
    ours, ours_logits, _ = _generate_batch(model, prompts, "paged|cupy_fa", 24, monkeypatch, block_size=32,
                                           max_batch_tokens=64)
    judgement = C.judge(prompts, ours, theirs, ours_logits, theirs_logits, twin)
    print(judgement.report(equal_lines=True))
    assert judgement.ok == (mutation is None), judgement.report()
    if mutation is None:
        ours_median, theirs_median = judgement.medians
        assert 5e-3 < ours_median < C.LOGITS_TOL and 5e-3 < theirs_median  # bf16 noise: real, and under the bar
