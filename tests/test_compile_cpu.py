"""Every kernel variant compiles to an sm_90a cubin through NVRTC, no GPU needed
(the path CI takes, so a kernel that does not compile cannot land). No skip: a
machine without NVRTC fails here rather than silently checking nothing."""

import multiprocessing
import os
import re
from concurrent.futures import ProcessPoolExecutor

import pytest

from cupy_fa import _build, knobs, schedule

from cupy_fa import _compile
from cupy_fa import families
from cupy_fa import catalog


def _compile_for_sm90a(variant):
    """(the cubin's first 4 bytes, ptxas's figures) of one variant, or the error's text."""
    try:
        cubin, res = _compile.compile_cubin(variant, "sm_90a")
    except Exception as exc:  # noqa: BLE001 - reported by the variant's own test
        return None, None, f"{type(exc).__name__}: {exc}"
    return cubin[:4], res, None


@pytest.fixture(scope="module")
def compiled(request):
    """The selected variants of test_variant_compiles_for_sm90a compiled up front, one NVRTC process
    per core (NVRTC needs no device; each variant is its own program), then checked one by one."""
    wanted = [item.callspec.params["variant"] for item in request.session.items
              if getattr(item, "originalname", None) == "test_variant_compiles_for_sm90a"]
    workers = min(len(wanted), os.cpu_count() or 1)
    if workers <= 1:
        return {v.expression: _compile_for_sm90a(v) for v in wanted}
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork")) as pool:
        return dict(zip((v.expression for v in wanted), pool.map(_compile_for_sm90a, wanted)))


@pytest.mark.parametrize("variant", catalog.all_kernels(), ids=lambda v: v.expression.replace(" ", ""))
def test_variant_compiles_for_sm90a(variant, compiled):
    head, res, error = compiled[variant.expression] if variant.expression in compiled else \
        _compile_for_sm90a(variant)
    assert error is None, error
    assert head == b"\x7fELF"
    assert res["registers"] is not None and res["registers"] <= 255
    assert res["stack"] is not None, f"{variant.expression}: no stack frame figure in ptxas's log"
    assert res["spill_stores"] == 0 and res["spill_loads"] == 0, f"{variant.expression} spills: {res}"


def test_sm90a_guard_holds():
    """The sm_90a build really targets sm_90a (the header #errors otherwise)."""
    from cupy.cuda import nvrtc

    src = '#define CUPY_FA_REQUIRE_SM90A\n#include "shared/common.cuh"\n__global__ void k() {}\n'
    options = [o for o in _compile.compile_options("sm_90a")]
    prog = nvrtc.createProgram(src, "guard.cu", [], [])
    nvrtc.compileProgram(prog, options)  # sm_90a: compiles
    nvrtc.destroyProgram(prog)
    prog = nvrtc.createProgram(src, "guard.cu", [], [])
    with pytest.raises(nvrtc.NVRTCError):
        nvrtc.compileProgram(prog, [o for o in _compile.compile_options("sm_90")] + ["-DCUPY_FA_REQUIRE_SM90A"])
    nvrtc.destroyProgram(prog)


def test_source_hash_tracks_kernel_files(tmp_path, monkeypatch):
    (tmp_path / "a.cuh").write_text("x")
    monkeypatch.setattr(_compile, "KERNEL_DIR", tmp_path)
    _compile.source_hash.cache_clear()
    first = _compile.source_hash()
    (tmp_path / "a.cuh").write_text("y")
    _compile.source_hash.cache_clear()
    assert _compile.source_hash() != first
    _compile.source_hash.cache_clear()


