"""The SGLang backend's mapping on the CPU (marker sglang; `make test` runs it with sglang 0.5.17
installed --no-deps beside the CPU torch): SGLang's own attention kit drives ``"cupy_fa"`` with the
float64 reference in the kernels' place (tests/sglang_harness/reference_kernels.py), so every kit case
that needs no CUDA checks the metadata mapping end to end; deliberately wrong mappings must fail those
cases; the mapping's pieces, the registration, the EAGLE draft-backend hook and the refusals are
checked on their own.
"""

import pathlib
import types

import numpy as np
import pytest

pytestmark = pytest.mark.sglang

torch = pytest.importorskip("torch")
sglang_harness = pytest.importorskip("sglang_harness")

ROOT = pathlib.Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def kit():
    sglang_harness.prepare()
    from sglang.srt.model_executor.forward_batch_info import ForwardMode
    from sglang.test.kits.attention_unittest.attention_methods import dense_attention as dense

    from sglang_harness import kit_cases

    return types.SimpleNamespace(M=ForwardMode, dense=dense, cases=kit_cases)


@pytest.fixture
def reference_kernels(monkeypatch, kit):
    import cupy_fa.integrations.sglang.kernels as kernels
    from sglang_harness.reference_kernels import RefKernels

    monkeypatch.setattr(kernels, "Kernels", RefKernels)
    RefKernels.made.clear()
    return RefKernels


def _configs():
    sglang_harness.prepare()
    from sglang_harness import kit_cases

    return [kit_cases.Config(64, "float16", None, "cpu"), kit_cases.Config(64, "bfloat16", 64, "cpu"),
            kit_cases.Config(128, "bfloat16", None, "cpu")]


def _items():
    from sglang_harness import kit_cases

    dense = [it for c in _configs() for it in kit_cases.items("cupy_fa", c, graphs=False)]
    mla = [it for c in _configs()[:2] for it in kit_cases.mla_items("cupy_fa", c, graphs=False)]
    return dense + mla


ITEMS = _items()


@pytest.mark.parametrize("item", ITEMS, ids=[it.id for it in ITEMS])
def test_kit_case_on_the_reference(item, kit, reference_kernels):
    from sglang_harness.reference_kernels import RefMLAAttention

    item.run(kit.cases.KitTestCase())
    assert reference_kernels.made and all(a.plans for a in reference_kernels.made), "the backend never planned"
    assert all(isinstance(a, RefMLAAttention) == (item.method == "mla") for a in reference_kernels.made)


# ---- a wrong mapping fails the kit ------------------------------------------------------------

def _by_name(name, config=None, method="dense"):
    from sglang_harness import kit_cases

    config = config or kit_cases.Config(64, "float16", None, "cpu")
    found = kit_cases.items if method == "dense" else kit_cases.mla_items
    return next(it for it in found("cupy_fa", config, graphs=False) if it.case == name)


def _mutated_lengths(change):
    import cupy_fa.integrations.sglang.metadata as metadata

    original = metadata.step_lengths

    def wrong(mode, *args, **kwargs):
        lengths = original(mode, *args, **kwargs)
        return change(mode, lengths) or lengths

    return wrong


MUTATIONS = {
    # FA3 / FA4's DRAFT_EXTEND_V2 bug: keys of the prefix only (the step's drafts unseen)
    "dev2_prefix_only": ("runner_cuda_graph_eagle_draft_extend_v2_fixed_tokens[small_real,bs=4]",
                         lambda m, L: setattr(L, "kv_lens", L.kv_lens - L.q_lens) if m.name == "DRAFT_EXTEND_V2"
                         else None),
    # TARGET_VERIFY's seq_lens taken as the whole extent
    "verify_prefix_only": ("runner_eagle_verify_chain[eagle]",
                           lambda m, L: setattr(L, "kv_lens", L.kv_lens - L.q_lens) if m.name == "TARGET_VERIFY"
                           else None),
    # decode seeing one key too few (the new token)
    "decode_one_short": ("mha_decode_page_boundary",
                         lambda m, L: setattr(L, "kv_lens", L.kv_lens - 1) if m.name == "DECODE" else None),
}


