"""The NumPy params dtypes match kernels/shared/params.cuh field by field (CPU)."""

import re

import numpy as np

from cases import new_rng
from cupy_fa import _params
from cupy_fa import _compile

C_TYPES = {"int": np.int32, "unsigned": np.uint32, "float": np.float32, "long long": np.int64}


def parse_structs(text):
    structs = {}
    for name, body in re.findall(r"struct (\w+) \{(.*?)\};", text, re.S):
        fields = []
        for line in body.splitlines():
            line = line.split("//")[0].strip()
            if not line:
                continue
            m = re.match(r"(?:const )?([\w ]+?)\s*(\*?)\s*(\w+)(?:\[(\w+)\])?;$", line)
            assert m, f"cannot parse field line {line!r} of {name}"
            ctype, pointer, field, count = m.groups()
            base = np.uint64 if pointer else C_TYPES.get(ctype) or _params.DTYPES[ctype]  # a struct of the header
            fields.append((field, (base, (_params.STAGE_COPIES,)) if count == "kStageCopies" else base))
        structs[name] = fields
    return structs


def test_params_match_header():
    text = (_compile.KERNEL_DIR / "shared" / "params.cuh").read_text()
    assert int(re.search(r"constexpr int kStageCopies = (\d+);", text).group(1)) == _params.STAGE_COPIES
    header = parse_structs(text)
    assert set(header) == set(_params.DTYPES)
    for name, fields in header.items():
        dtype = _params.DTYPES[name]
        assert list(dtype.names) == [f for f, _ in fields], name
        for field, ctype in fields:
            assert dtype.fields[field][0] == np.dtype(ctype), f"{name}.{field}"


def test_make_rejects_missing_and_unknown_fields():
    import pytest

    with pytest.raises(TypeError, match="missing"):
        _params.make("MergeParams", out=0)
    fields = {f: 0 for f in _params.DTYPES["MergeParams"].names}
    with pytest.raises(TypeError, match="unknown"):
        _params.make("MergeParams", bogus=1, **fields)
    record = _params.make("MergeParams", **fields)
    assert record.dtype.itemsize == _params.DTYPES["MergeParams"].itemsize


def test_make_matches_fieldwise_assignment():
    rng, _ = new_rng()
    for name, dtype in _params.DTYPES.items():
        if name.startswith("Stage"):  # an array of structs: its writer is tests/test_graph_host_cpu.py's
            continue
        values = {}
        for field in dtype.names:
            kind = dtype.fields[field][0]
            values[field] = float(rng.random()) if kind.kind == "f" else int(rng.integers(0, 2**31))
        expected = np.zeros((), dtype)
        for field, value in values.items():
            expected[field] = value
        made = _params.make(name, **values)
        assert made.dtype == dtype
        for field in values:  # padding bytes may differ: the kernels never read them
            assert made[field].tobytes() == expected[field].tobytes(), f"{name}.{field}"


def test_fast_divisor_divides_exactly():
    """kernels/shared/common.cuh FastDiv with _params.fast_divisor's (multiplier, shift): the same
    quotient as integer division for every dividend the kernels can pass (0 <= n < 2^31)."""
    import pytest

    def fast_div(n, d):
        multiplier, shift = _params.fast_divisor(d)
        if multiplier == 0:
            return n
        return ((n * np.uint64(multiplier)) >> np.uint64(32)) >> np.uint64(shift)  # __umulhi, then >>

    rng, _ = new_rng()
    edges = np.array([0, 1, 2, 3, 2**16 - 1, 2**16, 2**30, 2**31 - 2, 2**31 - 1], np.uint64)
    small = np.arange(0, 1 << 16, dtype=np.uint64)
    divisors = list(range(1, 65)) + [127, 128, 129, 1000, 65535, 65536, 2**30 + 1, 2**31 - 1]
    divisors += [int(d) for d in rng.integers(1, 2**31, 64)]
    for d in divisors:
        n = np.concatenate([edges, small, rng.integers(0, 2**31, 4096).astype(np.uint64)])
        assert np.array_equal(fast_div(n, d), n // np.uint64(d)), d
        multiplier, shift = _params.fast_divisor(d)
        assert 0 <= multiplier < 2**32 and 0 <= shift < 32
    for bad in (0, -1, 2**31):
        with pytest.raises(ValueError, match="divisor"):
            _params.fast_divisor(bad)
