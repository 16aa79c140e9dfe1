"""What a new user meets first, on the CPU: serving-mode lengths from plain Python values,
results in the caller's framework, a plain sentence when CUDA is missing, the demo's --help
and its cached no-GPU compile."""

import json

import numpy as np
import pytest

import cupy_fa
from cupy_fa import _arrays, demo
from cupy_fa.modes import ForwardMode as M, contract_lengths, from_sglang
from cupy_fa import catalog


def test_lists_in_lists_out():
    assert contract_lengths(M.EXTEND, prefix_lens=[10, 20], new_lens=[3, 4]) == ([3, 4], [13, 24])
    assert contract_lengths(M.DECODE, prefix_lens=[10, 20]) == ([1, 1], [11, 21])
    assert contract_lengths(M.TARGET_VERIFY, prefix_lens=(5, 0), num_draft_tokens=4) == ([4, 4], [9, 4])
    assert contract_lengths(M.DRAFT_EXTEND, prefix_lens=[5, 6], accepted_lens=[1, 3]) == ([1, 3], [6, 9])
    assert from_sglang(M.DECODE, [11, 21]) == ([1, 1], [11, 21])
    assert from_sglang(M.EXTEND, [13, 24], extend_seq_lens=[3, 4]) == ([3, 4], [13, 24])
    assert from_sglang(M.TARGET_VERIFY, [5, 0], num_draft_tokens=4) == ([4, 4], [9, 4])
    assert from_sglang(M.DRAFT_EXTEND_V2, [9, 4], num_draft_tokens=4) == ([4, 4], [9, 4])
    assert from_sglang(M.DRAFT_EXTEND, [6, 9], accept_lens=[1, 3]) == ([1, 3], [6, 9])


def test_ints_and_numpy_keep_their_kind():
    q, kv = contract_lengths("decode", prefix_lens=7)
    assert (q, kv) == (1, 8) and type(q) is int and type(kv) is int
    assert contract_lengths(M.EXTEND, prefix_lens=3, new_lens=5) == (5, 8)
    q, kv = contract_lengths(M.EXTEND, prefix_lens=np.array([1, 2], np.int32), new_lens=np.array([3, 4], np.int32))
    assert isinstance(q, np.ndarray) and q.dtype == np.int32 and kv.tolist() == [4, 6]
    q, kv = contract_lengths(M.EXTEND, prefix_lens=5, new_lens=np.array([1, 2]))  # an int prefix for all
    assert isinstance(kv, np.ndarray) and kv.tolist() == [6, 7]


