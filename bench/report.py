"""Machine information, the final table, and the JSON file."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

from cupy_fa.reference import TOL

IMPLS = ["ours", "sdpa_cudnn", "sdpa_flash", "flashinfer"]
LABELS = {"ours": "ours", "sdpa_cudnn": "SDPA cuDNN", "sdpa_flash": "SDPA flash", "flashinfer": "FlashInfer"}


def sm_count() -> int:
    import cupy

    dev = cupy.cuda.Device()
    props = cupy.cuda.runtime.getDeviceProperties(dev.id)
    return int(props.get("multiProcessorCount") or dev.attributes["MultiProcessorCount"])


def machine_info(flashinfer_version=None) -> dict:
    import cupy

    dev = cupy.cuda.Device()
    props = cupy.cuda.runtime.getDeviceProperties(dev.id)
    rt = cupy.cuda.runtime
    info = {
        "gpu": props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"]),
        "sm_count": sm_count(),
        "l2_bytes": int(props.get("l2CacheSize") or dev.attributes["L2CacheSize"]),
        "memory_bytes": int(props.get("totalGlobalMem", 0)),
        "compute_capability": dev.compute_capability,
        "cuda_driver": rt.driverGetVersion(),
        "cuda_runtime": rt.runtimeGetVersion(),
        "cupy": cupy.__version__,
        "python": sys.version.split()[0],
        "host": platform.node(),
        "flashinfer": flashinfer_version,
        "knobs": {k: v for k, v in os.environ.items() if k.startswith("CUPY_FA_")},  # tuning settings in force
    }
    try:
        import torch

        info.update(torch=torch.__version__, torch_cuda=torch.version.cuda,
                    cudnn=torch.backends.cudnn.version())
    except Exception as e:  # noqa: BLE001
        info["torch"] = f"not importable ({type(e).__name__}: {e})"
    try:
        q = "name,driver_version,clocks.sm,clocks.max.sm,clocks.mem,power.limit,temperature.gpu"
        info["nvidia_smi"] = subprocess.run(["nvidia-smi", f"--query-gpu={q}", "--format=csv,noheader"],
                                            check=False, capture_output=True, text=True, timeout=20).stdout.strip()
    except Exception:  # noqa: BLE001
        info["nvidia_smi"] = None
    return info


def _fig(cell, metric) -> str:
    if not cell:
        return "-"
    if cell.get("status") == "wrong":
        return "wrong"
    v = cell.get("value")
    if v is None:
        return "n/a"
    return f"{v:.2f}" if metric == "TB/s" else f"{v:.0f}"


def table(rows) -> str:
    """One line per (workload, page size)."""
    head = ["workload", "ps", "unit", "ours us", "run host", "FI run host", "plan host", "FI plan host", "ours",
            "%ceil", "cuDNN", "flash", "FlashInfer", "ours/FI", "max rel err", "check"]
    lines = [head]
    for r in rows:
        impls, metric = r["impls"], r["metric"]
        ours = impls.get("ours", {})
        t = ours.get("time_us")
        frac = r.get("ours_frac_ceiling")
        ratio = r.get("ours_over_flashinfer")
        err = ours.get("err")
        host, fi_host = ours.get("host") or {}, (impls.get("flashinfer") or {}).get("host") or {}
        us = lambda d, k: f"{d[k]:.1f}" if d.get(k) is not None else "-"
        lines.append([
            r["workload"], str(r["page_size"]), metric,
            f"{t:.1f}" if t is not None else "-",
            us(host, "run_us"), us(fi_host, "run_us"), us(host, "plan_us"), us(fi_host, "plan_us"),
            _fig(ours, metric),
            f"{100 * frac:.0f}%" if frac is not None else "-",
            _fig(impls.get("sdpa_cudnn"), metric), _fig(impls.get("sdpa_flash"), metric),
            _fig(impls.get("flashinfer"), metric),
            f"{ratio:.2f}" if ratio is not None else "n/a",
            f"{err:.1e}" if err is not None else "-",
            "ok" if ours.get("status") == "ok" else "FAIL",
        ])
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    fmt = lambda line: "  ".join(c.ljust(wd) if i < 3 else c.rjust(wd)
                                 for i, (c, wd) in enumerate(zip(line, widths)))
    out = [fmt(lines[0]), "  ".join("-" * wd for wd in widths)] + [fmt(x) for x in lines[1:]]
    return "\n".join(out)


def legend(results) -> str:
    c, m = results.get("ceilings_used", {}), results.get("ceilings", {})
    copy = (m.get("copy") or {}).get("tbps")
    lines = [
        (f"ceilings: read {c.get('read_tbps', 0):.2f} TB/s ({c.get('read_from')}), "
         f"GEMM {c.get('gemm_tflops', 0):.0f} TFLOP/s ({c.get('gemm_from')}), "
         f"copy {f'{copy:.2f} TB/s (read+write)' if copy else 'not measured'}"),
        (f"TB/s: K+V bytes of the cache once (H_kv={results['shape']['H_kv']}) for every implementation; "
         "TFLOP/s: 4*H_q*D*visible keys (causal counted exactly); us: a mixed batch's step time (lower is better)."),
        ("run host / plan host: host us of one run (out given) / one plan (host lengths), ours and FlashInfer's, "
         "each timed alone after a sync, median (torch tensors both; bench.timing.host_us); "
         "%ceil: ours over the read (TB/s) or GEMM (TFLOP/s) "
         "ceiling (mixed: the larger floor over the time); ours/FI: FlashInfer time / ours time; "
         f"n/a: peer unavailable or failed (JSON has why); wrong: peer over its dtype's rel err bar "
         f"({', '.join(f'{k} {v:g}' for k, v in TOL.items())}); SDPA is dense, timed once per workload "
         "(n/a on ragged batches)."),
    ]
    return "\n".join(lines)


def write_json(results, path) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(results, f, indent=1, default=str)
