"""The package layout is the architecture (docs/architecture.md): layers only point down.

Read from the source with ``ast`` (every import, including those inside functions and under
``TYPE_CHECKING``), so a lazy import cannot hide an upward edge.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "dcp_safe"

# Bottom to top. A module may import its own layer and the layers below it, never above.
LAYERS: list[tuple[str, ...]] = [
    (
        "errors",
        "layout",
        "observe",
        "units",
        "choices",
        "version",
        "torch_compat",
        "untrusted",
        "topology",
        "host_memory",
        "periodic",
    ),
    ("manifest",),
    ("backends",),
    ("commit",),
    ("checkpoints",),
    ("coordination",),
    ("retention",),
    ("replication",),
    # The DCP adapters and reading back share a layer: reading decodes items with the writer's
    # tensor templates (adapters.tensor_records), and the restore audit reads the load planner.
    ("adapters", "reading"),
    ("staging", "telemetry"),
    ("worker",),
    ("manager", "exporting", "api_types", "torch_checkpointing"),
    (
        "cli",
        "cli_adopt",
        "cli_args",
        "cli_manifests",
        "cli_output",
        "cli_schemas",
        "cli_tensors",
        "demo",
        "bench",
        "testing",
    ),
]
FOUNDATION = set(LAYERS[0])
# Leaves: used by the layers above, they depend on nothing but the foundation (they report
# through the small protocols in ``observe`` and take plain callbacks).
LEAVES = {"staging", "telemetry"}
FACES = set(LAYERS[-1])
MAX_LINES = 600
# Issue #44 lets a module reach 800 lines where one concept reads better in one file: the
# torch_checkpointing adapter is one Storage, its commit callbacks and its checked reads; the
# manager module is the one public class a loop calls, each method a facade over a part, its
# docstrings the API reference (about 30 % of its lines).
ONE_CONCEPT = {"dcp_safe.torch_checkpointing": 800, "dcp_safe.manager.manager": 700}


def _part(module: str) -> str:
    """The top-level part of a dcp_safe module name: ``dcp_safe.adapters.api`` -> ``adapters``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _rank(part: str) -> int:
    for rank, layer in enumerate(LAYERS):
        if part in layer:
            return rank
    raise AssertionError(f"dcp_safe.{part} is in no layer: add it to LAYERS and the docs")


def _modules() -> dict[str, Path]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


MODULES = _modules()


def _imports(path: Path) -> set[str]:
    """The dcp_safe modules ``path`` imports (``from dcp_safe import x`` names module x)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] == "dcp_safe"}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module.split(".")[0] != "dcp_safe":
                continue
            for alias in node.names:
                submodule = f"{node.module}.{alias.name}"
                found.add(submodule if submodule in MODULES else node.module)
    return found


def _edges() -> list[tuple[str, str]]:
    return [(mod, imp) for mod, path in MODULES.items() for imp in sorted(_imports(path))]


def test_every_part_of_the_package_has_a_layer() -> None:
    for module in MODULES:
        if module != "dcp_safe":
            _rank(_part(module))


def test_no_module_imports_a_higher_layer() -> None:
    upward = [
        f"{mod} -> {imp}"
        for mod, imp in _edges()
        if mod != "dcp_safe" and _part(imp) and _rank(_part(imp)) > _rank(_part(mod))
    ]
    assert upward == []


def test_staging_and_telemetry_import_only_the_foundation() -> None:
    leaking = [
        f"{mod} -> {imp}"
        for mod, imp in _edges()
        if _part(mod) in LEAVES and _part(imp) != _part(mod) and _part(imp) not in FOUNDATION
    ]
    assert leaking == []


def test_no_core_module_imports_the_package_root() -> None:
    rooted = [mod for mod, imp in _edges() if imp == "dcp_safe" and _part(mod) not in FACES | {""}]
    assert rooted == []


def test_the_package_root_does_not_import_the_faces() -> None:
    faces = [imp for imp in _imports(MODULES["dcp_safe"]) if _part(imp) in FACES]
    assert faces == []


# A private torch name: a ``_``-prefixed module or attribute under ``torch.``, a private name
# imported from torch, or the DTensor/version internals reached through an object.
_PRIVATE_TORCH = re.compile(
    r"torch\.(?:[A-Za-z]\w*\.)*_[A-Za-z]"
    r"|from torch[\w.]* import (?:[\w, ]*, )?_[A-Za-z]"
    r"|\._local_tensor\b|\._spec\b|serialization\._"
)


def test_private_torch_apis_are_used_in_one_module_only() -> None:
    users = sorted(
        mod
        for mod, path in MODULES.items()
        if _part(mod) not in FACES and _PRIVATE_TORCH.search(path.read_text(encoding="utf-8"))
    )
    assert users == ["dcp_safe.torch_compat"]


@pytest.mark.parametrize("module", sorted(MODULES))
def test_no_module_is_over_the_size_limit(module: str) -> None:
    lines = len(MODULES[module].read_text(encoding="utf-8").splitlines())
    assert lines <= ONE_CONCEPT.get(module, MAX_LINES), f"{module}: {lines} lines; split it by job"


def test_the_checker_sees_an_upward_import(tmp_path: Path) -> None:
    """The rule is not vacuous: a lower layer importing a higher one is caught."""
    bad = tmp_path / "bad.py"
    bad.write_text("from dcp_safe.manager import CheckpointManager\n", encoding="utf-8")
    [imported] = _imports(bad)
    assert _rank(_part(imported)) > _rank(_part("dcp_safe.backends.backend"))


# Which way a root publishes is the commit strategy's business: everything else asks the
# strategy (a Publication, a ReplicaPublication, require_rename, sweep), never a flag.
FLAG_READERS = ("commit", "backends")
# The backend contract kit checks the very claim a flag makes (a backend's exclusive create).
FLAG_EXEMPT = {"dcp_safe.testing.backend_contract"}


def _flag_reads(source: str) -> list[int]:
    """Lines of ``source`` that read a capability flag (``.in_place``, ``.can_replace``,
    ``.supports_*``)."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load)):
            continue
        if node.attr in ("in_place", "can_replace") or node.attr.startswith("supports_"):
            lines.append(node.lineno)
    return lines