@pytest.mark.parametrize("call,message", [
    (lambda: contract_lengths(M.EXTEND, prefix_lens=[10, -2], new_lens=[3, 4]), r"prefix_lens\[1\] = -2 is negative"),
    (lambda: contract_lengths(M.MIXED, prefix_lens=[1, 2], new_lens=[-1, 4]), r"new_lens\[0\] = -1 is negative"),
    (lambda: contract_lengths(M.DECODE, prefix_lens=-1), "prefix_lens = -1 is negative"),
    (lambda: contract_lengths(M.EXTEND, prefix_lens=[1, 2], new_lens=[3, 4, 5]), "new_lens has 3 entries, prefix_lens has 2"),
    (lambda: contract_lengths(M.TARGET_VERIFY, prefix_lens=[1], num_draft_tokens=0), "num_draft_tokens must be a positive int"),
    (lambda: from_sglang(M.EXTEND, [3, 4], extend_seq_lens=[3, 5]), r"seq_lens\[1\] = 4 is below extend_seq_lens\[1\] = 5"),
    (lambda: from_sglang(M.DECODE, [3, 0]), r"seq_lens\[1\] = 0 is below the step's one new token"),
    (lambda: from_sglang(M.DRAFT_EXTEND_V2, [3, 8], num_draft_tokens=4), r"seq_lens\[0\] = 3 is below num_draft_tokens = 4"),
    (lambda: from_sglang(M.DRAFT_EXTEND, [3, 8], accept_lens=[4, 1]), r"seq_lens\[0\] = 3 is below accept_lens\[0\] = 4"),
    (lambda: from_sglang(M.TARGET_VERIFY, [-3], num_draft_tokens=2), r"seq_lens\[0\] = -3 is negative"),
])
def test_bad_host_lengths_are_named(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_non_integer_lengths_are_refused():
    with pytest.raises(TypeError, match="prefix_lens must hold integers"):
        contract_lengths(M.DECODE, prefix_lens=[1.5])
    with pytest.raises(TypeError, match="new_lens must hold integers"):
        contract_lengths(M.EXTEND, prefix_lens=[1], new_lens=[True])
    with pytest.raises(ValueError, match="one length per request"):
        contract_lengths(M.DECODE, prefix_lens=[[1, 2]])


def test_results_come_back_in_the_callers_framework():
    source = np.arange(6, dtype=np.float32)
    back = _arrays.to_caller(source, like=np.zeros(1))  # an array-API array: its namespace's from_dlpack
    assert isinstance(back, np.ndarray) and np.shares_memory(back, source)
    assert _arrays.to_caller(source, like=None) is source


def test_missing_cuda_is_said_plainly(cuda_devices):
    problem = _arrays.cuda_problem()
    if cuda_devices:
        assert problem is None
        return
    assert isinstance(problem, str) and ("driver" in problem or "device" in problem or "CuPy" in problem)
    attn = cupy_fa.BatchAttention(8, 2, 128)
    with pytest.raises(ValueError, match=r"q_lens\[0\] = 3 > kv_lens\[0\] = 2"):  # bad input: said first
        attn.plan([3], [2], [[0]])
    with pytest.raises(RuntimeError, match="cupy_fa cannot run here"):
        attn.plan([1], [5], [[0]])


@pytest.fixture
def cuda_devices():
    from conftest import cuda_device_count

    return cuda_device_count()


def test_demo_help():
    with pytest.raises(SystemExit) as exit_:
        demo.parse_args(["--help"])
    assert exit_.value.code == 0


def test_demo_no_gpu_compile_is_cached(monkeypatch, tmp_path):
    from cupy_fa import compile_check, knobs

    pytest.importorskip("cupy")  # the key names NVRTC's version
    calls = []
    some = catalog.all_kernels()[:3]

    def fake_compile_all(arch="sm_90a", only="", jobs=None, progress=None, kernels=None):
        calls.append(arch)
        assert kernels == demo.demo_kernels(arch)  # the first-use set, not every kernel
        return [(v, {"registers": 40 + i, "spill_stores": 0, "spill_loads": 0, "stack": 0}, 0.5) for i, v in
                enumerate(some)]

    monkeypatch.setenv("CUPY_FA_CACHE_DIR", str(tmp_path))
    knobs.reload()  # knobs are read once: take the new value
    monkeypatch.setattr(compile_check, "compile_all", fake_compile_all)
    first, _, cached_first = demo.compile_table("sm_90a")
    second, _, cached_second = demo.compile_table("sm_90a")
    assert calls == ["sm_90a"] and (cached_first, cached_second) == (False, True) and first == second
    saved = json.loads(next(tmp_path.glob("compile_check-sm_90a-*.json")).read_text())
    assert [r["resources"]["registers"] for r in saved["rows"]] == [40, 41, 42]
    demo.compile_table("sm_90a", recompile=True)
    assert calls == ["sm_90a", "sm_90a"]


def test_every_entry_point_without_cupy_says_install_the_cuda_extra():
    """Where CuPy is not installed (a plain `pip install` without the extra), each public entry point
    that needs the device raises one sentence naming the fix, not a bare `No module named 'cupy'`;
    host-side mistakes are still named first (a NumPy cache). Run in a child process that cannot
    import cupy."""
    import subprocess
    import sys

    code = r'''
import sys
sys.modules["cupy"] = None  # import cupy -> ImportError, as on a machine without it
import numpy as np
import cupy_fa
calls = {
    "PagedKVCache.allocate": lambda: cupy_fa.PagedKVCache.allocate(4, 16, 2, 64),
    "GraphRunner": lambda: cupy_fa.GraphRunner(8, 2, 64, "bfloat16", max_batch_size=2, max_q_len=4,
                                               max_pages_per_request=4, page_size=16),
    "merge_states": lambda: cupy_fa.merge_states(*[np.zeros((2, 8, 64), np.float16), np.zeros((2, 8), np.float32)] * 2),
    "warmup": lambda: cupy_fa.warmup(),
    "plan": lambda: cupy_fa.BatchAttention(8, 2, 64).plan([1], [3], [[0]]),
    "BatchAttention capacities": lambda: cupy_fa.BatchAttention(8, 2, 64, max_batch_size=2, max_num_tokens=4,
                                                                max_pages_per_request=2),
    "PagedKVCache(numpy)": lambda: cupy_fa.PagedKVCache(np.zeros((4, 16, 2, 64), np.float16),
                                                        np.zeros((4, 16, 2, 64), np.float16)),
}
for name, call in calls.items():
    try:
        call()
        print(name, "|", "no error")
    except Exception as exc:
        print(name, "|", type(exc).__name__, str(exc).replace(chr(10), " "))
'''
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True).stdout
    got = dict(line.split(" | ", 1) for line in out.splitlines())
    for name in ("PagedKVCache.allocate", "GraphRunner", "merge_states", "warmup", "plan", "BatchAttention capacities"):
        assert got[name].startswith("RuntimeError cupy_fa cannot run here: CuPy is not installed: install cupy_fa "
                                    "with the CUDA extra"), (name, got[name])
    assert got["PagedKVCache(numpy)"].startswith("TypeError k must be a CUDA device array"), got


@pytest.mark.parametrize("example", ["engine.py", "hf_continuous_batching.py", "tp_engine.py"])
def test_the_torch_examples_say_in_one_line_that_torch_is_missing(tmp_path, example):
    """Each example that drives torch, run where torch cannot be imported (a stand-in package that
    raises, first on the path, so this holds where torch is installed too), exits 1 with one line
    naming itself and torch, not a traceback."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    (tmp_path / "torch").mkdir()
    (tmp_path / "torch" / "__init__.py").write_text("raise ImportError(\"No module named 'torch' (simulated)\")\n")
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), str(root)]))
    done = subprocess.run([sys.executable, str(root / "examples" / example)], capture_output=True, text=True,
                          timeout=120, env=env, cwd=root)
    assert done.returncode == 1, done.stderr
    assert done.stdout == "" and done.stderr.count("\n") == 1, done.stderr
    assert done.stderr.startswith(f"examples/{example} needs torch"), done.stderr
