"""The catalog of compiled kernels: every kernel the library launches, named by all its
compile-time parameters (a :class:`cupy_fa._compile.Kernel`: source file + name expression),
the lists CI compiles (:func:`all_kernels`) and a device warms up (:func:`warmup_kernels`,
:func:`warmup`).

What a step runs is :mod:`cupy_fa.schedule`'s choice (a tile per class of requests, the merge's
shape); this module turns those choices into kernels: :func:`attention_kernel` asks the tile's
family (:mod:`cupy_fa.families`) for it, the others are the shared kernels of
``kernels/shared/`` (plan, merge, append, merge_states).
"""

from __future__ import annotations

import dataclasses
import functools
import re

import numpy as np

from . import _arrays, _build, _compile, schedule
from ._compile import Kernel
from .families import is_small_q_tile, mma_sync, sm90
from .families import mla as mla_family
from .families.common import (FP8, FP8_HEAD_DIMS, HEAD_DIM_PAIRS, HEAD_DIMS, MERGE_GROUP, SM80_SMEM_LIMIT, SMEM_LIMIT,
                              ElementTypes, is_sm90a, split_merge_kernel)
from .families.mma_sync import MmaTile
from .knobs import STAGE_CHOICES

_BUILDERS = {mma_sync.MMA_SYNC: mma_sync.kernel, sm90.SM90_WGMMA: sm90.kernel}


@functools.lru_cache(maxsize=None)
def attention_kernel(dtype, tile):
    """The attention kernel of a tile (its family's template) for element types ``dtype`` (a
    dtype name, or an ``ElementTypes``; the wgmma family takes one element type for Q, KV and O;
    a tile's ``kv_bytes`` must be the KV type's)."""
    types = ElementTypes.of(dtype)
    if tile.kv_bytes != types.kv_bytes:
        raise ValueError(f"internal: tile {tile} is for {tile.kv_bytes}-byte K/V, the KV type is {types.kv}")
    return _BUILDERS[tile.family](types, tile)


