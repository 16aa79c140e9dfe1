"""Compiles ``kernels/*.cu`` with NVRTC and launches them: the only module that
knows kernels exist as text.

* Every compiled kernel is a :class:`Variant`: a source file plus one name
  expression naming all its compile-time parameters
  (``cupy_fa::attention_kernel<__nv_bfloat16, cupy_fa::TileTraits<128, 1, 4, 64, 2>>``).
* ``cupy.RawModule`` compiles it on first use, once per device, and CuPy's disk
  cache keeps it; the options carry a hash of the whole ``kernels/`` tree, so an
  edited header never hits a stale cache entry.
* Without a GPU, :func:`compile_cubin` drives NVRTC directly (no device needed)
  and reports registers and spills; CI compiles every variant that way.

Environment knobs (all of them):
  ``CUPY_FA_ARCH``            target instead of the device's, e.g. ``sm_90a`` or ``sm_80``.
  ``CUPY_FA_CACHE_DIR``       kernel cache directory (default: CuPy's, ``CUPY_CACHE_DIR``).
  ``CUPY_FA_DECODE_STAGES``   cp.async pipeline depth of the decode-like tiles (default 2; tuning).
  ``CUPY_FA_DECODE_WARPS_M``  1 or 2 rows of warps in decode-like tiles (default auto: 2 above 16 packed rows; tuning).
  ``CUPY_FA_SPLIT_SIZE``      keys per split of small-q requests (default 512; tuning, see cupy_fa/plan.py).
  ``CUPY_FA_SPLITS_PER_CTA``  consecutive splits one decode CTA runs (default 1; tuning, results unchanged).
  ``CUPY_FA_PDL``             ``0``: launch the merge kernel the ordinary way, not as a programmatic
                              dependent of the attention kernel (default on, sm_90+; results unchanged).
  ``CUPY_FA_FOLD_SPLITS``     ``auto`` (default), ``0`` or ``1``: CTAs of small-q tiles fold their
                              splits themselves (a whole row, or a group of 8) instead of a merge
                              kernel (auto: when the batch fills the GPU; results unchanged;
                              cupy_fa/plan.py fold_tile).
  ``CUPY_FA_TRACE``           ``1``: compile the attention kernel's timeline stamps in (diagnosis only,
                              scripts/probe_timeline.py; ``trace_buffer`` reads them).
"""

import ctypes
import dataclasses
import functools
import hashlib
import os
import pathlib
import re
import threading

import numpy as np

from . import _params

# ---- where the sources are ---------------------------------------------------

_PACKAGE_KERNELS = pathlib.Path(__file__).resolve().parent / "kernels"  # inside a wheel
_REPO_KERNELS = pathlib.Path(__file__).resolve().parent.parent / "kernels"  # a source checkout
KERNEL_DIR = _PACKAGE_KERNELS if _PACKAGE_KERNELS.is_dir() else _REPO_KERNELS


@functools.lru_cache(maxsize=None)
def source_hash():
    """Hash of every file under ``kernels/``: part of the compile options."""
    digest = hashlib.sha256()
    for path in sorted(KERNEL_DIR.glob("*.cu*")):
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


# ---- variants --------------------------------------------------------------------

CTYPES = {"float16": "__half", "bfloat16": "__nv_bfloat16"}
HEAD_DIMS = (64, 128, 256)
WARP_LAYOUTS = ((1, 4), (2, 4), (4, 1))  # (warps over query rows, warps over keys)
SMALL_Q_LEN = 16  # batches with q_len <= this are decode-like: the small-q tile and fixed-position splits
MAX_SPLITS_PER_CTA = 64  # CUPY_FA_SPLITS_PER_CTA bound (keeps the kernels' split arithmetic in int32)
STAGE_CHOICES = (2, 3, 4)                 # cp.async pipeline depths a decode-like tile may use
SMEM_LIMIT = 227 * 1024                   # dynamic shared memory per CTA on sm_90 (the kernels' occupancy math)
SM80_SMEM_LIMIT = 163 * 1024              # and on sm_80: tiles are chosen for the device's own limit


