"""NumPy mirrors of the MLA family's params structs (``kernels/mla/params.cuh``): one structured
scalar per launch, passed as raw bytes. Every MLA kernel's compile checks their sizes
(:func:`size_checks`); ``tests/test_mla_cpu.py`` compares names, types and order with the header."""

import numpy as np

_PTR = np.uint64

FIELDS = {
    "MlaParams": [
        ("q_nope", _PTR), ("q_pe", _PTR), ("cache", _PTR), ("out", _PTR), ("lse", _PTR), ("partial_out", _PTR),
        ("partial_lse", _PTR), ("page_table", _PTR), ("custom_mask", _PTR), ("q_indptr", _PTR), ("kv_lens", _PTR),
        ("work_indptr", _PTR), ("num_splits", _PTR), ("split_keys", _PTR), ("partial_indptr", _PTR),
        ("mask_indptr", _PTR), ("status", _PTR), ("kv_scale", _PTR),
        ("q_nope_token_stride", np.int64), ("q_nope_head_stride", np.int64),
        ("q_pe_token_stride", np.int64), ("q_pe_head_stride", np.int64),
        ("batch_size", np.int32), ("num_heads", np.int32), ("page_size", np.int32), ("page_shift", np.int32),
        ("page_table_stride", np.int32), ("mask_mode", np.int32), ("sm_scale_log2", np.float32),
        ("head_multiplier", np.uint32), ("head_shift", np.int32),
        ("num_pages", np.int32), ("page_table_columns", np.int32), ("num_tokens", np.int32), ("mask_entries", np.int32),
    ],
    "MlaAppendParams": [
        ("ckv", _PTR), ("kpe", _PTR), ("cache", _PTR), ("slots", _PTR), ("status", _PTR), ("scale", _PTR),
        ("num_slots", np.int64), ("ckv_stride", np.int64), ("kpe_stride", np.int64), ("num_tokens", np.int32),
    ],
}

DTYPES = {name: np.dtype(fields, align=True) for name, fields in FIELDS.items()}
_REQUIRED = {name: frozenset(dtype.names) for name, dtype in DTYPES.items()}


def make(struct_name, **values):
    """A NumPy scalar of the struct with every field set (a missing or unknown field is an error)."""
    dtype = DTYPES[struct_name]
    if values.keys() != _REQUIRED[struct_name]:
        missing = _REQUIRED[struct_name] - values.keys()
        unknown = values.keys() - _REQUIRED[struct_name]
        raise TypeError(f"{struct_name}: missing {sorted(missing)}, unknown {sorted(unknown)}")
    return np.array(tuple(values[field] for field in dtype.names), dtype)[()]


def size_checks():
    """C++ constant expressions every MLA kernel compiles: the structs' sizes as the host packs them."""
    return tuple(f"sizeof(cupy_fa::mla::{name}) == {dtype.itemsize}" for name, dtype in DTYPES.items())