@functools.lru_cache(maxsize=None)
def merge_kernel(dtype_name, head_dim, shape):
    """The split merge (kernels/shared/merge.cu) of one output type and head dim, in a shape of
    ``schedule.MERGE_SHAPES`` (heads per CTA, ways over split groups; 0: a way per group)."""
    heads_per_cta, ways = shape
    if ways == 0:  # a way per group of splits, up to 1024 threads (32 ways at D=128: one group each)
        lanes = head_dim // 4 * heads_per_cta
        ways = min(1024 // lanes, schedule.MAX_SPLITS // MERGE_GROUP)
        while lanes * ways % 32:  # whole warps (D = 192: 20 ways of 48 lanes): its warp-wide search
            ways -= 1
    return split_merge_kernel(dtype_name, head_dim, heads_per_cta, ways, schedule.MAX_SPLITS)


MERGE_STATES_THREADS = 256  # kernels/shared/merge_states.cu's launch bounds: head_dim / 4 threads a row


@functools.lru_cache(maxsize=None)
def merge_states_kernel(dtype_name):
    """cupy_fa.merge_states' kernel (kernels/shared/merge_states.cu) for one output type; any head
    dim that is a multiple of 4 up to 4 x MERGE_STATES_THREADS."""
    return Kernel("shared/merge_states.cu", f"cupy_fa::merge_states_kernel<{_compile.CTYPES[dtype_name]}>",
                  MERGE_STATES_THREADS)


@functools.lru_cache(maxsize=None)
def append_kernel(index_dtype, quantize_from=None):
    """The append kernel for slots of ``index_dtype``: a copy, or (``quantize_from``: the new
    rows' dtype name) the fp8 cache's quantising one."""
    index = {"int32": "int", "int64": "long long"}[np.dtype(index_dtype).name]
    if quantize_from is not None:
        return Kernel("shared/kv_append.cu",
                      f"cupy_fa::append_quantize_kernel<{index}, {_compile.CTYPES[quantize_from]}>", 256)
    return Kernel("shared/kv_append.cu", f"cupy_fa::append_kernel<{index}>", 256)


PLAN_KERNEL = Kernel("shared/plan.cu", "cupy_fa::plan_kernel", 1024)
# a step's device inputs into the static buffers in one launch (kernels/shared/stage.cu, cupy_fa._staging)
STAGE_KERNEL = Kernel("shared/stage.cu", "cupy_fa::stage_kernel", 256)


def _merge_kernels(dtype_name, head_dim):
    return [merge_kernel(dtype_name, head_dim, shape) for _, shape in schedule.MERGE_SHAPES]


def all_kernels(arch=None):
    """Every kernel the library can launch, on Hopper or on an A100, under any knob values (what
    CI compiles): with ``arch`` those an ``arch`` build can run (the wgmma family only for sm_90a);
    None: every one (they all compile for sm_90a)."""
    out = [PLAN_KERNEL, STAGE_KERNEL, append_kernel(np.int32), append_kernel(np.int64)]
    out += [merge_states_kernel(dtype_name) for dtype_name in _compile.CTYPES]
    out += [append_kernel(i, d) for d in _compile.CTYPES for i in (np.int32, np.int64)]
    for dtype_name in _compile.CTYPES:
        for head_dim in HEAD_DIMS:
            out += _merge_kernels(dtype_name, head_dim)
            kernels = (attention_kernel(dtype_name, t) for t in _tiles(head_dim, arch))
            out += list({k.expression: k for k in kernels}.values())  # one per distinct kernel
            if head_dim in FP8_HEAD_DIMS:
                out += fp8_kernels(dtype_name, head_dim, fp8_tiles(head_dim, arch=arch))
    out += mla_family.all_kernels(arch)  # multi-head latent attention (cupy_fa.mla)
    for dtype_name in _compile.CTYPES:  # separate qk / vo head dims (their merge is the vo head dim's)
        for head_dim, head_dim_vo in HEAD_DIM_PAIRS:
            kernels = (attention_kernel(dtype_name, t) for t in _tiles(head_dim, arch, head_dim_vo))
            out += list({k.expression: k for k in kernels}.values())
    return out


def _tiles(head_dim, arch, head_dim_vo=None):
    """The 16-bit cache's tiles the policy can select at a head dim (or a pair), plain and with the
    variant hooks: the prefill tiles, the small-q tiles of both row layouts at each depth for
    Hopper's and an A100's shared memory, and their folding tiles."""
    # mma.sync prefill: any target but sm_90a (there: no wgmma fit)
    tiles = [schedule.prefill_tile(head_dim, head_dim_vo=head_dim_vo)]
    if arch is None or is_sm90a(arch):  # the wgmma family's tile (every head dim, and the pairs)
        tiles.append(sm90.prefill_tile(head_dim, head_dim_vo=head_dim_vo))
    for warps_m in (1, 2):
        for stages in STAGE_CHOICES:
            for limit in (SMEM_LIMIT, SM80_SMEM_LIMIT):  # what Hopper and what A100 pick
                tile = mma_sync.small_q_tile(head_dim, warps_m, stages, limit, head_dim_vo=head_dim_vo)
                tiles += [tile, tile.folding(smem_limit=limit)]
    tiles = [t for t in tiles if t is not None]
    return tiles + [t.with_variants() for t in tiles]  # each with the variant hooks (window, soft-cap, sinks)


def fp8_tiles(head_dim, stage_choices=None, limits=(SMEM_LIMIT, SM80_SMEM_LIMIT), arch=None):
    """The tiles of an fp8 cache the policy can select at a head dim: the mma.sync prefill tile
    and the small-q tiles (both row layouts, each depth, Hopper's and an A100's shared memory)
    with their folding tiles and one-row-half tiles; where ``arch`` is sm_90a or None (any), also
    the one-row-half tiles with a producer warpgroup and the wgmma family's fp8 tile;
    ``stage_choices``: the depths (default the policy's)."""
    tiles = [schedule.prefill_tile(head_dim, kv_bytes=1)]
    if arch is None or is_sm90a(arch):  # the wgmma family's fp8 tile
        tiles.append(sm90.prefill_tile(head_dim, kv_bytes=1))
    for warps_m in (1, 2):
        for stages in stage_choices or (mma_sync.fp8_small_q_shape(head_dim)[1],):
            for limit in limits:
                tile = mma_sync.small_q_tile(head_dim, warps_m, stages, limit, kv_bytes=1)
                tiles += [tile, tile.folding(smem_limit=limit)]
                if warps_m == 1:  # and with one row half (tile_for: requests of <= 8 rows), and a producer warpgroup
                    half = dataclasses.replace(tile, row_halves=1)
                    tiles += [half, half.folding(smem_limit=limit)]
                    if half.producer_warp_layout and (arch is None or is_sm90a(arch)):
                        ring = dataclasses.replace(half, producer_capable=True)
                        tiles += [ring, ring.folding(smem_limit=limit)]
    return [t for t in tiles if t is not None]


def fp8_kernels(dtype_name, head_dim, tiles=None):
    """The attention kernels over an fp8 cache with ``dtype_name`` queries and outputs, each once,
    plain and with the variant hooks (the merge, plan and append kernels are the 16-bit ones')."""
    types = ElementTypes(dtype_name, FP8, dtype_name)
    tiles = fp8_tiles(head_dim) if tiles is None else tiles
    kernels = (attention_kernel(types, t) for t in tiles + [t.with_variants() for t in tiles])
    return list({k.expression: k for k in kernels}.values())


def warmup_kernels(dtypes=("float16", "bfloat16"), head_dims=HEAD_DIMS, smem_limit=SMEM_LIMIT, arch=None,
                   kv_dtypes=None, variants=False):
    """Every kernel that plans with these dtypes and head dims can select under the knobs in
    force, on a device with ``smem_limit`` and ``arch`` (the small-q tiles of either class, the
    prefill family of the arch, the merges, plan and append, and merge_states'). ``head_dims``:
    ints, or (qk, vo) pairs of HEAD_DIM_PAIRS (``BatchAttention(..., head_dim_vo=)``: 16-bit caches
    only). ``kv_dtypes``: the cache dtypes (default: each query dtype's own; add
    ``"float8_e4m3fn"`` for an fp8 cache, head dims 64, 128 and 256 only: FP8_HEAD_DIMS); with
    ``variants`` each attention kernel with the variant hooks too (what steps with a window, a
    soft-cap or sinks run)."""
    wanted = [PLAN_KERNEL, STAGE_KERNEL, append_kernel(np.int32), append_kernel(np.int64)]
    wanted += [merge_states_kernel(dtype_name) for dtype_name in dtypes]
    for dtype_name in dtypes:
        for dims in head_dims:
            head_dim, head_dim_vo = (dims if isinstance(dims, tuple) else (dims, None))
            if head_dim_vo is not None and (head_dim, head_dim_vo) not in HEAD_DIM_PAIRS:
                raise ValueError(f"head_dims takes ints and the (qk, vo) pairs {HEAD_DIM_PAIRS}, got {dims!r}")
            wanted += _merge_kernels(dtype_name, head_dim_vo or head_dim)  # the merge runs at V's head dim
            for kv in (kv_dtypes or (dtype_name,)):
                kv = FP8 if _arrays.resolve_kv_dtype(kv, "kv_dtypes") == FP8 else dtype_name
                if kv == FP8 and (head_dim not in FP8_HEAD_DIMS or head_dim_vo is not None):
                    continue  # no fp8 tile at this head dim or pair (BatchAttention refuses it)
                types = ElementTypes(dtype_name, kv, dtype_name)
                if kv == FP8:
                    wanted += [append_kernel(np.int32, dtype_name), append_kernel(np.int64, dtype_name)]
                # each layout tile_for picks: one row half, the one-row tile, the two-row tile, prefill
                for max_q_len, group in ((1, 1), (4, 4), (schedule.SMALL_Q_LEN, 4), (schedule.SMALL_Q_LEN + 1, 1)):
                    tile = schedule.tile_for(head_dim, max_q_len, group, smem_limit, arch, types.kv_bytes,
                                             head_dim_vo=head_dim_vo)
                    folded = tile.folding(smem_limit=smem_limit) if is_small_q_tile(tile) else None  # fold_tile's pick
                    picked = [t for t in (tile, folded) if t is not None]
                    picked += [t.with_variants() for t in picked] if variants else []
                    wanted += [attention_kernel(types, t) for t in picked]
    return list({k: None for k in wanted})


def warmup(dtypes=("float16", "bfloat16"), head_dims=HEAD_DIMS, kv_dtypes=None, variants=False, device=None,
           jobs=None, progress=None):
    """Compiles (or loads from the disk cache) every kernel that plans with these dtypes and
    head dims (ints, or (qk, vo) pairs such as (192, 128)) can select under the current knobs, on
    ``device`` (an int id, a ``cupy.cuda.Device``,
    a torch cuda device; default CuPy's current device: each device loads its own), so no compile happens
    inside a step or a graph capture (``kv_dtypes=("bfloat16", "float8_e4m3fn")``: an fp8 cache's
    too); ``variants=True`` adds the kernels with the variant hooks (steps with a sliding window,
    a logits soft-cap or attention sinks). The missing ones compile in ``jobs`` processes at once
    (default every core; ``_compile.compile_many``), with a progress line on stderr when it is a
    terminal (``progress=True`` / ``False`` to force it on / off). Returns how many."""
    _arrays.require_cuda()
    import cupy

    device_id = _arrays.resolve_device(device)
    with cupy.cuda.Device(device_id):
        arch = _build.device_arch(device_id)
        wanted = warmup_kernels(dtypes, head_dims, _build.device_smem_limit(device_id), arch, kv_dtypes, variants)
        _compile.compile_many(wanted, _build.loadable_arch(device_id), jobs, progress)  # what get_function loads
        for kernel in wanted:
            _build.get_function(kernel, device_id)  # now a load from the cache
    return len(wanted)


# Dynamic shared memory one CTA may opt in to, by compute capability (the CUDA programming guide's
# table): the tiles warmup_kernels picks depend on it, so a target named without a device needs it.
SMEM_LIMITS = {80: SM80_SMEM_LIMIT, 86: 99 * 1024, 87: SM80_SMEM_LIMIT, 89: 99 * 1024, 90: SMEM_LIMIT, 100: SMEM_LIMIT,
               103: SMEM_LIMIT, 120: 99 * 1024, 121: 99 * 1024}


def smem_limit_of(arch):
    """The opt-in shared memory of a target such as ``sm_90a``; ``ValueError`` naming ``--arch``
    for anything else."""
    found = re.fullmatch(r"sm_(\d+)(a?)", arch or "")
    if not found or int(found.group(1)) not in SMEM_LIMITS:
        known = ", ".join(f"sm_{cc}" + ("a" if cc == 90 else "") for cc in sorted(SMEM_LIMITS))
        raise ValueError(f"--arch must be one of {known} (sm_90a on Hopper), got {arch!r}")
    return SMEM_LIMITS[int(found.group(1))]
