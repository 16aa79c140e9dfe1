"""``python -m cupy_fa`` without a GPU: the plain help, ``warmup --arch`` compiling into an empty
cache directory and a second run loading it all, ``--list``, and each bad argument refused with
a message naming it. Each command runs in a process of its own with no CUDA device visible."""

import os
import subprocess
import sys

import pytest

from cupy_fa import __version__, _cache
from cupy_fa import families
from cupy_fa import catalog

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def cli(*args, cache_dir=None):
    env = dict(os.environ, PYTHONPATH=ROOT, CUDA_VISIBLE_DEVICES="")
    for name in ("CUPY_FA_ARCH", "CUPY_FA_CACHE_DIR"):
        env.pop(name, None)
    if cache_dir is not None:
        env["CUPY_FA_CACHE_DIR"] = str(cache_dir)
    return subprocess.run([sys.executable, "-m", "cupy_fa", *args], env=env, capture_output=True, text=True,
                          timeout=300)


def test_plain_help_says_what_is_there():
    proc = cli()
    assert proc.returncode == 0, proc.stderr
    assert f"cupy_fa {__version__}" in proc.stdout and "NVRTC 12." in proc.stdout
    assert "no CUDA device found" in proc.stdout and "usage: python -m cupy_fa" in proc.stdout
    assert "warmup" in proc.stdout and "kernel cache:" in proc.stdout
    assert cli("--version").stdout.strip() == f"cupy_fa {__version__}"
    help_text = cli("warmup", "--help").stdout
    for option in ("--arch", "--jobs", "--dtypes", "--head-dims", "--fp8", "--variants", "--list"):
        assert option in help_text, option


def test_list_is_warmup_kernels():
    proc = cli("warmup", "--arch", "sm_90a", "--dtypes", "bfloat16", "--head-dims", "128", "--list")
    assert proc.returncode == 0, proc.stderr
    wanted = catalog.warmup_kernels(("bfloat16",), (128,), families.common.SMEM_LIMIT, "sm_90a")
    lines = proc.stdout.splitlines()
    assert [line.split(None, 1)[1] for line in lines[:-1]] == [v.expression for v in wanted]
    assert lines[-1] == f"{len(wanted)} kernels for sm_90a"
    assert any("prefill_sm90_kernel" in line for line in lines)  # the sm_90a wgmma family
    fp8 = cli("warmup", "--arch", "sm_90a", "--dtypes", "bfloat16", "--head-dims", "128", "--list", "--fp8")
    assert f"{len(catalog.warmup_kernels(('bfloat16',), (128,), families.common.SMEM_LIMIT, 'sm_90a', ('bfloat16', families.common.FP8)))} kernels" in fp8.stdout
    a100 = cli("warmup", "--arch", "sm_80", "--head-dims", "128", "--list")
    assert a100.returncode == 0 and "prefill_sm90_kernel" not in a100.stdout
    pair = cli("warmup", "--arch", "sm_90a", "--dtypes", "bfloat16", "--head-dims", "128,192/128", "--list")
    wanted = catalog.warmup_kernels(("bfloat16",), (128, (192, 128)), families.common.SMEM_LIMIT, "sm_90a")
    assert pair.returncode == 0 and pair.stdout.splitlines()[-1] == f"{len(wanted)} kernels for sm_90a", pair.stderr
    assert "Sm90PrefillTraits<192, 128" in pair.stdout  # the pair's wgmma tile
    bad = cli("warmup", "--arch", "sm_90a", "--head-dims", "192/64", "--list")
    assert bad.returncode == 2 and "192/128" in bad.stderr


def test_warmup_compiles_into_an_empty_cache_then_loads(tmp_path):
    cache = tmp_path / "cache"
    args = ("warmup", "--arch", "sm_90a", "--dtypes", "float16", "--head-dims", "64", "--jobs", "2")
    wanted = catalog.warmup_kernels(("float16",), (64,), families.common.SMEM_LIMIT, "sm_90a")
    first = cli(*args, cache_dir=cache)
    assert first.returncode == 0, first.stderr
    assert f"{len(wanted)} kernels for sm_90a: {len(wanted)} compiled, 0 from the cache" in first.stdout
    assert f"on 2 processes; cache {cache}" in first.stdout
    assert f"{len(wanted)}/{len(wanted)} ({len(wanted)} compiled" in first.stderr  # the progress line
    names = sorted(p for p in os.listdir(cache) if p.endswith(".cubin"))
    assert len(names) == len(wanted)
    assert all(_cache.load(str(cache), name[:-len(".cubin")]) is not None for name in names)
    second = cli(*args, "--quiet", cache_dir=cache)
    assert second.returncode == 0, second.stderr
    assert f"0 compiled, {len(wanted)} from the cache" in second.stdout and second.stderr == ""


@pytest.mark.parametrize("args, names", [
    (("warmup", "--arch", "sm_91"), "--arch"),
    (("warmup", "--arch", "gfx90a"), "--arch"),
    (("warmup", "--arch", "sm_90a", "--dtypes", "float32"), "--dtypes"),
    (("warmup", "--arch", "sm_90a", "--head-dims", "100"), "--head-dims"),
    (("warmup", "--arch", "sm_90a", "--head-dims", "a,b"), "--head-dims"),
    (("warmup", "--arch", "sm_90a", "--jobs", "0"), "--jobs"),
    (("warmup", "--arch", "sm_90a", "--jobs", "two"), "--jobs"),
    (("warmpu",), "warmup"),
])
def test_bad_arguments_are_named(args, names):
    proc = cli(*args)
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    assert names in proc.stderr, proc.stderr


def test_warmup_without_a_device_asks_for_arch():
    proc = cli("warmup")
    assert proc.returncode == 1
    assert "no CUDA device found" in proc.stderr and "--arch" in proc.stderr
