"""``dcp_safe`` imports its public names on first use (PEP 562), so ``import dcp_safe`` (and
``dcp-safe ls``) does not import torch; what type checkers see is what runs."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import dcp_safe

_ROOT = Path(dcp_safe.__file__)
# Generous: only a guard against a hung subprocess, never a measure of speed.
_SUBPROCESS_TIMEOUT_S = 300


def _type_checking_imports() -> dict[str, str]:
    """name -> module of the imports under ``if TYPE_CHECKING:`` in dcp_safe/__init__.py."""
    tree = ast.parse(_ROOT.read_text(encoding="utf-8"))
    (block,) = [
        node
        for node in tree.body
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING"
    ]
    return {
        alias.asname or alias.name: node.module or ""
        for node in block.body
        if isinstance(node, ast.ImportFrom)
        for alias in node.names
    }


def test_the_lazy_table_is_what_type_checkers_see() -> None:
    assert _type_checking_imports() == dcp_safe._LAZY


def test_every_public_name_resolves_is_listed_by_dir_and_imports_from_the_root() -> None:
    for name in dcp_safe.__all__:
        assert getattr(dcp_safe, name) is not None, name
        assert name in dir(dcp_safe)
    namespace: dict[str, object] = {}
    exec("from dcp_safe import CheckpointManager, list_checkpoints", namespace)
    assert namespace["CheckpointManager"] is dcp_safe.manager.CheckpointManager


def test_an_unknown_name_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="no_such_name"):
        dcp_safe.no_such_name  # type: ignore[attr-defined]  # noqa: B018


@pytest.mark.subprocess
def test_import_dcp_safe_leaves_torch_out_until_a_name_needs_it() -> None:
    code = (
        "import sys, dcp_safe\n"
        "before = 'torch' in sys.modules\n"
        "dcp_safe.CheckpointManager\n"
        "print(before, 'torch' in sys.modules)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=_SUBPROCESS_TIMEOUT_S,
        check=True,
    )
    assert done.stdout.split() == ["False", "True"]