@pytest.mark.parametrize("name", sorted(MUTATIONS))
def test_a_wrong_length_mapping_fails_the_kit(name, kit, reference_kernels, monkeypatch):
    import cupy_fa.integrations.sglang.backend as backend

    case_name, change = MUTATIONS[name]
    item = _by_name(case_name)
    item.run(kit.cases.KitTestCase())  # right mapping: passes
    monkeypatch.setattr(backend, "step_lengths", _mutated_lengths(change))
    with pytest.raises(AssertionError):
        item.run(kit.cases.KitTestCase())


def test_a_wrong_page_table_or_tree_mask_fails_the_kit(kit, reference_kernels, monkeypatch):
    import cupy_fa.integrations.sglang.backend as backend

    original = backend.gather_page_table
    shifted = lambda *args, **kw: torch.roll(original(*args, **kw), 1, dims=1)  # noqa: E731 (slots one column off)
    monkeypatch.setattr(backend, "gather_page_table", shifted)
    with pytest.raises(AssertionError):
        _by_name("layout_extend_two_request_ragged[interleaved_pages]").run(kit.cases.KitTestCase())
    monkeypatch.undo()
    import cupy_fa.integrations.sglang.kernels as kernels
    from sglang_harness.reference_kernels import RefKernels

    monkeypatch.setattr(kernels, "Kernels", RefKernels)
    tree = _by_name("runner_eagle_verify_tree[eagle]")
    tree.run(kit.cases.KitTestCase())
    monkeypatch.setattr(backend.CupyFaAttnBackend, "_tree_mask", lambda self, *a, **k: None)  # causal instead
    with pytest.raises(AssertionError):
        tree.run(kit.cases.KitTestCase())


def test_a_wrong_latent_mapping_fails_the_kits_mla_cases(kit, reference_kernels, monkeypatch):
    """The MLA path's own mapping: the latent read one slot off, and the page table one column off."""
    import cupy_fa.integrations.sglang.backend as backend

    extend = _by_name("mla_extend_ragged_page_boundary", method="mla")
    decode = _by_name("mla_decode_page_boundary", method="mla")
    for item in (extend, decode):
        item.run(kit.cases.KitTestCase())  # right mapping: passes
    original = reference_kernels.latent_cache

    def one_slot_off(self, layer_id, buffer, scale=None):
        cache = original(self, layer_id, buffer, scale)
        cache.latent = torch.roll(cache.latent, 1, dims=0)  # slot s read where s - 1 is
        return cache

    monkeypatch.setattr(reference_kernels, "latent_cache", one_slot_off)
    for item in (extend, decode):
        with pytest.raises(AssertionError):
            item.run(kit.cases.KitTestCase())
    monkeypatch.setattr(reference_kernels, "latent_cache", original)
    shifted = backend.gather_page_table
    monkeypatch.setattr(backend, "gather_page_table", lambda *a, **k: torch.roll(shifted(*a, **k), 1, dims=1))
    with pytest.raises(AssertionError):
        _by_name("mla_layout_extend_two_request_ragged[interleaved_pages]", method="mla").run(kit.cases.KitTestCase())


@pytest.mark.parametrize("name", ["mla_extend_ragged_page_boundary", "mla_decode_page_boundary"])
def test_an_fp8_mla_pool_reads_its_e4m3_rows(kit, reference_kernels, monkeypatch, name):
    """The kit's MLA case over an fp8 (e4m3) pool (``fp8_kv_cache``). The kit's reference keeps the latent
    unquantized, and e4m3's rounding of 576 latent columns moves the output past the kit's 3e-2 even on
    the float64 reference; with the reference's latent rounded through e4m3 as the pool stores it, the
    case holds at the kit's tolerance."""
    from sglang.test.kits.attention_unittest.attention_methods import mla_attention as mla

    from sglang_harness.kit_cases import MLA_LATENT

    case = next(c for c in mla.make_mla_cases("cupy_fa") if c.name == name)
    run = lambda: mla.run_mla_attention_case(kit.cases.KitTestCase(), case, fp8_kv_cache=True, device="cpu",  # noqa: E731
                                             **MLA_LATENT)
    with pytest.raises(AssertionError, match="not close"):
        run()  # against the unquantized latent
    project = mla.ReferenceDeepseekMLAAttention.project_latent_qk
    e4m3 = lambda x: x.to(torch.float8_e4m3fn).to(x.dtype)  # noqa: E731

    def rounded(self, hidden):
        q, k, q_rope, k_rope = project(self, hidden)
        return q, e4m3(k), q_rope, e4m3(k_rope)

    monkeypatch.setattr(mla.ReferenceDeepseekMLAAttention, "project_latent_qk", rounded)
    run()
    assert reference_kernels.made and all(a.plans for a in reference_kernels.made)