@pytest.mark.parametrize("stages", knobs.STAGE_CHOICES)
def test_every_selectable_tile_is_compiled_in_ci(stages, monkeypatch):
    """Whatever tile_for (and schedule.fold_tile after it) can pick, on Hopper or on an A100 (any
    knob value, any batch shape), is among the variants CI compiles."""
    monkeypatch.setenv("CUPY_FA_DECODE_STAGES", str(stages))
    knobs.reload()  # knobs are read once: take the new value
    compiled = set(catalog.all_kernels())
    for dtype in _compile.CTYPES:
        for head_dim in families.common.HEAD_DIMS:
            for max_q_len in (1, 4, 8, 16, 17, 4096):
                for group in (1, 4, 8, 16):
                    for limit in (families.common.SMEM_LIMIT, families.common.SM80_SMEM_LIMIT):
                        tile = schedule.tile_for(head_dim, max_q_len, group, limit)
                        assert tile.fits_in(limit)
                        for t in (tile, tile.folding(smem_limit=limit), tile.folding(2, limit)):
                            if t is not None:
                                assert t.fits_in(limit)
                                assert catalog.attention_kernel(dtype, t) in compiled, t


def test_launch_config_structs_match_cuda_h():
    """The ctypes mirrors of cuda.h's CUlaunchAttribute / CUlaunchConfig (the programmatic
    launch of the merge kernel passes them to cuLaunchKernelEx): sizes and offsets as
    gcc reports them for CUDA 13.0's cuda.h (x86-64)."""
    import ctypes

    assert (ctypes.sizeof(_build._LaunchAttribute), _build._LaunchAttribute.value.offset) == (72, 8)
    config = _build._LaunchConfig
    assert ctypes.sizeof(config) == 56
    assert (config.stream.offset, config.attrs.offset, config.num_attrs.offset) == (32, 40, 48)


def test_merge_group_matches_the_kernel():
    """families.common.MERGE_GROUP sizes the deepest merge's ways and the fold's splits per CTA; it must
    be the kernels' kMergeGroup."""
    text = (_compile.KERNEL_DIR / "shared" / "softmax.cuh").read_text()
    assert f"constexpr int kMergeGroup = {families.common.MERGE_GROUP};" in text


def test_programmatic_launch_only_for_sm90_builds(monkeypatch):
    """The merge is launched early only where the kernels were built with griddepcontrol
    (sm_90+): an sm_80 build (CUPY_FA_ARCH=sm_80 on a Hopper) must launch it the ordinary way."""
    monkeypatch.setattr(_build, "_driver", lambda: object())
    _build._programmatic_launch_supported.cache_clear()
    try:
        assert _build._programmatic_launch_supported("sm_90a")
        assert _build._programmatic_launch_supported("sm_100")
        assert not _build._programmatic_launch_supported("sm_80")
        assert not _build._programmatic_launch_supported("sm_86")
        assert _build._programmatic_launch_supported("compute_90")
        assert not _build._programmatic_launch_supported("gfx90a")
    finally:
        _build._programmatic_launch_supported.cache_clear()


def test_host_mirrors_of_the_traits_are_compiled_in():
    """MmaTile's shared-memory size, epilogue and fold flags mirror TileTraits (and
    TRACE_SHAPE the trace buffer's); every attention variant's program carries them as
    static_asserts, so a drifted mirror cannot compile (here: a shared-memory size one byte off)."""
    import dataclasses

    variant = catalog.attention_kernel("bfloat16", families.mma_sync.MmaTile(128, 1, 4, 2, fold_capable=True))
    assert len(variant.checks) == 4 and all(c in _compile.program_text(variant) for c in variant.checks)
    wrong = dataclasses.replace(variant, checks=(variant.checks[0] + " + 1",))
    with pytest.raises(RuntimeError, match="host mirror"):
        _compile.compile_cubin(wrong)


