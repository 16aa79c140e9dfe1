"""Diagnosis only: the SM clock, board power and clock-event reasons while one cell replays for a
few seconds. Cells: decode B=64 H 32/8 D 128 page 16 over a bf16 and an fp8 cache at L = 4096 and
16384, and the prefill B=2 L=8192 causal (bf16, page 16); ``--cells prefill-peers``: that prefill
held for ours and for PyTorch SDPA's cuDNN backend on the bench's dense copy, twice each in turn.
``nvidia-smi`` samples every 50 ms in the background; each cell's samples are those between its
first and last replay. Timing only, no float64 check (the bench's cells have it).

On the device machine, from a tree's root: ``PYTHONPATH=$PWD python3 lab/probe_clocks.py``
(``--cells decode`` or ``prefill``: those cells only; ``--seconds``: how long each is held).
Knobs apply as everywhere (``CUPY_FA_SPLIT_SIZE=2048 python3 lab/probe_clocks.py``)."""

import datetime
import statistics
import subprocess
import time

import numpy as np

from probe_fp8_layout import D, LAYOUTS, decode_caches  # lab/ is the script's own directory on sys.path

SECONDS = 4.0
FIELDS = "timestamp,clocks.sm,power.draw,clocks_event_reasons.active"


def _hold(replay, synchronize, seconds):
    """Replays until ``seconds`` have passed (checked every 10 replays); (replays, wall start, end)."""
    t0, reps = datetime.datetime.now(), 0
    while True:
        replay()
        reps += 1
        if reps % 10 == 0:
            synchronize()
            if (datetime.datetime.now() - t0).total_seconds() > seconds:
                return reps, t0, datetime.datetime.now()


def sustained(run, seconds, n_launch=20):
    """Replays a graph of ``n_launch`` runs for ``seconds``; (mean us per run, wall-clock start, end)."""
    import cupy

    from cupy_fa._timing import capture_graph

    graph, stream = capture_graph([run] * n_launch)
    for _ in range(3):
        graph.launch(stream)
    stream.synchronize()
    start, end = cupy.cuda.Event(), cupy.cuda.Event()
    start.record(stream)
    reps, t0, t1 = _hold(lambda: graph.launch(stream), stream.synchronize, seconds)
    end.record(stream)
    end.synchronize()
    return cupy.cuda.get_elapsed_time(start, end) * 1e3 / (reps * n_launch), t0, t1


def sustained_torch(run, seconds, n_launch):
    """:func:`sustained` for a torch callable (a torch CUDA graph of ``n_launch`` runs,
    bench.timing.capture_torch_graph)."""
    import torch

    from bench.timing import capture_torch_graph

    graph = capture_torch_graph([run] * n_launch)
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    reps, t0, t1 = _hold(graph.replay, torch.cuda.synchronize, seconds)
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / (reps * n_launch), t0, t1


def decode_cell(kv_len, elem, seconds):
    import cupy
    import cupy_fa
    from bench.fp8 import kv_bytes

    batch, h_q, h_kv, page = LAYOUTS[0]  # the bench's decode layout, as probe_fp8_layout times it
    table, c16, c8, q = decode_caches(batch, h_q, h_kv, page, kv_len, np.random.default_rng(7))
    cache = c8 if elem == 1 else c16
    del c16, c8
    out = cupy.empty_like(q)
    attn = cupy_fa.BatchAttention(h_q, h_kv, D, "bfloat16", kv_dtype="float8_e4m3fn" if elem == 1 else None)
    attn.plan(np.ones(batch, int), np.full(batch, kv_len), table)
    us, t0, t1 = sustained(lambda: attn.run(q, cache, out=out), seconds)
    tbps = kv_bytes(batch, kv_len, elem) / (us * 1e-6) / 1e12
    return f"decode B=64 L={kv_len:5d} {'fp8' if elem == 1 else 'bf16'}", f"{us:8.1f} us {tbps:5.2f} TB/s", t0, t1


