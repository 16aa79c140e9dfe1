"""The example engine (examples/engine.py) tensor-parallel over attention heads, one process per
GPU, through ``torch.distributed``.

Each rank holds ``H_q / tp`` query heads and ``H_kv / tp`` KV heads of every layer (the rows of the
q / k / v projections of those heads), its own paged KV caches and its own cupy_fa
``BatchAttention`` instances on its own GPU (bound to it: ``BatchAttention(..., device=rank)``,
whatever CuPy's current device is), and all-gathers the attention outputs of every layer before
``o_proj`` (``engine.Shard``). The o_proj, MLP, norms and lm_head stay whole on every rank, so
every rank computes the same logits and emits the same tokens; the run checks that they are the
tokens of one GPU (``--tp 1``, run first in this process), plain and speculative, eager and under
CUDA graphs (the all-gathers captured with the rest of the step), and prints tokens/s of both.

    PYTHONPATH=. python examples/tp_engine.py --tp 2                      # NCCL, GPUs 0 and 1
    PYTHONPATH=. python examples/tp_engine.py --tp 2 --device cpu --backend torch_ref   # gloo, CPU

NCCL's NVLink multicast (NVLS) is turned off before any process group exists
(``NCCL_NVLS_ENABLE=0``, and PyTorch's and NVSHMEM's multicast likewise): the all-gathers here
are small and need no switch-side reduction. The engine's own flags (model shape, dtype, page
size, drafts, ``--no-graphs``, ``--timing-runs``) pass through.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import socket
import sys
import tempfile
import time
from pathlib import Path

try:
    import torch
except ImportError:  # one line, not a traceback
    sys.exit("examples/tp_engine.py needs torch (a CPU build runs its ranks over gloo, a CUDA build over NCCL): "
             "pip install torch")

# NVLink multicast off, in this process and every rank it starts (they inherit the environment)
MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def load_engine():
    """examples/engine.py under the name the tests give it (a top-level ``examples`` may be
    another package's)."""
    name = "cupy_fa_example_engine"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, Path(__file__).resolve().with_name("engine.py"))
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def parse_args(argv=None):
    """(tp options, the engine's args)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], add_help=False)
    p.add_argument("--tp", type=int, default=2, help="tensor-parallel ranks (one process each)")
    p.add_argument("--dist-backend", choices=("nccl", "gloo"), default=None,
                   help="default: nccl on cuda, gloo on cpu")
    tp, rest = p.parse_known_args(argv)
    args = load_engine().parse_args(rest)
    if tp.dist_backend is None:
        tp.dist_backend = "nccl" if args.device == "cuda" else "gloo"
    if tp.tp < 1 or args.heads % tp.tp or args.kv_heads % tp.tp:
        raise SystemExit(f"--tp {tp.tp} must divide --heads {args.heads} and --kv-heads {args.kv_heads}")
    return tp, args


def head_gather(size, backend, capture_group=None):
    """All-gather of one layer's attention output ``[T, H_q / size, D]`` into ``[T, H_q, D]``, rank
    r's heads at ``r * H_q / size ..``: into one flat buffer on NCCL, as float32 parts on gloo
    (exact: fp16 / bf16 widen losslessly). Inside a CUDA-graph capture the gather goes through
    ``capture_group``, a communicator of its own that only captured steps use (eager steps keep
    the default group), so no NCCL communicator mixes captured and eager work."""
    import torch.distributed as dist

    def gather(o):
        o = o.contiguous()
        t, h, d = o.shape
        if backend == "gloo":
            parts = [torch.empty((t, h, d), dtype=torch.float32) for _ in range(size)]
            dist.all_gather(parts, o.float())
            return torch.cat(parts, dim=1).to(o.dtype)
        flat = torch.empty((size * t, h, d), dtype=o.dtype, device=o.device)
        capturing = capture_group is not None and torch.cuda.is_current_stream_capturing()
        dist.all_gather_into_tensor(flat, o, group=capture_group if capturing else None)
        return flat.view(size, t, h, d).permute(1, 0, 2, 3).reshape(t, size * h, d)

    return gather


def run_rank(args, device, shard=None, log=lambda *a: None):
    """One rank's generation (plain and speculative; eager, and with graphs on a GPU): the
    tokens of each run and its tokens/s over ``--timing-runs`` repeats."""
    engine = load_engine()
    shard = shard or engine.Shard()
    target, draft = engine.build_models(args, device)     # the same seeded weights on every rank
    W = args.num_draft + 1
    prompts, shared = engine.make_prompts(args.vocab, args.page_size, W, args.seed)
    budgets = [args.new_tokens + 2 * i for i in range(len(prompts))]
    settings = [False] + ([True] if args.graphs and torch.device(device).type == "cuda" else [])
    out = {}
    for graphs in settings:
        run_args = argparse.Namespace(**{**vars(args), "graphs": graphs})
        e = engine.Engine(target, draft, run_args, prompts, budgets, device, shard=shard)
        for spec in (False, True):
            key = ("spec" if spec else "plain") + ("_graphs" if graphs else "_eager")
            first = e.generate(prompts, budgets, shared, spec, seed=1)
            timed = [e.generate(prompts, budgets, shared, spec, seed=2 + k) for k in range(args.timing_runs)]
            out[key] = dict(tokens=first["tokens"], graphs_captured=first["graphs_captured"],
                            reruns_identical=all(t["tokens"] == first["tokens"] for t in timed),
                            tokens_per_s=(sum(t["emitted"] for t in timed) / sum(t["seconds"] for t in timed)
                                          if timed else None))
            log(f"rank {shard.rank}/{shard.size} {key}: {_rate(out[key]['tokens_per_s'])} tokens/s")
    return out


def _rate(tokens_per_s):
    return "-" if tokens_per_s is None else f"{tokens_per_s:.0f}"


def _worker(rank, size, tp_backend, argv, port, out_dir):
    """One rank: a process group, its GPU (or the CPU), its heads; writes rank<r>.json."""
    import torch.distributed as dist

    os.environ.update(MULTICAST_OFF)
    _, args = parse_args(argv)
    if args.device == "cuda":
        torch.cuda.set_device(rank)         # torch's current device; cupy_fa is bound by device= anyway
        device = torch.device("cuda", rank)
    else:
        torch.set_num_threads(1)            # ranks share the machine's cores
        device = torch.device("cpu")
    dist.init_process_group(tp_backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size,
                            **({"device_id": device} if device.type == "cuda" else {}))
    try:
        capture_group = None
        if device.type == "cuda":  # the captured steps' communicator, set up now: never inside a capture
            capture_group = dist.new_group(list(range(size)), backend=tp_backend)
            ready = torch.ones(1, device=device)
            dist.all_reduce(ready, group=capture_group)
            dist.all_reduce(ready)
            torch.cuda.synchronize(device)
            assert int(ready.item()) == size * size, ready
        shard = load_engine().Shard(rank, size, head_gather(size, tp_backend, capture_group))
        result = run_rank(args, device, shard)
        dist.barrier()
    finally:
        if tp_backend == "gloo":
            _leave_gloo_group(dist, rank, size, out_dir)
        else:  # (NCCL's teardown may wait on every rank: no order imposed)
            dist.destroy_process_group()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))


def _leave_gloo_group(dist, rank, size, out_dir, wait_s=60.0):
    """Destroys this rank's gloo process group, rank 0 last: rank 0 holds the TCP store the groups were
    made through, and a rank still tearing down when it goes away can abort its process
    ("terminate called without an active exception"). Every other rank leaves a mark in ``out_dir``
    after its teardown; rank 0 waits for them (at most ``wait_s``: a rank that died leaves none)."""
    if rank != 0:
        dist.destroy_process_group()
        Path(out_dir, f"rank{rank}.left").touch()
        return
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline and not all(Path(out_dir, f"rank{r}.left").exists() for r in range(1, size)):
        time.sleep(0.01)
    dist.destroy_process_group()


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(argv, size, dist_backend):
    """Runs ``size`` ranks (torch.multiprocessing spawn) and returns each rank's :func:`run_rank`."""
    import torch.multiprocessing as mp

    os.environ.update(MULTICAST_OFF)
    with tempfile.TemporaryDirectory() as out_dir:
        mp.spawn(_worker, args=(size, dist_backend, list(argv), _free_port(), out_dir), nprocs=size, join=True)
        return [json.loads(Path(out_dir, f"rank{r}.json").read_text()) for r in range(size)]