def _mla_fixture(kit, mode_name="EXTEND", **kw):
    from sglang.test.kits.attention_unittest.attention_methods import mla_attention as mla

    from sglang_harness.kit_cases import MLA_LATENT

    mode = getattr(kit.M, mode_name)
    extend = (3, 2) if mode_name == "EXTEND" else ()
    case = mla.MLAAttentionCase(name="mla_split", backend="cupy_fa", forward_mode=mode, num_heads=4, page_size=16,
                                prefix_lens=(5, 17), extend_lens=extend)
    latent = {**MLA_LATENT, **kw}
    return mla, mla.build_mla_attention_fixture(kit.cases.KitTestCase(), case, device="cpu", **latent)


@pytest.mark.parametrize("mode_name", ["EXTEND", "DECODE"])
def test_deepseeks_two_mla_call_forms_write_and_read_the_same(kit, reference_kernels, mode_name):
    """SGLang's DeepSeek code calls an MLA layer with q, k (c_kv then k_pe) and v = c_kv, the backend writing
    the rows (set_kv_buffer); or with q_nope, c_kv and q_rope / k_rope apart (set_mla_kv_buffer). The kit
    writes the rows itself and passes k None: all three read the same and give the kit's reference."""
    mla, fixture = _mla_fixture(kit, mode_name)
    module, fb, backend = fixture.actual_module, fixture.forward_batch, fixture.backend
    layer, pool = module.attn_mqa, fixture.runner.token_to_kv_pool
    expected = mla.expected_mla_fixture_output(fixture)
    with torch.no_grad():
        q_nope, k_nope, q_rope, k_rope = module.forward_absorb_prepare(fixture.input_hidden)
        backend.init_forward_metadata(fb)
        rows = torch.cat([k_nope, k_rope], -1).to(pool.dtype)  # [T, 1, 576]: c_kv then k_pe
        outputs = []
        for form in ("concatenated", "apart"):
            pool.get_key_buffer(0)[fb.out_cache_loc] = 0  # the step's rows: written by the backend
            if form == "concatenated":
                out = backend.forward(torch.cat([q_nope, q_rope], -1), torch.cat([k_nope, k_rope], -1), k_nope, layer,
                                      fb)
            else:
                out = backend.forward(q_nope, k_nope, k_nope, layer, fb, q_rope=q_rope, k_rope=k_rope)
            assert torch.equal(pool.get_key_buffer(0)[fb.out_cache_loc], rows), form
            assert out.shape == (q_nope.shape[0], 4 * 512)
            outputs.append(out)
    assert torch.equal(outputs[0], outputs[1])
    attn_out = outputs[0].view(-1, 4, 512)
    got = torch.nn.functional.linear(torch.bmm(attn_out.transpose(0, 1), module.w_vc).transpose(0, 1).flatten(1, 2),
                                     module.o_proj.weight)
    torch.testing.assert_close(got, expected, atol=3e-2, rtol=3e-2)


