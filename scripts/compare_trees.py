"""Outputs and LSE of two source trees' kernels, compared bit for bit (GPU).

Usage (repo root, on a GPU machine):
    python3 scripts/compare_trees.py OLD [--new DIR] [--grid N] [--seed S] [--out DIR]

OLD is a directory holding an old revision's ``cupy_fa/`` and ``kernels/`` (e.g. ``exp/base``,
made with ``mkdir -p exp/base && git archive REV | tar -x -C exp/base``) or, where git is at hand,
a revision itself. NEW is the working tree by default. Each tree runs in a worker process of its
own (its ``cupy_fa`` first on PYTHONPATH, so its kernels compile under their own source hash), on
the same cases, and writes every case's ``out`` (as bits) and ``lse`` to .npy files; the parent
compares them and prints one line per case:

* every bench shape (``bench/workloads.py``) at page sizes 16 and 1, eager ``BatchAttention``
  (uniform prefill and extend at batch 1), with the same inputs in both trees
  (``bench.inputs.make_inputs`` from one seed);
* the decode-like bench shapes through ``GraphRunner`` (capture, then a replay);
* a random grid from ``tests/cases.py``: ragged batches of decode, prefill, extend, verify and
  padding rows, fp16 and bf16, head dims 64 / 128 / 256, page sizes 1, 3, 16, 64, causal or not,
  tree masks for verify-like batches; shuffled, interleaved page tables, NaN in unused slots.

It also records each case's planned tile (family fields, splits per CTA, fold), grid and merge (and
the long launch's tile and grid where the tree has one), so a schedule that changed shows even
where the bits agree. Exit status 0 when every case has the same bits, the same schedule, and no
NaN; 1 otherwise.

``--small-q`` keeps the cases whose every request has at most 16 tokens (the decode-like bench
shapes and graph cases, and the grid with its q_lens cut to 16): what must keep its bits when
the prefill family changes (a change of the long requests' kernel changes the bits of every case
that holds one, by design).
"""

import argparse
import dataclasses
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

REPO = pathlib.Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.append(str(REPO))  # bench/ (appended: a worker's own tree stays first on the path)
TILE_FIELDS = ("head_dim", "warps_m", "warps_n", "stages", "fold_capable", "splits_per_cta", "fold_splits")
GRAPH_MODES = {"decode_b64_l4096": ("DECODE", 1), "decode_b1_l4096": ("DECODE", 1),
               "verify_q4_b64_l4096": ("TARGET_VERIFY", 4), "verify_q8_b64_l4096": ("TARGET_VERIFY", 8),
               "draft_extend_q4_b64_l4096": ("DRAFT_EXTEND_V2", 4)}


# ---- the cases (the same list in both workers) ----------------------------------------------


def case_list(grid, seed, small_q=False):
    from bench import workloads

    cases = []
    for w in workloads.WORKLOADS:
        if small_q and w.kind != "memory":
            continue
        for ps in workloads.PAGE_SIZES:
            cases.append({"kind": "bench", "workload": w.name, "page_size": ps,
                          "batch": w.batch if w.kind == "memory" or not w.uniform else 1, "seed": seed})
    for name in GRAPH_MODES:
        cases.append({"kind": "graph", "workload": name, "page_size": 16, "seed": seed})
    rng = np.random.default_rng(seed)
    for i in range(grid):
        cases.append({"kind": "grid", "seed": seed * 1000 + i, "dtype": str(rng.choice(["float16", "bfloat16"])),
                      "head_dim": int(rng.choice([64, 128, 256])),
                      "heads": [int(h) for h in [(32, 8), (8, 8), (16, 2), (32, 4)][int(rng.integers(4))]],
                      "page_size": int(rng.choice([1, 3, 16, 64])), "causal": bool(rng.random() < 0.8),
                      "tree": bool(rng.random() < 0.25), "small_q": small_q})
    for i, c in enumerate(cases):
        c["id"] = i
    return cases


def describe(case):
    if case["kind"] in ("bench", "graph"):
        return f"{case['kind']:5s} {case['workload']} ps{case['page_size']}" + \
            (f" B={case['batch']}" if case["kind"] == "bench" else "")
    return (f"grid  seed {case['seed']} {case['dtype']} D{case['head_dim']} {case['heads'][0]}/{case['heads'][1]} "
            f"ps{case['page_size']} {'causal' if case['causal'] else 'full'}{' tree' if case['tree'] else ''}"
            f"{' q<=16' if case.get('small_q') else ''}")


# ---- the worker: one tree, every case --------------------------------------------------------


