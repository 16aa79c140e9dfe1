"""The caches' append on the host without a GPU (every device call stubbed, as lab/host_cpu.py stubs
them, and recorded; tests/test_graph_host_cpu.py's fixture): the append kernel's struct, packed once
per cache and rewritten call after call, holds what a fresh fill of every field gives (new rows,
slots, token count; both arrays of separate K / V widths; an fp8 cache's scales; the latent rows'
strides), its grid covers the rows, and bad input raises before anything is launched."""

import contextlib
import threading

import numpy as np
import pytest

from cupy_fa import _arrays
from lab import host_cpu, host_cpu_mla
from test_graph_host_cpu import device  # noqa: F401 - the stubs, recorded
from test_mla_host_cpu import launches  # noqa: F401 - every packed launch, recorded

Strided, Sliced = host_cpu_mla.StridedFake, host_cpu_mla.SlicedFake
BF16 = _arrays.DTYPES["bfloat16"]


def fields(record):
    return {n: record[n].item() for n in record.dtype.names}


def kv_cache(head_dim=128, head_dim_v=None, fp8=False):
    """A PagedKVCache over fake arrays (1024 pages of 16 tokens, 8 KV heads)."""
    cache = host_cpu.fake_cache(1024, 16, d=head_dim)
    cache.head_dim_v = head_dim_v or head_dim
    cache.v = Strided((1024, 16, 8, cache.head_dim_v), np.float16)
    cache._status, cache._device = Strided((1,), np.uint64), contextlib.nullcontext()
    cache._append_launches, cache._append_lock = {}, threading.Lock()
    cache.k_scale_device = cache.v_scale_device = None
    if fp8:
        cache.dtype_name = _arrays.FP8
        cache.k_scale_device, cache.v_scale_device = Strided((8,), np.float32), Strided((8,), np.float32)
    return cache


@pytest.mark.parametrize("fp8", [False, True])
def test_kv_append_struct_is_the_full_fill(launches, fp8):
    cache = kv_cache(fp8=fp8)
    for tokens, index in ((5, np.int32), (300, np.int64), (1, np.int32)):
        k, v = Strided((tokens, 8, 128), BF16), Strided((tokens, 8, 128), BF16)
        slots = Strided((tokens,), index)
        launches.clear()
        cache.append(k, v, slots)
        (kernel, got, grid), = launches
        c_index = "int" if index == np.int32 else "long long"
        assert kernel.expression == (f"cupy_fa::append_quantize_kernel<{c_index}, __nv_bfloat16>" if fp8
                                     else f"cupy_fa::append_kernel<{c_index}>")
        want = cache.append_params(cache.k, cache.v, 128, k_new=k.data.ptr, v_new=v.data.ptr, slots=slots.data.ptr,
                                   num_tokens=tokens)
        assert got == fields(want)
        assert grid[0] * kernel.threads >= tokens * 8 * 128 // 8 > (grid[0] - 1) * kernel.threads


def test_kv_append_of_separate_widths_launches_each_array(launches):
    cache = kv_cache(192, 128)
    tokens = 7
    k, v, slots = Strided((tokens, 8, 192), BF16), Strided((tokens, 8, 128), BF16), Strided((tokens,), np.int64)
    cache.append(k, v, slots)
    assert len(launches) == 2
    for (_, got, _), (new, arr, dim) in zip(launches, ((k, cache.k, 192), (v, cache.v, 128))):
        assert got == fields(cache.append_params(arr, arr, dim, k_new=new.data.ptr, v_new=new.data.ptr,
                                                 slots=slots.data.ptr, num_tokens=tokens))


@pytest.mark.parametrize("bad,match", [
    ("k_shape", r"k_new has shape"),
    ("k_misaligned", "k_new must start on a 16-byte boundary"),
    ("v_shape", r"v_new has shape"),
    ("k_dtype", "k_new must have dtype bfloat16"),
    ("slots_float", "slots must hold integers"),
    ("slots_2d", "slots must have 1 dimension"),
    ("slots_count", "slots has 4 entries, k_new has 5 tokens"),
    ("host_k", "k_new must be a CUDA device array"),
])
def test_kv_append_bad_input_launches_nothing(launches, bad, match):
    cache = kv_cache()
    cache.dtype_name = "bfloat16"
    k, v, slots = Strided((5, 8, 128), BF16), Strided((5, 8, 128), BF16), Strided((5,), np.int32)
    if bad == "k_shape":
        k = Strided((5, 4, 128), BF16)
    elif bad == "k_misaligned":
        k = Strided((5, 8, 128), BF16, k.data.ptr + 8)
    elif bad == "v_shape":
        v = Strided((5, 8, 64), BF16)
    elif bad == "k_dtype":
        k = Strided((5, 8, 128), np.float16)
    elif bad == "slots_float":
        slots = Strided((5,), np.float32)
    elif bad == "slots_2d":
        slots = Strided((5, 1), np.int32)
    elif bad == "slots_count":
        slots = Strided((4,), np.int32)
    else:
        k = np.zeros((5, 8, 128), np.float16)
    with pytest.raises((ValueError, TypeError), match=match):
        cache.append(k, v, slots)
    assert launches == []


@pytest.mark.parametrize("fp8", [False, True])
def test_latent_append_struct_is_the_full_fill(launches, fp8):
    """c_kv and k_pe as column slices of one [T, 576] array, then as [T, 1, W] arrays of their own."""
    cache = host_cpu_mla.fake_latent(1024, 64)
    cache._device, cache._append_launches, cache._append_lock = contextlib.nullcontext(), {}, threading.Lock()
    if fp8:
        cache.dtype_name, cache.scale_device = _arrays.FP8, Strided((1,), np.float32)
    tokens = 9
    rows = Strided((tokens, 576), BF16)
    ckv = Sliced((tokens, 512), BF16, rows.data.ptr, (576 * 2, 2))
    kpe = Sliced((tokens, 64), BF16, rows.data.ptr + 1024, (576 * 2, 2))
    slots = Strided((tokens,), np.int64)
    cache.append(ckv, kpe, slots)
    (kernel, got, grid), = launches
    want = cache.append_params(ckv=rows.data.ptr, kpe=rows.data.ptr + 1024, slots=slots.data.ptr, ckv_stride=576,
                               kpe_stride=576, num_tokens=tokens)
    assert got == fields(want) and ("true" in kernel.expression) == fp8
    assert grid[0] * kernel.threads >= tokens * 72
    launches.clear()
    ckv, kpe = Strided((3, 1, 512), BF16), Strided((3, 1, 64), BF16)
    slots = Strided((3,), np.int64)
    cache.append(ckv, kpe, slots)
    (_, got, _), = launches
    assert got == fields(cache.append_params(ckv=ckv.data.ptr, kpe=kpe.data.ptr, slots=slots.data.ptr,
                                             ckv_stride=512, kpe_stride=64, num_tokens=3))