def compare(argv=None, log=print):
    """tp=1 here, then ``--tp`` ranks; the verdict: every rank's tokens == one GPU's, for every run."""
    tp, args = parse_args(argv)
    argv = list(argv or [])
    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    log(f"tp engine: {args.heads} q / {args.kv_heads} kv heads over {tp.tp} ranks ({tp.dist_backend}), "
        f"{args.layers} layers, hidden {args.hidden}, {args.dtype} via {args.backend} on {args.device}")
    one = run_rank(args, device, log=log)
    ranks = launch(argv, tp.tp, tp.dist_backend)
    checks = {}
    for key, base in one.items():
        same = [r[key]["tokens"] == base["tokens"] for r in ranks]
        checks[key] = dict(identical=all(same), per_rank=same, reruns=all(r[key]["reruns_identical"] for r in ranks)
                           and base["reruns_identical"])
        diff = [(r, b, next(i for i, (x, y) in enumerate(zip(tr, tb)) if x != y) if tr != tb else None)
                for r, rank in enumerate(ranks) for b, (tr, tb) in enumerate(zip(rank[key]["tokens"], base["tokens"]))
                if tr != tb]
        log(f"{key}: tp={tp.tp} tokens == tp=1: {'PASS' if all(same) else 'FAIL'}"
            + "".join(f"; rank {r} request {b} first differs at token {i}" for r, b, i in diff)
            + f"; tokens/s tp=1 {_rate(base['tokens_per_s'])}, tp={tp.tp} {_rate(ranks[0][key]['tokens_per_s'])}")
    plain_spec = all(one["spec" + s]["tokens"] == one["plain" + s]["tokens"] for s in ("_eager", "_graphs")
                     if "spec" + s in one)
    ok = all(c["identical"] and c["reruns"] for c in checks.values()) and plain_spec
    log(("ALL PASS" if ok else "FAILED") + f" (speculative == plain greedy at tp=1: {plain_spec})")
    return dict(ok=ok, checks=checks, tp1=one, ranks=ranks,
                tokens_per_s={key: {"tp1": one[key]["tokens_per_s"], f"tp{tp.tp}": ranks[0][key]["tokens_per_s"]}
                              for key in one})


def main(argv=None):
    return 0 if compare(sys.argv[1:] if argv is None else argv)["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
