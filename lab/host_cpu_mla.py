"""MLAAttention's host time of plan / run on a machine without a GPU (lab probe, 2026-12-08): every device
call stubbed as in lab/host_cpu.py (plus CuPy's kernel call and the array intake), so what is timed is
cupy_fa's own Python between the calls; a probe for predicting the GPU host's figures, not one of them.

    PYTHONPATH=. python lab/host_cpu_mla.py [--profile]      (repo root, CuPy installed, no GPU needed)
"""

import argparse
import os
import sys
import types

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import host_cpu as H  # noqa: E402

CELLS = [("decode B=64 L=4096 H=128", 128, 64, 1, 4096), ("decode B=64 L=4096 H=16", 16, 64, 1, 4096),
         ("decode B=1 L=32768 H=128", 128, 1, 1, 32768), ("verify q=4 B=64 L=4096 H=128", 128, 64, 4, 4096)]


class StridedFake(H.FakeArray):
    """A FakeArray with the strides and itemsize MLAAttention's query intake reads."""
    itemsize = property(lambda self: self.dtype.itemsize)

    @property
    def strides(self):
        out, step = [], self.dtype.itemsize
        for n in reversed(self.shape):
            out.append(step)
            step *= n
        return tuple(reversed(out))


class SlicedFake(StridedFake):
    """A StridedFake with strides of its own (a column slice of a wider array)."""

    def __init__(self, shape, dtype, ptr, strides):
        super().__init__(shape, dtype, ptr)
        self._strides = strides

    strides = property(lambda self: self._strides)


def install():
    H.install()
    from cupy_fa import _arrays, _build

    class Function:  # a loaded kernel: its CUfunction, and CuPy's RawKernel call (counted, does nothing)
        kernel = types.SimpleNamespace(ptr=1)

        def __call__(self, *args, **kwargs):
            H.CALLS["cupy kernel call"] = H.CALLS.get("cupy kernel call", 0) + 1

    function = Function()
    _build.get_function = lambda kernel, device_id=None: function
    _arrays.to_cupy = lambda x, name: x  # (the intake before cupy_fa._views)
    _arrays.check_device = lambda *a, **k: None
    from cupy_fa import _views

    _views._KINDS[StridedFake] = _views.CUPY


def fake_latent(num_pages, page_size):
    from cupy_fa.mla.cache import PagedLatentCache

    cache = PagedLatentCache.__new__(PagedLatentCache)
    cache.latent = cache.source = StridedFake((num_pages, page_size, 576), np.uint16)
    cache.dtype_name, cache.device_id, cache.num_pages, cache.page_size = "bfloat16", 0, num_pages, page_size
    cache.scale = cache.scale_device = None
    cache._status = StridedFake((1,), np.int32)
    return cache


def cell(heads, b, q_len, kv_len):
    """(plan, run) of an MLAAttention step (bf16, page 64) over a fake cache; planned and run once."""
    import cupy_fa
    from cupy_fa import _arrays

    pages = -(-kv_len // 64)
    table = np.arange(b * pages, dtype=np.int32).reshape(b, pages)
    q_lens, kv_lens = np.full(b, q_len, np.int32), np.full(b, kv_len, np.int32)
    cache = fake_latent(b * pages, 64)
    attn = cupy_fa.MLAAttention(heads, "bfloat16")
    bf16 = _arrays.DTYPES["bfloat16"]
    q, out = StridedFake((b * q_len, heads, 576), bf16), StridedFake((b * q_len, heads, 512), bf16)
    plan, run = (lambda: attn.plan(q_lens, kv_lens, table)), (lambda: attn.run(q, cache, out=out))
    plan()
    run()
    return plan, run


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--profile", action="store_true", help="cProfile of each call kind, top functions")
    args = parser.parse_args(argv)
    install()
    print(f"host us per call, device calls stubbed (median; {sys.version.split()[0]})")
    print(f"{'MLA cell (bf16, page 64)':32s} {'plan':>8s} {'run':>8s}   driver calls a run")
    for name, *shape in CELLS:
        plan, run = cell(*shape)
        H.CALLS.clear()
        run()
        calls = " ".join(f"{k} {v}" for k, v in sorted(H.CALLS.items()))
        print(f"{name:32s} {H.median_us(plan, 500):8.1f} {H.median_us(run, 2000):8.1f}   {calls}")
        if args.profile:
            H.print_profiles(name, 2000, plan=plan, run=run)


if __name__ == "__main__":
    main()
