"""Compiling the MLA kernels ahead of the first step (so none compiles inside a step or a capture)."""

from .. import _arrays, _build, _compile, catalog
from ..families import mla as family
from . import schedule


def warmup_kernels(dtypes=("bfloat16",), kv_dtypes=None, arch="sm_90a", heads=(16, 128)):
    """The kernels MLA steps of these query dtypes, cache dtypes (default each query dtype's own; add
    "float8_e4m3fn" for an fp8 cache) and head counts can select on ``arch``: every tile either class
    takes, the merges, the appends, and the plan and staging kernels."""
    wanted = [catalog.PLAN_KERNEL, catalog.STAGE_KERNEL]
    for dtype in dtypes:
        for kv in kv_dtypes or (dtype,):
            fp8 = _arrays.resolve_kv_dtype(kv, "kv_dtypes") == _arrays.FP8
            tiles = set()
            for h in heads:
                tiles |= {schedule.small_q_tile(h, fp8, arch, q) for q in (1, schedule.SMALL_Q_LEN)}
                tiles.add(schedule.long_tile(h, fp8, arch))
            wanted += [family.kernel(dtype, t) for t in sorted(tiles, key=repr)]
            wanted += [family.append_kernel(i, dtype, fp8) for i in ("int32", "int64")]
        wanted += [family.merge_kernel(dtype, shape) for shape in (family.MERGE_WIDE, family.MERGE_DEEP)]
    return list(dict.fromkeys(wanted))


def warmup(dtypes=("bfloat16",), kv_dtypes=None, heads=(16, 128), device=None, jobs=None, progress=None):
    """Compiles (or loads from the disk cache) every MLA kernel these steps can select on ``device``
    (default CuPy's current one), in ``jobs`` processes at once; returns how many."""
    _arrays.require_cuda()
    import cupy

    device_id = _arrays.resolve_device(device)
    with cupy.cuda.Device(device_id):
        arch = _build.device_arch(device_id)
        wanted = warmup_kernels(dtypes, kv_dtypes, arch, heads)
        _compile.compile_many(wanted, arch, jobs, progress)
        for kernel in wanted:
            _build.get_function(kernel, device_id)
    return len(wanted)