def test_deepseek_takes_the_absorbed_path_under_cupy_fa(kit):
    """A prefill without prefix takes the non-absorbed MHA path under a name DeepSeek's code does not know
    (triton's rule); register() gives "cupy_fa" the absorbed path for every step."""
    from sglang.srt.models.deepseek_common.attention_backend_handler import AttentionBackendRegistry
    from sglang.srt.models.deepseek_common.attention_forward_methods.forward_methods import AttnForwardMethod

    from cupy_fa.integrations.sglang import mla

    fb = types.SimpleNamespace(forward_mode=kit.M.EXTEND, extend_prefix_lens_cpu=[0, 0], seq_lens_cpu=[4, 4])
    attn = types.SimpleNamespace(current_attention_backend="cupy_fa")
    assert AttentionBackendRegistry.get_handler("cupy_fa") is mla.absorbed_mla
    assert AttentionBackendRegistry.get_handler("no_such")(attn, fb) is AttnForwardMethod.MHA
    for mode in (kit.M.EXTEND, kit.M.DECODE, kit.M.TARGET_VERIFY):
        fb.forward_mode = mode
        assert AttentionBackendRegistry.get_handler("cupy_fa")(attn, fb) is AttnForwardMethod.MLA


# ---- the mapping's pieces -----------------------------------------------------------------------

def test_step_lengths_follow_each_modes_convention():
    from cupy_fa.integrations.sglang.metadata import ForwardMode as F, step_lengths

    seq = torch.tensor([5, 9, 1], dtype=torch.int32)
    ext = torch.tensor([2, 3, 1], dtype=torch.int32)
    cases = {
        F.DECODE: ([1, 1, 1], [5, 9, 1], {}),
        F.EXTEND: ([2, 3, 1], [5, 9, 1], dict(extend_seq_lens=ext)),
        F.MIXED: ([2, 3, 1], [5, 9, 1], dict(extend_seq_lens=ext)),
        F.DRAFT_EXTEND: ([2, 3, 1], [5, 9, 1], dict(extend_seq_lens=ext)),
        F.TARGET_VERIFY: ([4, 4, 4], [9, 13, 5], dict(num_draft_tokens=4)),
        F.DRAFT_EXTEND_V2: ([4, 4, 0], [5, 9, 1], dict(num_draft_tokens=4)),  # row 2: graph padding (1 < N)
    }
    for mode, (q, kv, kw) in cases.items():
        got = step_lengths(mode, seq, max_kv_bound=64, seq_lens_cpu=seq.tolist(), **kw)
        assert got.q_lens.tolist() == q and got.kv_lens.tolist() == kv, mode
        assert got.q_lens.dtype == got.kv_lens.dtype == torch.int32
        assert got.max_q_len >= max(q) and got.max_kv_len >= max(kv), mode
    no_mirror = step_lengths(F.TARGET_VERIFY, seq, num_draft_tokens=4, max_kv_bound=64)
    assert no_mirror.max_kv_len == 64 and no_mirror.max_q_len == 4


def test_draft_mask_indices_pick_each_requests_draft_block():
    from cupy_fa.integrations.sglang.metadata import draft_mask_indices

    rng = np.random.default_rng(3)
    n, prefixes = 3, [4, 0, 7]
    blocks, flat = [], []
    for p in prefixes:
        block = rng.random((n, n)) < 0.5
        blocks.append(block.reshape(-1))
        flat.append(np.concatenate([np.ones((n, p), bool), block], 1).reshape(-1))
    flat = torch.from_numpy(np.concatenate(flat))
    idx = draft_mask_indices(torch.tensor(prefixes), n, flat.numel())
    assert torch.equal(flat[idx], torch.from_numpy(np.concatenate(blocks)))


@pytest.mark.parametrize("page_size,topk", [(1, 2), (16, 1), (16, 2), (4, 3)])
def test_draft_decode_page_table_lists_prefix_then_the_branchs_drafts(page_size, topk):
    from cupy_fa.integrations.sglang.metadata import draft_decode_page_table

    steps, width = 3, 64
    rng = np.random.default_rng(page_size + topk)
    r2t = torch.from_numpy(rng.permutation(10_000)[:4 * width].reshape(4, width).astype(np.int32))
    rpi, seq = torch.tensor([2, 0]), torch.tensor([5, 13])
    table = draft_decode_page_table(r2t, rpi, seq, topk=topk, num_steps=steps, page_size=page_size,
                                    columns=13 + steps)
    for b, (r, p) in enumerate(zip(rpi.tolist(), seq.tolist())):
        for t in range(topk):
            row = table[b * topk + t]
            assert torch.equal(row[:p], r2t[r, :p])
            for k in range(steps):  # SGLang's EAGLE allocation of branch t's draft k
                if page_size == 1 or topk == 1:
                    pos = p + t * steps + k
                else:
                    per = (p % page_size + steps + page_size - 1) // page_size
                    pos = p // page_size * page_size + t * per * page_size + p % page_size + k
                assert row[p + k] == r2t[r, pos], (b, t, k)