def planned_facts(attn):
    state = attn.planned
    tile = state.tile
    long = getattr(getattr(state, "schedule", None), "long", None)  # trees with a launch per family
    return {"tile": {f: getattr(tile, f, None) for f in TILE_FIELDS}, "work_grid": int(state.work_grid),
            "needs_merge": bool(state.needs_merge),
            "long": None if long is None else {"tile": _fields(long.tile), "work_grid": int(long.work_grid)}}


def _fields(tile):
    """A tile's fields by name (a dataclass), else its repr."""
    import dataclasses

    return dataclasses.asdict(tile) if dataclasses.is_dataclass(tile) else repr(tile)


def same_long(a, b):
    """The long launches agree: the same grid and every tile field both trees have the same (a
    field one tree dropped, as an option no tile chose, is no change of schedule)."""
    if a is None or b is None:
        return a is b
    x, y = a["tile"], b["tile"]
    if isinstance(x, dict) and isinstance(y, dict):
        x, y = ({k: d[k] for k in x.keys() & y.keys()} for d in (x, y))
    return (x, a["work_grid"]) == (y, b["work_grid"])


def save(out_dir, case, out, lse, facts):
    import cupy

    cupy.cuda.Device().synchronize()
    bits = out.view(cupy.uint16)
    nan = int(((bits & 0x7FFF) > (0x7C00 if out.dtype == np.float16 else 0x7F80)).sum())
    np.save(out_dir / f"{case['id']}_out.npy", cupy.asnumpy(bits))
    np.save(out_dir / f"{case['id']}_lse.npy", cupy.asnumpy(lse).view(np.uint32))
    return dict(facts, nan=nan, rows=int(out.shape[0]))


def run_bench_case(case, out_dir):
    import cupy
    import cupy_fa
    from bench import inputs, workloads

    w = workloads.BY_NAME[case["workload"]]
    if case["batch"] != w.batch:
        w = dataclasses.replace(w, batch=case["batch"])
    inp = inputs.make_inputs(w, case["page_size"], 1, case["seed"] + case["id"])
    s = inp.sets[0]
    attn = cupy_fa.BatchAttention(workloads.H_Q, workloads.H_KV, getattr(w, "head_dim", workloads.HEAD_DIM),
                                  dtype=getattr(w, "dtype", workloads.DTYPE))
    attn.plan(inp.q_lens, inp.kv_lens, inp.page_table, causal=w.causal)
    inputs.poison(s.out)
    lse = cupy.full((s.q.shape[0], workloads.H_Q), np.nan, np.float32)
    attn.run(s.q, s.cache, out=s.out, lse=lse)
    return save(out_dir, case, s.out, lse, planned_facts(attn))


def run_graph_case(case, out_dir):
    import cupy
    import cupy_fa
    from bench import inputs, workloads
    from cupy_fa.modes import ForwardMode

    w = workloads.BY_NAME[case["workload"]]
    mode, max_q = GRAPH_MODES[case["workload"]]
    inp = inputs.make_inputs(w, case["page_size"], 1, case["seed"] + case["id"])
    s = inp.sets[0]
    runner = cupy_fa.GraphRunner(workloads.H_Q, workloads.H_KV, workloads.HEAD_DIM, workloads.DTYPE,
                                 max_batch_size=w.batch, max_q_len=max_q,
                                 max_pages_per_request=inp.page_table.shape[1], page_size=case["page_size"])
    for _ in range(2):  # the first run captures (after an eager warm-up), the second replays
        runner.out.view(cupy.uint16).fill(inputs.BF16_NAN_BITS)
        out, lse = runner.run(ForwardMode[mode], s.q, s.cache, inp.q_lens, inp.kv_lens, inp.page_table,
                              return_lse=True)
    return save(out_dir, case, out.copy(), lse.copy(), planned_facts(runner.attn))


def grid_inputs(case):
    """A grid case's host inputs, from its seed (tests/cases.py): the same arrays in both workers."""
    if str(REPO / "tests") not in sys.path:
        sys.path.append(str(REPO / "tests"))
    import cases as gen  # tests/cases.py

    rng = np.random.default_rng(case["seed"])
    h_q, h_kv = case["heads"]
    q_lens, kv_lens = gen.random_lengths(rng, max_requests=16, max_q=200, max_kv=6000, work_budget=1_500_000)
    if case["tree"]:  # verify-like: every live request a few drafts
        q_lens = np.where(q_lens > 0, np.minimum(q_lens, int(rng.integers(2, 9))), 0)
        kv_lens = np.maximum(kv_lens, q_lens)
    elif case.get("small_q"):  # decode-like only: the same draws, q_len cut to 16
        q_lens = np.minimum(q_lens, 16)
    table, num_pages = gen.paged_layout(rng, kv_lens, case["page_size"])
    dtype = gen.np_dtype(case["dtype"])
    k, v = gen.fill_cache(rng, (num_pages, case["page_size"], h_kv, case["head_dim"]), dtype, table, kv_lens,
                          case["page_size"])
    q = rng.standard_normal((int(q_lens.sum()), h_q, case["head_dim"]), dtype=np.float32).astype(dtype)
    mask = np.concatenate([m.ravel() for m in gen.tree_masks(rng, q_lens)]) if case["tree"] else None
    return q_lens, kv_lens, table, k, v, q, mask


