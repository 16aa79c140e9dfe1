"""bench/: workload definitions, byte and flop counting, selection, table and plot (CPU only)."""

import pytest

from bench import cli, report
from bench import workloads as W


def test_workload_set():
    names = [w.name for w in W.WORKLOADS]
    assert len(names) == len(set(names)) == 32
    for w in W.WORKLOADS:
        assert all(1 <= q <= kv for q, kv in w.requests()) and len(w.requests()) == w.batch
        assert w.head_dim in (64, 96, 128, 192, 256) and w.dtype in ("bfloat16", "float16")
    assert [w.name for w in W.WORKLOADS if w.kind == "compute"] == [
        "prefill_b4_l4096", "prefill_b2_l8192", "extend_b4_q1024_l16384", "prefill_b2_l8192_d64",
        "prefill_b2_l8192_d256", "prefill_b2_l8192_full", "prefill_b2_l8192_fp16", "extend_b8_q512_l8192",
        "prefill_b4_l4096_w1024", "prefill_b4_l4096_cap50", "prefill_b4_l4096_sinks",
        "prefill_b4_l4096_d96", "prefill_b4_l4096_d192", "prefill_b4_l4096_qk192_vo128", "prefill_b4_l4096_fp8", "prefill_b2_l8192_fp8",
        "extend_b4_q1024_l16384_fp8"]
    assert [w.name for w in W.WORKLOADS if not w.causal] == ["prefill_b2_l8192_full"]
    assert [w.name for w in W.WORKLOADS if w.kind == "mixed"] == ["mixed_q2048_d63_l4096"]


def test_qk_vo_cell_counts():
    """Separate qk / vo head dims: flops 2 H (D_qk + D_vo) per visible key, K and V bytes at their widths."""
    w, d192 = W.BY_NAME["prefill_b4_l4096_qk192_vo128"], W.BY_NAME["prefill_b4_l4096_d192"]
    assert (w.head_dim, w.dim_vo) == (192, 128) and w.shape == "bf16 D192/128 causal"
    assert w.visible_keys() == d192.visible_keys()
    assert w.flops() == 2 * W.H_Q * (192 + 128) * w.visible_keys() * 4 == d192.flops() * 320 // 384
    assert w.kv_bytes() == 4 * 4096 * W.H_KV * (192 + 128) * 2


def test_the_variant_workloads():
    """The attention variants' cells: decode B=64 and prefill B=4 at L=4096 with a window, a soft-cap or sinks,
    and a window of 4096 over 131072 keys, whose bytes are the window's."""
    variants = {w.name: w for w in W.WORKLOADS if w.variant}
    assert sorted(variants) == sorted([f"{kind}_l4096_{v}" for kind in ("decode_b64", "prefill_b4")
                                       for v in ("w1024", "cap50", "sinks")] + ["decode_b1_l131072_w4096"])
    long = variants["decode_b1_l131072_w4096"]
    assert long.kv_bytes() == 4096 * 8 * 128 * 2 * 2 == W.BY_NAME["decode_b1_l131072"].kv_bytes() // 32
    assert long.flops() == 4 * 32 * 128 * 4096 and long.shape == "bf16 D128 causal w4096"
    pw = variants["prefill_b4_l4096_w1024"]
    # query i sees min(1024, i + 1) keys; every key is some query's
    assert pw.visible_keys() == 1024 * 1025 // 2 + (4096 - 1024) * 1024 and pw.kv_bytes() == W.BY_NAME[
        "prefill_b4_l4096"].kv_bytes()
    assert variants["decode_b64_l4096_w1024"].kv_bytes() == W.BY_NAME["decode_b64_l4096"].kv_bytes() // 4
    assert variants["decode_b64_l4096_cap50"].kv_bytes() == W.BY_NAME["decode_b64_l4096"].kv_bytes()
    assert variants["prefill_b4_l4096_sinks"].shape == "bf16 D128 causal sinks"


