"""NumPy mirrors of the params structs in ``kernels/shared/params.cuh``.

Each kernel takes one struct by value; CuPy passes a NumPy structured scalar
as raw bytes, so the dtype below must match the C layout exactly. ``align=True``
gives C's natural alignment; :func:`layout_asserts` pins each struct's size in
every compiled kernel and a CPU test compares names, types and order with the
header, so a mismatch fails a build or a test, never misreads silently.
"""

import struct

import numpy as np

_PTR = np.uint64

_FIELDS = {
    "PlanParams": [
        ("q_lens", _PTR), ("kv_lens", _PTR), ("q_indptr", _PTR), ("work_indptr", _PTR), ("long_work_indptr", _PTR),
        ("num_splits", _PTR), ("split_keys", _PTR), ("partial_indptr", _PTR), ("mask_indptr", _PTR),
        ("status", _PTR),
        ("batch_size", np.int32), ("group_size", np.int32), ("block_m", np.int32), ("block_n", np.int32),
        ("long_q_len", np.int32), ("long_block_m", np.int32), ("long_block_n", np.int32),
        ("split_size", np.int32), ("max_splits", np.int32), ("small_q_len", np.int32),
        ("split_row_budget", np.int32), ("splits_per_cta", np.int32), ("fold_splits", np.int32),
        ("partial_capacity", np.int32), ("max_q_len", np.int32), ("max_kv_len", np.int32),
        ("key_base", _PTR), ("window", np.int32),
    ],
    "AttentionParams": [
        ("q", _PTR), ("k_cache", _PTR), ("v_cache", _PTR), ("out", _PTR), ("lse", _PTR),
        ("partial_out", _PTR), ("partial_lse", _PTR), ("page_table", _PTR), ("custom_mask", _PTR),
        ("q_indptr", _PTR), ("kv_lens", _PTR), ("work_indptr", _PTR), ("num_splits", _PTR),
        ("split_keys", _PTR), ("partial_indptr", _PTR), ("mask_indptr", _PTR),
        ("batch_size", np.int32), ("page_size", np.int32), ("page_table_stride", np.int32),
        ("num_qo_heads", np.int32), ("num_kv_heads", np.int32), ("mask_mode", np.int32),
        ("sm_scale_log2", np.float32), ("page_shift", np.int32), ("splits_per_cta", np.int32),
        ("group_multiplier", np.uint32), ("group_shift", np.int32),
        ("fold_splits", np.int32),
        ("status", _PTR), ("num_pages", np.int32), ("page_table_columns", np.int32), ("num_tokens", np.int32),
        ("mask_entries", np.int32), ("k_scale", _PTR), ("v_scale", _PTR),
        ("key_base", _PTR), ("sinks", _PTR), ("window", np.int32), ("soft_cap_scale", np.float32),
        ("soft_cap_log2", np.float32),
    ],
    "MergeParams": [
        ("out", _PTR), ("lse", _PTR), ("partial_out", _PTR), ("partial_lse", _PTR),
        ("q_indptr", _PTR), ("num_splits", _PTR), ("partial_indptr", _PTR),
        ("batch_size", np.int32), ("num_qo_heads", np.int32), ("fold_groups", np.int32),
        ("sinks", _PTR),
    ],
    "AppendParams": [
        ("k_new", _PTR), ("v_new", _PTR), ("k_cache", _PTR), ("v_cache", _PTR), ("slots", _PTR),
        ("num_slots", np.int64), ("num_tokens", np.int32), ("row_chunks", np.int32), ("status", _PTR),
        ("k_scale", _PTR), ("v_scale", _PTR), ("head_chunks", np.int32),
    ],
    "MergeStatesParams": [
        ("out_a", _PTR), ("lse_a", _PTR), ("out_b", _PTR), ("lse_b", _PTR), ("out", _PTR), ("lse", _PTR),
        ("rows", np.int64), ("head_dim", np.int32), ("rows_per_cta", np.int32),
    ],
}

