"""The status word's decoding (cupy_fa/status.py) and its mirror of kernels/shared/status.cuh."""

import pathlib
import re

import numpy as np

from cupy_fa import status

HEADER = pathlib.Path(__file__).resolve().parent.parent / "kernels" / "shared" / "status.cuh"


def test_reason_codes_mirror_the_header():
    text = HEADER.read_text()
    codes = {int(v): name for name, v in re.findall(r"^\s*(k\w+) = (\d+),", text, re.M)}
    assert sorted(codes) == sorted(status.REASONS), (codes, status.REASONS)
    assert "constexpr StatusWord kStatusOk = ~0ull;" in text and status.OK == 2**64 - 1


def test_decoding():
    ok = status.Status(status.OK)
    assert ok == 0 and ok.ok and ok.request is None and str(ok) == "ok" and not ok
    bad = status.Status((7 << 8) | 6)
    assert bad == 8 and not bad.ok and bad.request == 7 and bad.reason == 6 and bad
    assert str(bad) == "request 7: a page id it reads is not a page of the cache"
    assert repr(bad) == "Status(request 7: a page id it reads is not a page of the cache)"
    token = status.read(np.array([(3 << 8) | 9], np.uint64), unit="token")
    assert int(token) == 4 and str(token) == "token 3: its slot is outside the cache"
    # the lowest request wins, then its lowest reason: atomicMin on (request << 8) | reason
    words = [(5 << 8) | 2, (2 << 8) | 6, (2 << 8) | 4, status.OK]
    assert status.Status(min(words)).request == 2 and status.Status(min(words)).reason == 4