def test_the_issue_18_workloads():
    """Head dims 64 and 256, non-causal, fp16, a ragged mixed batch (one 2048-token chunk and 63
    decodes at L = 4096) and a long-prefix extend (B = 8, q 512 over 8192)."""
    assert {W.BY_NAME[n].head_dim for n in ("prefill_b2_l8192_d64", "prefill_b2_l8192_d256")} == {64, 256}
    assert W.BY_NAME["prefill_b2_l8192_fp16"].dtype == "float16"
    full = W.BY_NAME["prefill_b2_l8192_full"]
    assert full.visible_keys() == 8192 * 8192 and full.flops() == 4 * 2 * 32 * 128 * 8192 * 8192
    mixed = W.BY_NAME["mixed_q2048_d63_l4096"]
    assert mixed.q_lens == [2048] + [1] * 63 and mixed.kv_lens == [4096] * 64 and not mixed.uniform
    assert mixed.num_q_rows == 2048 + 63 and mixed.metric == "us" and mixed.figure(123.0) == 123.0
    # the chunk sees a 2048-key prefix plus its causal triangle; each decode all 4096 keys
    assert mixed.visible_keys() == 2048 * 2048 + 2048 * 2049 // 2 + 63 * 4096
    assert mixed.kv_bytes() == 64 * 4096 * 8 * 128 * 2 * 2
    assert mixed.num_pages(16) == 64 * 256 and mixed.pages_of(1)[0] == 4096
    assert W.check_windows(mixed) == [(0, 0, 32), (0, 1984, 2048), (1, 0, 1), (63, 0, 1)]
    fb, ff = mixed.floors_us()
    assert mixed.floor_fraction(2 * max(fb, ff), 4.56, 812.0) == pytest.approx(0.5)
    extend = W.BY_NAME["extend_b8_q512_l8192"]
    assert (extend.batch, extend.q_len, extend.kv_len) == (8, 512, 8192)
    assert extend.visible_keys() == sum(7680 + i + 1 for i in range(512))
    d256 = W.BY_NAME["prefill_b2_l8192_d256"]
    assert d256.kv_bytes() == 2 * 8192 * 8 * 256 * 2 * 2 and d256.flops() == 2 * W.BY_NAME["prefill_b2_l8192"].flops()
    with pytest.raises(ValueError, match="ragged groups hold"):
        W.Workload("bad", 3, 2048, 4096, ragged=((1, 2048, 4096), (1, 1, 4096)))


def test_kv_bytes_counts_k_and_v_once():
    w = W.BY_NAME["decode_b64_l4096"]
    assert w.kv_bytes() == 64 * 4096 * 8 * 128 * 2 * 2 == 1 << 30
    assert w.min_bytes() == w.kv_bytes() + 2 * 64 * 32 * 128 * 2
    assert W.BY_NAME["draft_extend_q4_b64_l4096"].kv_len == 4100


def test_causal_flops_exact():
    # prefill: query i sees i + 1 keys -> L (L + 1) / 2 per head
    w = W.BY_NAME["prefill_b4_l4096"]
    assert w.visible_keys() == 4096 * 4097 // 2
    assert w.flops() == 4 * 4 * 32 * 128 * 4096 * 4097 // 2
    # within 0.03% of the usual causal count 4 * B * H * L * L * D / 2
    assert abs(w.flops() / (4 * 4 * 32 * 4096 * 4096 * 128 / 2) - 1) < 3e-4
    # extend: 1024 queries over a 15360 prefix
    e = W.BY_NAME["extend_b4_q1024_l16384"]
    assert e.visible_keys() == sum(15360 + i + 1 for i in range(1024))
    # decode: one query sees every key; verify q=4 sees L-3 .. L
    assert W.BY_NAME["decode_b1_l4096"].visible_keys() == 4096
    assert W.BY_NAME["verify_q4_b64_l4096"].visible_keys() == 4093 + 4094 + 4095 + 4096


def test_figures_and_floors():
    w = W.BY_NAME["decode_b64_l4096"]
    assert w.figure(1e6 * (1 << 30) / 4e12) == pytest.approx(4.0)  # 1 GiB in its 4 TB/s time
    p = W.BY_NAME["prefill_b2_l8192"]
    assert p.figure(p.flops() / 500e6) == pytest.approx(500.0)
    fb, ff = p.floors_us()
    assert ff > fb and ff == pytest.approx(p.flops() / 812e6)
    fb, ff = w.floors_us()
    assert fb > ff and fb == pytest.approx(w.min_bytes() / 4.56e6)


def test_pages_and_sets():
    w = W.BY_NAME["draft_extend_q4_b64_l4096"]
    assert w.pages_per_request(16) == 257 and w.num_pages(1) == 64 * 4100
    small = W.BY_NAME["decode_b1_l4096"]
    n = W.num_sets(small.min_bytes(), 60 << 20, 20)
    assert n * small.min_bytes() > 3 * (60 << 20) and n <= 20
    assert W.num_sets(W.BY_NAME["decode_b64_l4096"].min_bytes(), 60 << 20, 20) == 2