def test_only_commit_and_backends_read_a_capability_flag() -> None:
    readers = {
        f"{mod}:{line}"
        for mod, path in MODULES.items()
        if _part(mod) not in FLAG_READERS and mod not in FLAG_EXEMPT
        for line in _flag_reads(path.read_text(encoding="utf-8"))
    }
    assert not readers, f"ask the commit strategy instead of reading a flag: {sorted(readers)}"


def test_the_flag_checker_sees_a_branch_on_a_flag() -> None:
    source = "if strategy_for(b).in_place:\n    pass\nok = b.supports_atomic_rename\n"
    assert _flag_reads(source) == [1, 3]
    assert _flag_reads("in_place = True\nstrategy.publication(b, n, s)\n") == []


# ----------------------------------------------------------------- coordination

# Ranks meet, and wait for each other within a deadline, through dcp_safe.coordination only: the
# one place a missing or failed peer becomes a typed error naming the rank.
COORDINATION = "coordination"
_GROUP_MAKERS = {"new_group", "new_subgroups", "new_subgroups_by_enumeration", "init_process_group"}
_STORE_CLIENTS = {"TCPStore", "PrefixStore", "FileStore", "HashStore"}
# Justified exceptions, each a wait with no peer in it: the stager waits for its own copy threads
# and for host memory on a condition variable (a leaf, it cannot import coordination).
COORDINATION_EXEMPT = {"dcp_safe.staging.stager"}


def _called(node: ast.AST) -> str | None:
    """The name a call calls: ``dist.new_group(...)`` and ``new_group(...)`` -> ``new_group``."""
    if not isinstance(node, ast.Call):
        return None
    func = node.func
    return func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)


def _coordinates(source: str) -> list[str]:
    """Where ``source`` makes a process group or a store client, or waits in a deadline loop:
    a ``while`` loop that reads ``time.monotonic()`` (in its test or its body)."""
    found: list[str] = []
    for node in ast.walk(ast.parse(source)):
        name = _called(node)
        if name in _GROUP_MAKERS or name in _STORE_CLIENTS:
            found.append(f"line {node.lineno}: {name}()")  # type: ignore[attr-defined]
        if isinstance(node, ast.While) and any(
            _called(inner) == "monotonic" for inner in ast.walk(node)
        ):
            found.append(f"line {node.lineno}: a deadline loop")
    return found


def test_only_coordination_makes_groups_stores_and_deadline_loops() -> None:
    outside = [
        f"{module}: {where}"
        for module, path in MODULES.items()
        if _part(module) not in FACES | {COORDINATION} and module not in COORDINATION_EXEMPT
        for where in _coordinates(path.read_text(encoding="utf-8"))
    ]
    assert outside == [], "go through dcp_safe.coordination instead"


