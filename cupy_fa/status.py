"""The device status word (``kernels/shared/status.cuh``), read back as a :class:`Status`.

Device metadata, the lengths and page table of a CUDA-graph step, cannot be read by the host
without a sync, so the kernels check it: a request that breaks the contract never reads or writes
outside its buffers, its rows of ``out`` are written NaN, the other requests are computed exactly
as without it, and the first bad request is recorded in a 64-bit word on the device,
``(request << 8) | reason`` (the lowest request, then its lowest reason). Reading it syncs;
``BatchAttention.status()`` and ``PagedKVCache.status()`` do.
"""

import numpy as np

OK = (1 << 64) - 1  # kStatusOk: no bad request

# kernels/shared/status.cuh BadRequest: code -> what was wrong (tests/test_status_cpu.py checks the mirror)
REASONS = {
    1: "q_len is negative",
    2: "q_len is above kv_len (kv_len counts this step's tokens too)",
    3: "q_len is above the max_q_len the plan was given",
    4: "kv_len is above the max_kv_len the plan was given",
    5: "kv_len needs more pages than the page table has columns",
    6: "a page id it reads is not a page of the cache",
    7: "its query rows run past the rows of q",
    8: "its custom-mask block runs past the mask the plan was given",
    9: "its slot is outside the cache",
}


class Status(int):
    """0 when nothing was wrong, else 1 + the index of the first bad request (``int`` as before:
    ``status() == 0`` still reads "all good"). Attributes: ``ok``, ``request`` (None when ok),
    ``reason`` (the code of :data:`REASONS`, 0 when ok) and ``what`` (its text).

    ``str()`` is a sentence naming the request and what was wrong."""

    def __new__(cls, word, unit="request"):
        word = int(word)
        if word == OK:
            self = super().__new__(cls, 0)
            self.request, self.reason = None, 0
        else:
            self = super().__new__(cls, (word >> 8) + 1)
            self.request, self.reason = word >> 8, word & 0xFF
        self.unit = unit
        return self

    @property
    def ok(self):
        return self.request is None

    @property
    def what(self):
        return "" if self.ok else REASONS.get(self.reason, f"unknown reason {self.reason}")

    def __str__(self):
        return "ok" if self.ok else f"{self.unit} {self.request}: {self.what}"

    def __repr__(self):
        return f"Status({self})"


def read(word_array, unit="request"):
    """The Status in a one-element uint64 device (or host) array; the caller has synced."""
    host = word_array.get() if hasattr(word_array, "get") else np.asarray(word_array)
    return Status(int(np.asarray(host).reshape(-1)[0]), unit)