def test_trace_build_compiles(monkeypatch):
    """The timeline probe's build (CUPY_FA_TRACE=1, lab/probe_timeline.py) still compiles, for
    the tile the decode benchmarks run and the sm90 prefill tiles of D 128 over a 16-bit and an
    fp8 cache: without spills, but for the fp8 tile (NVRTC 12.9 with bf16 queries: 24 bytes stored,
    48 loaded, in its prologue and around its producer's three sums a widening, which its 32
    registers do not hold; the probe's figures for it carry those reloads), held to at most 64
    bytes."""
    monkeypatch.setenv("CUPY_FA_TRACE", "1")
    knobs.reload()  # knobs are read once: take the new value
    assert "-DCUPY_FA_TRACE" in _compile.compile_options("sm_90a")
    fp8 = families.common.ElementTypes("bfloat16", families.common.FP8, "bfloat16")
    for variant in (catalog.attention_kernel("bfloat16", schedule.tile_for(128, 1, 4).folding()),
                    catalog.attention_kernel("bfloat16", families.sm90.DEFAULT_TILES[128]),
                    catalog.attention_kernel(fp8, families.sm90.FP8_TILES[128])):
        cubin, res = _compile.compile_cubin(variant, "sm_90a")
        assert cubin[:4] == b"\x7fELF"
        most = 64 if "cupy_fa::fp8_e4m3" in variant.expression else 0
        assert res["spill_stores"] <= most and res["spill_loads"] <= most, (variant.expression, res)


def test_compile_check_fails_without_a_resource_line(monkeypatch, capsys):
    """compile_check: a variant whose ptxas log has no resource line for it fails the check (its
    spills would read as zero, never measured), naming the variant."""
    from cupy_fa import compile_check

    log = ("ptxas info    : Compiling entry function '_Z3fooPf' for 'sm_90a'\n"
           "ptxas info    : Function properties for _Z3fooPf\n")
    assert _compile._resources_of(log, "_Z3fooPf")["registers"] is None
    assert _compile._resources_of("", "_Z3fooPf") == dict.fromkeys(compile_check.RESOURCE_KEYS)
    first = catalog.all_kernels()[0]
    monkeypatch.setattr(_compile, "compile_cubin", lambda variant, arch="sm_90a": (b"\x7fELF", _compile._resources_of(
        log, "_Z3fooPf")))
    with pytest.raises(compile_check.MissingResources, match="no registers, .* for " + re.escape(first.expression)):
        compile_check.compile_all(only=first.expression)
    assert compile_check.main(["--only", first.expression]) == 1
    assert "resource line is missing" in capsys.readouterr().err
    # the registers line without the stack / spill line: the spills were never measured, not zero
    half = log + "ptxas info    : Used 128 registers, used 1 barriers, 400 bytes cmem[0]\n"
    assert _compile._resources_of(half, "_Z3fooPf") == {"registers": 128, "spill_stores": None, "spill_loads": None,
                                                       "stack": None}
    monkeypatch.setattr(_compile, "compile_cubin", lambda variant, arch="sm_90a": (b"\x7fELF", _compile._resources_of(
        half, "_Z3fooPf")))
    with pytest.raises(compile_check.MissingResources, match="no spill_stores, spill_loads, stack for"):
        compile_check.compile_all(only=first.expression)


def test_compile_check_reports_stack_frames(monkeypatch, capsys):
    """Stack frames are read from ptxas's log and reported per variant; --strict fails on them."""
    from cupy_fa import compile_check

    log = ("ptxas info    : Compiling entry function '_Z3fooPf' for 'sm_90a'\n"
           "ptxas info    : Function properties for _Z3fooPf\n"
           "    24 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n"
           "ptxas info    : Used 128 registers, used 1 barriers, 400 bytes cmem[0]\n")
    res = _compile._resources_of(log, "_Z3fooPf")
    assert res == {"registers": 128, "spill_stores": 0, "spill_loads": 0, "stack": 24}
    variant = catalog.PLAN_KERNEL
    monkeypatch.setattr(_compile, "compile_cubin", lambda v, arch="sm_90a": (b"\x7fELF", dict(res)))
    assert compile_check.main(["--only", variant.expression]) == 0
    out = capsys.readouterr().out
    assert "stack B" in out and "1 with a stack frame" in out and f"stack frame: {variant.expression}" in out
    assert compile_check.main(["--only", variant.expression, "--strict"]) == 1


def test_every_variant_reports_its_stack_frame():
    """The real plan kernel's log carries the stack line (compile_check reads it for every variant)."""
    from cupy_fa import compile_check

    ((variant, res, _),) = compile_check.compile_all(only=catalog.PLAN_KERNEL.expression)
    assert res["stack"] is not None and res["registers"] is not None
