"""The public API: ``dcp_safe.__all__`` is small, documented, and closed over its signatures.

The rule for "every type in a public signature is exported": the public namespaces are
``dcp_safe`` itself (what the README and examples teach, at most ``MAX_NAMES`` names) and the
documented submodules in ``NAMESPACES`` (each declares ``__all__``): the exceptions in
``dcp_safe.errors``, the parts of the manager, the stager, telemetry and export in their
packages, and ``dcp_safe.api_types`` for the reports, enums and protocols a signature names but
a training loop seldom imports. Every dcp_safe class named by the annotations (parameters and
return, through ``Optional``/``Union``/generics/``Callable``) of an exported function, or of
``__init__``, a public method or a property of an exported class, is in one of those
``__all__`` lists. Exceptions are checked by their own tests (``tests/test_errors.py``).
"""

from __future__ import annotations

import importlib
import inspect
import re
import typing
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

import dcp_safe

MAX_NAMES = 45
NAMESPACES = (
    "dcp_safe",
    "dcp_safe.errors",
    "dcp_safe.manager",
    "dcp_safe.staging",
    "dcp_safe.telemetry",
    "dcp_safe.exporting",
    "dcp_safe.api_types",
)
REPO = Path(__file__).resolve().parents[1]


def _docs() -> str:
    pages = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    return "\n".join(page.read_text(encoding="utf-8") for page in pages)


def _namespace(name: str) -> ModuleType:
    return importlib.import_module(name)


def _public_types() -> dict[str, type]:
    """Every class a public namespace exports, by name (what an annotation may resolve to)."""
    found: dict[str, type] = {}
    for module in map(_namespace, NAMESPACES):
        for name in module.__all__:
            obj = getattr(module, name)
            if isinstance(obj, type):
                found[name] = obj
    return found


def _classes_in(annotation: Any) -> Iterator[type]:
    """The classes an annotation names, through unions, generics and ``Callable``'s lists."""
    if isinstance(annotation, list | tuple):
        for item in annotation:
            yield from _classes_in(item)
        return
    if isinstance(annotation, type):
        yield annotation
    origin = typing.get_origin(annotation)
    if isinstance(origin, type):
        yield origin
    for arg in typing.get_args(annotation):
        yield from _classes_in(arg)


def _signatures(name: str, obj: Any) -> Iterator[tuple[str, Callable[..., Any]]]:
    """The callables an export brings: itself, or a class's ``__init__``, methods, properties."""
    if not isinstance(obj, type):
        if callable(obj):
            yield name, obj
        return
    if issubclass(obj, BaseException):
        return
    yield f"{name}.__init__", obj.__init__
    for attr, member in vars(obj).items():
        if attr.startswith("_"):
            continue
        if isinstance(member, property) and member.fget is not None:
            yield f"{name}.{attr}", member.fget
        elif isinstance(member, staticmethod | classmethod):
            yield f"{name}.{attr}", member.__func__
        elif inspect.isfunction(member):
            yield f"{name}.{attr}", member


def test_all_is_small_unique_and_exists() -> None:
    names = dcp_safe.__all__
    assert len(names) <= MAX_NAMES, f"{len(names)} public names, the limit is {MAX_NAMES}"
    assert len(set(names)) == len(names)
    for name in names:
        assert hasattr(dcp_safe, name), name


def test_every_public_class_and_function_is_listed() -> None:
    public = {
        name
        for name, obj in vars(dcp_safe).items()
        if not name.startswith("_") and (isinstance(obj, type) or callable(obj))
    }
    assert public <= set(dcp_safe.__all__)


def test_a_dropped_name_is_not_importable_from_the_root() -> None:
    with pytest.raises(ImportError):
        exec("from dcp_safe import PeerCopyError", {})


@pytest.mark.parametrize("namespace", NAMESPACES)
def test_each_namespace_lists_what_it_exports(namespace: str) -> None:
    module = _namespace(namespace)
    assert len(set(module.__all__)) == len(module.__all__)
    missing = [name for name in module.__all__ if not hasattr(module, name)]
    assert missing == []
    assert namespace == "dcp_safe" or f"`{namespace}`" in _docs(), "name it in the docs"


def test_every_public_name_is_used_in_the_docs() -> None:
    """As code: in a fenced block or a backtick span, not just as an English word."""
    docs = _docs()
    fenced = re.findall(r"```.*?```", docs, flags=re.DOTALL)
    spans = re.findall(r"`[^`\n]+`", re.sub(r"```.*?```", "", docs, flags=re.DOTALL))
    words = set(re.findall(r"\w+", "\n".join(fenced + spans)))
    assert [name for name in dcp_safe.__all__ if name not in words] == []


def test_every_dcp_safe_type_in_a_public_signature_is_exported() -> None:
    public = _public_types()
    exported = set(public.values())
    unexported = []
    for name in dcp_safe.__all__:
        for where, func in _signatures(name, getattr(dcp_safe, name)):
            try:
                # Names a module imports only under TYPE_CHECKING resolve through the
                # public namespaces: a name found in none of them is itself a failure.
                hints = typing.get_type_hints(func, localns=public)
            except NameError as err:
                unexported.append(f"{where}: {err}")
                continue
            for cls in (c for hint in hints.values() for c in _classes_in(hint)):
                if cls.__module__.startswith("dcp_safe") and cls not in exported:
                    unexported.append(f"{where}: {cls.__module__}.{cls.__qualname__}")
    assert unexported == []


def test_the_design_entry_points_are_public() -> None:
    for name in ("SafeStorageWriter", "SafeStorageReader", "list_checkpoints", "verify_checkpoint"):
        assert name in dcp_safe.__all__


def test_every_error_is_public_under_the_root_error() -> None:
    from dcp_safe import errors

    assert "DcpSafeError" in dcp_safe.__all__
    assert "PeerCopyError" in errors.__all__
    classes = {
        name
        for name, obj in vars(errors).items()
        if isinstance(obj, type) and obj.__module__ == errors.__name__
    }
    listed = classes & set(errors.__all__)
    assert classes == listed
    for name in listed:
        assert issubclass(getattr(errors, name), dcp_safe.DcpSafeError), name
