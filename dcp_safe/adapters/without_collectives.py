"""A save without collectives (``use_collectives=False``): the ranks agree and report on storage.

DCP then plans on every rank alone and exchanges no plans and no results, so the two steps that
need every rank go through the shared root (the protocol, the assignment key's rule and what it
trusts with and without a signing key: docs/multirank.md, "Saves without collectives"):

- **Agree** (``prepare_global_plan``): rank 0 claims the name as always, then posts the save id
  and its plain keys with their fingerprints in an assignment file named by :func:`save_key`;
  the others take it, leave rank 0's plain keys to it and refuse a copy whose fingerprint
  differs (:class:`DivergentStateError`). Who writes what: :func:`items_to_write`.
- **Gather** (``finish``): a rank other than 0 writes a report after its rank manifest (its
  metadata in plain form, the checksum of that manifest), or a failure marker; rank 0 polls
  ``_ranks/`` until every rank reported, one failed, or the deadline passed, merges, and the
  unchanged :class:`~dcp_safe.commit.committer.Committer` verifies and publishes.

With a signing key the assignment and every report carry an HMAC under it
(:func:`~dcp_safe.manifest.signing.part_mac`), and rank 0 refuses a rank manifest of other bytes
than its report names.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeGuard

import torch
from torch.distributed.checkpoint.metadata import (
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.distributed.tensor import DTensor

from dcp_safe import layout
from dcp_safe.adapters.options import WriterOptions
from dcp_safe.adapters.planners import FingerprintedPlan
from dcp_safe.backends.backend import Backend
from dcp_safe.commit.fencing import DEFAULT_RUN_ID, RUN_ID_ENV, Attempt
from dcp_safe.commit.results import ReportedItem, attach_report, records_by_rank, report_for
from dcp_safe.commit.strategy import Publication
from dcp_safe.coordination.markers import poll
from dcp_safe.errors import CommitError, ConfigError, DcpSafeError, DivergentStateError
from dcp_safe.manifest.checksum import ChecksumAlgorithm, digest_bytes
from dcp_safe.manifest.dcp_metadata import decode_dcp_metadata, encode_dcp_metadata
from dcp_safe.manifest.limits import MANIFEST_MAX_BYTES
from dcp_safe.manifest.schema import Manifest, RankManifest
from dcp_safe.manifest.signing import part_mac, part_mac_matches
from dcp_safe.torch_compat import rank_world
from dcp_safe.version import __version__

_ASSIGNMENT, _REPORT = "dcp_safe/assignment", "dcp_safe/rank-report"
_PLAIN = (WriteItemType.TENSOR, WriteItemType.BYTE_IO)
_MASK = (1 << 64) - 1


@dataclass(frozen=True)
class Assignment:
    """What every rank of a save needs to know of it (the plan's ``storage_data``)."""

    rank: int
    world_size: int
    save_id: str
    work_dir: str
    skip: frozenset[str] = frozenset()  # plain keys this rank leaves to rank 0 (no collectives)


def assignment_of(plan: SavePlan) -> Assignment:
    """The assignment a writer's ``prepare_global_plan`` gave ``plan`` (ConfigError if none)."""
    if not isinstance(plan.storage_data, Assignment):
        raise ConfigError(
            "write_data got a plan this writer did not prepare: pass the writer to dcp.save, "
            "which plans with it"
        )
    return plan.storage_data


def save_key(attempt: Attempt | None, count: int) -> str:
    """The key of the ``count``-th save of a name through a writer of ``attempt``."""
    if attempt is None:
        return f"{os.environ.get(RUN_ID_ENV) or DEFAULT_RUN_ID}-none-{count}"
    return f"{attempt.run_id}-{attempt.number}-{count}"


def _entries(plain: object) -> TypeGuard[list[tuple[str, int | None]]]:
    """Whether ``plain`` is what :meth:`StorageAgreement.post` writes: ``[key, fingerprint]``
    pairs (an unsigned assignment file is anyone's to write: a bare TypeError is no answer)."""
    return isinstance(plain, list) and all(
        isinstance(pair, list)
        and len(pair) == 2
        and isinstance(pair[0], str)
        and (pair[1] is None or (isinstance(pair[1], int) and not isinstance(pair[1], bool)))
        for pair in plain
    )


@dataclass(frozen=True)
class StorageAgreement:
    """One save of ``name`` without collectives on ``backend``, under the save key ``key``."""

    backend: Backend
    name: str
    key: str
    options: WriterOptions  # the writer's: its report_timeout_s and signing_key
    #: The publication of a save id (the writer's, made by the root's strategy).
    publication: Callable[[str], Publication]

    @property
    def path(self) -> str:
        return layout.assignment_file_name(self.name, self.key)

    def agree(
        self,
        plan: SavePlan,
        rank: int,
        coordinator: bool,
        plain: dict[str, int | None],
        claim: Callable[[list[SavePlan]], list[SavePlan]],
    ) -> SavePlan:
        """``plan`` with this save's assignment: rank 0 claims (``claim``) and posts the save
        id; the others take it and leave the plain entries rank 0 holds to it.

        Raises:
            DivergentStateError: this rank's copy of a plain entry differs from rank 0's.
            CommitError: rank 0 posted nothing in time, or failed (naming rank 0).
        """
        world = rank_world()[1]
        if coordinator:
            try:
                plan = claim([plan])[0]
                assignment = dataclasses.replace(assignment_of(plan), world_size=world)
                self.post(assignment.save_id, world, plain)
            except BaseException as exc:
                with contextlib.suppress(OSError, DcpSafeError):  # the others fail at once
                    self._write(self.path, {"error": _describe(exc)}, (self.key, 0))
                raise
            return dataclasses.replace(plan, storage_data=assignment)
        save_id, taken = self.take(world)
        shared = plain.keys() & taken.keys()
        work_dir = self.publication(save_id).work_dir
        assignment = Assignment(rank, world, save_id, work_dir, frozenset(shared))
        if divergent := {
            key: [[0], [rank]]
            for key in sorted(shared)
            if None not in (plain[key], taken[key]) and plain[key] != taken[key]
        }:
            error = DivergentStateError(divergent)
            self.failed(assignment, error, coordinator=False)
            raise error
        return dataclasses.replace(plan, storage_data=assignment)

    def post(self, save_id: str, world_size: int, plain: Mapping[str, int | None]) -> None:
        """Tell the other ranks the save id, and which plain entries rank 0 writes."""
        body = {"save_id": save_id, "world_size": world_size, "plain": sorted(plain.items())}
        self._write(self.path, body, (self.key, 0))

    def take(self, world_size: int) -> tuple[str, dict[str, int | None]]:
        """Rank 0's save id and plain entries, once posted.

        Raises:
            CommitError: rank 0 failed, posted for another world size, or posted nothing
                within the deadline (naming rank 0).
        """
        found = poll(self._posted, self.options.report_timeout_s)
        if found is None:
            raise CommitError(
                f"no save id from rank 0 within {self.options.report_timeout_s} s (a save without"
                " collectives waits for it on storage; signed, only for one the key"
                " authenticates)",
                {0: f"nothing at {self.backend.full_path(self.path)}"},
            )
        if "error" in found:
            raise CommitError("rank 0 could not start the save", {0: str(found["error"])})
        save_id, world, plain = found.get("save_id"), found.get("world_size"), found.get("plain")
        if not layout.is_save_id(save_id) or world != world_size or not _entries(plain):
            raise CommitError(
                "rank 0's assignment does not fit this save",
                {0: f"save id {str(save_id)[:64]!r}, world size {world} (here {world_size})"},
            )
        return str(save_id), dict(plain)

    def clear(self) -> None:
        with contextlib.suppress(OSError, DcpSafeError):
            self.backend.remove_file(self.path)

    def report(
        self, assignment: Assignment, metadata: Metadata, results: list[list[WriteResult]]
    ) -> None:
        """A rank other than 0: its part is on storage, with its metadata and the checksum of
        the rank manifest it wrote; if the report cannot be written, a failure marker says so.

        Raises:
            ConfigError: the metadata has no plain form (a custom planner's data).
        """
        first = results[0][0].storage_data if results and results[0] else None
        # The checksum of the rank manifest as this rank wrote it (not as storage now holds it).
        checksum = first.report.manifest.checksum if isinstance(first, ReportedItem) else None
        try:
            plain = _plain_metadata(metadata)
            body = {"rank": assignment.rank, "dcp_metadata": plain, "manifest": checksum}
            rel = layout.rank_report_name(assignment.rank, assignment.save_id)
            self._write(f"{assignment.work_dir}/{rel}", body, (assignment.save_id, assignment.rank))
        except BaseException as exc:
            self.failed(assignment, exc, coordinator=False)
            raise

    def failed(self, assignment: Assignment, exc: BaseException, *, coordinator: bool) -> None:
        """This rank's part failed: tell rank 0 (best effort); rank 0 withdraws the save id."""
        body: dict[str, Any] = {"error": _describe(exc)}
        if isinstance(exc, DivergentStateError):
            body["divergent"] = exc.keys
        rel = layout.rank_failure_marker_name(assignment.rank, assignment.save_id)
        with contextlib.suppress(OSError, DcpSafeError):
            self._write(f"{assignment.work_dir}/{rel}", body, None)
        if coordinator:
            self.clear()

    def gather(
        self,
        assignment: Assignment,
        metadata: Metadata,
        results: list[list[WriteResult]],
    ) -> tuple[Metadata, list[list[WriteResult]]]:
        """Rank 0: the global metadata and every rank's results, once every rank reported; the
        reports are removed. On a failure nothing is published and the save's files are removed.

        Raises:
            DivergentStateError: a rank's copy of a plain entry differs from rank 0's.
            CommitError: a rank failed, did not report within the deadline, left a report the
                key does not authenticate or a rank manifest other than the one its report
                names, or its metadata names items no rank wrote (naming the ranks).
        """
        try:
            reports = self._await_reports(assignment)  # by rank
            results = [
                results[0],
                *(self._results_of(assignment, r, c) for r, (_, c) in reports.items()),
            ]
            union = _union_manifest(self.name, assignment, self.options.checksum, results)
            metadatas = [metadata]
            for rank, (plain, _) in reports.items():
                try:
                    metadatas.append(decode_dcp_metadata(plain, union, f"rank {rank}'s report"))
                except DcpSafeError as exc:
                    raise CommitError(
                        "a rank holds entries no rank wrote: a plain entry several ranks hold"
                        " must be on rank 0 too, or be declared per rank (per_rank=)",
                        {rank: str(exc)},
                    ) from exc
            for rank in reports:
                rel = layout.rank_report_name(rank, assignment.save_id)
                with contextlib.suppress(OSError, DcpSafeError):
                    self.backend.remove_file(f"{assignment.work_dir}/{rel}")
            return _merged(metadatas), results
        except BaseException as exc:
            self.publication(assignment.save_id).discard(exc)
            raise
        finally:
            self.clear()

    def _write(self, path: str, body: dict[str, Any], signer: tuple[str, int] | None) -> None:
        """``body`` as JSON at ``path`` (the assignment's format there, else a rank's report's),
        with a signing key and ``signer`` (the save and the rank it speaks for), with its MAC."""
        kind = _ASSIGNMENT if path == self.path else _REPORT
        body = {"format": kind, **body}
        if self.options.signing_key is not None and signer is not None:
            body["mac"] = part_mac(self.options.signing_key, *signer, body)
        self.backend.write_bytes(path, json.dumps(body).encode())

    def _read(self, path: str, kind: str, rank: int | None = None) -> tuple[dict[str, Any], object]:
        """The JSON body at ``path`` and its MAC (``None`` without one).

        Raises:
            FileNotFoundError: nothing there. ValueError: not JSON of ``kind``. CommitError
                instead, for a part ``rank`` wrote."""
        try:
            body = json.loads(self.backend.read_small(path, MANIFEST_MAX_BYTES))
            if not isinstance(body, dict) or body.get("format") != kind:
                raise ValueError(f"not a {kind}")
        except (FileNotFoundError, ValueError, DcpSafeError) as exc:
            if rank is None:
                raise
            raise CommitError("a rank's report is missing or unreadable", {rank: str(exc)}) from exc
        return body, body.pop("mac", None)

    def _posted(self) -> dict[str, Any] | None:
        try:
            found, mac = self._read(self.path, _ASSIGNMENT)
        except (FileNotFoundError, ValueError):
            return None  # not there yet (or half written where a write is not atomic)
        key = self.options.signing_key
        if key is not None and not part_mac_matches(key, self.key, 0, found, mac):
            return None  # not rank 0's: wait on for rank 0's post, which replaces it
        return found

    def _await_reports(self, assignment: Assignment) -> dict[int, tuple[Any, str | None]]:
        """Every other rank's report (its plain DCP metadata and its rank manifest's checksum),
        once all are on storage; with a key, authenticated."""
        others = range(1, assignment.world_size)
        reports = {r: layout.rank_report_name(r, assignment.save_id) for r in others}
        failures = {r: layout.rank_failure_marker_name(r, assignment.save_id) for r in others}
        present: set[str] = set()

        def every_report() -> bool | None:
            # Both names are in the ranks' directory (layout's rank stem).
            listed = self.backend.list_dir(f"{assignment.work_dir}/{layout.RANKS_DIR}")
            present.clear()
            present.update(f"{layout.RANKS_DIR}/{leaf}" for leaf in listed)
            if failed := [r for r, rel in failures.items() if rel in present]:
                raise self._failure(assignment, failed, failures)
            return True if present.issuperset(reports.values()) else None

        if poll(every_report, self.options.report_timeout_s) is None:
            missing = [r for r, rel in reports.items() if rel not in present]
            raise CommitError(
                f"ranks did not report within {self.options.report_timeout_s} s (a save without"
                " collectives)",
                {r: "no report: it died, hung or is still writing" for r in missing},
            )
        found: dict[int, tuple[Any, str | None]] = {}
        for rank, rel in reports.items():
            body, mac = self._read(f"{assignment.work_dir}/{rel}", _REPORT, rank)
            key = self.options.signing_key
            if key is not None and not part_mac_matches(key, assignment.save_id, rank, body, mac):
                raise CommitError(
                    "a rank's report is not authenticated by the job's signing key, so it may"
                    " not be that rank's: nothing is published. Give every rank's writer the"
                    " same signing key, and check who else can write the root",
                    {rank: f"{'no MAC' if mac is None else 'a MAC that does not match'} in {rel}"},
                )
            checksum = body.get("manifest")  # of its rank manifest
            fits = body.get("rank") == rank and "dcp_metadata" in body
            if not fits or not isinstance(checksum, str | None):
                raise CommitError("a rank's report is malformed", {rank: rel})
            found[rank] = (body["dcp_metadata"], checksum)
        return found

    def _failure(
        self, assignment: Assignment, failed: list[int], markers: Mapping[int, str]
    ) -> BaseException:
        """The error for ranks that left failure markers: divergence as itself, else CommitError."""
        divergent: dict[str, list[list[int]]] = {}
        described = {}
        for rank in failed:
            try:
                body, _ = self._read(f"{assignment.work_dir}/{markers[rank]}", _REPORT, rank)
            except CommitError:
                body = {}
            described[rank] = str(body.get("error", "failed (no detail)"))
            if isinstance(found := body.get("divergent"), dict):
                divergent.update({str(k): v for k, v in found.items() if isinstance(v, list)})
        if divergent:
            return DivergentStateError(divergent)
        return CommitError("a rank failed to write its part of the save", described)

    def _results_of(
        self, assignment: Assignment, rank: int, expected: str | None
    ) -> list[WriteResult]:
        """A rank's write results, from its rank manifest, with the report the committer checks;
        signed, the manifest must be the one whose checksum is ``expected`` (one with no items
        may go unnamed: it holds nothing a load reads)."""
        rel = f"{assignment.work_dir}/{layout.rank_manifest_name(rank)}"
        try:
            raw = self.backend.read_small(rel, MANIFEST_MAX_BYTES)
            manifest = RankManifest.from_json(raw, self.backend.full_path(rel))
        except (FileNotFoundError, DcpSafeError) as exc:
            raise CommitError("a rank manifest is missing or unreadable", {rank: str(exc)}) from exc
        # The bytes checked are the bytes used (read once): nothing swapped in later counts.
        signed, algorithm = self.options.signing_key is not None, self.options.checksum
        if signed and (expected or manifest.items) and digest_bytes(raw, algorithm) != expected:
            raise CommitError(
                "a rank manifest is not the one its rank's authenticated report names: nothing"
                " is published (someone else wrote it, or it was damaged)",
                {rank: self.backend.full_path(rel)},
            )
        if manifest.checksum_algorithm != algorithm.value:
            raise CommitError(
                f"a rank checksummed with another algorithm than {algorithm.value!r}: every"
                " rank must be configured alike",
                {rank: manifest.checksum_algorithm},
            )
        results = [WriteResult(MetadataIndex(r.fqn, r.offset), r.length, r) for r in manifest.items]
        return attach_report(results, report_for(manifest, raw, algorithm))


def plain_keys(plan: SavePlan) -> dict[str, int | None]:
    """A local plan's plain entries, each with its fingerprint (None where not taken)."""
    fingerprints = plan.fingerprints if isinstance(plan, FingerprintedPlan) else {}
    return {i.index.fqn: fingerprints.get(i.index.fqn) for i in plan.items if i.type in _PLAIN}


def items_to_write(
    items: Sequence[WriteItem], assignment: Assignment, planner: SavePlanner
) -> list[WriteItem]:
    """The items of a save without collectives that this rank writes: a plain entry (a tensor
    or object that is not sharded) when rank 0 does not hold it (``assignment.skip``), a DTensor
    chunk at coordinate 0 of each mesh dimension it is replicated over."""
    state = getattr(planner, "state_dict", None)
    state = state if isinstance(state, dict) else {}
    return [
        item
        for item in items
        if item.index.fqn not in assignment.skip
        and (item.type in _PLAIN or _primary(state.get(item.index.fqn)))
    ]


def _primary(value: object) -> bool:
    """Whether this rank writes its chunk of ``value``: a DTensor's replicas are written once,
    by the rank at coordinate 0 of each replicated mesh dimension; anything else is this rank's."""
    if not isinstance(value, DTensor):
        return True
    coordinate = value.device_mesh.get_coordinate()
    if coordinate is None:
        return False  # not in the mesh: holds no chunk of it
    return all(coordinate[d] == 0 for d, p in enumerate(value.placements) if p.is_replicate())


def _plain_metadata(metadata: Metadata) -> Any:
    """A rank's metadata in the plain form, for its report (ConfigError where it has none)."""
    planner = dict(metadata.planner_data or {})
    if isinstance(audit := planner.get(layout.AUDIT_KEY), dict):
        # A rank's sums cover only its blocks of a sharded tensor, and the plain form wants
        # blocks 0, 1, ...: the others are 0, which leaves rank 0's sum as it is.
        planner[layout.AUDIT_KEY] = {
            key: {b: blocks.get(b, 0) for b in range(max(blocks, default=-1) + 1)}
            for key, blocks in audit.items()
        }
    try:
        return encode_dcp_metadata(dataclasses.replace(metadata, planner_data=planner or None))
    except ValueError as exc:
        raise ConfigError(
            "a save without collectives sends each rank's DCP metadata through storage as plain"
            f" data, and this one has none ({exc}): use DCP's or dcp_safe's planner, or"
            " use_collectives=True"
        ) from exc


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"[:2000]


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
    chunks: dict[str, dict[tuple[int, ...], Any]] = {}  # by key, then by offsets
    paths: dict[str, Any] = {}
    audits: dict[str, dict[frozenset[tuple[int, ...]], Mapping[int, int]]] = {}
    for metadata in metadatas:
        for key, entry in metadata.state_dict_metadata.items():
            state.setdefault(key, entry)
            for chunk in entry.chunks if isinstance(entry, TensorStorageMetadata) else ():
                chunks.setdefault(key, {}).setdefault(tuple(chunk.offsets), chunk)
        planner = dict(metadata.planner_data or {})
        for key, sums in planner.pop(layout.AUDIT_KEY, {}).items():
            # A rank's sums cover its chunks; ranks holding the same chunks count once.
            held = metadata.state_dict_metadata.get(key)
            pieces = held.chunks if isinstance(held, TensorStorageMetadata) else []
            audits.setdefault(key, {}).setdefault(frozenset(tuple(c.offsets) for c in pieces), sums)
        paths.update(planner)
    for key, by_offsets in chunks.items():
        entry = state[key]
        state[key] = TensorStorageMetadata(entry.properties, entry.size, [*by_offsets.values()])
    if audits:
        paths[layout.AUDIT_KEY] = {
            key: {
                b: sum(part.get(b, 0) for part in parts.values()) & _MASK
                for b in sorted(set().union(*parts.values()))
            }
            for key, parts in audits.items()
        }
    return Metadata(
        state_dict_metadata=state,
        planner_data=paths or metadatas[0].planner_data,
        storage_meta=StorageMeta(),
        version=metadatas[0].version,
    )
