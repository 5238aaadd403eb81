"""The headline chart: four panels drawn from one run's raw results (matplotlib, PNG)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ._common import median

__all__ = ["draw"]

_VARIANTS = {
    "a": "(a) sync save",
    "b": "(b) NeMo-RL",
    "c": "(c) bare async",
    "d": "(d) ckptd",
    "e": "(e) begin first",
}


def _stall(ax: Any, raw: dict[str, Any]) -> None:
    sizes = list(raw)
    variants = [v for v in _VARIANTS if any(v in raw[s]["blocked_ms"] for s in sizes)]
    width = 0.8 / max(1, len(variants))
    for i, v in enumerate(variants):
        xs = [j + i * width for j in range(len(sizes))]
        ys = [median(raw[s]["blocked_ms"].get(v, [])) for s in sizes]
        ax.bar(xs, ys, width, label=_VARIANTS[v])
    ax.set_xticks([j + width * (len(variants) - 1) / 2 for j in range(len(sizes))])
    ax.set_xticklabels([f"{s} per rank" for s in sizes])
    ax.set_yscale("log")
    ax.set_ylabel("ms (median, log)")
    ax.set_title("1. Training thread blocked per save")
    ax.legend(fontsize=7)


def _throughput(ax: Any, raw: dict[str, Any]) -> None:
    for label, per_n in raw.items():
        counts = sorted(int(n) for n in per_n)
        ax.plot(counts, [per_n[str(n)]["rps"] for n in counts], marker="o", label=label)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("concurrent clients")
    ax.set_ylabel("requests/s (log)")
    ax.set_title("4. Daemon throughput vs echo server")
    ax.legend(fontsize=7)


def _promotion(ax: Any, raw: dict[str, Any]) -> None:
    counts = sorted(int(n) for n in raw if n.isdigit())
    lat = [median([s["latency_ms"] for s in raw[str(n)]]) for n in counts]
    up = [median([s["upload_ms"] for s in raw[str(n)]]) for n in counts]
    ax.plot(counts, lat, marker="o", label="last done -> promoted")
    ax.plot(counts, up, marker="s", linestyle="--", label="raw upload (write + fsync)")
    ax.axhline(10, color="grey", linewidth=0.8, linestyle=":", label="10 ms")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("files in the checkpoint")
    ax.set_ylabel("ms (median, log)")
    ax.set_title("2. Promotion latency")
    ax.legend(fontsize=7)


def _disk(ax: Any, raw: dict[str, Any]) -> None:
    labels = ["disk write+fsync", "bare async_save", "ckptd end to end"]
    keys = ["disk_gbps", "bare_dcp_gbps", "ckptd_gbps"]
    ax.bar(labels, [median(raw[k]) for k in keys], color=["grey", "tab:blue", "tab:green"])
    ax.set_ylabel("GB/s (median)")
    ax.set_title(f"3. End to end vs disk ({raw['mb_per_rank']} MB/rank x 2)")
    ax.tick_params(axis="x", labelsize=8)


def draw(raw: dict[str, Any], path: Path, title: str) -> bool:
    """Draw the panels whose benchmarks ran into ``path``.

    Returns:
        False when matplotlib is not installed (nothing is drawn).
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    panels = [
        ("stall", _stall),
        ("promotion", _promotion),
        ("disk", _disk),
        ("throughput", _throughput),
    ]
    present = [(name, fn) for name, fn in panels if name in raw]
    if not present:
        return False
    cols = 2 if len(present) > 1 else 1
    rows = (len(present) + 1) // 2
    fig, axes = plt.subplots(rows, cols, figsize=(6 * cols, 4.2 * rows), squeeze=False)
    for ax, (name, fn) in zip(axes.flat, present, strict=False):
        fn(ax, raw[name])
    for ax in list(axes.flat)[len(present) :]:
        ax.axis("off")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