@dataclasses.dataclass(frozen=True)
class Variant:
    source: str       # file under kernels/
    expression: str   # name expression (template instance) or extern "C" name
    threads: int
    smem_bytes: int = 0  # dynamic shared memory per CTA
    checks: tuple = ()   # C++ constant expressions that must hold (host mirrors of the kernel's traits)


@dataclasses.dataclass(frozen=True)
class TileShape:
    """Tile of the attention kernel; the C++ TileTraits derives the rest."""
    head_dim: int
    warps_m: int
    warps_n: int
    stages: int = 2
    fold_capable: bool = False  # carries a fold state (TileTraits FOLD): its own kernel binary
    splits_per_cta: int = 1  # consecutive KV splits one CTA runs (schedule only: same kernel binary)
    fold_splits: bool = False  # CTAs fold their splits themselves (AttentionParams::fold_splits)

    def __post_init__(self):
        if self.fold_capable and not self.fold_layout:
            raise ValueError(f"a fold state needs a small-q tile whose epilogue fits one stage (one row of "
                             f"warps, or two at D >= 128), got {self}")
        if self.splits_per_cta != 1 and not self.epilogue_in_stage:
            raise ValueError(f"splits_per_cta={self.splits_per_cta} needs a tile whose epilogue fits one stage; "
                             f"{self} does not")
        if self.fold_splits and not (self.fold_capable and self.splits_per_cta % MERGE_GROUP == 0):
            raise ValueError(f"fold_splits needs a fold-capable tile running whole groups of {MERGE_GROUP} "
                             f"splits per CTA, got {self}")

    @property
    def block_m(self):
        return 16 * self.warps_m

    @property
    def block_n(self):
        return 32 if (self.head_dim == 256 and self.warps_n == 1) else 64

    @property
    def fold_layout(self):
        """Whether this warp layout can carry a fold state: a small-q tile whose epilogue fits
        one stage (one row of warps, or two at D >= 128, half of D per pass)."""
        return self.warps_n > 1 and (self.warps_m == 1 or self.head_dim >= 128)

    @property
    def smem_bytes(self):
        fold = self.block_m * (2 * self.head_dim * 4 + 16) if self.fold_capable else 0  # TileTraits::kSmemFold
        return 2 * self.head_dim * (self.block_m + 2 * self.stages * self.block_n) + fold

    @property
    def epilogue_in_stage(self):
        """The end-of-split epilogue fits in one pipeline stage, at once or in two passes
        (TileTraits::kEpilogueInStage): only then may a CTA run several splits."""
        return self.warps_m * self.warps_n <= self.block_n // 16 or self.fold_capable

    @property
    def min_ctas_per_sm(self):
        """TileTraits::kMinCtasPerSm: CTAs per SM the launch bounds hold small-q tiles to
        (as many as shared memory allows, up to what 128 registers a thread can feed)."""
        by_smem = SMEM_LIMIT // (self.smem_bytes + 1024)
        by_registers = 65536 // (32 * self.warps_m * self.warps_n * 128)
        return 1 if self.warps_n == 1 or by_smem < 1 else min(by_smem, by_registers)

    @property
    def fits(self):
        return self.fits_in(SMEM_LIMIT)

    def fits_in(self, smem_limit):
        """Whether its dynamic shared memory fits a device's per-CTA limit (opt-in)."""
        return self.smem_bytes <= smem_limit

    def deepest_fit(self, smem_limit):
        """This tile with the deepest pipeline up to its own that fits ``smem_limit``, or None."""
        tile = self
        while not tile.fits_in(smem_limit) and tile.stages > min(STAGE_CHOICES):
            tile = dataclasses.replace(tile, stages=tile.stages - 1)
        return tile if tile.fits_in(smem_limit) else None

    def folding(self, groups_per_cta=1, smem_limit=SMEM_LIMIT):
        """This tile with each CTA folding ``groups_per_cta`` groups of MERGE_GROUP splits of
        its row block (plan.fold_tile), in the fold-capable variant with the deepest pipeline
        that still fits ``smem_limit``; None where no such variant exists."""
        if not self.fold_layout:
            return None
        return dataclasses.replace(self, fold_capable=True, splits_per_cta=MERGE_GROUP * groups_per_cta,
                                   fold_splits=True).deepest_fit(smem_limit)


