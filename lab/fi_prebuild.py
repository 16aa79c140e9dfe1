"""FlashInfer's JIT modules for the bench's workloads, built ahead of `python -m bench` in several
processes at once, so that a bench on the same machine (the same FLASHINFER_WORKSPACE_BASE, /tmp/fiws
as scripts/device_check.sh sets it) finds them built (2026-12-07).

The bench's 32 workloads need 14 modules, which the bench builds one after another as its cells
first need them: about 990 s on an H100 host, more than a call (lab/NOTES.md, twenty-second stop).
Here each variant (its wrapper and template arguments: bench.peers.flashinfer_refuses decides which
workloads FlashInfer runs at all) is planned once on a one-request copy of a workload that has it,
through the bench's own bench.peers.flashinfer_step, so the module built is the one the bench will
load. PROCESSES processes share the variants; each runs FlashInfer's ninja with MAX_JOBS = cores /
PROCESSES, so no more compilers run at once than the machine has cores.

    PYTHONPATH=$PWD:/tmp/fi python3 lab/fi_prebuild.py [workload patterns] [--processes 4]
    python3 lab/fi_prebuild.py --list        (the variants and their workloads; no GPU needed)
"""

import argparse
import dataclasses
import multiprocessing as mp
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def variant(w):
    """What FlashInfer builds a module for: the wrapper and the template arguments of workload w
    (lengths, batch, page size, causality and the variants' values are run time)."""
    from bench import peers

    return (peers.flashinfer_wrapper_kind(w), w.dtype, w.kv_dtype or w.dtype, w.head_dim, w.dim_vo, bool(w.window),
            bool(w.soft_cap))


def variants(patterns):
    """{variant: the first workload (in the bench's order) that has it}, of the workloads FlashInfer runs."""
    from bench import peers
    from bench import workloads as W

    todo = {}
    for w in (W.select(patterns) if patterns else W.WORKLOADS):
        if peers.flashinfer_refuses(w) is None:
            todo.setdefault(variant(w), w)
    return todo


def tiny(w):
    """A one-request copy of w with the same variant: one decode token, or 16 query tokens over 64 keys."""
    return dataclasses.replace(w, name=w.name + "_prebuild", batch=1, q_len=1 if w.q_len == 1 else 16, kv_len=64,
                               ragged=())


def worker(names, jobs, seed):
    os.environ["MAX_JOBS"] = str(jobs)
    os.environ.setdefault("FLASHINFER_WORKSPACE_BASE", "/tmp/fiws")
    from bench import inputs, peers
    from bench import workloads as W

    fi, why = peers.load_flashinfer()
    if fi is None:
        print(f"flashinfer does not import: {why}", flush=True)
        return
    for name in names:
        t0 = time.perf_counter()
        try:
            peers.flashinfer_step(fi, inputs.make_inputs(tiny(W.BY_NAME[name]), 16, 1, seed))
            what = "built"
        except Exception as e:  # noqa: BLE001 - the bench records its own error for the cell
            what = f"{type(e).__name__}: {str(e)[:160]}"
        print(f"{name}: {what} in {time.perf_counter() - t0:.0f} s", flush=True)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("workloads", nargs="*", help="bench workload patterns (default: all)")
    parser.add_argument("--processes", type=int, default=4)
    parser.add_argument("--list", action="store_true", help="print the variants and stop")
    args = parser.parse_args(argv)
    todo = variants(args.workloads)
    if args.list:
        for key, w in todo.items():
            print(f"{w.name:32s} {key}")
        print(f"{len(todo)} modules")
        return 0
    procs = max(1, min(args.processes, len(todo)))
    jobs = max(1, (os.cpu_count() or procs) // procs)
    # prefill modules (FlashInfer's sm90 ones: ten translation units, ~80-95 s each) first, dealt in turn,
    # so each process gets its share of the heavy ones
    names = [w.name for key, w in sorted(todo.items(), key=lambda item: item[0][0] == "decode")]
    shares = [names[i::procs] for i in range(procs)]
    t0 = time.perf_counter()
    ctx = mp.get_context("spawn")
    running = [ctx.Process(target=worker, args=(share, jobs, 1)) for share in shares if share]
    for p in running:
        p.start()
    for p in running:
        p.join()
    print(f"{len(todo)} modules on {procs} processes (MAX_JOBS {jobs} each) in {time.perf_counter() - t0:.0f} s",
          flush=True)
    return 0 if all(p.exitcode == 0 for p in running) else 1


if __name__ == "__main__":
    sys.exit(main())