GRID_FIELDS = ("q_lens", "kv_lens", "table", "k", "v", "q", "mask")


def save_grid_inputs(cases, inputs_dir):
    """The parent writes every grid case's inputs once (with the working tree's generators), so
    both workers read the same arrays and neither imports the other tree's test helpers."""
    inputs_dir.mkdir(parents=True, exist_ok=True)
    for case in cases:
        if case["kind"] != "grid":
            continue
        arrays = dict(zip(GRID_FIELDS, grid_inputs(case)))
        dtype = case["dtype"]
        packed = {name: (a.view(np.uint16) if name in ("k", "v", "q") else a) for name, a in arrays.items()
                  if a is not None}
        np.savez(inputs_dir / f"{case['id']}.npz", dtype=np.array(dtype), **packed)


def load_grid_inputs(case, inputs_dir):
    from cupy_fa import _arrays

    data = np.load(pathlib.Path(inputs_dir) / f"{case['id']}.npz")
    elem = _arrays.DTYPES[str(data["dtype"])]
    return tuple((data[name].view(elem) if name in ("k", "v", "q") else data[name]) if name in data else None
                 for name in GRID_FIELDS)


def run_grid_case(case, out_dir, inputs_dir):
    import cupy
    import cupy_fa

    q_lens, kv_lens, table, k, v, q, mask = load_grid_inputs(case, inputs_dir)
    h_q, h_kv = case["heads"]
    cache = cupy_fa.PagedKVCache(cupy.asarray(k), cupy.asarray(v))
    attn = cupy_fa.BatchAttention(h_q, h_kv, case["head_dim"], dtype=case["dtype"])
    attn.plan(q_lens, kv_lens, table, causal=case["causal"], custom_mask=mask)
    out = cupy.full(q.shape, np.nan, q.dtype)
    lse = cupy.full(q.shape[:2], np.nan, np.float32)
    attn.run(cupy.asarray(q), cache, out=out, lse=lse)
    return save(out_dir, case, out, lse, planned_facts(attn))


def worker(out_dir, grid, seed, inputs_dir, small_q=False):
    import cupy

    out_dir = pathlib.Path(out_dir)
    results = {}
    runners = {"bench": run_bench_case, "graph": run_graph_case,
               "grid": lambda case, out: run_grid_case(case, out, inputs_dir)}
    # the parent's case list (its bench workloads), not this tree's: an old tree's bench may lack fields
    for case in json.loads((pathlib.Path(inputs_dir) / "cases.json").read_text()):
        start = time.perf_counter()
        try:
            results[case["id"]] = dict(runners[case["kind"]](case, out_dir), seconds=time.perf_counter() - start)
        except Exception as exc:  # noqa: BLE001 - recorded, the comparison reports it
            results[case["id"]] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
        cupy.get_default_memory_pool().free_all_blocks()
        (out_dir / "results.json").write_text(json.dumps(results, indent=1))
    import cupy_fa

    (out_dir / "tree.txt").write_text(os.path.dirname(cupy_fa.__file__))


# ---- the parent: two workers, one table -------------------------------------------------------


def tree_dir(spec, scratch):
    path = pathlib.Path(spec)
    if (path / "cupy_fa").is_dir() and (path / "kernels").is_dir():
        return path.resolve()
    target = scratch / "old_tree"
    target.mkdir()
    archive = subprocess.run(["git", "-C", str(REPO), "archive", spec, "kernels", "cupy_fa"], check=True,
                             capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(target)], input=archive, check=True)
    return target


def launch(tree, out_dir, args, log):
    env = dict(os.environ, PYTHONPATH=f"{tree}{os.pathsep}{REPO}", PYTHONUNBUFFERED="1")
    cmd = [sys.executable, str(pathlib.Path(__file__).resolve()), "--worker", str(out_dir), "--grid", str(args.grid),
           "--seed", str(args.seed), "--inputs", str(args.inputs)] + (["--small-q"] if args.small_q else [])
    return subprocess.Popen(cmd, env=env, cwd=str(REPO), stdout=log, stderr=subprocess.STDOUT)