DTYPES = {name: np.dtype(fields, align=True) for name, fields in _FIELDS.items()}

# kernels/shared/stage.cu's struct: a count, then STAGE_COPIES copies (an array of StageCopy)
STAGE_COPIES = 6
DTYPES["StageCopy"] = np.dtype([("src", _PTR), ("dst", _PTR), ("bytes", np.int64), ("rows", np.int32),
                                ("src_pitch", np.int32), ("dst_pitch", np.int32), ("fill_bytes", np.int32),
                                ("fill", np.int32)], align=True)
DTYPES["StageParams"] = np.dtype([("count", np.int32), ("copies", DTYPES["StageCopy"], (STAGE_COPIES,))],
                                 align=True)


_REQUIRED = {name: frozenset(dtype.names) for name, dtype in DTYPES.items()}


def make(struct_name, **values):
    """A NumPy scalar of the struct, every field set (missing fields are an error).
    Built in one call (this runs for every launch): the same np.void a 0-d record yields."""
    dtype = DTYPES[struct_name]
    if values.keys() != _REQUIRED[struct_name]:
        missing = _REQUIRED[struct_name] - values.keys()
        unknown = values.keys() - _REQUIRED[struct_name]
        raise TypeError(f"{struct_name}: missing {sorted(missing)}, unknown {sorted(unknown)}")
    return np.array(tuple(values.get(field, 0) for field in dtype.names), dtype)[()]


_STRUCT_CODES = {("u", 8): "Q", ("i", 8): "q", ("u", 4): "I", ("i", 4): "i", ("f", 4): "f", ("f", 8): "d"}


def field_setter(struct_name, fields, dtypes=None):
    """``write(buffer, values)``: packs ``values`` into ``fields`` of a ``struct_name`` struct held
    in ``buffer`` (a writable byte view of one packed struct), each in its own little-endian
    standard-size format (uint64 pointers as 8 bytes: struct's ``L`` would be 4); fields that
    follow one another in the struct with no padding between them go in one ``pack_into``.
    ``dtypes``: the mirrors the struct is named in (default this module's; the MLA family's are
    cupy_fa._mla_params.DTYPES)."""
    dtype = (DTYPES if dtypes is None else dtypes)[struct_name]
    groups = []  # [offset, format codes, value count]
    for name in fields:
        field, offset = dtype.fields[name][:2]
        code = _STRUCT_CODES[(field.kind, field.itemsize)]
        last = groups[-1] if groups else None
        if last is not None and last[0] + struct.calcsize("<" + last[1]) == offset:
            last[1] += code
            last[2] += 1
        else:
            groups.append([offset, code, 1])
    packers = [(struct.Struct("<" + codes).pack_into, offset, count) for offset, codes, count in groups]
    if len(packers) == 1:
        pack, offset, _ = packers[0]
        return lambda buffer, values: pack(buffer, offset, *values)

    def write(buffer, values):
        start = 0
        for pack, offset, count in packers:
            pack(buffer, offset, *values[start:start + count])
            start += count
    return write


def fast_divisor(d):
    """(multiplier, shift) of kernels/shared/common.cuh FastDiv for a divisor 1 <= d < 2^31:
    n // d == (n * multiplier >> 32) >> shift for every 0 <= n < 2^31 (multiplier 0: d = 1)."""
    if not 1 <= d < 2**31:
        raise ValueError(f"a FastDiv divisor must be in [1, 2^31), got {d}")
    if d == 1:
        return 0, 0
    log2 = (d - 1).bit_length()  # ceil(log2 d)
    return ((1 << (31 + log2)) + d - 1) // d, log2 - 1


def layout_asserts():
    """C++ static_asserts pinning the size of each struct. (NVRTC has no
    offsetof; tests/test_params_layout.py checks field names, types and order
    against kernels/shared/params.cuh instead.)"""
    lines = [f"static_assert(sizeof(cupy_fa::{name}) == {dtype.itemsize}, \"{name} size\");"
             for name, dtype in DTYPES.items()]
    return "\n".join(lines) + "\n"
