"""cupy_fa's SGLang backend beside SGLang's triton backend, on the attention kit's fixtures scaled up.

    python -m bench.sglang [--workloads decode,verify,extend] [--backends cupy_fa,triton] [--json FILE]

Needs a GPU, sglang 0.5.17 and the harness of tests/sglang_harness (placeholders for sgl_kernel /
flashinfer). Each workload is one of the kit's ``DenseAttentionCase`` at serving size (32 query heads, 8
KV heads, head dim 128, bf16, page 16, shuffled pages; the kit projects random hidden states into the
pool): decode B=64 over 4096 keys, target verify (chain) q=4 B=64 over 4096 keys, extend 4 x 1024 new
tokens over 16384 keys. Per backend and workload it prints:

* host us per ``init_forward_metadata`` (eager) and per ``init_forward_metadata_out_graph`` (replay),
  median of 30 calls, without a sync;
* host us per ``forward_*`` call (eager), median of 30 calls, without a sync;
* GPU us per layer call, eager (CUDA events around 30 back-to-back calls) and replayed (a graph of 10
  layer calls and the in-graph metadata, replayed 20 times; per layer call).

Triton's backend has no CUDA-graph path for EXTEND (its out_graph raises), so that cell reads "-".
"""

import argparse
import json
import statistics
import sys
import time

HEADS, KV_HEADS, HEAD_DIM, PAGE = 32, 8, 128, 16
WORKLOADS = {
    "decode": dict(mode="DECODE", prefix=(4095,) * 64, extend=()),
    "verify": dict(mode="TARGET_VERIFY", prefix=(4092,) * 64, extend=(4,) * 64),
    "extend": dict(mode="EXTEND", prefix=(15360,) * 4, extend=(1024,) * 4),
}
LAYERS_PER_GRAPH = 10


def _fixture(name, backend):
    import torch

    from sglang.srt.model_executor.forward_batch_info import ForwardMode
    from sglang.test.kits.attention_unittest.attention_methods import dense_attention as dense
    from sglang.test.kits.attention_unittest.runner_modes import speculative_target_verify_runner as tv

    w = WORKLOADS[name]
    case = dense.DenseAttentionCase(name=f"bench_{name}", backend=backend, forward_mode=getattr(ForwardMode, w["mode"]),
                                    num_heads=HEADS, num_kv_heads=KV_HEADS, page_size=PAGE, prefix_lens=w["prefix"],
                                    extend_lens=w["extend"])
    context = max(p + (e or 1) for p, e in zip(w["prefix"], w["extend"] or (1,) * len(w["prefix"]))) + PAGE

    class TC:
        def skipTest(self, why):
            raise RuntimeError(why)

    fixture = dense.build_dense_attention_fixture(TC(), case, head_dim=HEAD_DIM, hidden_size=256,
                                                  max_context_len=context, dtype=torch.bfloat16, device="cuda",
                                                  disable_cuda_graph=False)
    if w["mode"] == "TARGET_VERIFY":
        tv._prepare_spec_verify_batch(case, fixture.forward_batch, topk=1, spec_kind="eagle", device="cuda")
    q, k, v = fixture.actual_module.project_qkv(fixture.input_hidden)
    return fixture, q, k.view(-1, KV_HEADS, HEAD_DIM), v.view(-1, KV_HEADS, HEAD_DIM)


def _host_us(fn, n=30):
    import torch

    times = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
        torch.cuda.synchronize()
    return statistics.median(times) * 1e6


def _gpu_us(fn, n=30):
    import torch

    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(n):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / n


def measure(name, backend_name):
    import torch

    from sglang.srt.model_executor.forward_context import ForwardContext, forward_context

    fixture, q, k, v = _fixture(name, backend_name)
    backend, layer, fb = fixture.backend, fixture.actual_module.attn, fixture.forward_batch
    row = dict(backend=backend_name, workload=name)
    with torch.no_grad(), forward_context(ForwardContext(attn_backend=backend)):
        backend.init_forward_metadata(fb)
        layer_call = lambda: backend.forward(q, k, v, layer, fb)  # noqa: E731
        layer_call()
        torch.cuda.synchronize()
        row["host_us_init_forward_metadata"] = _host_us(lambda: backend.init_forward_metadata(fb))
        row["host_us_forward"] = _host_us(layer_call)
        row["gpu_us_layer_eager"] = _gpu_us(layer_call)
        row["host_us_out_graph"] = row["gpu_us_layer_replayed"] = None
        if name == "extend" and backend_name == "triton":
            return row
        bs, tokens = fb.batch_size, q.shape[0]
        backend.init_cuda_graph_state(bs, tokens)
        backend.init_forward_metadata_out_graph(fb, in_capture=True)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            backend.init_forward_metadata_in_graph(fb)
            layer_call()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            backend.init_forward_metadata_in_graph(fb)
            for _ in range(LAYERS_PER_GRAPH):
                layer_call()
        row["host_us_out_graph"] = _host_us(lambda: backend.init_forward_metadata_out_graph(fb))
        row["gpu_us_layer_replayed"] = _gpu_us(graph.replay, 20) / LAYERS_PER_GRAPH
    return row


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workloads", default="decode,verify,extend")
    ap.add_argument("--backends", default="cupy_fa,triton")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    from . import refuse_here

    if refuse_here("bench.sglang", needs=("torch", "transformers")):
        return 1
    sys.path.insert(0, "tests")
    import sglang_harness

    sglang_harness.prepare()
    import torch

    print(f"device: {torch.cuda.get_device_name(0)}; heads {HEADS}/{KV_HEADS}, head dim {HEAD_DIM}, bf16, page {PAGE}")
    cols = ["host_us_init_forward_metadata", "host_us_forward", "gpu_us_layer_eager", "host_us_out_graph",
            "gpu_us_layer_replayed"]
    print(f"{'workload':8s} {'backend':8s} " + " ".join(f"{c:>29s}" for c in cols))
    rows = []
    for name in args.workloads.split(","):
        for backend in args.backends.split(","):
            try:
                row = measure(name, backend)
            except Exception as exc:  # a backend that cannot run a workload says so, the others go on
                row = dict(backend=backend, workload=name, error=f"{type(exc).__name__}: {exc}"[:300])
                print(f"{name:8s} {backend:8s} ERROR {row['error']}", flush=True)
                rows.append(row)
                continue
            rows.append(row)
            cells = ["-" if row[c] is None else f"{row[c]:.1f}" for c in cols]
            print(f"{name:8s} {backend:8s} " + " ".join(f"{c:>29s}" for c in cells), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