def test_select_and_windows():
    assert [w.name for w in W.select(["decode"])][:2] == ["decode_b64_l4096", "decode_b16_l32768"]
    assert [w.name for w in W.select(["*_b64_*"])] == [
        "decode_b64_l4096", "verify_q4_b64_l4096", "verify_q8_b64_l4096", "draft_extend_q4_b64_l4096",
        "decode_b64_l4096_w1024", "decode_b64_l4096_cap50", "decode_b64_l4096_sinks",
        "decode_b64_l4096_d96", "decode_b64_l4096_d192"]
    assert len(W.select([])) == 32
    assert [w.name for w in W.select(["prefill_b2_l8192*"])] == [
        "prefill_b2_l8192", "prefill_b2_l8192_d64", "prefill_b2_l8192_d256", "prefill_b2_l8192_full",
        "prefill_b2_l8192_fp16", "prefill_b2_l8192_fp8"]
    assert [w.name for w in W.select(["prefill_b2_l8192"])] == ["prefill_b2_l8192"]  # an exact name: that one
    # the order given (a --budget keeps the first cells), each pattern's matches in the table's order, once each
    assert [w.name for w in W.select(["prefill_b4_l4096_sinks", "decode_b1_", "prefill_b4_l4096_sinks"])] == [
        "prefill_b4_l4096_sinks", "decode_b1_l131072", "decode_b1_l4096", "decode_b1_l131072_w4096"]
    with pytest.raises(ValueError):
        W.select(["nope"])
    assert W.check_windows(W.BY_NAME["decode_b1_l4096"]) == [(0, 0, 1)]
    assert W.check_windows(W.BY_NAME["prefill_b2_l8192"]) == [
        (0, 0, 32), (0, 8128, 8192), (1, 0, 32), (1, 8128, 8192)]


def test_cli_help_and_list(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["--help"])
    assert e.value.code == 0
    assert cli.main(["--list"]) == 0
    assert "prefill_b2_l8192" in capsys.readouterr().out


@pytest.mark.parametrize("module,prog", [("bench.cli", "bench"), ("bench.mla", "bench.mla"), ("bench.fp8", "bench.fp8"),
                                         ("bench.host", "bench.host")])
def test_every_bench_says_in_one_line_that_it_needs_a_gpu(monkeypatch, capsys, module, prog):
    """Without a usable CUDA device (simulated, so this holds on a GPU machine too) each bench entry
    point exits 1 with one line naming itself and what is missing, before any device call; its
    --help still works."""
    import importlib

    from cupy_fa import _arrays

    main = importlib.import_module(module).main
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    capsys.readouterr()
    monkeypatch.setattr(_arrays, "cuda_problem", lambda: "no NVIDIA driver was found (simulated here)")
    assert main([]) == 1
    out, err = capsys.readouterr()
    assert out == "" and err == f"python -m {prog} needs a GPU: no NVIDIA driver was found (simulated here)\n"


@pytest.mark.parametrize("module,prog", [("bench.hf_throughput", "bench.hf_throughput"), ("bench.sglang", "bench.sglang")])
def test_the_torch_benches_name_the_module_they_miss(monkeypatch, capsys, module, prog):
    """bench.hf_throughput and bench.sglang drive torch models: without torch they say so in one
    line and exit 1 (simulated: find_spec answers None for torch)."""
    import importlib
    import importlib.util

    main = importlib.import_module(module).main
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torch" else real(name, *a))
    assert main([]) == 1
    out, err = capsys.readouterr()
    assert out == "" and err.startswith(f"python -m {prog} needs torch, which is not installed here")
    assert err.count("\n") == 1


def _fake_results():
    rows = []
    design = {"decode_b64_l4096": (4.33, 4.46, 2.72), "prefill_b4_l4096": (516, 610, 323)}
    for name, (fi, cudnn, flash) in design.items():
        w = W.BY_NAME[name]
        for ps in W.PAGE_SIZES:
            cell = lambda v: {"status": "ok", "value": v, "time_us": 1.0, "err": 3e-3}
            rows.append({"workload": name, "page_size": ps, "kind": w.kind, "metric": w.metric,
                         "impls": {"ours": cell(0.9 * fi), "sdpa_cudnn": cell(cudnn),
                                   "sdpa_flash": {"status": "error", "error": "x"}, "flashinfer": cell(fi)},
                         "ours_frac_ceiling": 0.5, "ours_over_flashinfer": 0.9})
    return {"rows": rows, "date": "2026-01-01", "machine": {"gpu": "fake"}, "shape": {"H_kv": 8},
            "ceilings": {}, "ceilings_used": {"read_tbps": 4.56, "gemm_tflops": 812.0}}


