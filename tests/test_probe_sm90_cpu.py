"""lab/probe_prefill_sm90.py's A/B bookkeeping, without a GPU: a round under the flop floor
is reported as an error and never as a figure, and a CUDA error (or a child that dies in a
turn) names its implementation, which the remaining cells then run without."""

import importlib.util
import json
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent


@pytest.fixture()
def probe(tmp_path, monkeypatch):
    spec = importlib.util.spec_from_file_location("probe_prefill_sm90", ROOT / "lab" / "probe_prefill_sm90.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    monkeypatch.setattr(mod, "WORK", str(tmp_path))
    return mod


def impl(us, ok=True, below=0):
    return dict(us=us, err=1e-3, err_graph=1e-3, below_floor=below, ok=ok, tflops=0.0)


def test_floor_is_800_tflops(probe):
    assert probe.ab_floor_us(800e12) == pytest.approx(1e6)
    assert probe.ab_floor_us(0.55e12) == pytest.approx(687.5)  # prefill_b4_l4096: no launch under 0.69 ms


def test_ab_table_reports_ratios_and_never_a_figure_under_the_floor(probe):
    flops = 0.55e12
    ab = dict(cells={"prefill_b4_l4096|16": dict(
        flops=flops, floor_us=probe.ab_floor_us(flops), order=["d128_r2", "d128", "d128_l", "sdpa_cudnn"],
        impls={"d128_r2": impl([1300.0, 1310.0, 1290.0]), "d128": impl([1250.0, 1260.0, 1240.0]),
               "d128_l": impl([66.5, 1200.0, 1210.0], ok=False, below=1),
               "sdpa_cudnn": impl([980.0, 990.0, 970.0])})},
        failures=[dict(cell="prefill_b2_l8192|16", impl="v3_37ed792", where="round 3", error="CUDARuntimeError: x")])
    lines = probe.ab_table(ab)
    text = "\n".join(lines)
    d128 = next(ln for ln in lines if " d128 " in ln)
    assert "1.040" in d128 and "1.000" in d128  # /base (1300 / 1250), /dflt (itself)
    bad = next(ln for ln in lines if " d128_l " in ln)
    assert "ERROR" in bad and "floor" in bad and "8270" not in bad and "TFLOP/s floor" in bad
    assert "CUDA ERROR: v3_37ed792 on prefill_b2_l8192|16 (round 3)" in text


def test_run_ab_reruns_the_remaining_cells_without_the_failing_implementation(probe, monkeypatch):
    cells = [("prefill_b4_l4096", 16, ["a", "b"]), ("prefill_b4_l4096", 1, ["a", "b"]),
             ("prefill_b2_l8192", 16, ["a", "b"])]
    calls = []

    def fake_run_child(stage, payload, timeout):
        assert stage == "ab"
        calls.append(payload)
        done = {f"{w}|{ps}": dict(flops=1.0, impls={}) for w, ps, _ in payload["cells"]}
        if len(calls) == 1:  # the first child: cell 1 done, a CUDA error in cell 2 charged to "b"
            return dict(cells=dict(list(done.items())[:1]),
                        failure=dict(cell="prefill_b4_l4096|1", impl="b", where="round 0", error="e")), "exit 3"
        if len(calls) == 2:  # the second dies without a word during a turn of "a"
            with open(pathlib.Path(probe.WORK) / "ab_progress.json", "w") as f:
                json.dump(dict(cell="prefill_b2_l8192|16", impl="a", where="round 5"), f)
            return dict(cells=dict(list(done.items())[:1]), failure=None), "exit -11"
        return dict(cells=done, failure=None), "exit 0"

    monkeypatch.setattr(probe, "run_child", fake_run_child)
    ab, status = probe.run_ab(cells, 21, 3, 1000)
    assert [c["skip"] for c in calls] == [[], ["b"], ["b", "a"]]
    assert [len(c["cells"]) for c in calls] == [3, 2, 1]
    assert set(ab["cells"]) == {"prefill_b4_l4096|16", "prefill_b4_l4096|1", "prefill_b2_l8192|16"}
    assert [f["impl"] for f in ab["failures"]] == ["b", "a"] and "died" in ab["failures"][1]["error"]
    assert status == "exit 0"


def test_ab_plan_is_compiled_and_checked(probe):
    """Every A/B implementation is a known variant, is checked for correctness in the same call
    (stage 2 covers the A/B's names), and each cell has a reference first (an earlier default,
    `_r2`, or this tree's) and this tree's default in it (the ratios' references)."""
    for w, ps, names in probe.AB_CELLS:
        assert w in {x[0] for x in probe.WORKLOADS} and ps in (1, 16)
        assert all(n in probe.VARIANTS for n in names)
        assert (names[0].endswith("_r2") or names[0] in probe.DEFAULTS) and any(n in probe.DEFAULTS for n in names)
        head_dims = {probe.VARIANTS[n][1].head_dim for n in names}
        assert head_dims == {next(x for x in probe.WORKLOADS if x[0] == w)[5]}
    assert all(n in probe.VARIANTS for n in probe.AB_CORRECT_EXTRA)
