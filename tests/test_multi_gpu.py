"""Two devices: everything built while CuPy's current device is one id and the inputs live on the
other (both ways round), checked against the float64 reference; nothing allocated on the
current device; inputs on the wrong device refused before anything is written; the compile cache
holding one module per device.

Marked ``multi_gpu``, not ``gpu``: ``scripts/device_check.sh`` (``-m gpu``) never selects them, and
on a machine of one GPU they skip with "needs 2 CUDA devices". ``lab/tp_check.sh`` runs them on
a machine of two: ``python3 -m pytest -m multi_gpu tests/test_multi_gpu.py``.
"""

import numpy as np
import pytest

from cases import POISON, new_rng, np_dtype, paged_case
from safety_cases import assert_matches, bits

pytestmark = pytest.mark.multi_gpu

DTYPE, HEADS, D = "bfloat16", (8, 2), 128
PAIRS = [(1, 0), (0, 1)]  # (device the inputs live on and the instances are bound to, device current meanwhile)


def used_bytes(device_id):
    """Bytes CuPy's pool holds on ``device_id`` (its pool is per device)."""
    import cupy

    with cupy.cuda.Device(device_id):
        return cupy.get_default_memory_pool().used_bytes()


def make_step(rng, device_id, page_size, q_lens, kv_lens):
    """A shuffled, interleaved paged case (NaN in every slot no request may read), on ``device_id``."""
    import cupy

    q_lens, kv_lens = np.asarray(q_lens), np.asarray(kv_lens)
    with cupy.cuda.Device(device_id):
        table, k, v, cache, q_host = paged_case(rng, DTYPE, HEADS, D, page_size, kv_lens, int(q_lens.sum()))
        q = cupy.asarray(q_host)
    assert cache.device_id == device_id and q.device.id == device_id
    return dict(q_lens=q_lens, kv_lens=kv_lens, table=table, k=k, v=v, cache=cache, q_host=q_host, q=q)


def reference(step):
    from cupy_fa import reference as ref

    return ref.paged_attention(step["q_host"], step["k"], step["v"], step["q_lens"], step["kv_lens"], step["table"])


@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("bound,current", PAIRS, ids=["inputs-on-1-current-0", "inputs-on-0-current-1"])
def test_batch_attention_on_the_inputs_device(bound, current, page_size):
    import cupy
    import cupy_fa

    rng, _ = new_rng()
    # decode, verify-sized, a long prefill and padding: both kernel families and the split merge
    step = make_step(rng, bound, page_size, [1, 4, 0, 77, 1, 9], [3001, 515, 7, 77, 1, 1200])
    ref = reference(step)
    with cupy.cuda.Device(bound):
        out = cupy.full((step["q"].shape[0] + 3,) + step["q"].shape[1:], POISON, np_dtype(DTYPE))
        q_dev, kv_dev, pt_dev = (cupy.asarray(x, np.int32) for x in (step["q_lens"], step["kv_lens"], step["table"]))
    before = used_bytes(current)
    with cupy.cuda.Device(current):
        attn = cupy_fa.BatchAttention(*HEADS, D, DTYPE, device=bound)
        attn.plan(step["q_lens"], step["kv_lens"], step["table"])             # host lengths
        got = attn.run(step["q"], step["cache"])                              # allocated out, on `bound`
        attn.run(step["q"], step["cache"], out=out[:step["q"].shape[0]])
        assert cupy.cuda.runtime.getDevice() == current
        dev_attn = cupy_fa.BatchAttention(*HEADS, D, DTYPE, device=bound)
        dev_attn.plan(q_dev, kv_dev, pt_dev, max_q_len=77, max_kv_len=3001)  # device lengths
        dev_out = dev_attn.run(step["q"], step["cache"])
        assert attn.status().ok and dev_attn.status().ok
    assert got.device.id == bound and dev_out.device.id == bound
    buffers = attn._buffers
    assert {getattr(buffers, name).device.id for name in vars(buffers) if hasattr(getattr(buffers, name), "device")} \
        == {bound}
    assert used_bytes(current) == before, "something was allocated on the current device"
    with cupy.cuda.Device(bound):
        assert_matches(got, ref, DTYPE, step["q_lens"], f"host plan on {bound} (current {current})")
        assert_matches(dev_out, ref, DTYPE, step["q_lens"], f"device plan on {bound} (current {current})")
        from cupy_fa.reference import check_attention

        check_attention(out, ref, DTYPE, q_lens=step["q_lens"], poison=POISON).assert_ok()
        assert (bits(got) == bits(out[:step["q"].shape[0]])).all()