def test_layer_variants_reach_the_plan_and_run(kit, reference_kernels):
    """scaling, SGLang's sliding window W (W + 1 keys: cupy_fa's window), logit_cap and sinks."""
    M, dense = kit.M, kit.dense
    case = dense.DenseAttentionCase(name="variants", backend="cupy_fa", forward_mode=M.EXTEND, num_heads=4,
                                    num_kv_heads=2, page_size=1, prefix_lens=(6, 3), extend_lens=(2, 4))
    fixture = dense.build_dense_attention_fixture(kit.cases.KitTestCase(), case, head_dim=64, hidden_size=128,
                                                  dtype=torch.float16, device="cpu")
    layer = fixture.actual_module.attn
    layer.scaling, layer.sliding_window_size, layer.logit_cap = 0.11, 3, 30.0
    sinks = torch.tensor([0.5, -1.0, 0.0, 2.0])
    # outside torch.no_grad, as SGLang's draft runners call it: q and the pool require grad there
    q, k, v = fixture.actual_module.project_qkv(fixture.input_hidden)
    fixture.backend.init_forward_metadata(fixture.forward_batch)
    out = fixture.backend.forward(q, k.view(-1, 2, 64), v.view(-1, 2, 64), layer, fixture.forward_batch,
                                  sinks=sinks)
    assert q.requires_grad
    attn = reference_kernels.made[-1]
    assert attn.planned["sm_scale"] == 0.11 and attn.planned["window"] == 4 and attn.planned["soft_cap"] == 30.0
    from cupy_fa import reference

    pool = fixture.runner.token_to_kv_pool
    ref = reference.paged_attention(
        q.detach().view(-1, 4, 64).float().numpy(), pool.get_key_buffer(0)[:, None].detach().float().numpy(),
        pool.get_value_buffer(0)[:, None].detach().float().numpy(), [2, 4], [8, 7],
        fixture.runner.req_to_token_pool.req_to_token[:2].numpy(), sm_scale=0.11, window=4, soft_cap=30.0,
        sinks=sinks.double().numpy())
    assert np.abs(out.view(-1, 4, 64).detach().float().numpy() - ref).max() < 2e-3


# ---- registration, the plugin entry point, the draft hook -----------------------------------------

def test_register_adds_the_backend_and_the_server_choice(kit):
    import cupy_fa.integrations.sglang as cupy_fa_sgl
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS
    from sglang.srt.server_args import ATTENTION_BACKEND_CHOICES

    assert cupy_fa_sgl.register() == "cupy_fa" == cupy_fa_sgl.register()  # idempotent
    assert ATTENTION_BACKENDS["cupy_fa"] is cupy_fa_sgl.create_backend
    assert ATTENTION_BACKEND_CHOICES.count("cupy_fa") == 1


def test_the_plugin_entry_point_names_register():
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    target = project["entry-points"]["sglang.srt.plugins"]["cupy_fa"]
    assert target == "cupy_fa.integrations.sglang:register"
    assert "cupy_fa.integrations.sglang" in tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"][
        "setuptools"]["packages"]


def _draft_factory(kit, backend_name, decode_backend=None):
    from sglang.srt.speculative.draft_utils import DraftBackendFactory

    case = kit.dense.DenseAttentionCase(name="draft", backend="cupy_fa", forward_mode=kit.M.DECODE, num_heads=4,
                                        num_kv_heads=4, page_size=1, prefix_lens=(4, 7))
    fixture = kit.dense.build_dense_attention_fixture(kit.cases.KitTestCase(), case, head_dim=64, hidden_size=128,
                                                      device="cpu")
    args = types.SimpleNamespace(speculative_draft_attention_backend=None, attention_backend=backend_name,
                                 decode_attention_backend=decode_backend or backend_name,
                                 prefill_attention_backend=backend_name)
    return DraftBackendFactory(args, fixture.runner, topk=2, speculative_num_steps=3)