def test_table_marks():
    res = _fake_results()
    res["rows"][0]["impls"]["ours"]["status"] = "FAIL"
    text = report.table(res["rows"])
    assert "FAIL" in text and "n/a" in text and "decode_b64_l4096" in text
    assert "ceilings" in report.legend(res)


def test_plot(tmp_path):
    from bench import plot

    path = plot.plot(_fake_results(), str(tmp_path / "bench.png"))
    assert path and (tmp_path / "bench.png").stat().st_size > 1000


def test_the_fp8_kv_workloads():
    """The fp8 prefill cells: the bf16 prefill / extend shapes over an fp8 cache (per-tensor scale):
    the same flops, half the K / V bytes, q and out still 16-bit."""
    for name in ("prefill_b4_l4096", "prefill_b2_l8192", "extend_b4_q1024_l16384"):
        w, bf16 = W.BY_NAME[name + "_fp8"], W.BY_NAME[name]
        assert w.fp8 and w.kv_dtype == W.FP8 and w.elem_bytes == 1 and not bf16.fp8
        assert (w.batch, w.q_len, w.kv_len, w.head_dim, w.dtype) == (bf16.batch, bf16.q_len, bf16.kv_len, 128,
                                                                     "bfloat16")
        assert w.flops() == bf16.flops() and w.kv_bytes() * 2 == bf16.kv_bytes() and w.qo_bytes() == bf16.qo_bytes()
        assert w.shape == "bf16 fp8kv D128 causal" and w.metric == "TFLOP/s"


def test_flashinfer_is_not_called_where_it_faults():
    """FlashInfer's paged prefill runs only at the head dims it serves here (64, 128, 256 and the qk 192 /
    vo 128 pair): at 96 its kernel faults and takes the process's CUDA context with it, so that cell's
    FlashInfer column is n/a with the reason, and decode at any head dim is still run."""
    from bench import peers

    assert peers.flashinfer_refuses(W.BY_NAME["prefill_b4_l4096_d96"]).startswith("n/a: FlashInfer")
    assert peers.flashinfer_refuses(W.BY_NAME["prefill_b4_l4096_d192"]) is not None
    for name in ("prefill_b4_l4096", "prefill_b2_l8192_d64", "prefill_b2_l8192_d256", "prefill_b4_l4096_qk192_vo128",
                 "decode_b64_l4096", "prefill_b4_l4096_fp8"):
        assert peers.flashinfer_refuses(W.BY_NAME[name]) is None, name


@pytest.mark.parametrize("raising", ["sdpa", "flashinfer"])
def test_peer_that_raises_fails_its_own_cells(monkeypatch, raising):
    """A peer raising past its own handler (a fault that loses the CUDA context) is recorded as a FAIL
    under that peer's cells; a peer after it is 'not run', never blamed."""
    from bench import inputs, ours, peers

    w = W.BY_NAME["decode_b64_l4096"]

    class Inp:
        sets = [0]

    def boom(*args, **kwargs):
        raise RuntimeError("an illegal memory access was encountered")

    ok = {"status": "ok", "time_us": 10.0, "value": 1.0, "err": 1e-3}
    monkeypatch.setattr(inputs, "make_inputs", lambda *a: Inp())
    monkeypatch.setattr(inputs, "reference_windows", lambda *a: None)
    monkeypatch.setattr(ours, "bench_ours", lambda *a: dict(ok))
    monkeypatch.setattr(peers, "bench_sdpa", boom if raising == "sdpa" else
                        (lambda *a: {name: dict(ok) for name in peers.SDPA_BACKENDS}))
    monkeypatch.setattr(peers, "bench_flashinfer", boom)
    ctx = {"opts": None, "launches": 8, "l2": 50 << 20, "seed": 0, "no_peers": False, "sdpa": {}, "fi": object(),
           "fi_reason": "", "ceilings_used": {"read_tbps": 3.0, "gemm_tflops": 700.0}}
    row = cli.run_cell(w, 16, ctx)
    impls = row["impls"]
    assert "illegal memory access" in ctx["lost"] and impls["ours"]["status"] == "ok"
    if raising == "sdpa":
        assert all(impls[name]["status"] == "FAIL" for name in peers.SDPA_BACKENDS)
        assert impls["flashinfer"]["status"] == "n/a" and impls["flashinfer"]["error"].startswith("not run: ")
    else:
        assert all(impls[name]["status"] == "ok" for name in peers.SDPA_BACKENDS)
        assert impls["flashinfer"]["status"] == "FAIL" and "RuntimeError" in impls["flashinfer"]["error"]
    assert row["ours_over_flashinfer"] is None
