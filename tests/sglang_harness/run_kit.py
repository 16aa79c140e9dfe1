"""Runs SGLang's attention kit (dense or MLA method) for some backends and configs and prints one line per
case: result, backend, config, mode, graph or eager, case, max |actual - expected| over the kit's checks,
time.

    python tests/sglang_harness/run_kit.py --backends triton,cupy_fa --configs d128-fp16-kit,d64-bf16-p64 \\
        [--method dense|mla] [--json FILE] [--budget SECONDS]

A config is ``d<head dim>-<fp16|bf16>-<kit|p<page>>`` (kit_cases.Config; the MLA method ignores the head
dim: its latent is kit_cases.MLA_LATENT, and its configs print as ``mla-<dtype>-<pages>``). Every case runs; a failure
prints its first line and the run goes on; the exit status is 1 when any case failed. ``--budget``
stops starting new cases after that many seconds (those left are listed as NOT RUN, never passed).
"""

import argparse
import json
import os
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def parse_config(text, device):
    from sglang_harness.kit_cases import Config

    d, dt, page = text.split("-")
    return Config(int(d[1:]), {"fp16": "float16", "bf16": "bfloat16"}[dt], None if page == "kit" else int(page[1:]),
                  device)


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--backends", default="triton,cupy_fa")
    ap.add_argument("--configs", default="d128-fp16-kit")
    ap.add_argument("--method", default="dense", choices=("dense", "mla"), help="the kit's attention method")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--json", default=None)
    ap.add_argument("--budget", type=float, default=None)
    ap.add_argument("--only", default="", help="run only cases whose id contains this")
    ap.add_argument("--reference-kernels", action="store_true",
                    help="cupy_fa's kernels replaced by the float64 reference (the CPU box)")
    args = ap.parse_args(argv)
    import torch

    import sglang_harness

    placeholders = sglang_harness.prepare()
    print(f"placeholders: {', '.join(placeholders) or 'none'}", flush=True)
    from sglang_harness import kit_cases, placeholders as ph

    if args.reference_kernels:
        import cupy_fa.integrations.sglang.kernels as kernels
        from sglang_harness.reference_kernels import RefKernels

        kernels.Kernels = RefKernels

    errors = []
    original = torch.testing.assert_close

    def recording_assert_close(actual, expected, *a, **kw):
        try:
            diff = (actual.detach().float() - expected.detach().float()).abs()
            errors.append(float(diff.max()) if diff.numel() else 0.0)
        except Exception:  # shapes that differ: the kit's own assert says so
            pass
        return original(actual, expected, *a, **kw)

    torch.testing.assert_close = recording_assert_close
    rows, start, failed = [], time.time(), 0
    for config_text in args.configs.split(","):
        config = parse_config(config_text, args.device)
        for backend in args.backends.split(","):
            found = kit_cases.items if args.method == "dense" else kit_cases.mla_items
            for item in found(backend, config, graphs=args.device == "cuda"):
                if args.only and args.only not in item.id:
                    continue
                label = config.label_for(args.method)
                row = dict(backend=backend, config=label, mode=item.mode, graph=item.graph, case=item.case)
                if args.budget is not None and time.time() - start > args.budget:
                    row.update(result="NOT RUN", max_err=None, seconds=0.0, message="time budget spent")
                    rows.append(row)
                    failed += 1
                    print(f"NOT RUN {item.id}", flush=True)
                    continue
                errors.clear()
                t = time.time()
                try:
                    item.run(kit_cases.KitTestCase())
                    row.update(result="PASS", message="")
                except Exception as exc:
                    failed += 1
                    lines = [ln for ln in str(exc).splitlines() if ln.strip()]
                    row.update(result="SKIP" if isinstance(exc, kit_cases.KitSkipped) else "FAIL",
                               message=f"{type(exc).__name__}: {lines[0][:200] if lines else ''}")
                    if os.environ.get("KIT_TRACEBACK"):
                        traceback.print_exc(limit=-4)
                if torch.cuda.is_available():
                    torch.cuda.synchronize()
                row.update(max_err=max(errors) if errors else None, seconds=round(time.time() - t, 2))
                rows.append(row)
                err = "-" if row["max_err"] is None else f"{row['max_err']:.2e}"
                print(f"{row['result']:4s} {backend:8s} {label:13s} {item.mode:16s} {item.graph:38s} "
                      f"{item.case:72s} {err:>9s} {row['seconds']:6.2f}s {row['message']}", flush=True)
    counts = {}
    for row in rows:
        key = (row["backend"], row["config"], row["result"])
        counts[key] = counts.get(key, 0) + 1
    for (b, c, r), n in sorted(counts.items()):
        print(f"TOTAL {b:8s} {c:13s} {r:7s} {n}")
    print(f"placeholder calls: {ph.calls or 'none'}")
    print(f"{sum(r['result'] == 'PASS' for r in rows)} passed, {failed} failed in {time.time() - start:.1f}s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