def test_the_draft_hook_makes_cupy_fa_an_eagle_draft_backend(kit):
    from cupy_fa.integrations.sglang.backend import CupyFaAttnBackend
    from cupy_fa.integrations.sglang.draft import CupyFaMultiStepDraftBackend

    factory = _draft_factory(kit, "cupy_fa")
    decode = factory.create_decode_backend()
    assert isinstance(decode, CupyFaMultiStepDraftBackend) and len(decode.attn_backends) == 2
    assert all(isinstance(b, CupyFaAttnBackend) for b in decode.attn_backends)
    assert isinstance(factory.create_draft_extend_backend(), CupyFaAttnBackend)
    with pytest.raises(ValueError, match="EAGLE is not supported in decode attention backend no_such"):
        _draft_factory(kit, "no_such").create_decode_backend()  # every other name resolves as before


def test_multi_step_draft_lengths_grow_by_one_a_step(kit, reference_kernels):
    from cupy_fa.integrations.sglang.draft import CupyFaMultiStepDraftBackend

    factory = _draft_factory(kit, "cupy_fa")
    draft = CupyFaMultiStepDraftBackend(factory.draft_model_runner, topk=2, speculative_num_steps=4)
    seq = torch.tensor([4, 7], dtype=torch.int32)
    fb = types.SimpleNamespace(batch_size=2, seq_lens=seq, seq_lens_cpu=seq.clone(),
                               req_pool_indices=torch.tensor([0, 1]))
    draft.init_forward_metadata(fb)
    for i, backend in enumerate(draft.attn_backends):
        step = backend.forward_metadata
        assert step.q_lens.tolist() == [1] * 4 and step.kv_lens.tolist() == [5 + i, 5 + i, 8 + i, 8 + i]
        assert step.page_table.shape[0] == 4 and step.max_kv_len >= 8 + i


# ---- refusals (docs/errors.md rows) ------------------------------------------------------------------

def test_refusals_name_what_cupy_fa_does_not_serve(kit):
    from cupy_fa.integrations.sglang import mla
    from cupy_fa.integrations.sglang.metadata import mode_of

    with pytest.raises(NotImplementedError, match="does not serve forward mode"):
        mode_of(types.SimpleNamespace(name="SPLIT_PREFILL"))
    with pytest.raises(NotImplementedError, match="kv_lora_rank 512 and qk_rope_head_dim 64"):
        _mla_fixture(kit, kv_lora_rank=32, qk_rope_head_dim=0)  # the kit's default latent
    mla_layer = _mla_fixture(kit)[1].actual_module.attn_mqa
    mla_layer.qk_head_dim, mla_layer.v_head_dim, mla_layer.tp_k_head_num = 192, 128, 4  # DeepSeek's attn_mha
    with pytest.raises(NotImplementedError, match="serves MLA layers in the absorbed form .* qk head 192, v head 128"):
        mla.variant(mla_layer, torch.zeros(1, 4, 192), torch.bfloat16)
    case = kit.dense.DenseAttentionCase(name="refuse", backend="cupy_fa", forward_mode=kit.M.DECODE, num_heads=4,
                                        num_kv_heads=4, page_size=1, prefix_lens=(4,))
    fixture = kit.dense.build_dense_attention_fixture(kit.cases.KitTestCase(), case, head_dim=64, hidden_size=128,
                                                      device="cpu")
    layer = fixture.actual_module.attn
    layer.v_head_dim = 32
    with pytest.raises(NotImplementedError, match="one head dim for q, K, V and out"):
        fixture.backend._variant(layer, torch.zeros(1, 4, 64), torch.float16)
    layer.v_head_dim, layer.is_cross_attention = 64, True
    with pytest.raises(NotImplementedError, match="does not serve cross attention"):
        fixture.backend._variant(layer, torch.zeros(1, 4, 64), torch.float16)


