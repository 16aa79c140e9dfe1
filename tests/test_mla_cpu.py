"""Multi-head latent attention on the CPU: the float64 reference against a direct computation, the
params mirrors against kernels/mla/params.cuh, the MLA policy (tiles, splits, grids) against the
plan kernel's layout, and the API's argument checks (raised before anything touches a device)."""

import math
import re

import numpy as np
import pytest

from cases import new_rng, tree_masks
from test_params_layout import parse_structs

from cupy_fa import _compile, _mla_params, catalog, reference
from cupy_fa.families import mla as family
from cupy_fa.mla import schedule as mla_schedule
from cupy_fa.plan import Capacity

H_SMALL = 4


def direct_mla(q, latent, q_lens, kv_lens, page_table, sm_scale, causal=True, masks=None):
    """MLA written out per (request, query, head) in float64, straight from the definition."""
    page_size = latent.shape[1]
    out = np.zeros(q.shape[:2] + (512,))
    lse = np.full(q.shape[:2], -np.inf)
    row = 0
    for b, (n, kv) in enumerate(zip(q_lens, kv_lens)):
        keys = np.stack([latent[page_table[b, j // page_size], j % page_size] for j in range(kv)]).astype(np.float64)
        for i in range(n):
            pos = kv - n + i
            if masks is not None:
                seen = np.array([j < kv - n or masks[b][i, j - (kv - n)] for j in range(kv)])
            else:
                seen = np.arange(kv) <= pos if causal else np.ones(kv, bool)
            for h in range(q.shape[1]):
                s = keys @ q[row + i, h].astype(np.float64) * sm_scale
                s[~seen] = -np.inf
                m = s.max()
                p = np.exp(s - m)
                out[row + i, h] = p @ keys[:, :512] / p.sum()
                lse[row + i, h] = m + math.log(p.sum())
        row += n
    return out, lse


def random_case(rng, page_size, q_lens, kv_lens):
    pages = sum(-(-k // page_size) for k in kv_lens) + 2
    perm = rng.permutation(pages)
    width = max(-(-k // page_size) for k in kv_lens)
    table = np.zeros((len(q_lens), width), np.int32)
    at = 0
    for b, kv in enumerate(kv_lens):
        n = -(-kv // page_size)
        table[b, :n] = perm[at:at + n]
        at += n
    latent = rng.standard_normal((pages, page_size, 576))
    q = rng.standard_normal((int(sum(q_lens)), H_SMALL, 576))
    return q, latent, table


@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("mode", ["causal", "full", "tree"])
def test_reference_is_the_definition(page_size, mode):
    rng, seed = new_rng()
    q_lens, kv_lens = np.array([1, 4, 3, 1]), np.array([70, 9, 130, 1])
    q, latent, table = random_case(rng, page_size, q_lens, kv_lens)
    masks = tree_masks(rng, q_lens) if mode == "tree" else None
    scale = 0.07
    got, got_lse = reference.mla_attention(q, latent, q_lens, kv_lens, table, causal=mode == "causal", sm_scale=scale,
                                           custom_mask=masks, return_lse=True)
    want, want_lse = direct_mla(q, latent, q_lens, kv_lens, table, scale, causal=mode == "causal", masks=masks)
    assert got.shape == (int(q_lens.sum()), H_SMALL, 512)
    np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-12, err_msg=f"seed {seed}")
    # (atol: an LSE near 0, e.g. one key whose score is about 0, is off by float64's rounding, ~5e-16)
    np.testing.assert_allclose(got_lse, want_lse, rtol=1e-12, atol=1e-14, err_msg=f"seed {seed}")


def test_reference_takes_q_pe_apart_and_a_four_dim_cache():
    rng, _ = new_rng()
    q_lens, kv_lens = np.array([2, 1]), np.array([20, 33])
    q, latent, table = random_case(rng, 16, q_lens, kv_lens)
    whole = reference.mla_attention(q, latent, q_lens, kv_lens, table)
    apart = reference.mla_attention(q[..., :512], latent[:, :, None], q_lens, kv_lens, table, q_pe=q[..., 512:])
    np.testing.assert_array_equal(whole, apart)
    # the default scale is DeepSeek's qk head before absorption, 1 / sqrt(192)
    np.testing.assert_array_equal(whole, reference.mla_attention(q, latent, q_lens, kv_lens, table,
                                                                 sm_scale=1 / math.sqrt(192)))


def test_reference_reads_fp8_bytes_with_their_scale():
    rng, _ = new_rng()
    q_lens, kv_lens = np.array([1, 3]), np.array([40, 17])
    q, latent, table = random_case(rng, 16, q_lens, kv_lens)
    scale = 0.0125
    raw = reference.quantize_e4m3(latent.reshape(-1, 1, 576), scale).reshape(latent.shape)
    values = reference.dequantize_e4m3(raw, scale)
    np.testing.assert_array_equal(reference.mla_attention(q, raw, q_lens, kv_lens, table, scale=scale),
                                  reference.mla_attention(q, values, q_lens, kv_lens, table))


def test_reference_names_bad_shapes():
    rng, _ = new_rng()
    q, latent, table = random_case(rng, 16, [1], [5])
    with pytest.raises(ValueError, match=re.escape("q must be [T, H, 576]")):
        reference.mla_attention(q[..., :512], latent, [1], [5], table)
    with pytest.raises(ValueError, match=re.escape("latent must be [num_pages, page_size, 576]")):
        reference.mla_attention(q, latent[..., :512], [1], [5], table)
    with pytest.raises(ValueError, match="q_pe"):
        reference.mla_attention(q[..., :512], latent, [1], [5], table, q_pe=q[..., :32])


# ---- the params mirrors ---------------------------------------------------------------------------


def test_params_match_header():
    header = parse_structs((_compile.KERNEL_DIR / "mla" / "params.cuh").read_text())
    assert set(header) == set(_mla_params.DTYPES)
    for name, fields in header.items():
        dtype = _mla_params.DTYPES[name]
        assert list(dtype.names) == [f for f, _ in fields], name
        for field, ctype in fields:
            assert dtype.fields[field][0] == np.dtype(ctype), f"{name}.{field}"
    with pytest.raises(TypeError, match="missing"):
        _mla_params.make("MlaAppendParams", ckv=0)


def test_every_mla_kernel_carries_the_size_checks():
    for kernel in family.all_kernels():
        if kernel.source.startswith("mla/"):
            assert all(c in _compile.program_text(kernel) for c in _mla_params.size_checks()), kernel.expression


def test_the_catalog_compiles_every_mla_kernel():
    everything = set(catalog.all_kernels())
    assert set(family.all_kernels()) <= everything
    wgmma = {family.kernel(dt, family.MlaWgmmaTile(fp8)) for dt in _compile.CTYPES for fp8 in (False, True)}
    assert len(wgmma) == 2 * len(_compile.CTYPES) and wgmma <= everything and not wgmma & set(catalog.all_kernels("sm_80"))


# ---- the policy --------------------------------------------------------------------------------------


@pytest.mark.parametrize("heads", [8, 16, 32, 64, 128])
@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("arch", ["sm_90a", "sm_80"])
def test_small_q_tiles_share_their_key_layout(heads, fp8, arch):
    """Every small-q tile of one (heads, cache, target) reduces a split's keys alike: decode and verify
    of up to 16 tokens run the same kernel arithmetic per row (one family, one BLOCK_N, 4 warps over
    the keys), and every tile the policy picks is compiled in CI."""
    compiled = set(catalog.all_kernels())
    tiles = {mla_schedule.small_q_tile(heads, fp8, arch, q) for q in range(1, mla_schedule.SMALL_Q_LEN + 1)}
    assert len({(type(t), t.block_n) for t in tiles}) == 1, tiles
    wgmma = arch == "sm_90a" and heads >= mla_schedule.WGMMA_MIN_HEADS
    assert all(isinstance(t, family.MlaWgmmaTile) == wgmma for t in tiles)
    for t in tiles | {mla_schedule.long_tile(heads, fp8, arch)}:
        assert t.kv_fp8 == fp8 and t.smem_bytes <= family.SMEM_LIMIT
        for dt in _compile.CTYPES:
            assert family.kernel(dt, t) in compiled


def plan_kernel_items(q_lens, kv_lens, heads, sched):
    """The work items plan_kernel lays out for these host lengths (kernels/shared/plan.cu, no overflow):
    per live request, row blocks of its list's block_m times its splits."""
    c = mla_schedule.plan_constants(sched)
    items = {"small": 0, "long": 0}
    for q, kv in zip(q_lens, kv_lens):
        if q == 0:
            continue
        splits = -(-max(kv, 1) // c["split_size"])
        if q > c["small_q_len"]:
            splits = min(splits, max(1, c["split_row_budget"] // q))
        splits = max(1, min(splits, c["max_splits"]))
        long = q >= c["long_q_len"]
        block_m = c["long_block_m"] if long else c["block_m"]
        items["long" if long else "small"] += -(-(q * heads) // block_m) * splits
    return items


@pytest.mark.parametrize("heads", [16, 128])
@pytest.mark.parametrize("arch", ["sm_90a", "sm_80"])
def test_grids_cover_the_plan_kernels_layout(heads, arch):
    rng, seed = new_rng()
    capacity = Capacity(40, 4000, 600)
    for _ in range(50):
        batch = int(rng.integers(1, 41))
        q_lens = rng.choice([0, 1, 2, 4, 16, 17, 100], size=batch)
        q_lens = np.minimum(q_lens, 4000 // batch)
        kv_lens = q_lens + rng.integers(0, 9000, size=batch)
        sched = mla_schedule.schedule_step(heads, False, arch, q_lens=q_lens, kv_lens=kv_lens)
        items = plan_kernel_items(q_lens, kv_lens, heads, sched)
        if sched.one_list:
            assert sum(x.work_grid for x in sched.launches) == items["small"] + items["long"], seed
        else:
            assert (sched.small.work_grid, sched.long.work_grid) == (items["small"], items["long"]), seed
        splits = mla_schedule.max_splits(q_lens[q_lens > 0], kv_lens[q_lens > 0], heads)
        assert sched.needs_merge == bool((splits > 1).any()), seed
        # the graph path's grids, from bounds, hold every such step
        bound = mla_schedule.schedule_step(heads, False, arch, max_q_len=int(q_lens.max()) or 1,
                                           max_kv_len=int(kv_lens.max()) or 1, capacity=capacity)
        assert sum(x.work_grid for x in bound.launches) >= items["small"] + items["long"], seed
        assert bound.needs_merge or not sched.needs_merge


@pytest.mark.parametrize("heads", [16, 128])
def test_splits_sit_at_fixed_positions_for_small_q(heads):
    """Decode and verify of the same keys split them alike (the key of batch invariance); longer
    requests split less; no request past MAX_SPLITS."""
    s = mla_schedule.split_size(heads)
    assert s == 1024
    assert mla_schedule.max_splits([1], [4096], heads)[0] == mla_schedule.max_splits([16], [4096], heads)[0] == 4096 // s
    assert mla_schedule.max_splits([100], [4096], heads)[0] == 1
    assert mla_schedule.max_splits([1], [10**7], heads)[0] == mla_schedule.MAX_SPLITS == family.MAX_MERGE_SPLITS
    assert s % 128 == 0 and s % family.MMA_BLOCK_N == 0


def test_the_workspace_says_when_a_batch_keeps_its_bits():
    """The rows a host step's splits want (MLAAttention warns past the workspace, BatchInvarianceWarning):
    q_len x splits at the fixed 1024-key positions; at 128 heads a verify step of 64 x 4 drafts over
    8196 keys wants 9 splits a token, past the default's 8 a token of that capacity, and a
    workspace_bytes of those rows holds it."""
    from cupy_fa.mla import plan as mla_plan

    rng, seed = new_rng()
    for _ in range(50):
        b = int(rng.integers(1, 65))
        q = rng.integers(0, 17, size=b)
        kv = q + rng.integers(0, 40000, size=b)
        sched = mla_schedule.schedule_step(128, False, "sm_90a", q_lens=q, kv_lens=kv)
        splits = -(-np.maximum(kv, 1) // mla_schedule.split_size(128))
        assert sched.partial_rows == int((q * splits)[(q > 0) & (splits > 1)].sum()), seed
    q, kv = np.full(64, 4), np.full(64, 8196)
    wanted = mla_schedule.schedule_step(128, False, "sm_90a", q_lens=q, kv_lens=kv).partial_rows
    capacity = Capacity(64, 256, 257)
    row = 128 * (512 * 2 + 4)
    assert wanted == 64 * 4 * 9 > mla_plan.partial_rows(capacity, 128, 2) == 2048
    assert mla_plan.partial_rows(capacity, 128, 2, workspace_bytes=wanted * row) >= wanted


def test_merge_shapes():
    assert mla_schedule.merge_shape(64, 128) == family.MERGE_WIDE
    assert mla_schedule.merge_shape(1, 128) == family.MERGE_DEEP
    heads, ways, vec = family.MERGE_DEEP
    # merge.cu's shared memory at 512 columns: a float4 per 4 columns per group of 8 splits, under 48 KiB
    assert (family.MAX_MERGE_SPLITS // 8) * heads * 128 * 16 <= 48 * 1024


# ---- the API's checks, before any device ----------------------------------------------------------


def test_mla_attention_constructs_under_the_default_knobs():
    """Valid arguments construct an MLAAttention (16-bit or fp8 cache) with every knob at its
    default (without capacities nothing is allocated, so this runs without a device too)."""
    from cupy_fa import MLAAttention, knobs

    knobs.use(knobs.Knobs())  # tests/conftest.py puts the knobs in force back after the test
    assert MLAAttention(16).num_heads == 16 and not MLAAttention(16).kv_fp8
    assert MLAAttention(128, "float16", kv_dtype="float8_e4m3fn").kv_fp8


def test_mla_attention_names_bad_arguments():
    """docs/errors.md's rows of MLAAttention and its plan: each raised before anything touches a device."""
    import re

    from cupy_fa import MLAAttention

    with pytest.raises(ValueError, match="num_heads must be a positive int"):
        MLAAttention(0)
    with pytest.raises(ValueError, match="kv_lora_rank and qk_rope_head_dim must be 512 and 64"):
        MLAAttention(16, kv_lora_rank=256)
    with pytest.raises(TypeError, match="must be float16 or bfloat16"):
        MLAAttention(16, "float32")
    with pytest.raises(ValueError, match="give all of max_batch_size"):
        MLAAttention(16, max_batch_size=4)
    attn = MLAAttention(16)
    with pytest.raises(ValueError, match="kv_len counts the valid keys AFTER"):
        attn.plan([2], [1], [[0]])
    with pytest.raises(ValueError, match=re.escape("custom_mask has 3 entries, expected sum(q_lens**2)")):
        attn.plan([2], [5], [[0]], custom_mask=np.ones(3, bool))
    with pytest.raises(ValueError, match="sm_scale must be a positive finite number"):
        attn.plan([1], [5], [[0]], sm_scale=-1.0)
    with pytest.raises(TypeError, match="causal must be True or False"):
        attn.plan([1], [5], [[0]], causal=1)


def test_latent_cache_refuses_host_arrays():
    from cupy_fa import PagedLatentCache

    with pytest.raises(TypeError, match="latent must be a CUDA device array"):
        PagedLatentCache(np.zeros((4, 16, 576), np.float16))


# ---- a step's launches, with the device calls stubbed ---------------------------------------------


class _Buf:
    _next = [0x10000]

    def __init__(self, shape=(1,)):
        import types

        self.shape = shape
        self.data = types.SimpleNamespace(ptr=_Buf._next[0])
        _Buf._next[0] += 0x1000


@pytest.mark.parametrize("heads,q_lens,kv_lens,arch", [
    (128, [1] * 64, [4096] * 64, "sm_90a"),     # decode on the seesaw kernel, split, merged
    (16, [1] * 64, [4096] * 64, "sm_90a"),      # decode on the mma.sync tile
    (16, [4, 200, 1], [4000, 900, 10], "sm_90a"),  # small-q on mma.sync, a long request on wgmma: two lists
    (128, [4, 200], [4000, 900], "sm_90a"),     # both classes on the seesaw kernel: one list
    (128, [1], [300], "sm_80"),                 # one split, no merge, mma.sync (2 rows of warps)
])
def test_launch_step_fills_every_field(monkeypatch, heads, q_lens, kv_lens, arch):
    import types

    from cupy_fa import _build, plan
    from cupy_fa.mla import launch as mla_launch
    from cupy_fa.mla.plan import MlaPlanState, plan_params

    names = ("q_lens", "kv_lens", "q_indptr", "work_indptr", "long_work_indptr", "partial_indptr", "mask_indptr",
             "num_splits", "split_keys", "status", "custom_mask", "partial_out", "partial_lse", "key_base")
    buffers = types.SimpleNamespace(**{n: _Buf() for n in names}, page_table=_Buf((len(q_lens), 300)))
    sched = mla_schedule.schedule_step(heads, False, arch, q_lens=np.array(q_lens), kv_lens=np.array(kv_lens))
    step = types.SimpleNamespace(page_columns=300)
    state = MlaPlanState(len(q_lens), int(np.sum(q_lens)), sched, plan.MASK_CAUSAL, 0.0721, step, None, None,
                         page_table_stride=177)
    cache = types.SimpleNamespace(kernel_fields=lambda: dict(cache=0xCAC0, page_size=64, page_shift=6, num_pages=999,
                                                             kv_scale=0))
    calls = []
    monkeypatch.setattr(_build, "launch_packed", lambda launch, stream_ptr: calls.append(
        (launch.kernel, launch.grid, launch.packed[0].copy(), launch.programmatic)))
    tokens = int(np.sum(q_lens))
    q = ((0x1000, (heads * 576, 576)), (0x1000 + 1024, (heads * 576, 576)))
    mla_launch.launch_step(state, buffers, heads, "bfloat16", cache, q, _Buf().data.ptr, _Buf().data.ptr, tokens,
                           types.SimpleNamespace(ptr=0), 0)
    attention = [c for c in calls if c[0].source != "shared/merge.cu"]
    assert [c[1] for c in attention] == [(x.work_grid,) for x in sched.launches]
    for (kernel, _, params, programmatic), launch in zip(attention, sched.launches):
        assert kernel == family.kernel("bfloat16", launch.tile) and not programmatic
        assert params["num_heads"] == heads and params["cache"] == 0xCAC0 and params["page_shift"] == 6
        assert params["page_table_stride"] == 177  # stage_inputs' dense rows, not the buffer's width
        assert params["q_pe"] - params["q_nope"] == 1024 and params["q_nope_token_stride"] == heads * 576
        assert abs(params["sm_scale_log2"] - 0.0721 * 1.4426950408889634) < 1e-6
        two_lists = len(sched.launches) == 2
        want = buffers.long_work_indptr if two_lists and launch is sched.long else buffers.work_indptr
        assert params["work_indptr"] == want.data.ptr
        assert (params["head_multiplier"], params["head_shift"]) == tuple(_lib_fast_div(heads))
    merges = [c for c in calls if c[0].source == "shared/merge.cu"]
    assert len(merges) == int(sched.needs_merge)
    if merges:
        shape, grid = mla_schedule.merge_grid(tokens, heads)
        assert merges[0][0] == family.merge_kernel("bfloat16", shape) and merges[0][1] == grid and merges[0][3]
    # the plan kernel's constants for this schedule
    fake = types.SimpleNamespace(**{n: _Buf() for n in names}, page_table=_Buf((len(q_lens), 300)))
    fake.partial_out = _Buf((5000, heads, 512))
    params = plan_params(fake, len(q_lens), heads, sched, 300, 5000)
    assert params["group_size"] == heads and params["split_size"] == mla_schedule.split_size(heads)
    assert params["long_q_len"] == (17 if len(sched.launches) == 2 else 2**31 - 1)
    assert params["block_m"] == (sched.small or sched.long).tile.block_m and params["partial_capacity"] == 5000


def _lib_fast_div(d):
    from cupy_fa import _params

    return _params.fast_divisor(d)


@pytest.mark.parametrize("heads,kv_fp8,arch", [(128, False, "sm_90a"), (16, True, "sm_90a"), (8, False, "sm_90a"),
                                               (128, False, "sm_80")])
def test_memoised_schedules_are_fresh_ones(heads, kv_fp8, arch):
    """Over random batches (decode, verify, draft extend, prefill, mixed; lengths moved within and
    across split boundaries), each memoised MLA schedule equals schedule_step's, and a batch whose
    lengths moved within their splits hits the memo."""
    rng = np.random.default_rng(5 + heads + kv_fp8)
    memo = mla_schedule.ScheduleMemo(heads, kv_fp8)
    split = mla_schedule.split_size(heads)
    for trial in range(60):
        b = int(rng.integers(1, 40))
        q = rng.choice([0, 1, 1, 4, 8, 16, 17, 100, 300, 2048], size=b).astype(np.int64 if trial % 2 else np.int32)
        kv = (q + rng.integers(0, 40000, size=b)).astype(q.dtype)
        for moved in (kv, kv + (split - 1 - (kv - 1) % split) * (kv % split != 0), kv + 1, kv + split):
            moved = np.maximum(moved, q).astype(q.dtype)
            fresh = mla_schedule.schedule_step(heads, kv_fp8, arch, q_lens=q, kv_lens=moved)
            assert memo.step(arch, q, moved) == fresh, (q, moved)
    hits = memo.hits
    q, kv = np.ones(8, np.int64), np.full(8, 3 * split + 5, np.int64)
    memo.step(arch, q, kv)
    memo.step(arch, q, kv + 1)  # one more key in the same split: the same schedule
    assert memo.hits == hits + 1


def test_the_plan_launch_holds_plan_params(monkeypatch):
    """The plan kernel's packed struct (cupy_fa.plan.packed_plan), rewritten in place step after step
    (other batches, head counts' schedules, bounds), holds what plan_params gives, field for field;
    new buffers, a new one."""
    import types

    from cupy_fa.mla.plan import plan_launch, plan_params

    names = ("q_lens", "kv_lens", "q_indptr", "work_indptr", "long_work_indptr", "partial_indptr", "mask_indptr",
             "num_splits", "split_keys", "status", "custom_mask", "key_base")

    def new_buffers():
        return types.SimpleNamespace(**{n: _Buf() for n in names}, partial_out=_Buf((5000, 8, 512)), device_id=0,
                                     _plan_launch=None)

    buffers = new_buffers()
    rng = np.random.default_rng(3)
    for i in range(8):
        if i == 5:
            buffers = new_buffers()
        heads, arch = [(128, "sm_90a"), (8, "sm_90a"), (16, "sm_80")][i % 3]
        b = int(rng.integers(1, 30))
        q = rng.choice([1, 4, 300], size=b)
        kv = q + rng.integers(0, 9000, size=b)
        sched = mla_schedule.schedule_step(heads, bool(i % 2), arch, q_lens=q, kv_lens=kv)
        max_q, max_kv = int(q.max()), int(kv.max()) + i
        launch = plan_launch(buffers, b, heads, sched, max_q, max_kv)
        assert _fields(launch.packed[0]) == _fields(plan_params(buffers, b, heads, sched, max_q, max_kv)), f"step {i}"
        assert launch is plan_launch(buffers, b, heads, sched, max_q, max_kv)


def _fields(record):
    """Every field of a packed struct by name (its padding bytes are no field)."""
    return tuple((name, record[name].item()) for name in record.dtype.names)


def test_prepared_launches_hold_the_full_fill(monkeypatch):
    """A plan's packed structs, updated in place run after run (new q / out / lse, strides, another
    cache, another token count, a plan of the same shape reusing them), hold what a fresh fill of every
    field gives, field for field, attention and merge alike."""
    import types

    from cupy_fa import _build, _mla_params, _params, plan
    from cupy_fa.mla import launch as mla_launch
    from cupy_fa.mla.plan import MlaPlanState

    rng = np.random.default_rng(7)
    names = ("q_lens", "kv_lens", "q_indptr", "work_indptr", "long_work_indptr", "partial_indptr", "mask_indptr",
             "num_splits", "split_keys", "status", "custom_mask", "partial_out", "partial_lse", "key_base")
    buffers = types.SimpleNamespace(**{n: _Buf() for n in names}, page_table=_Buf((3, 300)))
    heads, q_lens, kv_lens = 8, np.array([4, 200, 1]), np.array([4000, 900, 10])  # two lists, a merge
    sched = mla_schedule.schedule_step(heads, False, "sm_90a", q_lens=q_lens, kv_lens=kv_lens)
    assert len(sched.launches) == 2 and sched.needs_merge
    launched = []
    monkeypatch.setattr(_build, "launch_packed", lambda launch, stream_ptr: launched.append(launch))

    def new_state():
        return MlaPlanState(3, int(q_lens.sum()), sched, plan.MASK_CAUSAL, 0.0721, types.SimpleNamespace(page_columns=300),
                            None, None, page_table_stride=177)

    def new_cache(base):
        fields = dict(cache=base, page_size=16, page_shift=4, num_pages=int(rng.integers(1, 1 << 20)), kv_scale=base + 8)
        return types.SimpleNamespace(kernel_fields=lambda: dict(fields))

    state, cache = new_state(), new_cache(0xCAC0)
    for i in range(6):
        if i == 3:
            cache = new_cache(0xBEE0)
        if i == 4:  # the next step's plan, same shape: the same packed launches
            previous, state = state, new_state()
            assert previous.prepared.matches(state, buffers, 0)
            state.prepared = previous.prepared
        tokens = int(q_lens.sum()) - (i == 5)
        q = tuple((int(rng.integers(1, 1 << 40)) * 16, (int(rng.integers(1, 1 << 20)), int(rng.integers(1, 4096))))
                  for _ in range(2))
        out, lse = _Buf(), (_Buf() if i % 2 else None)
        launched.clear()
        lse_ptr = lse.data.ptr if lse is not None else 0
        mla_launch.launch_step(state, buffers, heads, "bfloat16", cache, q, out.data.ptr, lse_ptr, tokens,
                               types.SimpleNamespace(ptr=0), 0)
        attention, merge = launched[:-1], launched[-1]
        head_div = _params.fast_divisor(heads)
        for packed, launch in zip(attention, sched.launches):
            want = mla_launch.attention_params(state, buffers, launch, heads, head_div, cache.kernel_fields(), q,
                                               out.data.ptr, lse_ptr, tokens)
            assert packed.packed.dtype == _mla_params.DTYPES["MlaParams"]
            assert _fields(packed.packed[0]) == _fields(want), f"run {i}"
        assert merge.programmatic and merge.grid == tuple(mla_schedule.merge_grid(tokens, heads)[1])
        want = mla_launch.merge_params(state, buffers, heads, out.data.ptr, lse_ptr)
        assert _fields(merge.packed[0]) == _fields(want), f"run {i}"


def test_the_wgmma_knob_keeps_every_step_on_mma_sync():
    import dataclasses

    from cupy_fa import knobs

    before = knobs.use(dataclasses.replace(knobs.knobs(), mla_wgmma=False))
    try:
        assert isinstance(mla_schedule.small_q_tile(128, False, "sm_90a"), family.MlaMmaTile)
        assert isinstance(mla_schedule.long_tile(16, False, "sm_90a"), family.MlaMmaTile)
    finally:
        knobs.use(before)
    assert isinstance(mla_schedule.small_q_tile(128, False, "sm_90a"), family.MlaWgmmaTile)


def test_warmup_lists_what_steps_select():
    from cupy_fa.mla import warm

    hopper = set(warm.warmup_kernels(("bfloat16",), ("bfloat16", "float8_e4m3fn"), "sm_90a"))
    assert family.kernel("bfloat16", family.MlaWgmmaTile()) in hopper
    assert family.kernel("bfloat16", family.MlaWgmmaTile(True)) in hopper  # fp8 from 16 heads
    assert family.kernel("bfloat16", family.MlaMmaTile(1, True)) not in hopper  # (16 and 128 heads by default)
    few = set(warm.warmup_kernels(("bfloat16",), ("float8_e4m3fn",), "sm_90a", heads=(8,)))
    assert family.kernel("bfloat16", family.MlaMmaTile(1, True)) in few  # fp8 below 16 heads
    assert hopper <= set(catalog.all_kernels("sm_90a")) | {catalog.PLAN_KERNEL}
    ampere = set(warm.warmup_kernels(("float16",), None, "sm_80"))
    assert not any(k.source == "mla/wgmma.cu" for k in ampere)


# ---- the kernels' softmax schedules, modelled in NumPy -------------------------------------------
#
# Not the kernels (this CPU file runs none; tests/test_mla_gpu.py does): their arithmetic schedules,
# step by step in float32 with P rounded to bf16 where the kernels round it, held to float64. A
# wrong factor in a schedule (an offset applied twice, a sum left at the old offset) fails here.

LAZY = 8.0  # kernels/shared/softmax.cuh kLazyRescale


def _bf16(x):
    import ml_dtypes

    return x.astype(ml_dtypes.bfloat16).astype(np.float32)


def _factor(m_old, m_new):
    with np.errstate(invalid="ignore"):
        return np.where(m_new != m_old, np.where(m_old == -np.inf, 0.0, np.exp2(m_old - m_new)), 1.0).astype(np.float32)


def _scores(q, keys, key0, n, kv_end, sees):
    s = (q @ keys[key0:key0 + n].T).astype(np.float32)
    cols = key0 + np.arange(n)
    return np.where((cols[None, :] < kv_end) & sees(cols), s, -np.inf).astype(np.float32)


def seesaw_model(q, keys, kv_end, scale_log2, sees):
    """kernels/mla/seesaw.cuh's run(): pairs of 64-key blocks, warpgroup 0's block then 1's as one
    offset chain, O split 256 / 256, each half taking both P's (rounded to bf16), each warpgroup's
    sum of its own blocks rescaled by both factors, added at the end."""
    rows = q.shape[0]
    keys = np.concatenate([keys, np.zeros((256, keys.shape[1]), np.float32)])  # zero-filled past the end
    m = np.full(rows, -np.inf, np.float32)
    l0 = np.zeros(rows, np.float32)
    l1 = np.zeros(rows, np.float32)
    o_l = np.zeros((rows, 256), np.float32)
    o_r = np.zeros((rows, 256), np.float32)
    blocks = -(-kv_end // 64)
    for i in range(-(-blocks // 2)):
        s0 = _scores(q, keys, 128 * i, 64, kv_end, sees)
        s1 = _scores(q, keys, 128 * i + 64, 64, kv_end, sees)
        v0, v1 = keys[128 * i:128 * i + 64, :512], keys[128 * i + 64:128 * i + 128, :512]
        # warpgroup 0
        mx0 = s0.max(axis=1) * scale_log2
        m0 = np.where(mx0 > m + LAZY, mx0, m).astype(np.float32)
        fa = _factor(m, m0)
        p0 = np.exp2(s0 * scale_log2 - np.where(m0 == -np.inf, 0, m0)[:, None]).astype(np.float32)
        l0 = l0 * fa + p0.sum(axis=1)
        p0 = _bf16(p0)
        o_l = o_l * fa[:, None] + p0 @ v0[:, :256]
        # warpgroup 1 (takes m0 and P0)
        mx1 = s1.max(axis=1) * scale_log2
        m1 = np.where(mx1 > m0 + LAZY, mx1, m0).astype(np.float32)
        fb = _factor(m0, m1)
        p1 = np.exp2(s1 * scale_log2 - np.where(m1 == -np.inf, 0, m1)[:, None]).astype(np.float32)
        l1 = l1 * fa * fb + p1.sum(axis=1)
        p1 = _bf16(p1)
        o_r = (o_r * fa[:, None] + p0 @ v0[:, 256:]) * fb[:, None] + p1 @ v1[:, 256:]
        # warpgroup 0 again (takes m1 and P1)
        o_l = o_l * fb[:, None] + p1 @ v1[:, :256]
        l0 = l0 * fb
        m = m1
    l = l0 + l1
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.concatenate([o_l, o_r], axis=1) / l[:, None], (m + np.log2(l)) * math.log(2)


def mma_tile_model(q, keys, kv_end, scale_log2, sees):
    """kernels/mla/mma_tile.cuh: one softmax step per 64-key tile over its 4 warps' keys, each warp's
    part of the sum kept apart (16 keys each) and added in warp order at the end."""
    rows = q.shape[0]
    keys = np.concatenate([keys, np.zeros((64, keys.shape[1]), np.float32)])
    m = np.full(rows, -np.inf, np.float32)
    parts = np.zeros((4, rows), np.float32)
    o = np.zeros((rows, 512), np.float32)
    for t in range(-(-kv_end // 64)):
        s = _scores(q, keys, 64 * t, 64, kv_end, sees)
        mx = s.max(axis=1) * scale_log2
        new = np.where(mx > m + LAZY, mx, m).astype(np.float32)
        f = _factor(m, new)
        m = new
        p = np.exp2(s * scale_log2 - np.where(m == -np.inf, 0, m)[:, None]).astype(np.float32)
        parts = parts * f + p.reshape(rows, 4, 16).sum(axis=2).T
        o = o * f[:, None] + _bf16(p) @ keys[64 * t:64 * t + 64, :512]
    l = parts[0] + parts[1] + parts[2] + parts[3]
    with np.errstate(invalid="ignore", divide="ignore"):
        return o / l[:, None], (m + np.log2(l)) * math.log(2)


@pytest.mark.parametrize("model", [seesaw_model, mma_tile_model], ids=["seesaw", "mma_tile"])
@pytest.mark.parametrize("kv_len", [1, 63, 64, 65, 200, 1000])
@pytest.mark.parametrize("mask", ["causal", "tree", "none"])
def test_kernel_softmax_schedules_hold_to_float64(model, kv_len, mask):
    """A block of query rows (4 tokens x 16 heads) over one split of kv_len keys, the scores in a range
    that moves the lazy offset several times (a growing key norm): the model's output and LSE against
    reference.mla_attention, at the bf16 bars."""
    rng, seed = new_rng()
    q_len, heads = 4, 16
    kv_len = max(kv_len, q_len)
    keys = _bf16(rng.standard_normal((kv_len, 576)).astype(np.float32) * np.linspace(0.3, 3.0, kv_len)[:, None])
    q = _bf16(rng.standard_normal((q_len * heads, 576)).astype(np.float32))
    masks = tree_masks(rng, [q_len]) if mask == "tree" else None
    prefix = kv_len - q_len
    token = np.arange(q_len * heads) // heads

    def sees(cols):
        if mask == "causal":
            return cols[None, :] <= (prefix + token)[:, None]
        if mask == "tree":
            draft = np.clip(cols - prefix, 0, q_len - 1)
            return (cols[None, :] < prefix) | masks[0][token[:, None], draft[None, :]]
        return np.ones((1, cols.size), bool)

    scale = 1 / math.sqrt(192)
    out, lse = model(q, keys, kv_len, np.float32(scale * 1.4426950408889634), sees)
    latent = keys.reshape(kv_len, 1, 576)
    ref, ref_lse = reference.mla_attention(q.reshape(q_len, heads, 576), latent, [q_len], [kv_len],
                                           np.arange(kv_len)[None], causal=mask == "causal",
                                           custom_mask=masks, sm_scale=scale, return_lse=True)
    ref, ref_lse = ref.reshape(-1, 512), ref_lse.reshape(-1)
    err = np.linalg.norm(out - ref) / np.linalg.norm(ref)
    assert err < reference.TOL["bfloat16"] / 4, f"seed {seed}: rel err {err}"
    np.testing.assert_allclose(lse, ref_lse, atol=2e-4, rtol=1e-5, err_msg=f"seed {seed}")


def test_a_new_step_loads_all_its_kernels_at_once(monkeypatch):
    """MLAAttention._load: the plan kernel, each launch's kernel and the merge kernel of the step's
    shape go to one _build.load_all (compiled together on a first call); device lengths, whose token
    count comes only at run, take both merge shapes; the same kernels again load nothing."""
    from cupy_fa import _build
    from cupy_fa.mla.attention import MLAAttention

    calls = []
    monkeypatch.setattr(_build, "load_all", lambda kernels, device_id: calls.append(list(kernels)))
    attn = MLAAttention.__new__(MLAAttention)
    attn.num_heads, attn.dtype_name, attn.device_id, attn._loaded = 128, "bfloat16", 0, None
    host = mla_schedule.schedule_step(128, False, "sm_90a", q_lens=[1] * 8, kv_lens=[4096] * 8)
    assert host.needs_merge and len(host.launches) == 1
    attn._load(catalog.PLAN_KERNEL, host, 8)
    shape = mla_schedule.merge_shape(8, 128)
    assert calls == [[catalog.PLAN_KERNEL, family.kernel("bfloat16", host.launches[0].tile),
                      family.merge_kernel("bfloat16", shape)]]
    attn._load(catalog.PLAN_KERNEL, mla_schedule.schedule_step(128, False, "sm_90a", q_lens=[1] * 8,
                                                               kv_lens=[4096] * 8), 8)
    assert len(calls) == 1  # the same kernels: nothing to load
    device = mla_schedule.schedule_step(128, False, "sm_90a", max_q_len=4096, max_kv_len=None,
                                        capacity=Capacity(8, 8192, 64, 0))
    attn._load(catalog.PLAN_KERNEL, device, None)
    tiles = [launch.tile for launch in device.launches]
    assert len(calls) == 2 and calls[1] == [catalog.PLAN_KERNEL] + [family.kernel("bfloat16", t) for t in tiles] + [
        family.merge_kernel("bfloat16", s) for s in (family.MERGE_WIDE, family.MERGE_DEEP)]