@pytest.mark.parametrize("bound,current", PAIRS, ids=["inputs-on-1-current-0", "inputs-on-0-current-1"])
def test_graph_runner_and_cache_on_the_inputs_device(bound, current):
    """GraphRunner: static buffers, its BatchAttention and captured graphs on ``bound``; replay ==
    eager bit for bit; PagedKVCache.allocate / append there too, while ``current`` is current."""
    import cupy
    import cupy_fa
    from cupy_fa import ForwardMode

    rng, _ = new_rng()
    page_size, batch = 16, 5
    kv_lens = rng.integers(20, 900, batch)
    before = used_bytes(current)
    with cupy.cuda.Device(current):
        runner = cupy_fa.GraphRunner(*HEADS, D, DTYPE, max_batch_size=8, max_q_len=4, max_pages_per_request=64,
                                     page_size=page_size, device=bound)
        cache = cupy_fa.PagedKVCache.allocate(batch * 64 + 1, page_size, HEADS[1], D, DTYPE, device=bound)
    assert runner.q.device.id == bound and cache.k.device.id == bound
    # every request's keys through append (host slots), pages shuffled over the cache
    pages = rng.permutation(np.arange(1, batch * 64 + 1))[:batch * 64].reshape(batch, 64).astype(np.int32)
    k = rng.standard_normal((int(kv_lens.sum()), HEADS[1], D), dtype=np.float32).astype(np_dtype(DTYPE))
    v = rng.standard_normal(k.shape, dtype=np.float32).astype(np_dtype(DTYPE))
    slots = np.concatenate([pages[b, np.arange(n) // page_size] * page_size + np.arange(n) % page_size
                            for b, n in enumerate(kv_lens)])
    with cupy.cuda.Device(bound):
        k_dev, v_dev = cupy.asarray(k), cupy.asarray(v)
        q_host = rng.standard_normal((batch * 4, HEADS[0], D), dtype=np.float32).astype(np_dtype(DTYPE))
        q = cupy.asarray(q_host)
    def keep(x):  # a copy of the runner's static output before the next step overwrites it, on its device
        with cupy.cuda.Device(bound):
            return x.copy()

    with cupy.cuda.Device(current):
        cache.append(k_dev, v_dev, slots)
        assert cache.status().ok
        q_lens = np.full(batch, 4)
        eager = keep(runner.run(ForwardMode.TARGET_VERIFY, q, cache, q_lens, kv_lens, pages, use_graph=False))
        first = keep(runner.run(ForwardMode.TARGET_VERIFY, q, cache, q_lens, kv_lens, pages))   # capture
        again = keep(runner.run(ForwardMode.TARGET_VERIFY, q, cache, q_lens, kv_lens, pages))   # replay
        assert runner.num_graphs == 1 and runner.status().ok
        assert cupy.cuda.runtime.getDevice() == current
    assert used_bytes(current) == before, "something was allocated on the current device"
    assert eager.device.id == first.device.id == bound
    # the reference over the keys as appended: a dense [pages, page_size] view of what we wrote
    k_pages = np.full((batch * 64 + 1, page_size, HEADS[1], D), np.nan, np.float32)
    v_pages = k_pages.copy()
    k_pages.reshape(-1, HEADS[1], D)[slots] = k
    v_pages.reshape(-1, HEADS[1], D)[slots] = v
    from cupy_fa import reference as ref

    expected = ref.paged_attention(q_host, k_pages.astype(np_dtype(DTYPE)), v_pages.astype(np_dtype(DTYPE)), q_lens,
                                   kv_lens, pages)
    with cupy.cuda.Device(bound):
        assert_matches(eager, expected, DTYPE, q_lens, f"GraphRunner eager on {bound} (current {current})")
        assert (bits(first) == bits(eager)).all() and (bits(again) == bits(eager)).all(), "replay != eager"


@pytest.mark.parametrize("bound,current", PAIRS, ids=["inputs-on-1-current-0", "inputs-on-0-current-1"])
def test_merge_states_on_the_inputs_device(bound, current):
    import cupy
    import cupy_fa
    from cupy_fa import reference as ref

    rng, _ = new_rng()
    n, h, d = 33, 8, 128
    a = rng.standard_normal((n, h, d), dtype=np.float32).astype(np_dtype(DTYPE))
    b = rng.standard_normal((n, h, d), dtype=np.float32).astype(np_dtype(DTYPE))
    la, lb = (rng.standard_normal((n, h)).astype(np.float32) * 4 for _ in range(2))
    with cupy.cuda.Device(bound):
        args = [cupy.asarray(x) for x in (a, la, b, lb)]
    before = used_bytes(current)
    with cupy.cuda.Device(current):
        out, lse = cupy_fa.merge_states(*args)
    assert out.device.id == lse.device.id == bound and used_bytes(current) == before
    want, want_lse = ref.merge_states(a, la, b, lb)
    with cupy.cuda.Device(bound):
        assert ref.relative_error(out.get().astype(np.float64), want) < ref.TOL[DTYPE] / 4
        assert np.allclose(lse.get(), want_lse, atol=1e-4)


def test_inputs_on_another_device_are_refused_before_anything_is_written():
    import cupy
    import cupy_fa

    rng, _ = new_rng()
    on_1 = make_step(rng, 1, 16, [1, 3], [40, 19])
    on_0 = make_step(rng, 0, 16, [1, 3], [40, 19])
    attn = cupy_fa.BatchAttention(*HEADS, D, DTYPE, device=1)
    attn.plan(on_1["q_lens"], on_1["kv_lens"], on_1["table"])
    with cupy.cuda.Device(1):
        out = cupy.full(on_1["q"].shape, POISON, np_dtype(DTYPE))
    with pytest.raises(ValueError, match=r"^q is on device 0, expected device 1"):
        attn.run(on_0["q"], on_1["cache"], out=out)
    with pytest.raises(ValueError, match=r"^cache is on device 0, expected device 1"):
        attn.run(on_1["q"], on_0["cache"], out=out)
    with cupy.cuda.Device(0):
        out_0 = cupy.full(on_1["q"].shape, POISON, np_dtype(DTYPE))
        lens_0 = cupy.asarray(on_1["q_lens"], np.int32)
    with pytest.raises(ValueError, match=r"^out is on device 0, expected device 1"):
        attn.run(on_1["q"], on_1["cache"], out=out_0)
    with pytest.raises(ValueError, match=r"^q_lens is on device 0, expected device 1"):
        attn.plan(lens_0, lens_0, on_1["table"], max_q_len=3)
    with cupy.cuda.Device(0):
        k_0 = on_0["q"][:, :HEADS[1]].copy()
    with pytest.raises(ValueError, match=r"^k_new is on device 0, expected device 1 \(the device of this cache\)"):
        on_1["cache"].append(k_0, k_0, [0, 1, 2, 3])
    runner = cupy_fa.GraphRunner(*HEADS, D, DTYPE, max_batch_size=2, max_q_len=3, max_pages_per_request=8,
                                 page_size=16, device=1)
    with pytest.raises(ValueError, match=r"^q is on device 0, expected device 1 \(the device this GraphRunner"):
        runner.run(cupy_fa.ForwardMode.EXTEND, on_0["q"], on_1["cache"], on_1["q_lens"], on_1["kv_lens"],
                   on_1["table"])
    with pytest.raises(ValueError, match=r"^cache is on device 0, expected device 1"):
        runner.run(cupy_fa.ForwardMode.EXTEND, on_1["q"], on_0["cache"], on_1["q_lens"], on_1["kv_lens"],
                   on_1["table"])
    cupy.cuda.Device(0).synchronize()
    cupy.cuda.Device(1).synchronize()
    assert (out.get() == POISON).all() and (out_0.get() == POISON).all(), "a refused run wrote its output"
    with cupy.cuda.Device(1):
        out_b = on_1["q"][:2].copy()
    with cupy.cuda.Device(0):
        with pytest.raises(ValueError, match="out_b is on device 1, expected device 0"):
            cupy_fa.merge_states(cupy.zeros((2, 8, 128), np_dtype(DTYPE)), cupy.zeros((2, 8), np.float32),
                                 out_b, cupy.zeros((2, 8), np.float32))


def test_compile_cache_holds_a_module_per_device():
    import cupy
    import cupy_fa
    from cupy_fa import _build

    rng, _ = new_rng()
    for device_id in (0, 1):
        step = make_step(rng, device_id, 16, [1, 2], [300, 80])
        attn = cupy_fa.BatchAttention(*HEADS, D, DTYPE, device=device_id)
        attn.plan(step["q_lens"], step["kv_lens"], step["table"])
        with cupy.cuda.Device(device_id):
            assert_matches(attn.run(step["q"], step["cache"]), reference(step), DTYPE, step["q_lens"],
                           f"device {device_id}")
    on_0, on_1 = set(_build.compiled_kernels(device_id=0)), set(_build.compiled_kernels(device_id=1))
    shared = on_0 & on_1
    assert shared, "the same step compiled no common variant on the two devices"
    for variant in shared:
        assert _build.get_function(variant, 0) is not _build.get_function(variant, 1)
