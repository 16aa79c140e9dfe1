"""The CUPY_FA_* knobs: read once into one frozen object, validated when read (CPU)."""

import dataclasses

import pytest

from cupy_fa import knobs, schedule


def test_defaults_and_parsing():
    k = knobs.Knobs.from_environ({})
    assert k == knobs.Knobs()
    assert (k.decode_stages, k.decode_warps_m, k.split_size, k.splits_per_cta, k.fold_splits, k.pdl, k.trace,
            k.half_rows) == (2, None, None, 1, "auto", True, False, True)  # split size unset: schedule.split_size's per-cache default
    env = {"CUPY_FA_ARCH": "sm_80", "CUPY_FA_CACHE_DIR": "/tmp/x", "CUPY_FA_DECODE_STAGES": "3",
           "CUPY_FA_DECODE_WARPS_M": "2", "CUPY_FA_SPLIT_SIZE": "1024", "CUPY_FA_SPLITS_PER_CTA": "4",
           "CUPY_FA_FOLD_SPLITS": "0", "CUPY_FA_PDL": "0", "CUPY_FA_TRACE": "1"}
    k = knobs.Knobs.from_environ(env)
    assert k == knobs.Knobs("sm_80", "/tmp/x", 3, 2, 1024, 4, "0", False, True)
    assert not knobs.Knobs.from_environ({"CUPY_FA_HALF_ROWS": "0"}).half_rows
    assert k.producer_warp and not knobs.Knobs.from_environ({"CUPY_FA_PRODUCER_WARP": "0"}).producer_warp
    assert knobs.Knobs.from_environ({"CUPY_FA_DECODE_WARPS_M": "auto"}).decode_warps_m is None
    with pytest.raises(dataclasses.FrozenInstanceError):
        k.split_size = 64


@pytest.mark.parametrize("name,value", [
    ("CUPY_FA_DECODE_STAGES", "5"), ("CUPY_FA_DECODE_STAGES", "two"), ("CUPY_FA_DECODE_WARPS_M", "4"),
    ("CUPY_FA_SPLIT_SIZE", "100"), ("CUPY_FA_SPLIT_SIZE", "0"), ("CUPY_FA_SPLITS_PER_CTA", "0"),
    ("CUPY_FA_SPLITS_PER_CTA", "65"), ("CUPY_FA_FOLD_SPLITS", "yes"), ("CUPY_FA_HALF_ROWS", "nope"),
    ("CUPY_FA_PRODUCER_WARP", "2"), ("CUPY_FA_PDL", "false-ish"), ("CUPY_FA_DEBUG", "enabled"),
    ("CUPY_FA_TRACE", "2"), ("CUPY_FA_SOFT_CAP_TANH", "fast"), ("CUPY_FA_MLA_SPLIT_SIZE", "100"), ("CUPY_FA_MLA_SPLIT_SIZE", "0"), ("CUPY_FA_SOFT_CAP_TANH", "1"),
    ("CUPY_FA_MLA_WGMMA_MIN_HEADS", "0"), ("CUPY_FA_MLA_WGMMA_MIN_HEADS", "many"),
])
def test_bad_values_name_the_variable(name, value):
    with pytest.raises(ValueError, match=name):
        knobs.Knobs.from_environ({name: value})


@pytest.mark.parametrize("field,variable", [
    ("pdl", "CUPY_FA_PDL"), ("trace", "CUPY_FA_TRACE"), ("debug", "CUPY_FA_DEBUG"),
    ("half_rows", "CUPY_FA_HALF_ROWS"), ("producer_warp", "CUPY_FA_PRODUCER_WARP"),
])
def test_boolean_knobs_take_the_usual_spellings(field, variable):
    """0 / 1, true / false, on / off, yes / no in any case mean what they say (CUPY_FA_PDL=false turns
    PDL off, CUPY_FA_DEBUG=off leaves debug off); unset keeps the default."""
    for word, value in (("1", True), ("0", False), ("true", True), ("FALSE", False), ("On", True), ("off", False),
                        ("yes", True), ("No", False), (" 1 ", True)):
        assert getattr(knobs.Knobs.from_environ({variable: word}), field) is value, (variable, word)
    assert getattr(knobs.Knobs.from_environ({}), field) is getattr(knobs.Knobs(), field)


def test_read_once_then_reload(monkeypatch):
    """Changing the environment changes nothing until reload(); a bad value leaves the knobs in
    force as they were."""
    monkeypatch.setenv("CUPY_FA_SPLIT_SIZE", "512")
    knobs.reload()
    assert schedule.split_size() == 512
    monkeypatch.setenv("CUPY_FA_SPLIT_SIZE", "1024")
    assert schedule.split_size() == 512  # not re-read per call
    assert knobs.reload().split_size == 1024 and schedule.split_size() == 1024
    monkeypatch.setenv("CUPY_FA_SPLIT_SIZE", "1000")
    with pytest.raises(ValueError, match="CUPY_FA_SPLIT_SIZE"):
        knobs.reload()
    assert schedule.split_size() == 1024


def test_use_installs_and_returns_the_previous():
    before = knobs.knobs()
    previous = knobs.use(dataclasses.replace(before, decode_warps_m=2, splits_per_cta=3))
    assert previous == before
    tile = schedule.tile_for(128, 1, 4)
    assert (tile.warps_m, tile.splits_per_cta) == (2, 3)
    with pytest.raises(TypeError, match="Knobs"):
        knobs.use({"split_size": 512})
    knobs.use(before)
    assert schedule.tile_for(128, 1, 4).warps_m == 1


