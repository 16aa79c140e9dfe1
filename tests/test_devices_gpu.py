"""Device binding on one GPU: instances record the device they are bound to, their buffers live
there, a device id this process has none of is refused before anything is allocated, and the
caller's current device is left as it was. Inputs on a second device: tests/test_multi_gpu.py."""

import numpy as np
import pytest

from cases import new_rng
from safety_cases import assert_matches, device_step, reference_of

pytestmark = pytest.mark.gpu

DTYPE, HEADS, D, PAGE = "bfloat16", (8, 2), 128, 16


def test_bound_to_the_current_device_or_the_given_one():
    import cupy
    import cupy_fa

    count = cupy.cuda.runtime.getDeviceCount()
    last = count - 1
    with cupy.cuda.Device(last):
        attn = cupy_fa.BatchAttention(*HEADS, D, DTYPE, max_batch_size=4, max_num_tokens=16, max_pages_per_request=8)
    assert attn.device_id == last and attn._buffers.partial_out.device.id == last
    for given in (last, f"cuda:{last}", cupy.cuda.Device(last)):
        assert cupy_fa.BatchAttention(*HEADS, D, DTYPE, device=given).device_id == last
    runner = cupy_fa.GraphRunner(*HEADS, D, DTYPE, max_batch_size=2, max_q_len=1, max_pages_per_request=4,
                                 page_size=PAGE, device=last)
    assert runner.device_id == runner.attn.device_id == last and runner.q.device.id == last
    cache = cupy_fa.PagedKVCache.allocate(4, PAGE, HEADS[1], D, DTYPE, device=last)
    assert cache.device_id == last and cache.k.device.id == last
    with pytest.raises(ValueError, match=f"^device is {count}, but this process sees {count} CUDA device"):
        cupy_fa.BatchAttention(*HEADS, D, DTYPE, device=count)
    for bad in (count, -1, "cpu"):
        with pytest.raises(ValueError, match="^device "):
            cupy_fa.BatchAttention(*HEADS, D, DTYPE, device=bad)
        with pytest.raises(ValueError, match="^device "):
            cupy_fa.PagedKVCache.allocate(4, PAGE, HEADS[1], D, DTYPE, device=bad)


def test_calls_leave_the_current_device_as_they_found_it():
    """plan, run, append, status and a graph step each make the bound device current once and put
    the caller's back (here the same device: the cross-device run is tests/test_multi_gpu.py)."""
    import cupy
    import cupy_fa

    rng, _ = new_rng()
    step = device_step(rng, DTYPE, HEADS, D, PAGE, [1, 5, 30], [700, 64, 31])
    before = cupy.cuda.runtime.getDevice()
    attn = cupy_fa.BatchAttention(*HEADS, D, DTYPE)
    attn.plan(step["q_lens"], step["kv_lens"], step["table"])
    out = attn.run(step["q"], step["cache"])
    assert cupy.cuda.runtime.getDevice() == before
    assert attn.status().ok and cupy.cuda.runtime.getDevice() == before
    assert_matches(out, reference_of(step), DTYPE, step["q_lens"], "bound to the current device")
    cache = cupy_fa.PagedKVCache.allocate(2, PAGE, HEADS[1], D, DTYPE)
    k_new = rng.standard_normal((2, HEADS[1], D), dtype=np.float32).astype(cache.k.dtype)
    v_new = rng.standard_normal((2, HEADS[1], D), dtype=np.float32).astype(cache.k.dtype)
    cache.append(cupy.asarray(k_new), cupy.asarray(v_new), [3, PAGE + 5])
    assert cupy.cuda.runtime.getDevice() == before and cache.status().ok
    k, v = cache.k.get().reshape(-1, HEADS[1], D), cache.v.get().reshape(-1, HEADS[1], D)
    assert (k[[3, PAGE + 5]].view(np.uint16) == k_new.view(np.uint16)).all()
    assert (v[[3, PAGE + 5]].view(np.uint16) == v_new.view(np.uint16)).all()
