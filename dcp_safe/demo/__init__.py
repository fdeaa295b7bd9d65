"""``dcp-safe demo``: the main job, outside the library's import path (only the CLI imports it).

``run`` trains a small model with asynchronous checkpoints and restores from S3; ``report``
renders what it measured.
"""

from __future__ import annotations

from dcp_safe.demo.report import raise_if_failed, render
from dcp_safe.demo.run import DemoOptions, quiet, run_demo

__all__ = ["DemoOptions", "quiet", "raise_if_failed", "render", "run_demo"]
