"""MLAAttention's plan and run on the host without a GPU (every device call stubbed, as lab/host_cpu.py
stubs them, and recorded; tests/test_graph_host_cpu.py's fixture): what a run hands the driver (the
queries' addresses and strides, out, lse, the token count, in the structs packed once per plan), that
a later run writes only what moved, and that bad input raises before anything is launched."""

import numpy as np
import pytest

from cupy_fa import _arrays, _build, _views
from lab import host_cpu, host_cpu_mla
from test_graph_host_cpu import device  # noqa: F401 - the fixture

Strided, Sliced = host_cpu_mla.StridedFake, host_cpu_mla.SlicedFake
BF16 = _arrays.DTYPES["bfloat16"]


@pytest.fixture
def launches(device, monkeypatch):  # noqa: F811 - the fixture above
    """Every packed launch of the test: (kernel, its struct's fields by name, grid); the fake views
    (lab/host_cpu_mla.py) read as CuPy arrays. tests/test_append_host_cpu.py takes it too."""
    found = []
    for cls in (Strided, Sliced):
        monkeypatch.setitem(_views._KINDS, cls, _views.CUPY)
    monkeypatch.setattr(_build, "launch_packed", lambda launch, stream_ptr: found.append(
        (launch.kernel, {n: launch.packed[0][n].item() for n in launch.packed.dtype.names}, launch._grid3)))
    return found


def planned(heads=128, batch=4, q_len=1, kv_len=3000):
    import cupy_fa

    pages = -(-kv_len // 64)
    table = np.arange(batch * pages, dtype=np.int32).reshape(batch, pages)
    attn = cupy_fa.MLAAttention(heads, "bfloat16")
    attn.plan(np.full(batch, q_len), np.full(batch, kv_len), table)
    return attn, host_cpu_mla.fake_latent(batch * pages, 64), batch * q_len


def test_run_hands_the_kernels_its_arrays(launches):
    """One [T, H, 576] q (q_pe 1024 bytes into each row), then q_nope and q_pe apart with strides of
    their own (two column slices of a wider array), then another out and an lse: the attention
    struct holds each run's addresses and strides, the merge's out and lse; nothing else moved."""
    heads = 128
    attn, cache, tokens = planned(heads)
    q, out = Strided((tokens, heads, 576), BF16), Strided((tokens, heads, 512), BF16)
    attn.run(q, cache, out=out)
    kinds = [k.source for k, _, _ in launches]
    assert kinds == ["shared/plan.cu", "mla/wgmma.cu", "shared/merge.cu"], kinds
    first = launches[1][1]
    assert (first["q_nope"], first["q_pe"]) == (q.data.ptr, q.data.ptr + 1024)
    assert (first["q_nope_token_stride"], first["q_nope_head_stride"]) == (heads * 576, 576)
    assert (first["q_pe_token_stride"], first["q_pe_head_stride"]) == (heads * 576, 576)
    assert (first["out"], first["lse"], first["num_tokens"]) == (out.data.ptr, 0, tokens)
    assert first["cache"] == cache.latent.data.ptr and launches[2][1]["out"] == out.data.ptr

    wide = Strided((tokens, heads, 1024), BF16)  # q_nope / q_pe: two column slices, rows 2048 bytes apart
    rows = (heads * 2048, 2048, 2)
    nope = Sliced((tokens, heads, 512), BF16, wide.data.ptr, rows)
    pe = Sliced((tokens, heads, 64), BF16, wide.data.ptr + 1024 * 2, rows)
    out2, lse = Strided((tokens, heads, 512), BF16), Strided((tokens, heads), np.float32)
    launches.clear()
    attn.run(nope, cache, out=out2, q_pe=pe, lse=lse)
    second = launches[0][1]
    assert (second["q_nope"], second["q_pe"]) == (wide.data.ptr, wide.data.ptr + 2048)
    assert (second["q_nope_token_stride"], second["q_nope_head_stride"]) == (heads * 1024, 1024)
    assert (second["q_pe_token_stride"], second["q_pe_head_stride"]) == (heads * 1024, 1024)
    assert (second["out"], second["lse"]) == (out2.data.ptr, lse.data.ptr)
    assert launches[1][1]["out"] == out2.data.ptr and launches[1][1]["lse"] == lse.data.ptr
    assert {k: v for k, v in second.items() if k not in ("q_nope", "q_pe", "out", "lse") and "stride" not in k} == \
        {k: v for k, v in first.items() if k not in ("q_nope", "q_pe", "out", "lse") and "stride" not in k}


@pytest.mark.parametrize("bad,match", [
    ("out_misaligned", "out must start on a 16-byte boundary"),
    ("out_shape", r"out has shape"),
    ("lse_dtype", "lse must have dtype float32"),
    ("q_heads", r"q must be \[T, H, 576\]"),
    ("q_dtype", "q must have dtype bfloat16"),
    ("q_rows", "rows must start on 16-byte boundaries"),
    ("host_q", "q must be a CUDA device array"),
])
def test_bad_run_raises_before_any_launch(launches, bad, match):
    heads = 16
    attn, cache, tokens = planned(heads)
    q, out = Strided((tokens, heads, 576), BF16), Strided((tokens, heads, 512), BF16)
    lse = None
    if bad == "out_misaligned":
        out = Strided((tokens, heads, 512), BF16, out.data.ptr + 8)
    elif bad == "out_shape":
        out = Strided((tokens, heads, 256), BF16)
    elif bad == "lse_dtype":
        lse = Strided((tokens, heads), np.float16)
    elif bad == "q_heads":
        q = Strided((tokens, heads + 1, 576), BF16)
    elif bad == "q_dtype":
        q = Strided((tokens, heads, 576), np.float16)
    elif bad == "q_rows":
        q = Strided((tokens, heads, 576), BF16, q.data.ptr + 2)
    else:
        q = np.zeros((tokens, heads, 576), np.float16)
    launches.clear()
    with pytest.raises((ValueError, TypeError), match=match):
        attn.run(q, cache, out=out, lse=lse)
    assert launches == []