def test_the_coordination_checker_sees_groups_stores_and_deadline_loops() -> None:
    source = (
        "import time\n"
        "g = dist.new_group(backend='gloo')\n"
        "s = PrefixStore('p', TCPStore('h', 1))\n"
        "deadline = time.monotonic() + 5\n"
        "while time.monotonic() < deadline:\n"
        "    time.sleep(0.1)\n"
        "while True:\n"
        "    pass\n"
    )
    assert sorted(_coordinates(source)) == [
        "line 2: new_group()",
        "line 3: PrefixStore()",
        "line 3: TCPStore()",
        "line 5: a deadline loop",
    ]


# ----------------------------------------------------------------- on-storage names

LAYOUT = PACKAGE / "layout.py"
# A regex fragment in layout.py (a save id's pattern, say) is no name.
_REGEX_SYNTAX = re.compile(r"[\[\](){}\\^$|*?]")


def _storage_names(source: str) -> set[str]:
    """The names layout.py gives things on storage: every module-level constant it binds to a
    plain string, so a name added there is checked here without a change to this test."""
    names = set()
    for node in ast.parse(source).body:
        value = node.value if isinstance(node, ast.Assign | ast.AnnAssign) else None
        if isinstance(value, ast.Constant) and isinstance(value.value, str):
            names.add(value.value)
    return {name for name in names if not _REGEX_SYNTAX.search(name)}


def _strings(source: str) -> list[tuple[int, str]]:
    """Every string constant in ``source`` with its line, the constant parts of f-strings
    included; docstrings (they describe), ``__all__`` and the package root's ``_LAZY`` (they
    name Python objects and modules) left out."""
    tree = ast.parse(source)
    skipped: set[int] = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            first = body[0] if body else None
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                skipped.add(id(first.value))
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id in ("__all__", "_LAZY") for t in node.targets
        ):
            skipped |= {id(n) for n in ast.walk(node.value)}
    return [
        (node.lineno, node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str)
        if id(node) not in skipped
    ]


def _spelling(name: str) -> re.Pattern[str]:
    """``name`` as a whole name: ``_COMMITTED`` is not spelled by ``_NODE_COMMITTED``, nor
    ``_ranks`` by ``missing_ranks``; a prefix (``_FAILED-``) is spelled by ``_FAILED-x``."""
    head = r"(?<![A-Za-z0-9_])" if re.match(r"\w", name) else ""
    tail = r"(?![A-Za-z0-9])" if name[-1].isalnum() else ""
    return re.compile(head + re.escape(name) + tail)


def _spelled_names(source: str, names: set[str]) -> list[str]:
    patterns = {name: _spelling(name) for name in sorted(names)}
    return [
        f"line {line}: {name!r} in {text!r}"
        for line, text in _strings(source)
        for name, pattern in patterns.items()
        if pattern.search(text)
    ]


def test_only_layout_spells_an_on_storage_name() -> None:
    """Every on-storage name is defined once, in dcp_safe.layout; everything else uses it."""
    names = _storage_names(LAYOUT.read_text(encoding="utf-8"))
    assert {"_COMMITTED", "_history.jsonl", "_NODE_COMMITTED", "_FAILED-", ".failed-"} <= names
    spelled = [
        f"{module}: {found}"
        for module, path in MODULES.items()
        if path != LAYOUT
        for found in _spelled_names(path.read_text(encoding="utf-8"), names)
    ]
    assert spelled == []


def test_the_checker_sees_a_spelled_storage_name() -> None:
    """The rule is not vacuous: a marker name in a string or an f-string is caught, a mention
    in a docstring and a longer word that contains a name are not."""
    names = _storage_names(LAYOUT.read_text(encoding="utf-8"))
    source = (
        "def f(name, rank, save_id):\n"
        '    """Reads <name>/_COMMITTED."""\n'
        '    missing_ranks = "missing_ranks"\n'
        '    yield f"{name}/_COMMITTED"\n'
        '    yield f"_ranks/rank_{rank:05d}.failed-{save_id}"\n'
    )
    found = _spelled_names(source, names)
    assert [entry.split(":")[0] for entry in found] == ["line 4", "line 5", "line 5", "line 5"]
    assert any("'_COMMITTED'" in entry for entry in found)
