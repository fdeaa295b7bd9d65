"""Fixtures shared by every test module."""

from __future__ import annotations

import gc
import uuid
from collections.abc import Iterator
from typing import Any

import fsspec
import pytest
from support import make_state

# The S3 fixtures (s3, s3_bucket, s3_options, s3_root, proxy) are registered once, here, for every
# module: a module asks for them by parameter name and imports nothing.
pytest_plugins = ["s3_fixtures"]


@pytest.fixture
def state() -> dict[str, Any]:
    return make_state(0)


@pytest.fixture
def memory_root() -> Iterator[str]:
    """A fresh ``memory://`` root: storage without atomic rename, cleaned up afterwards."""
    url = f"memory://dcp-safe-{uuid.uuid4().hex}"
    yield url
    fs = fsspec.filesystem("memory")
    if fs.exists(url):
        fs.rm(url, recursive=True)


@pytest.fixture(autouse=True)
def _saves_on_threads_unless_the_worker_is_tested(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A manager a test builds with ``executor="auto"`` saves on a thread: a worker process
    costs seconds of imports per manager, and only the tests of the worker need one. Tests
    marked ``worker_process`` (and every explicit ``Runtime(executor="process")``) keep it;
    processes a test starts (ranks, scripts) are not touched."""
    if request.node.get_closest_marker("worker_process") is not None:
        return
    from dcp_safe.manager import manager as manager_module

    choose = manager_module.choose_executor

    def thread_for_auto(executor: str, *args: Any, **kwargs: Any) -> Any:
        return choose("thread" if executor == "auto" else executor, *args, **kwargs)

    monkeypatch.setattr(manager_module, "choose_executor", thread_for_auto)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """A test that asks for the S3 server is an ``s3`` test, mark or not: ``make test-fast``
    leaves out every test that starts a server or a process."""
    for item in items:
        if "s3" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.s3)


def pytest_collection_finish(session: pytest.Session) -> None:
    """Freeze what importing the suite made (torch, moto, every test module: ~300,000
    objects): a full ``gc.collect()``, which the stager runs on each close, then walks only
    what the tests made, not 0.4 s of module objects per close. Forked children (the crash
    sweeps' kill points) inherit the freeze. The garbage of the imports is collected first."""
    gc.collect()
    gc.freeze()


@pytest.fixture(scope="module", autouse=True)
def _frozen_heap() -> None:
    """Freeze again as each test module starts (before its own module fixtures): what earlier
    modules left alive (module-scoped fixtures, reports, caches) would otherwise be walked by
    every later ``gc.collect()``, in the parent and in each forked child, which also copies
    every page it touches. Measured: the manager crash sweep takes 21 s alone and 264 s late in
    the suite without this."""
    gc.collect()
    gc.freeze()