def tile_for(head_dim, max_q_len, group_size, smem_limit=SMEM_LIMIT):
    """Tile for a batch whose longest request has ``max_q_len`` query tokens, on a device
    with ``smem_limit`` bytes of dynamic shared memory per CTA.

    Decode-like batches (``max_q_len <= SMALL_Q_LEN``) spread 4 warps over the keys
    of each 64-key tile (memory-bound: few rows, many keys; may pipeline deeper),
    with a second row of warps when a request packs more than 16 (token x
    head-in-group) rows; they all share (BLOCK_N, WARPS_N), which with the
    fixed split positions keeps decode and verify of a token bit-identical.
    Prefill-like batches put 4 warps over query rows."""
    per_cta = int(os.environ.get("CUPY_FA_SPLITS_PER_CTA", "1"))  # tuning; never changes results
    if not 1 <= per_cta <= MAX_SPLITS_PER_CTA:
        raise ValueError(f"CUPY_FA_SPLITS_PER_CTA must be an int in 1..{MAX_SPLITS_PER_CTA}, got {per_cta}")
    if max_q_len > SMALL_Q_LEN:
        return TileShape(head_dim, 4, 1)
    knob = os.environ.get("CUPY_FA_DECODE_WARPS_M", "auto")  # tuning: force one or two rows of warps
    if knob not in ("auto", "1", "2"):
        raise ValueError(f"CUPY_FA_DECODE_WARPS_M must be auto, 1 or 2, got {knob!r}")
    warps_m = int(knob) if knob != "auto" else (1 if max(max_q_len, 1) * group_size <= 16 else 2)
    stages = int(os.environ.get("CUPY_FA_DECODE_STAGES", "2"))
    if stages not in STAGE_CHOICES:
        raise ValueError(f"CUPY_FA_DECODE_STAGES must be one of {STAGE_CHOICES}, got {stages}")
    tile = small_q_tile(head_dim, warps_m, stages, smem_limit)
    if tile.epilogue_in_stage:
        tile = dataclasses.replace(tile, splits_per_cta=per_cta)
    return tile


def small_q_tile(head_dim, warps_m, stages, smem_limit=SMEM_LIMIT):
    """The small-q tile with the deepest pipeline up to ``stages`` that fits this head dim
    and ``smem_limit``. The two-row tile carries a fold state (where its layout can, at
    D >= 128) when it fits: registers already hold it at 2 CTAs per SM, which the state
    keeps (at D = 256 only Hopper's shared memory has room; elsewhere it runs without, one
    split per CTA). The one-row tile gets one per batch (its ``folding()``, chosen by
    plan.fold_tile), as it costs it a CTA per SM."""
    base = TileShape(head_dim, warps_m, 4, stages)
    for fold in ((True, False) if warps_m == 2 and base.fold_layout else (False,)):
        tile = dataclasses.replace(base, fold_capable=fold).deepest_fit(smem_limit)
        if tile is not None:
            return tile
    raise ValueError(f"no small-q tile of head dim {head_dim} fits {smem_limit} bytes of shared memory per CTA")


@functools.lru_cache(maxsize=None)
def attention_variant(dtype_name, tile):
    fold = str(tile.fold_capable).lower()
    traits = (f"cupy_fa::TileTraits<{tile.head_dim}, {tile.warps_m}, {tile.warps_n}, {tile.block_n}, "
              f"{tile.stages}, {fold}>")
    expr = f"cupy_fa::attention_kernel<{CTYPES[dtype_name]}, {traits}>"
    # TileShape mirrors these traits to size the launch and plan the work; the compile checks it
    checks = (f"{traits}::kSmemBytes == {tile.smem_bytes}",
              f"{traits}::kEpilogueInStage == {str(tile.epilogue_in_stage).lower()}",
              f"{traits}::kMinCtasPerSm == {tile.min_ctas_per_sm}",
              f"cupy_fa::kTraceCtas == {TRACE_SHAPE[0]} && cupy_fa::kTraceStamps == {TRACE_SHAPE[1]}")
    return Variant("attention.cu", expr, 32 * tile.warps_m * tile.warps_n, tile.smem_bytes, checks)


