"""Grouped bars, ours against the peers: a TB/s panel (decode-like) and a TFLOP/s panel."""

from __future__ import annotations

from .report import IMPLS, LABELS

COLORS = {"ours": "#d62728", "sdpa_cudnn": "#1f77b4", "sdpa_flash": "#9ecae1", "flashinfer": "#2ca02c"}


def plot(results: dict, path: str) -> str | None:
    """Writes the PNG and returns its path, or None (with a message) without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        print(f"plot skipped: matplotlib not importable ({e})")
        return None

    rows = results["rows"]
    ceil = results.get("ceilings_used", {})
    panels = [("memory", "TB/s (K+V bytes once)", ceil.get("read_tbps"), "read ceiling"),
              ("compute", "TFLOP/s", ceil.get("gemm_tflops"), "GEMM ceiling"),
              ("mixed", "us per step (lower is better)", None, "")]
    panels = [p for p in panels if any(r["kind"] == p[0] for r in rows)]
    if not panels:
        print("plot skipped: no rows")
        return None
    fig, axes = plt.subplots(len(panels), 1, figsize=(14, 4.8 * len(panels)), squeeze=False)
    width = 0.8 / len(IMPLS)
    for ax, (kind, ylabel, ceiling, ceil_label) in zip(axes[:, 0], panels):
        sel = [r for r in rows if r["kind"] == kind]
        for j, impl in enumerate(IMPLS):
            for x, r in enumerate(sel):
                cell = r["impls"].get(impl) or {}
                v = cell.get("value") if cell.get("status") in ("ok", "FAIL") else None
                xpos = x - 0.4 + (j + 0.5) * width
                if v is None:
                    ax.text(xpos, 0, "n/a", rotation=90, ha="center", va="bottom", fontsize=6, color="gray")
                else:
                    ax.bar(xpos, v, width, color=COLORS[impl], hatch="//" if cell.get("status") == "FAIL" else None)
            ax.bar(0, 0, 0, color=COLORS[impl], label=LABELS[impl])  # legend entry
        top = max([ceiling or 0] + [(r["impls"].get(i) or {}).get("value") or 0 for r in sel for i in IMPLS])
        if ceiling:
            ax.axhline(ceiling, color="k", ls="--", lw=1, label=f"{ceil_label} {ceiling:.3g}")
        ax.set_ylim(0, 1.08 * top if top else 1)
        ax.set_xticks(range(len(sel)))
        ax.set_xticklabels([f"{r['workload']}\npage {r['page_size']}" for r in sel], fontsize=7, rotation=20)
        ax.set_ylabel(ylabel)
        ax.legend(fontsize=8, ncol=5, loc="lower left", bbox_to_anchor=(0, 1.0), frameon=False)
        ax.grid(axis="y", alpha=0.3)
    m = results.get("machine", {})
    fig.suptitle(f"cupy_fa bench, {m.get('gpu', '?')}, {results.get('date', '')}, H_q 32 / H_kv 8 "
                 "(bf16 D 128 causal unless the name says)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