def compare(old_dir, new_dir, grid, seed, small_q=False, only=None):
    cases = [c for c in case_list(grid, seed, small_q) if not only or c["kind"] in only]
    old = json.loads((old_dir / "results.json").read_text())
    new = json.loads((new_dir / "results.json").read_text())
    bad = 0
    print(f"{'case':70s} {'out bits':>10s} {'lse bits':>10s}  schedule (new)")
    for case in cases:
        key = str(case["id"])
        a, b = old.get(key, {"error": "missing"}), new.get(key, {"error": "missing"})
        if "error" in a or "error" in b:
            print(f"{describe(case):70s} ERROR old: {a.get('error', 'ok')} | new: {b.get('error', 'ok')}")
            bad += 1
            continue
        verdicts = []
        for part in ("out", "lse"):
            x = np.load(old_dir / f"{key}_{part}.npy")
            y = np.load(new_dir / f"{key}_{part}.npy")
            differ = int((x != y).sum()) if x.shape == y.shape else -1
            verdicts.append("identical" if differ == 0 else ("shape!" if differ < 0 else f"{differ} differ"))
        same_schedule = (a["tile"], a["work_grid"], a["needs_merge"]) == (b["tile"], b["work_grid"], b["needs_merge"]) \
            and same_long(a.get("long"), b.get("long"))
        t = b["tile"]
        schedule = (f"{t['warps_m']}x{t['warps_n']} st{t['stages']} fold{int(bool(t['fold_splits']))} "
                    f"c{t['splits_per_cta']} grid {b['work_grid']} merge {int(b['needs_merge'])}")
        flags = ("" if same_schedule else f"  SCHEDULE CHANGED (old {a['tile']}, grid {a['work_grid']}, "
                                          f"long {a.get('long')}; new long {b.get('long')})") + \
                ("" if a["nan"] == b["nan"] == 0 else f"  NaN old {a['nan']} new {b['nan']}")
        ok = verdicts == ["identical", "identical"] and same_schedule and a["nan"] == b["nan"] == 0
        bad += not ok
        print(f"{describe(case):70s} {verdicts[0]:>10s} {verdicts[1]:>10s}  {schedule}{flags}")
    print(f"{len(cases)} cases: {len(cases) - bad} bit-identical with the same schedule, {bad} not")
    return bad


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("old", nargs="?", help="old tree (directory with cupy_fa/ and kernels/) or git revision")
    parser.add_argument("--new", default=str(REPO), help="new tree (default: this working tree)")
    parser.add_argument("--grid", type=int, default=24, help="random grid cases (default 24)")
    parser.add_argument("--seed", type=int, default=20261201)
    parser.add_argument("--out", help="keep the workers' files and logs here (default: a temporary directory)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--inputs", help=argparse.SUPPRESS)
    parser.add_argument("--only", type=lambda v: v.split(","), default=None,
                        help="comma list of case kinds to run (bench, graph, grid; default: all)")
    parser.add_argument("--small-q", action="store_true",
                        help="only cases whose requests all have q_len <= 16 (decode-like: their bits must not move)")
    parser.add_argument("--list", action="store_true", help="print the cases and exit (no GPU)")
    args = parser.parse_args(argv)
    if args.worker:
        worker(args.worker, args.grid, args.seed, args.inputs, args.small_q)
        return 0
    if args.list:
        for case in case_list(args.grid, args.seed, args.small_q):
            print(describe(case))
        return 0
    if not args.old:
        parser.error("OLD is required")
    scratch = pathlib.Path(args.out) if args.out else pathlib.Path(tempfile.mkdtemp(prefix="compare_trees_"))
    scratch.mkdir(parents=True, exist_ok=True)
    trees = {"old": tree_dir(args.old, scratch), "new": pathlib.Path(args.new).resolve()}
    args.inputs = scratch / "inputs"
    cases = [c for c in case_list(args.grid, args.seed, args.small_q) if not args.only or c["kind"] in args.only]
    save_grid_inputs(cases, args.inputs)
    (args.inputs / "cases.json").write_text(json.dumps(cases))
    dirs = {side: scratch / side for side in trees}
    procs = {}
    for side, tree in trees.items():
        if dirs[side].exists():
            shutil.rmtree(dirs[side])
        dirs[side].mkdir()
        procs[side] = launch(tree, dirs[side], args, open(scratch / f"{side}.log", "w"))
    for side, proc in procs.items():
        if proc.wait() != 0:
            print(f"worker {side} ({trees[side]}) exited {proc.returncode}: {scratch / (side + '.log')}")
    for side in trees:
        print(f"{side}: {(dirs[side] / 'tree.txt').read_text() if (dirs[side] / 'tree.txt').exists() else '?'}")
    bad = compare(dirs["old"], dirs["new"], args.grid, args.seed, args.small_q, args.only)
    if not args.out:
        shutil.rmtree(scratch, ignore_errors=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