def prefill_cell(seconds, impl="ours"):
    """The bench's prefill_b2_l8192 at page 16, held: ours, or ``impl="cudnn"``: PyTorch SDPA's cuDNN
    backend on the bench's dense copy of the same inputs (as bench/peers.py times it)."""
    from bench.inputs import make_inputs
    from bench.workloads import H_KV, H_Q, WORKLOADS

    work = next(w for w in WORKLOADS if w.name == "prefill_b2_l8192")
    inp = make_inputs(work, 16, 1, 7)  # the bench's own inputs at page 16
    s = inp.sets[0]
    if impl == "cudnn":
        from torch.nn.attention import SDPBackend

        from bench.peers import dense_copy, sdpa_runner

        run_set, _, _ = sdpa_runner(work, [dense_copy(inp, s)], SDPBackend.CUDNN_ATTENTION)  # as the bench calls it
        us, t0, t1 = sustained_torch(lambda: run_set(0), seconds, n_launch=4)
        name = "prefill B=2 L=8192 causal cuDNN"
    else:
        import cupy_fa

        attn = cupy_fa.BatchAttention(H_Q, H_KV, D, work.dtype)
        attn.plan(inp.q_lens, inp.kv_lens, inp.page_table, causal=work.causal)  # as bench/ours.py plans it
        us, t0, t1 = sustained(lambda: attn.run(s.q, s.cache, out=s.out), seconds, n_launch=4)
        name = "prefill B=2 L=8192 causal bf16"
    return name, f"{us:8.1f} us {work.flops() / (us * 1e6):5.1f} TFLOP/s", t0, t1


def main(argv=None):
    import argparse

    import cupy

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cells", choices=("all", "decode", "prefill", "prefill-peers"), default="all",
                        help="prefill-peers: the prefill cell held for ours, cuDNN, ours, cuDNN in turn")
    parser.add_argument("--seconds", type=float, default=SECONDS, help="how long each cell is held")
    args = parser.parse_args(argv)
    makers = []
    if args.cells in ("all", "decode"):
        makers += [lambda kv=kv, e=e: decode_cell(kv, e, args.seconds) for kv in (4096, 16384) for e in (2, 1)]
    if args.cells in ("all", "prefill"):
        makers.append(lambda: prefill_cell(args.seconds))
    if args.cells == "prefill-peers":
        makers += [lambda i=i: prefill_cell(args.seconds, i) for i in ("ours", "cudnn", "ours", "cudnn")]

    fields = FIELDS
    if subprocess.run(["nvidia-smi", f"--query-gpu={fields}", "--format=csv"], capture_output=True).returncode:
        fields = fields.replace("clocks_event_reasons", "clocks_throttle_reasons")  # older drivers' name
    log = open("/tmp/probe_clocks_smi.csv", "w")
    smi = subprocess.Popen(["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader,nounits", "-lms", "50"],
                           stdout=log)
    time.sleep(1.0)
    cells = []
    try:
        for make in makers:
            cells.append(make())
            cupy.get_default_memory_pool().free_all_blocks()
            time.sleep(1.0)
    finally:
        smi.terminate()
        smi.wait()
        log.close()
    samples = []
    for line in open("/tmp/probe_clocks_smi.csv"):
        parts = [x.strip() for x in line.split(",")]
        try:
            samples.append((datetime.datetime.strptime(parts[0], "%Y/%m/%d %H:%M:%S.%f"), float(parts[1]),
                            float(parts[2]), parts[3]))
        except (ValueError, IndexError):
            continue
    print(f"{'cell':32s} {'time':>24s} {'n':>4s} {'SM MHz med':>10s} {'min':>5s} {'W med':>6s} {'max':>6s}  reasons")
    for name, figure, t0, t1 in cells:
        inside = [s for s in samples if t0 <= s[0] <= t1]
        if not inside:
            print(f"{name:32s} {figure:>24s} no samples")
            continue
        clk = [s[1] for s in inside]
        pw = [s[2] for s in inside]
        reasons = sorted({s[3] for s in inside})
        print(f"{name:32s} {figure:>24s} {len(inside):4d} {statistics.median(clk):10.0f} {min(clk):5.0f} "
              f"{statistics.median(pw):6.0f} {max(pw):6.0f}  {' '.join(reasons)}", flush=True)


if __name__ == "__main__":
    main()