TRACE_SHAPE = (1 << 15, 6)  # kernels/common.cuh (kTraceCtas, kTraceStamps): trace_buffer's shape


MAX_SPLITS = 256  # KV splits of one request at most (cupy_fa/plan.py); sizes the merge's shared memory
# Merge shapes (kernels/attention.cu MergeTraits): (heads per CTA, ways over split groups).
# Both fold in the same order, so the choice never changes a bit.
MERGE_GROUP = 8  # splits folded in order before the groups are (softmax.cuh kMergeGroup)
MERGE_WIDE = (8, 1)  # many tokens: one CTA per 8 heads of a token, one way
MERGE_DEEP = (1, 8)  # fewer tokens with more splits: one head, 8 ways
MERGE_DEEPEST = (1, 0)  # a few rows of long requests: one head, a way per group (up to 1024 threads)
# (from tokens x H_q rows, shape): wide while it still gives every SM a CTA, the deepest
# for a handful of rows (B=1 L=131072: 256 splits folded by 32 ways at once, not 8 x 4)
MERGE_SHAPES = ((1024, MERGE_WIDE), (256, MERGE_DEEP), (0, MERGE_DEEPEST))


def merge_shape(num_tokens, num_qo_heads):
    rows = num_tokens * num_qo_heads
    return next(shape for min_rows, shape in MERGE_SHAPES if rows >= min_rows)