def test_nothing_else_reads_the_environment():
    """Only cupy_fa/knobs.py reads CUPY_FA_* variables (the one table of them is README.md's)."""
    import pathlib
    import re

    package = pathlib.Path(knobs.__file__).parent
    readers = [p.name for p in package.rglob("*.py")
               if p.name != "knobs.py" and re.search(r"environ(\.get)?\s*[\[(]\s*[\"']CUPY_FA_", p.read_text())]
    assert readers == []
    readme = (package.parent / "README.md").read_text()
    for field in dataclasses.fields(knobs.Knobs):
        variable = "CUPY_FA_" + field.name.upper()
        assert f"`{variable}`" in readme, variable


def test_soft_cap_tanh_picks_the_hooked_wgmma_kernels_form():
    """CUPY_FA_SOFT_CAP_TANH names the tanh form the sm_90a hooked kernels compile (any case); unset,
    the family's default; the Newton form's kernel drops the warp-uniform warpgroup index."""
    from cupy_fa.families import sm90

    tile = sm90.DEFAULT_TILES[128]
    before = knobs.knobs()
    try:
        assert knobs.Knobs.from_environ({}).soft_cap_tanh is None
        for word, form in (("exact", 0), ("APPROX", 1), (" newton ", 2)):
            knobs.use(knobs.Knobs.from_environ({"CUPY_FA_SOFT_CAP_TANH": word}))
            hooked = tile.with_variants()
            assert hooked.tanh == form and hooked.variants and hooked.uniform_wg == (form != 2)
            assert hooked.traits().endswith(f", true, 2, 0, {form}>") if form else hooked.traits().endswith(", true>")
        knobs.use(knobs.Knobs())
        assert tile.with_variants().tanh == sm90.SOFT_CAP_TANH
    finally:
        knobs.use(before)


def test_mla_split_size_moves_every_mla_split_and_the_plan_constants():
    """CUPY_FA_MLA_SPLIT_SIZE sets the MLA small-q split (the host's bound and the plan kernel's
    constant together, so decode and verify still split at the same keys) at every head count;
    unset, SPLIT_SIZE at every head count."""
    import numpy as np

    from cupy_fa.mla import schedule as mla_schedule

    before = knobs.knobs()
    try:
        knobs.use(knobs.Knobs())
        for heads in (1, 16, 64, 65, 128):
            want = mla_schedule.SPLIT_SIZE
            assert mla_schedule.split_size(heads) == want
            sched = mla_schedule.schedule_step(heads, False, "sm_90a", q_lens=[1] * 4, kv_lens=[4096] * 4)
            assert sched.split_size == mla_schedule.plan_constants(sched)["split_size"] == want
        knobs.use(knobs.Knobs.from_environ({"CUPY_FA_MLA_SPLIT_SIZE": "2048"}))
        for heads in (16, 128):
            assert mla_schedule.split_size(heads) == 2048
            assert list(mla_schedule.max_splits(np.array([1, 4]), np.array([4096, 4099]), heads)) == [2, 3]
            sched = mla_schedule.schedule_step(heads, False, "sm_90a", q_lens=[1] * 4, kv_lens=[4096] * 4)
            assert mla_schedule.plan_constants(sched)["split_size"] == 2048
    finally:
        knobs.use(before)


def test_mla_wgmma_min_heads_moves_the_small_q_tile():
    """CUPY_FA_MLA_WGMMA_MIN_HEADS: the fewest heads whose small-q MLA steps take the seesaw kernel
    (a 16-bit cache on sm_90a); unset, WGMMA_MIN_HEADS."""
    from cupy_fa.families.mla import MlaMmaTile, MlaWgmmaTile
    from cupy_fa.mla import schedule as mla_schedule

    before = knobs.knobs()
    try:
        knobs.use(knobs.Knobs())
        assert isinstance(mla_schedule.small_q_tile(mla_schedule.WGMMA_MIN_HEADS - 1, False, "sm_90a"), MlaMmaTile)
        assert isinstance(mla_schedule.small_q_tile(mla_schedule.WGMMA_MIN_HEADS, False, "sm_90a"), MlaWgmmaTile)
        knobs.use(knobs.Knobs.from_environ({"CUPY_FA_MLA_WGMMA_MIN_HEADS": "32"}))
        assert isinstance(mla_schedule.small_q_tile(32, False, "sm_90a"), MlaWgmmaTile)
        assert isinstance(mla_schedule.small_q_tile(16, False, "sm_90a"), MlaMmaTile)
        assert isinstance(mla_schedule.small_q_tile(16, True, "sm_90a"), MlaMmaTile)
        assert mla_schedule.small_q_tile(32, True, "sm_90a") == MlaWgmmaTile(True)  # fp8 on the seesaw kernel
        knobs.use(knobs.Knobs.from_environ({"CUPY_FA_MLA_WGMMA_FP8": "0"}))
        assert isinstance(mla_schedule.small_q_tile(128, True, "sm_90a"), MlaMmaTile)  # fp8 kept off it
        assert isinstance(mla_schedule.long_tile(128, True, "sm_90a"), MlaMmaTile)
        assert mla_schedule.small_q_tile(128, False, "sm_90a") == MlaWgmmaTile()
    finally:
        knobs.use(before)
