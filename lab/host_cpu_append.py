"""The caches' append host time on a machine without a GPU (lab probe, 2026-12-08): PagedKVCache.append
(8 KV heads, D 128) and PagedLatentCache.append (576 columns) with device slots, every device call
stubbed as in lab/host_cpu_mla.py (the array intake included, so no DLPack exchange is in either tree's
figure); a probe for predicting the GPU host's figures, not one of them.

    PYTHONPATH=. python lab/host_cpu_append.py      (repo root, CuPy installed, no GPU needed)
"""

import contextlib
import os
import sys
import threading

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import host_cpu as H  # noqa: E402
import host_cpu_mla as HM  # noqa: E402


def main():
    HM.install()
    from cupy_fa import _arrays

    bf16 = _arrays.DTYPES["bfloat16"]
    cache = H.fake_cache(4096, 16)
    cache._status, cache._device = HM.StridedFake((1,), np.uint64), contextlib.nullcontext()
    cache._append_launches, cache._append_lock = {}, threading.Lock()  # (a tree before them ignores them)
    latent = HM.fake_latent(4096, 64)
    latent._device, latent._append_launches, latent._append_lock = contextlib.nullcontext(), {}, threading.Lock()
    print(f"host us per append, device calls stubbed (median; {sys.version.split()[0]})")
    for b in (1, 64):
        k, v = HM.StridedFake((b, 8, 128), bf16), HM.StridedFake((b, 8, 128), bf16)
        ckv, kpe = HM.StridedFake((b, 512), bf16), HM.StridedFake((b, 64), bf16)
        slots = HM.StridedFake((b,), np.int32)
        for name, fn in ((f"PagedKVCache.append B={b}", lambda: cache.append(k, v, slots)),
                         (f"PagedLatentCache.append B={b}", lambda: latent.append(ckv, kpe, slots))):
            fn()
            print(f"{name:32s} {H.median_us(fn, 2000):8.1f}")


if __name__ == "__main__":
    main()