@functools.lru_cache(maxsize=None)
def merge_variant(dtype_name, head_dim, shape):
    heads_per_cta, ways = shape
    if ways == 0:  # a way per group of splits, up to 1024 threads (32 ways at D=128: one group each)
        ways = min(1024 // (head_dim // 4 * heads_per_cta), MAX_SPLITS // MERGE_GROUP)
    expr = (f"cupy_fa::merge_kernel<{CTYPES[dtype_name]}, "
            f"cupy_fa::MergeTraits<{head_dim}, {heads_per_cta}, {ways}, {MAX_SPLITS}>>")
    return Variant("attention.cu", expr, head_dim // 4 * heads_per_cta * ways)


def append_variant(index_dtype):
    index = {"int32": "int", "int64": "long long"}[np.dtype(index_dtype).name]
    return Variant("kv_append.cu", f"cupy_fa::append_kernel<{index}>", 256)


PLAN_VARIANT = Variant("plan.cu", "cupy_fa::plan_kernel", 1024)


def all_variants():
    """Every kernel the library can launch (what CI compiles)."""
    out = [PLAN_VARIANT, append_variant(np.int32), append_variant(np.int64)]
    for dtype_name in CTYPES:
        for head_dim in HEAD_DIMS:
            out += [merge_variant(dtype_name, head_dim, shape) for _, shape in MERGE_SHAPES]
            tiles = [TileShape(head_dim, 4, 1)]  # prefill
            for warps_m in (1, 2):
                for stages in STAGE_CHOICES:
                    for limit in (SMEM_LIMIT, SM80_SMEM_LIMIT):  # what Hopper and what A100 pick
                        tile = small_q_tile(head_dim, warps_m, stages, limit)
                        tiles += [tile, tile.folding(smem_limit=limit)]
            variants = (attention_variant(dtype_name, t) for t in tiles if t is not None)
            out += list({v.expression: v for v in variants}.values())  # one per kernel binary
    return out


# ---- compile options -----------------------------------------------------------


@functools.lru_cache(maxsize=None)
def include_dirs():
    """CUDA headers the way a user's install finds them: the nvidia-cuda-runtime
    wheel through cuda.pathfinder, else a toolkit under CUDA_PATH."""
    dirs = [str(KERNEL_DIR)]
    try:
        from cuda import pathfinder

        found = pathfinder.find_nvidia_header_directory("cudart")
        if found:
            dirs.append(str(found))
    except Exception:  # pathfinder missing or nothing found: fall back below
        pass
    if len(dirs) == 1:
        for root in (os.environ.get("CUDA_PATH"), os.environ.get("CUDA_HOME"), "/usr/local/cuda"):
            if root and os.path.isfile(os.path.join(root, "include", "cuda_fp16.h")):
                dirs.append(os.path.join(root, "include"))
                break
    try:  # CuPy ships the CCCL headers (<nv/target>) that cuda_fp16.h includes
        import cupy

        cccl = pathlib.Path(cupy.__file__).parent / "_core" / "include" / "cupy" / "_cccl"
        dirs += [str(p) for p in (cccl / "libcudacxx", cccl / "cub", cccl / "thrust") if p.is_dir()]
    except ImportError:
        pass
    return tuple(dirs)


def compile_options(arch):
    options = ["-std=c++17", f"-DCUPY_FA_SOURCE_HASH={source_hash()}"]
    options += [f"-I{d}" for d in include_dirs()]
    options.append(f"-arch={arch}")
    if arch.endswith("90a"):
        options.append("-DCUPY_FA_REQUIRE_SM90A")
    if os.environ.get("CUPY_FA_TRACE") == "1":
        options.append("-DCUPY_FA_TRACE")
    return tuple(options)


def program_text(variant):
    """What NVRTC compiles: the kernel file, the params layout asserts and the variant's
    checks of the host's mirrors of its traits."""
    checks = "".join(f'static_assert({c}, "host mirror: {c}");\n' for c in variant.checks)
    return f'#include "{variant.source}"\n' + _params.layout_asserts() + checks


def device_arch(device):
    override = os.environ.get("CUPY_FA_ARCH")
    if override:
        return override
    major, minor = divmod(int(device.compute_capability), 10)
    if major < 8:
        raise RuntimeError(f"cupy_fa needs compute capability 8.0 or newer, device has {major}.{minor}")
    return f"sm_{major}{minor}a" if (major, minor) == (9, 0) else f"sm_{major}{minor}"


# ---- the device: its limits, read once per device --------------------------------


def device_attribute(name):
    """A CUDA device attribute of CuPy's current device (e.g. ``MultiProcessorCount``,
    ``MaxSharedMemoryPerBlockOptin``), queried once per device: plans read these every step."""
    import cupy

    return _device_attribute(cupy.cuda.Device().id, name)


@functools.lru_cache(maxsize=None)
def _device_attribute(device_id, name):
    import cupy

    return int(cupy.cuda.Device(device_id).attributes[name])


def device_smem_limit():
    """Dynamic shared memory one CTA may opt in to (227 KB on sm_90, 163 KB on sm_80): tiles
    are chosen to fit it."""
    return device_attribute("MaxSharedMemoryPerBlockOptin")


# ---- compile on a device, memoised ----------------------------------------------

_functions = {}
_modules = {}  # the same keys: the module each function lives in (trace_buffer)
_lock = threading.Lock()


def get_function(variant):
    """The launchable ``cupy.RawKernel`` of a variant on the current device."""
    import cupy

    device = cupy.cuda.Device()
    key = (device.id, variant)
    fn = _functions.get(key)
    if fn is not None:
        return fn
    with _lock:
        fn = _functions.get(key)
        if fn is None:
            if os.environ.get("CUPY_FA_CACHE_DIR"):
                os.environ.setdefault("CUPY_CACHE_DIR", os.environ["CUPY_FA_CACHE_DIR"])
            module = cupy.RawModule(
                code=program_text(variant),
                options=compile_options(device_arch(device)),
                name_expressions=[variant.expression],
            )
            fn = module.get_function(variant.expression)
            if variant.smem_bytes > 48 * 1024:
                fn.max_dynamic_shared_size_bytes = variant.smem_bytes
            _modules[key] = module
            _functions[key] = fn
    return fn


def trace_buffer(variant):
    """The timeline stamps of ``variant`` on the current device (``CUPY_FA_TRACE=1`` builds of
    attention.cu only): a uint64 cupy array [kTraceCtas, kTraceStamps] (kernels/common.cuh) of
    (start, first K/V tile, done, ns in epilogues, ns waiting at the loop top, SM id) per CTA,
    written by each launch (zero it in between to tell launches apart)."""
    import cupy

    module = _modules[(cupy.cuda.Device().id, variant)]
    pointer = module.get_global("cupy_fa_trace")
    return cupy.ndarray(TRACE_SHAPE, cupy.uint64, pointer)


def launch(variant, grid, params, stream, programmatic=False):
    """Launches one variant with its params struct on ``stream`` (a cupy Stream).

    ``programmatic=True`` launches it as a programmatic dependent of the kernel
    before it in the stream (sm_90+; kernels/common.cuh wait_for_prior_grid): its
    CTAs may start while that kernel's last wave still runs. Only for kernels that
    wait before reading what their predecessor writes; elsewhere (older GPUs, no
    driver entry point, ``CUPY_FA_PDL=0``) it is an ordinary launch."""
    fn = get_function(variant)
    if programmatic and _programmatic_launch_enabled():
        _launch_programmatic(fn, grid, variant.threads, variant.smem_bytes, stream.ptr, params)
        return
    with stream:
        fn(tuple(grid), (variant.threads,), (params,), shared_mem=variant.smem_bytes)


# ---- programmatic dependent launch through the driver (CuPy has no launch attributes) ----

_CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION = 6  # cuda.h CUlaunchAttributeID


class _LaunchAttribute(ctypes.Structure):  # cuda.h CUlaunchAttribute: id, pad to 8, 64-byte value union
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_int * 16)]


