"""A save without collectives: each rank reports through storage, rank 0 gathers and merges.

DCP calls ``finish`` on every rank with that rank's own metadata and results. A rank other than
0 writes a report (:func:`~dcp_safe.layout.rank_report_name`) after its rank manifest: its
metadata in the plain form manifests use (:mod:`dcp_safe.manifest.dcp_metadata`) and its audit
sums apart (they cover only its blocks of a sharded tensor); its results are its rank
manifest's items. A rank whose write fails leaves a failure marker instead. Rank 0
polls the work folder's ``_ranks/`` until every rank reported, one failed, or the deadline
passed, then builds the global metadata and every rank's results for the
:class:`~dcp_safe.commit.committer.Committer`, which verifies and publishes as after a
collective save. Reports are removed before the publish: they are no part of the checkpoint.

With a signing key, a report carries the checksum of the rank manifest its rank wrote and an
HMAC (:func:`~dcp_safe.manifest.signing.part_mac`) over the report and the save id; rank 0
refuses a report without one that matches, and a rank manifest of other bytes. The manifest's
item checksums (cryptographic when signed) then cover the rank's shards. Without a key, rank 0
trusts whoever can write the root (docs/multirank.md, "Saves without collectives").
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.storage import WriteResult

from dcp_safe import layout
from dcp_safe.adapters.assignment_board import Assignment
from dcp_safe.backends.backend import Backend
from dcp_safe.commit.report import attach_report, report_for
from dcp_safe.commit.results import records_by_rank
from dcp_safe.coordination.markers import poll
from dcp_safe.errors import CommitError, ConfigError, DcpSafeError, DivergentStateError
from dcp_safe.manifest.checksum import ChecksumAlgorithm, digest_bytes
from dcp_safe.manifest.dcp_metadata import decode_dcp_metadata, encode_dcp_metadata
from dcp_safe.manifest.limits import MANIFEST_MAX_BYTES
from dcp_safe.manifest.schema import Manifest, RankManifest
from dcp_safe.manifest.signing import part_mac, part_mac_matches
from dcp_safe.version import __version__

__all__ = ["Report", "await_reports", "gathered", "report_failure", "write_report"]

_FORMAT = "dcp_safe/rank-report"
#: A report as rank 0 uses it: the rank's plain DCP metadata, its audit sums (key -> block ->
#: sum, of the blocks it holds) where its planner recorded them, and the checksum of its rank
#: manifest (where it wrote one with items).
Report = tuple[Any, dict[str, dict[int, int]] | None, str | None]
_MASK = (1 << 64) - 1


def write_report(
    backend: Backend,
    assignment: Assignment,
    metadata: Metadata,
    *,
    manifest_checksum: str | None,
    key: bytes | None,
) -> None:
    """This rank's part is on storage: say so, with its metadata and the checksum of the rank
    manifest it wrote; with ``key``, authenticated (the module's rule).

    Raises:
        ConfigError: the metadata has no plain form (a custom planner's data).
    """
    # A rank's audit sums cover only its own blocks of a sharded tensor: sent apart, as plain
    # block -> sum pairs, and summed on rank 0 (the plain form wants every block of a tensor).
    planner = dict(metadata.planner_data or {})
    audit = planner.pop(layout.AUDIT_KEY, None)
    try:
        plain = encode_dcp_metadata(dataclasses.replace(metadata, planner_data=planner or None))
        sums = _encode_audit(audit)
    except ValueError as exc:
        raise ConfigError(
            f"a save without collectives sends each rank's DCP metadata through storage as plain"
            f" data, and this one has none ({exc}): use DCP's or dcp_safe's planner, or"
            " use_collectives=True"
        ) from exc
    body = {
        "format": _FORMAT,
        "rank": assignment.rank,
        "dcp_metadata": plain,
        "audit": sums,
        "manifest": manifest_checksum,
    }
    if key is not None:
        body["mac"] = part_mac(key, assignment.save_id, assignment.rank, body)
    rel = layout.rank_report_name(assignment.rank, assignment.save_id)
    backend.write_bytes(f"{assignment.work_dir}/{rel}", json.dumps(body).encode())


def report_failure(backend: Backend, assignment: Assignment, exc: BaseException) -> None:
    """This rank's part failed: say so, so that rank 0 fails at once (best effort)."""
    body: dict[str, Any] = {"format": _FORMAT, "error": f"{type(exc).__name__}: {exc}"[:2000]}
    if isinstance(exc, DivergentStateError):
        body["divergent"] = exc.keys
    rel = layout.rank_failure_marker_name(assignment.rank, assignment.save_id)
    with contextlib.suppress(OSError, DcpSafeError):
        backend.write_bytes(f"{assignment.work_dir}/{rel}", json.dumps(body).encode())


def await_reports(
    backend: Backend, assignment: Assignment, deadline_s: float, *, key: bytes | None
) -> dict[int, Report]:
    """Every other rank's report, once all are on storage; with ``key``, each authenticated.

    Raises:
        DivergentStateError: a rank found its copy of an entry differs from rank 0's.
        CommitError: a rank reported a failure, had not reported by the deadline, or (with
            ``key``) left a report its MAC does not authenticate (naming the ranks).
    """
    ranks_dir = f"{assignment.work_dir}/{layout.RANKS_DIR}"
    others = range(1, assignment.world_size)
    reports = {r: layout.rank_report_name(r, assignment.save_id) for r in others}
    failures = {r: layout.rank_failure_marker_name(r, assignment.save_id) for r in others}
    present: set[str] = set()

    def every_report() -> bool | None:
        present.clear()
        present.update(backend.list_dir(ranks_dir))
        failed = [r for r, rel in failures.items() if _leaf(rel) in present]
        if failed:
            raise _failure(backend, assignment.work_dir, failed, failures)
        return True if all(_leaf(rel) in present for rel in reports.values()) else None

    if poll(every_report, deadline_s) is None:
        missing = [r for r, rel in reports.items() if _leaf(rel) not in present]
        raise CommitError(
            f"ranks did not report within {deadline_s} s (a save without collectives)",
            {r: "no report: it died, hung or is still writing" for r in missing},
        )
    found: dict[int, Report] = {}
    for rank, rel in reports.items():
        body = _read_json(backend, f"{assignment.work_dir}/{rel}", rank)
        mac = body.pop("mac", None)
        if key is not None and not part_mac_matches(key, assignment.save_id, rank, body, mac):
            raise CommitError(
                "a rank's report is not authenticated by the job's signing key, so it may not"
                " be that rank's: nothing is published. Give every rank's writer the same"
                " signing key, and check who else can write the root",
                {rank: f"{'no MAC' if mac is None else 'a MAC that does not match'} in {rel}"},
            )
        checksum = body.get("manifest")
        if body.get("rank") != rank or "dcp_metadata" not in body:
            raise CommitError("a rank's report is malformed", {rank: rel})
        try:
            if checksum is not None and not isinstance(checksum, str):
                raise ValueError("a rank manifest checksum that is not a string")
            found[rank] = (body["dcp_metadata"], _decode_audit(body.get("audit")), checksum)
        except ValueError as exc:
            raise CommitError("a rank's report is malformed", {rank: str(exc)}) from exc
    return found


def gathered(
    backend: Backend,
    name: str,
    assignment: Assignment,
    checksum: ChecksumAlgorithm,
    own: tuple[Metadata, list[WriteResult]],
    reports: Mapping[int, Report],
    *,
    signed: bool,
) -> tuple[Metadata, list[list[WriteResult]]]:
    """The global metadata and every rank's results, from rank 0's own and the reports; the
    reports are removed from storage (they are no part of the checkpoint).

    Args:
        signed: the reports were authenticated: each rank manifest must be the one its report
            names (one with no items may go unnamed: it holds nothing a load reads).

    Raises:
        CommitError: a rank manifest is missing, of another save, not the one an
            authenticated report names, or a rank's metadata names items no rank wrote.
    """
    results = [own[1]]
    for rank in sorted(reports):
        expected = reports[rank][2] if signed else None
        results.append(_results_of(backend, assignment, rank, checksum, expected, signed=signed))
    union = _union_manifest(name, assignment, checksum, results)
    metadatas = [own[0]]
    for rank in sorted(reports):
        plain, audit, _ = reports[rank]
        try:
            decoded = decode_dcp_metadata(plain, union, f"rank {rank}'s report")
        except DcpSafeError as exc:
            raise CommitError(
                "a rank holds entries no rank wrote: a plain entry several ranks hold must be"
                " on rank 0 too, or be declared per rank (per_rank=)",
                {rank: str(exc)},
            ) from exc
        if audit is not None:
            decoded.planner_data = {**(decoded.planner_data or {}), layout.AUDIT_KEY: audit}
        metadatas.append(decoded)
    for rank in reports:
        rel = layout.rank_report_name(rank, assignment.save_id)
        with contextlib.suppress(OSError, DcpSafeError):
            backend.remove_file(f"{assignment.work_dir}/{rel}")
    return _merged(metadatas), results


def _results_of(
    backend: Backend,
    assignment: Assignment,
    rank: int,
    checksum: ChecksumAlgorithm,
    expected: str | None,
    *,
    signed: bool,
) -> list[WriteResult]:
    """A rank's write results, from its rank manifest (with the report the committer checks):
    signed, the manifest whose checksum is ``expected`` (the rank's authenticated word)."""
    rel = f"{assignment.work_dir}/{layout.rank_manifest_name(rank)}"
    try:
        raw = backend.read_small(rel, MANIFEST_MAX_BYTES)
        manifest = RankManifest.from_json(raw, backend.full_path(rel))
    except (FileNotFoundError, DcpSafeError) as exc:
        raise CommitError("a rank manifest is missing or unreadable", {rank: str(exc)}) from exc
    # The bytes checked are the bytes used (read once): nothing swapped in later counts.
    if signed and (expected or manifest.items) and digest_bytes(raw, checksum) != expected:
        raise CommitError(
            "a rank manifest is not the one its rank's authenticated report names: nothing is"
            " published (someone else wrote it, or it was damaged)",
            {rank: backend.full_path(rel)},
        )
    if (manifest.save_id, manifest.rank) != (assignment.save_id, rank):
        raise CommitError(
            "a rank manifest belongs to another save",
            {rank: f"{manifest.name}/{manifest.save_id} rank {manifest.rank}"},
        )
    if manifest.checksum_algorithm != checksum.value:
        raise CommitError(
            f"a rank checksummed with another algorithm than {checksum.value!r}: every rank"
            " must be configured alike",
            {rank: manifest.checksum_algorithm},
        )
    results = [
        WriteResult(
            index=MetadataIndex(record.fqn, record.offset),
            size_in_bytes=record.length,
            storage_data=record,
        )
        for record in manifest.items
    ]
    return attach_report(results, report_for(manifest, raw, checksum))


def _union_manifest(
    name: str, assignment: Assignment, checksum: ChecksumAlgorithm, results: list[list[WriteResult]]
) -> Manifest:
    """Every item any rank wrote, as a manifest: what the ranks' metadata is decoded against."""
    per_rank, reports = records_by_rank(results)
    return Manifest(
        name=name,
        save_id=assignment.save_id,
        world_size=assignment.world_size,
        created_at=time.time(),
        checksum_algorithm=checksum.value,
        compression="none",
        files=tuple(f for report in reports.values() for f in report.files),
        items=tuple(record for r in sorted(per_rank) for record in per_rank[r]),
        dcp_safe_version=__version__,
        torch_version=torch.__version__,
    )


def _merged(metadatas: Sequence[Metadata]) -> Metadata:
    """One metadata from the ranks': each entry once, each distinct chunk once (rank order)."""
    state: dict[str, Any] = {}
    paths: dict[str, Any] = {}
    audits: dict[str, dict[frozenset[tuple[int, ...]], Mapping[int, int]]] = {}
    for metadata in metadatas:
        for key, entry in metadata.state_dict_metadata.items():
            known = state.get(key)
            if known is None:
                state[key] = _copy(entry)
            elif isinstance(known, TensorStorageMetadata) and isinstance(
                entry, TensorStorageMetadata
            ):
                seen = {tuple(c.offsets) for c in known.chunks}
                known.chunks.extend(c for c in entry.chunks if tuple(c.offsets) not in seen)
        planner = dict(metadata.planner_data or {})
        for key, sums in planner.pop(layout.AUDIT_KEY, {}).items():
            # A rank's sums cover its chunks; ranks holding the same chunks count once.
            audits.setdefault(key, {}).setdefault(_chunks_of(metadata, key), sums)
        paths.update(planner)
    if audits:
        paths[layout.AUDIT_KEY] = {key: _sum(parts.values()) for key, parts in audits.items()}
    return Metadata(
        state_dict_metadata=state,
        planner_data=paths or metadatas[0].planner_data,
        storage_meta=StorageMeta(),
        version=metadatas[0].version,
    )


def _encode_audit(audit: object) -> list[list[Any]] | None:
    if audit is None:
        return None
    if not isinstance(audit, dict):
        raise ValueError("fingerprints that are not a dict")
    return [[str(k), [[int(b), int(v)] for b, v in blocks.items()]] for k, blocks in audit.items()]


def _decode_audit(raw: object) -> dict[str, dict[int, int]] | None:
    """A report's audit sums, strictly: ``[[key, [[block, sum], ...]], ...]``."""
    if raw is None:
        return None
    if not isinstance(raw, list):
        raise ValueError("audit sums that are not a list")
    found: dict[str, dict[int, int]] = {}
    for entry in raw:
        if not (isinstance(entry, list) and len(entry) == 2 and isinstance(entry[0], str)):
            raise ValueError("an audit entry that is not [key, blocks]")
        blocks = entry[1]
        if not isinstance(blocks, list) or not all(_block(b) for b in blocks):
            raise ValueError(f"audit sums of {entry[0][:80]!r} that are not [block, sum] pairs")
        found[entry[0]] = {b: v for b, v in blocks}
    return found


def _block(pair: object) -> bool:
    return (
        isinstance(pair, list)
        and len(pair) == 2
        and all(type(n) is int and 0 <= n <= _MASK for n in pair)
    )


def _copy(entry: Any) -> Any:
    if isinstance(entry, TensorStorageMetadata):
        return TensorStorageMetadata(entry.properties, entry.size, list(entry.chunks))
    return entry


def _chunks_of(metadata: Metadata, key: str) -> frozenset[tuple[int, ...]]:
    entry = metadata.state_dict_metadata.get(key)
    if not isinstance(entry, TensorStorageMetadata):
        return frozenset()
    return frozenset(tuple(c.offsets) for c in entry.chunks)


def _sum(parts: Any) -> dict[int, int]:
    total: dict[int, int] = {}
    for part in parts:
        for block, value in part.items():
            total[block] = (total.get(block, 0) + value) & _MASK
    return total


def _failure(
    backend: Backend, work_dir: str, failed: list[int], markers: Mapping[int, str]
) -> BaseException:
    """The error for ranks that left failure markers: divergence as itself, else CommitError."""
    divergent: dict[str, list[list[int]]] = {}
    described = {}
    for rank in failed:
        try:
            body = _read_json(backend, f"{work_dir}/{markers[rank]}", rank)
        except CommitError:
            body = {}
        described[rank] = str(body.get("error", "failed (no detail)"))
        found = body.get("divergent")
        if isinstance(found, dict):
            divergent.update({str(k): v for k, v in found.items() if isinstance(v, list)})
    if divergent:
        return DivergentStateError(divergent)
    return CommitError("a rank failed to write its part of the save", described)


def _read_json(backend: Backend, rel: str, rank: int) -> dict[str, Any]:
    try:
        body = json.loads(backend.read_small(rel, MANIFEST_MAX_BYTES))
    except (FileNotFoundError, ValueError, DcpSafeError) as exc:
        raise CommitError("a rank's report is missing or unreadable", {rank: str(exc)}) from exc
    if not isinstance(body, dict) or body.get("format") != _FORMAT:
        raise CommitError("a rank's report is malformed", {rank: rel})
    return body


def _leaf(rel: str) -> str:
    return rel.rpartition("/")[2]
