"""The sweep's figures, drawn with matplotlib (the optional ``dcp-safe[bench]`` extra).

Input is the sweep's per-point summaries (``{point: {contender: {metric: value} | floor
seconds}}``, as ``benchmarks/sweep.py`` writes them), so a figure can be redrawn from saved
results, or from synthetic ones in a test. matplotlib is imported only when a figure is drawn,
with the non-interactive Agg backend, so importing this module costs nothing and works
headless.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

__all__ = ["FIGURES", "render_figures"]

Points = Mapping[str, Mapping[str, Any]]
Series = dict[str, list[tuple[float, float]]]


def _metric(points: Points, metric: str, scale: float = 1.0) -> Series:
    """``{contender: [(point, value), ...]}`` for every session contender that has ``metric``."""
    series: Series = {}
    for key in sorted(points, key=float):
        for name, entry in points[key].items():
            if isinstance(entry, Mapping) and metric in entry:
                series.setdefault(name, []).append((float(key), float(entry[metric]) * scale))
    return series


def _floor(points: Points, name: str, label: str) -> Series:
    values = [
        (float(k), float(points[k][name])) for k in sorted(points, key=float) if name in points[k]
    ]
    return {label: values} if values else {}


def _draw(
    series: Series, path: Path, *, title: str, xlabel: str, ylabel: str, logy: bool = True
) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.0, 4.2), dpi=110)
    palette = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    colors: dict[str, str] = {}
    for label, values in series.items():
        if not values:
            continue
        xs, ys = zip(*values, strict=True)
        # One colour per contender; its variants (stall, back-to-back, S3) are dotted.
        base = label.split(" (")[0]
        color = colors.setdefault(base, palette[len(colors) % len(palette)])
        style = "--" if "floor" in label or "target" in label else ":" if "(" in label else "-"
        ax.plot(xs, ys, marker="o", linestyle=style, color=color, label=label)
    ax.set_xscale("log", base=2 if "MiB" in xlabel else 10)
    if logy:
        ax.set_yscale("log")
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path


def stall_vs_size(sweep: Mapping[str, Points], path: Path) -> Path:
    """Second-save stall per contender and the copy floor, against state size."""
    sizes = sweep["sizes"]
    series = _metric(sizes, "stall_s") | _floor(sizes, "copy_floor", "copy_ floor")
    return _draw(
        series,
        path,
        title="Training stall per save (2nd save)",
        xlabel="state size (MiB)",
        ylabel="seconds",
    )


def durable_vs_size(sweep: Mapping[str, Points], path: Path) -> Path:
    """Time to local commit (and to remote commit on S3) against state size, with floors."""
    sizes = sweep["sizes"]
    series = _metric(sizes, "local_commit_s") | _floor(sizes, "raw_floor", "raw write+fsync floor")
    s3 = sweep.get("s3", {})
    for name, values in _metric(s3, "remote_commit_s").items():
        series[f"{name} (S3 commit)"] = values
    series |= _floor(s3, "boto3_floor", "boto3 multipart floor (S3)")
    return _draw(
        series,
        path,
        title="Time from the save call to a durable commit",
        xlabel="state size (MiB)",
        ylabel="seconds",
    )


def memory_vs_size(sweep: Mapping[str, Points], path: Path) -> Path:
    """Peak RSS above the resident state, in generations (state sizes), with the 1.1 target."""
    sizes = sweep["sizes"]
    series: Series = {}
    for metric, suffix in (
        ("peak_over_state_bytes", ""),
        ("pair_peak_over_state_bytes", " (2 back-to-back)"),
    ):
        for name, values in _metric(sizes, metric).items():
            payload = {
                float(k): float(sizes[k].get("payload_bytes", float(k) * (1 << 20))) for k in sizes
            }
            series[f"{name}{suffix}"] = [(x, y / payload[x]) for x, y in values]
    series["target: 1.1 generations"] = [(float(k), 1.1) for k in sorted(sizes, key=float)]
    return _draw(
        series,
        path,
        title="Peak RSS above the resident state",
        xlabel="state size (MiB)",
        ylabel="peak RSS growth / state size",
        logy=False,
    )


def per_item_vs_count(sweep: Mapping[str, Points], path: Path) -> Path:
    """Time to local commit against tensor count at a fixed total size, with the floors."""
    counts = sweep["counts"]
    series = _metric(counts, "local_commit_s")
    for name, values in _metric(counts, "stall_s").items():
        series[f"{name} (stall)"] = values
    series |= _floor(counts, "raw_floor", "raw write+fsync floor")
    return _draw(
        series,
        path,
        title="Per-item overhead: same bytes, more tensors",
        xlabel="tensors (fixed total size)",
        ylabel="seconds",
    )


FIGURES: dict[str, Callable[[Mapping[str, Points], Path], Path]] = {
    "stall_vs_size.png": stall_vs_size,
    "durable_vs_size.png": durable_vs_size,
    "memory_vs_size.png": memory_vs_size,
    "per_item_vs_count.png": per_item_vs_count,
}


def render_figures(sweep: Mapping[str, Points], folder: Path) -> list[Path]:
    """Draw every figure whose part is present in ``sweep`` into ``folder``; return the paths.

    Args:
        sweep: ``{"sizes": points, "counts": points, "s3": points}``; a figure whose part is
            missing is skipped.
        folder: where the PNG files go.
    """
    needs = {
        "stall_vs_size.png": "sizes",
        "durable_vs_size.png": "sizes",
        "memory_vs_size.png": "sizes",
        "per_item_vs_count.png": "counts",
    }
    return [draw(sweep, folder / name) for name, draw in FIGURES.items() if needs[name] in sweep]