class _LaunchConfig(ctypes.Structure):  # cuda.h CUlaunchConfig
    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3), ("shared_mem_bytes", ctypes.c_uint),
                ("stream", ctypes.c_void_p), ("attrs", ctypes.POINTER(_LaunchAttribute)),
                ("num_attrs", ctypes.c_uint)]


@functools.lru_cache(maxsize=None)
def _driver():
    """libcuda's cuLaunchKernelEx (CUDA 12.0+ drivers), or None."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
        fn = lib.cuLaunchKernelEx
    except (OSError, AttributeError):
        return None
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.POINTER(_LaunchConfig), ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p]
    return fn


def _programmatic_launch_enabled():
    """True where programmatic launches happen: kernels compiled for sm_90+ (the
    arch CUPY_FA_ARCH may override), a driver with cuLaunchKernelEx, and
    ``CUPY_FA_PDL`` not ``0``."""
    if os.environ.get("CUPY_FA_PDL", "1") == "0":
        return False
    import cupy

    return _programmatic_launch_supported(device_arch(cupy.cuda.Device()))


@functools.lru_cache(maxsize=None)
def _programmatic_launch_supported(arch):
    """Kernels built for an older arch compile griddepcontrol out (common.cuh): a merge
    launched early would then read partials still being written, so they never are."""
    found = re.match(r"(?:sm|compute)_(\d+)", arch)
    return found is not None and int(found.group(1)) >= 90 and _driver() is not None


def _launch_programmatic(fn, grid, threads, smem_bytes, stream_ptr, params):
    grid = tuple(grid) + (1,) * (3 - len(grid))
    attr = _LaunchAttribute(id=_CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION)
    attr.value[0] = 1  # programmaticStreamSerializationAllowed
    config = _LaunchConfig((ctypes.c_uint * 3)(*grid), (ctypes.c_uint * 3)(threads, 1, 1), smem_bytes,
                           stream_ptr, ctypes.pointer(attr), 1)
    raw = ctypes.create_string_buffer(params.tobytes())  # the driver copies it at launch
    args = (ctypes.c_void_p * 1)(ctypes.cast(raw, ctypes.c_void_p))
    status = _driver()(ctypes.byref(config), fn.kernel.ptr, args, None)
    if status != 0:
        raise RuntimeError(f"cuLaunchKernelEx failed with CUresult {status} for {fn.name} (a programmatic launch; "
                           "CUPY_FA_PDL=0 launches it the ordinary way)")


def warmup(dtypes=("float16", "bfloat16"), head_dims=HEAD_DIMS):
    """Compiles (or loads from the disk cache) every variant that plans with these
    dtypes and head dims can select under the current knobs, on the current
    device, so no compile happens inside a step or a graph capture."""
    from . import _arrays

    _arrays.require_cuda()
    smem_limit = device_smem_limit()
    wanted = [PLAN_VARIANT, append_variant(np.int32), append_variant(np.int64)]
    for dtype_name in dtypes:
        for head_dim in head_dims:
            wanted += [merge_variant(dtype_name, head_dim, shape) for _, shape in MERGE_SHAPES]
            for max_q_len, group in ((1, 1), (SMALL_Q_LEN, 4), (SMALL_Q_LEN + 1, 1)):  # each layout tile_for picks
                tile = tile_for(head_dim, max_q_len, group, smem_limit)
                folded = tile.folding(smem_limit=smem_limit)  # what plan.fold_tile may switch to
                wanted += [attention_variant(dtype_name, t) for t in (tile, folded) if t is not None]
    for variant in wanted:
        get_function(variant)
    return len(wanted)


# ---- compile without a device (CI, `python -m cupy_fa.compile_check`) ------------

_RESOURCE = re.compile(r"Used (\d+) registers")
_SPILL = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")
_STACK = re.compile(r"(\d+) bytes stack frame")


# What cupy.RawModule adds to our options on its NVRTC path (cupy/cuda/compiler.py), so
# the CPU build below compiles the binary the GPU runs, registers and all. (The default
# device execution space is also what lets the kernels' generic lambdas compile.)
RAWMODULE_OPTIONS = ("--device-as-default-execution-space", "-ftz=true")


def compile_cubin(variant, arch="sm_90a"):
    """Compiles one variant to a cubin with NVRTC alone, with the options
    ``cupy.RawModule`` uses, and returns
    ``(cubin_bytes, {"registers", "spill_stores", "spill_loads", "stack"})``."""
    from cupy.cuda import nvrtc

    prog = nvrtc.createProgram(program_text(variant), "cupy_fa.cu", [], [])
    try:
        nvrtc.addNameExpression(prog, variant.expression)
        options = compile_options(arch) + RAWMODULE_OPTIONS + ("--ptxas-options=-v",)
        try:
            nvrtc.compileProgram(prog, options)
        except nvrtc.NVRTCError as exc:
            raise RuntimeError(f"NVRTC failed on {variant.expression}:\n{nvrtc.getProgramLog(prog)}") from exc
        lowered = nvrtc.getLoweredName(prog, variant.expression)
        log = nvrtc.getProgramLog(prog)
        cubin = nvrtc.getCUBIN(prog)
    finally:
        nvrtc.destroyProgram(prog)
    return cubin, _resources_of(log, lowered)


def _resources_of(log, lowered):
    """Registers / spills of function `lowered` from a ptxas -v log."""
    lines = log.splitlines()
    for i, line in enumerate(lines):
        if "Compiling entry function" in line and lowered in line:
            block = "\n".join(lines[i:i + 6])
            regs = _RESOURCE.search(block)
            spill = _SPILL.search(block)
            stack = _STACK.search(block)
            return {
                "registers": int(regs.group(1)) if regs else None,
                "spill_stores": int(spill.group(1)) if spill else 0,
                "spill_loads": int(spill.group(2)) if spill else 0,
                "stack": int(stack.group(1)) if stack else 0,
            }
    return {"registers": None, "spill_stores": None, "spill_loads": None, "stack": None}