def test_in_graph_metadata_runs_no_torch_op_and_reads_nothing_back(kit, reference_kernels):
    """init_forward_metadata_in_graph is what a CUDA graph records: here it may only plan (cupy_fa's
    plan kernel on the device); no torch op (no allocation, no copy) and no host read of a tensor.
    The step's inputs are written before, by init_forward_metadata_out_graph, into buffers that
    init_cuda_graph_state allocated once; a replay after new inputs sees them."""
    from sglang.srt.model_executor.forward_context import ForwardContext, forward_context
    from torch.utils._python_dispatch import TorchDispatchMode

    M, dense = kit.M, kit.dense
    case = dense.DenseAttentionCase(name="in_graph", backend="cupy_fa", forward_mode=M.DECODE, num_heads=4,
                                    num_kv_heads=2, page_size=16, prefix_lens=(14, 15, 16))
    fixture = dense.build_dense_attention_fixture(kit.cases.KitTestCase(), case, head_dim=64, hidden_size=128,
                                                  device="cpu", disable_cuda_graph=False)
    backend, fb, layer = fixture.backend, fixture.forward_batch, fixture.actual_module.attn

    class Recorder(TorchDispatchMode):
        ops = []

        def __torch_dispatch__(self, func, types_, args=(), kwargs=None):
            Recorder.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    with torch.no_grad(), forward_context(ForwardContext(attn_backend=backend)):
        backend.init_cuda_graph_state(max_bs=4, max_num_tokens=4)
        backend.init_forward_metadata_out_graph(fb, in_capture=True)
        expected = fixture.actual_module(fixture.input_hidden, fb)  # the first forward meets the variant
        backend.init_forward_metadata_out_graph(fb)  # a "replay": new host part, then what the graph holds
        before = torch.Tensor.item, torch.Tensor.tolist
        torch.Tensor.item = torch.Tensor.tolist = lambda *a, **k: pytest.fail("a host read inside in_graph")
        try:
            with Recorder():
                backend.init_forward_metadata_in_graph(fb)
        finally:
            torch.Tensor.item, torch.Tensor.tolist = before
        assert Recorder.ops == [], Recorder.ops
        assert reference_kernels.made[-1].plans == 2  # planned at the first forward and again in in_graph
        replayed = fixture.actual_module(fixture.input_hidden, fb)
    assert torch.equal(replayed, expected)
    torch.testing.assert_close(replayed, dense.expected_dense_fixture_output(fixture), atol=3e-2, rtol=3e-2)


def test_an_idle_step_plans_nothing_and_returns_no_rows(kit, reference_kernels):
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    case = kit.dense.DenseAttentionCase(name="idle", backend="cupy_fa", forward_mode=kit.M.DECODE, num_heads=4,
                                        num_kv_heads=2, page_size=1, prefix_lens=(3,))
    fixture = kit.dense.build_dense_attention_fixture(kit.cases.KitTestCase(), case, head_dim=64, hidden_size=128,
                                                      device="cpu")
    idle = types.SimpleNamespace(forward_mode=ForwardMode.IDLE, batch_size=0)
    fixture.backend.init_forward_metadata(idle)
    assert fixture.backend.forward_metadata is None
    fixture.backend.init_forward_metadata_in_graph(idle)  # nothing to plan
    q = torch.zeros(0, 4 * 64, dtype=torch.float16)
    out = fixture.backend.forward(q, q[:, :128].view(0, 2, 64), q[:, :128].view(0, 2, 64),
                                  fixture.actual_module.attn, idle)
    assert out.shape == (0, 4 * 64) and reference_kernels.made == []


def test_a_case_the_kit_skips_fails_not_skips():
    """The kit's skipTest inside our drivers is a named failure (run_kit reports it as SKIP and
    counts it failed), never a pytest skip that would pass the suite."""
    import unittest

    from sglang_harness import kit_cases

    with pytest.raises(kit_cases.KitSkipped, match="the kit skipped this case: no fp8 here"):
        kit_cases.KitTestCase().skipTest("no fp8 here")
    assert not issubclass(kit_cases.KitSkipped, unittest.SkipTest)
