"""benchmarks/plots.py: the sweep's figures render from saved (synthetic) results, headless."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from support import load_script

pytest.importorskip("matplotlib")

plots = load_script(Path(__file__).resolve().parents[2] / "benchmarks" / "plots.py")
FIGURES, render_figures = plots.FIGURES, plots.render_figures

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _session(scale: float) -> dict[str, float]:
    return {
        "stall_s": 0.1 * scale,
        "local_commit_s": 1.0 * scale,
        "peak_over_state_bytes": 1.05 * scale * (1 << 28),
        "pair_peak_over_state_bytes": 1.07 * scale * (1 << 28),
    }


def _sweep() -> dict[str, dict[str, dict[str, Any]]]:
    sizes = {
        str(mib): {
            "payload_bytes": mib << 20,
            "dcp_safe": _session(mib / 256),
            "torch_default_async": _session(2 * mib / 256),
            "torch_blocking_cached": {"error": "RuntimeError: no accelerator"},
            "copy_floor": 0.05 * mib / 256,
            "raw_floor": 0.8 * mib / 256,
        }
        for mib in (256, 1024, 4096)
    }
    s3 = {
        "256": {
            "payload_bytes": 256 << 20,
            "dcp_safe_s3": {"remote_commit_s": 3.0, "stall_s": 0.1, "local_commit_s": 3.0},
            "boto3_floor": 2.8,
        }
    }
    counts = {
        str(n): {"dcp_safe": _session(1 + n / 1000), "raw_floor": 0.3}
        for n in (10, 100, 1000, 10000)
    }
    return {"sizes": sizes, "s3": s3, "counts": counts}


def test_every_figure_is_written_as_a_png(tmp_path: Path) -> None:
    paths = render_figures(_sweep(), tmp_path / "figs")
    assert sorted(p.name for p in paths) == sorted(FIGURES)
    for path in paths:
        data = path.read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 5_000, path


def test_only_the_figures_of_parts_present_are_drawn(tmp_path: Path) -> None:
    sweep = {"counts": _sweep()["counts"]}
    paths = render_figures(sweep, tmp_path)
    assert [p.name for p in paths] == ["per_item_vs_count.png"]
