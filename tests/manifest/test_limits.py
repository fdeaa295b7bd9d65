"""Parsing a control file costs at most its budget: the estimate is an upper bound of what
``json.loads`` allocates, and a dense document is refused before it is parsed."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable

import pytest

from dcp_safe.manifest import limits
from dcp_safe.manifest.schema import FileRecord, ItemRecord, Manifest

pytestmark = pytest.mark.subprocess

N = 50_000


def _array(element: bytes, count: int = N) -> bytes:
    return b"[" + b",".join([element] * count) + b"]"


def _manifest(count: int = N // 10) -> bytes:
    items = tuple(
        ItemRecord(
            fqn=f"model.layers.{i // 10}.mlp.weight_{i % 10}",
            offset=(i * 16, 0),
            file=f"__{i % 64}_0.distcp",
            start=i * 4096,
            length=4096,
            checksum="xxh3_128:" + f"{i * 7919:032x}",
        )
        for i in range(count)
    )
    return Manifest(
        name="step_1",
        save_id="a" * 32,
        world_size=64,
        created_at=1.0,
        checksum_algorithm="xxh3_128",
        compression="none",
        files=(FileRecord(path=".metadata", size=1, checksum="xxh3_128:00"),),
        items=items,
        dcp_safe_version="1",
        torch_version="2",
    ).to_json()


SHAPES: dict[str, Callable[[], bytes]] = {
    "empty lists": lambda: _array(b"[]"),
    "empty objects": lambda: _array(b"{}"),
    "one-key objects": lambda: _array(b'{"a":1}'),
    "nested lists": lambda: _array(b"[[]]"),
    "floats": lambda: _array(b"1.5"),
    "ints": lambda: _array(b"1000"),
    "big ints": lambda: _array(b"1" + b"0" * 30),
    "short strings": lambda: _array(b'"ab"'),
    "escaped astral strings": lambda: _array(b'"\\ud83d\\ude00"'),
    "utf-8 strings": lambda: _array('"é"'.encode()),
    "one long string": lambda: b'"' + b"a" * 1_000_000 + b'"',
    "a long astral string": lambda: b'"' + b"a" * 100_000 + b'\\ud83d\\ude00"',
    "one big object": lambda: b"{" + b",".join(b'"%d":0' % i for i in range(N)) + b"}",
    "a manifest": _manifest,
}


_MEASURE = """
import json, sys, tracemalloc
data = sys.stdin.buffer.read()
tracemalloc.start()
value = json.loads(data)
print(tracemalloc.get_traced_memory()[1])
"""


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_the_parse_cost_is_an_upper_bound_of_what_parsing_allocates(shape: str) -> None:
    # Measured in a fresh interpreter: tracemalloc counts every thread's allocations, and in
    # the test process other tests' background threads (servers, managers) may be allocating.
    data = SHAPES[shape]()
    run = subprocess.run(
        [sys.executable, "-c", _MEASURE], input=data, capture_output=True, check=True
    )
    peak = int(run.stdout)
    assert peak <= limits.parse_cost(data), (peak, limits.parse_cost(data))


_REFUSE = """
import sys, tracemalloc
from dcp_safe.errors import CheckpointCorruptError
from dcp_safe.manifest import limits
data = sys.stdin.buffer.read()
tracemalloc.start()
try:
    limits.parse_json(data, "manifest.json")
except CheckpointCorruptError as exc:
    assert "budget" in str(exc), exc
else:
    raise AssertionError("parsed")
print(tracemalloc.get_traced_memory()[1])
"""


def test_a_dense_document_under_its_size_cap_is_refused_before_it_is_parsed() -> None:
    """32 MiB of ``[],`` (a tenth of the manifest cap): parsed, it took about 0.9 GiB.

    Measured in a fresh interpreter, as above: in the test process, the background work an
    earlier test left running (a save a close gave up on) allocates while this one measures."""
    data = _array(b"[]", (32 << 20) // 3)
    run = subprocess.run(
        [sys.executable, "-c", _REFUSE], input=data, capture_output=True, check=True
    )
    assert int(run.stdout) < 1 << 20


def test_dcp_safes_own_manifests_fit_the_budget_at_their_scale() -> None:
    """About 11 bytes of estimate per byte of manifest: 400,000 items fit the budget."""
    data = _manifest()
    per_item = limits.parse_cost(data) / (N // 10)
    assert per_item * 400_000 < limits.PARSE_BUDGET_BYTES
    assert limits.parse_json(data, "m")["name"] == "step_1"
