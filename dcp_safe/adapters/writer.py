"""``SafeStorageWriter``: DCP's ``StorageWriter`` with checksums, manifests and an atomic commit.

DCP calls a writer in this order (every rank unless noted; one save at a time per instance)::

    reset(checkpoint_id)            the checkpoint's name; validated, checked against the root
    set_up_storage_writer(is_coordinator, rank=..., use_collectives=...)
    prepare_local_plan(plan)
    prepare_global_plan(plans)      coordinator only: picks the save id and the work directory
    write_data(plan, planner)       streams this rank's items, then writes its rank manifest
    finish(metadata, results)       coordinator only, and only if every rank's write_data
                                    succeeded: verify, then publish

With ``use_collectives=False`` every step runs on every rank with its own plan only, and the
ranks agree and report through storage (:mod:`dcp_safe.adapters.without_collectives`). What each
step does for the commit: docs/architecture.md, "The commit protocol". Shard files use DCP's own
format (zstd as DCP's transform descriptor), so torch's ``FileSystemReader`` loads them; no shard
is ever buffered whole.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import os
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import Future as Future_
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Self

from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from dcp_safe import layout
from dcp_safe.adapters.options import REPLICA_MOVED, WRITER_MOVED, WriterOptions, writer_options
from dcp_safe.adapters.tensor_records import write_item
from dcp_safe.adapters.without_collectives import Assignment as _Assignment
from dcp_safe.adapters.without_collectives import (
    StorageAgreement,
    assignment_of,
    items_to_write,
    plain_keys,
    save_key,
)
from dcp_safe.backends.backend import Backend
from dcp_safe.backends.fsspec_backend import write_buffer_bytes
from dcp_safe.backends.retry import RetryPolicy, call_with_retries
from dcp_safe.backends.roots import open_backend
from dcp_safe.choices import refuse_moved
from dcp_safe.commit.committer import Committer
from dcp_safe.commit.fencing import attempt_from_env
from dcp_safe.commit.lease import DEFAULT_STALE_LEASE_S, Claimant
from dcp_safe.commit.results import attach_report, report_for
from dcp_safe.commit.strategy import Publication, strategy_for
from dcp_safe.coordination.markers import watch_for_commit
from dcp_safe.errors import CheckpointExistsError, ConfigError
from dcp_safe.manifest.blocks import BLOCK_BYTES
from dcp_safe.manifest.checksum import ChecksumAlgorithm
from dcp_safe.manifest.schema import FileRecord, ItemRecord, Manifest, RankManifest
from dcp_safe.manifest.streams import HashingSink
from dcp_safe.manifest.verify import DEFAULT_CHUNK_BYTES
from dcp_safe.replication.copying import copy_buffer_bytes
from dcp_safe.replication.peer_transport import peer_buffer_bytes
from dcp_safe.replication.rank_upload import (
    UploadOptions,
    report_commit_failure,
    report_rank_failure,
)
from dcp_safe.replication.replicator import RankReplicator, RankSave, Replicator
from dcp_safe.topology import RootLike, Topology


class SafeStorageWriter(StorageWriter):
    """Write DCP checkpoints under ``root`` with checksums and an atomic two-phase commit.

    Args:
        root: a directory, an fsspec URL or a :class:`~dcp_safe.topology.Root`; each checkpoint
            is ``<root>/<checkpoint_id>``. Or a :class:`~dcp_safe.topology.Topology`, kept as the
            writer's own, which names the roots (no ``replicate_to``/``storage_options`` then).
        storage_options: the shorthand of ``Root(root, storage_options=...)``.
        step: the training step the manifest records.
        replicate_to: a second root every checkpoint is copied to and committed on, in the
            background (:meth:`replication`); a path or URL gets ``root``'s fsspec options.
        replication_options: the per-rank uploads' deadlines, polling and chunk size.
        retry: for transient storage errors; a shard file that fails so is rewritten whole.
        attempt: this job attempt's number, monotone across restarts (default:
            ``TORCHELASTIC_RESTART_COUNT``, else no fencing); a writer of an older attempt than
            one that saved under ``root`` fails with ``StaleWriterError`` (docs/architecture.md,
            "Fencing").
        stale_lease_s: with ``attempt``, a lease naming no attempt of this run is taken over
            once its name was idle this long (None: never).
        options: :class:`~dcp_safe.adapters.options.WriterOptions`; without a ``signing_key``,
            ``$DCP_SAFE_SIGNING_KEY``'s, and a checksum left at its default becomes the signed
            default (docs/integrity.md, "Signed checkpoints").

    Raises:
        ConfigError: an unsupported option; a keyword that moved into ``options`` or a root
            (:data:`~dcp_safe.adapters.options.WRITER_MOVED`); roots beside a ``Topology``, or
            a node-local one (that is :class:`NodeLocalWriter`'s).
    """

    #: Whether the writer takes a topology with a node cache (``NodeLocalWriter`` does).
    _node_local = False

    def __init__(
        self,
        root: RootLike | Topology,
        *,
        storage_options: dict[str, Any] | None = None,
        step: int | None = None,
        replicate_to: RootLike | None = None,
        replication_options: UploadOptions | None = None,
        retry: RetryPolicy | None = None,
        attempt: int | None = None,
        stale_lease_s: float | None = DEFAULT_STALE_LEASE_S,
        options: WriterOptions | None = None,
        **moved: Any,
    ) -> None:
        super().__init__()
        refuse_moved(type(self).__name__, moved, WRITER_MOVED | REPLICA_MOVED)
        self.options = writer_options(options)
        if not isinstance(root, Topology):
            root = Topology.of(root, replicate_to=replicate_to, storage_options=storage_options)
        elif (replicate_to, storage_options) != (None, None):
            raise ConfigError(
                "a Topology root names the roots and their storage options: give replicate_to="
                " and storage_options= to Topology.of, not to the writer"
            )
        if (root.node_cache is not None) != self._node_local:
            raise ConfigError(
                "a topology with a node cache needs NodeLocalWriter (writer_for picks it)"
                if root.node_cache is not None
                else "NodeLocalWriter needs a topology with a node cache"
            )
        self.topology = root
        self.root = root.writes_to.url
        self.replicate_to = None if root.replica is None else root.replica.url
        self.retry = retry or RetryPolicy()
        self.attempt = attempt_from_env(attempt)
        self.claimant = Claimant(attempt=self.attempt, stale_after_s=stale_lease_s)
        self.backend: Backend = open_backend(root.writes_to, fsync=self.options.fsync, retry=retry)
        if self.options.overwrite:
            strategy_for(self.backend).require_rename(
                f"overwrite=True needs a backend that renames atomically; {self.root} does not"
            )
        self.step = step
        self.metrics: Mapping[str, float | str] | None = None  # recorded in the manifest
        uploads_to = root.uploads_to
        self.remote = None if uploads_to is None else open_backend(uploads_to, retry=retry)
        #: The backend of the root this writer publishes checkpoints on (``topology.commit``).
        self.commit_backend: Backend = self.backend
        self.replication_options = replication_options or UploadOptions()
        self._name: str | None = None
        self._rank = 0
        self._assignment: _Assignment | None = None
        self._collective, self._coordinator, self._saves = True, True, 0
        self._plain: dict[str, int | None] = {}  # this rank's plain entries, without collectives
        self._start_engines()

    #: What holds this process's background threads: shared by the per-save views
    #: (:meth:`for_step`), never pickled, started afresh in a copy (:meth:`_start_engines`).
    _ENGINES: tuple[str, ...] = ("_replicator", "_rank_replicator")

    def _start_engines(self) -> None:
        """The uploads to ``replicate_to``: of a single rank's checkpoint once committed, or of
        this rank's part of a save of several ranks (neither starts a thread until used)."""
        remote, claimant = self.remote, self.claimant
        self._replicator = self._rank_replicator = None
        if remote is not None:
            self._replicator = Replicator(self.backend, remote, claimant=claimant)
            options = self.replication_options
            self._rank_replicator = RankReplicator(
                self.backend, remote, options=options, retry=self.retry, claimant=claimant
            )

    def for_step(self, step: int | None, metrics: Mapping[str, float | str] | None = None) -> Self:
        """This writer for one save of training step ``step`` (its manifest records it, and
        ``metrics``, checked by :func:`~dcp_safe.manifest.schema.check_metrics`): the
        same roots, options and background uploads, and per-save state of its own, so that a
        save never changes a writer that another save may still be using."""
        view = object.__new__(type(self))
        view.__dict__.update(self.__dict__)  # not copy.copy: __getstate__ drops the engines
        view.step, view.metrics, view._name, view._assignment = step, metrics, None, None
        return view

    def detached(self) -> Self:
        """A copy with background uploads of its own: the manager's synchronous saves run
        beside an asynchronous one, whose per-rank upload must not be ended by theirs."""
        return copy.copy(self)  # through __getstate__ and __setstate__: fresh engines

    # ----------------------------------------------------------------- DCP call order

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        """Start a new save named ``checkpoint_id`` (a plain key under the root).

        Raises:
            InvalidCheckpointNameError: a name with ``/``, ``..``, a leading dot, or empty.
            CheckpointExistsError: the name is committed and ``overwrite`` is off.
            StorageError: the root cannot be created or written.
        """
        if checkpoint_id is not None:
            self._name = layout.validate_name(os.fspath(checkpoint_id))
        self._assignment = None
        if self._name is not None:
            self._refuse_committed(self._name)
            self.backend.makedirs("")

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self._rank = int(kwargs.get("rank") or 0)
        self._collective = kwargs.get("use_collectives", True) is not False
        if self._node_local and not self._collective:
            # Each rank saves to its own node's root: there is no storage where rank 0 could
            # post the save id and read every rank's report, as a save without collectives needs.
            raise ConfigError(
                "NodeLocalWriter needs use_collectives=True: its ranks write to node-local roots,"
                " which share no storage to agree through; use SafeStorageWriter on a shared root"
                " for saves without collectives"
            )
        self._coordinator, self._saves = bool(is_coordinator), self._saves + 1

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        self._require_name()
        if not self._collective and not plan.items and getattr(plan, "plan_token", None):
            raise ConfigError(
                "use_collectives=False needs every rank's whole local plan: pass"
                " SafeSavePlanner(cache_plans=False) (dcp_safe.save does)"
            )
        self._plain = {} if self._collective else plain_keys(plan)
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        if self._collective:
            return self._claim(plans)
        agreement = self._storage_agreement()
        return [agreement.agree(plans[0], self._rank, self._coordinator, self._plain, self._claim)]

    def _claim(self, plans: list[SavePlan]) -> list[SavePlan]:
        publication = self._claim_on(self.backend, layout.new_save_id(), self.options.overwrite)
        save_id, work_dir = publication.save_id, publication.work_dir
        return [
            dataclasses.replace(plan, storage_data=_Assignment(rank, len(plans), save_id, work_dir))
            for rank, plan in enumerate(plans)
        ]

    def _claim_on(self, backend: Backend, save_id: str, replace: bool = False) -> Publication:
        """Claim this save's name on ``backend`` for ``save_id``, with its ranks directory."""
        publication = self._publication(save_id, backend)
        publication.claim(replace=replace)
        try:
            backend.makedirs(f"{publication.work_dir}/{layout.RANKS_DIR}")
        except BaseException:
            # Held with nothing under it, the name would stay blocked until the sweeper's.
            with contextlib.suppress(OSError):
                publication.release()
            raise
        return publication

    def _storage_agreement(self) -> StorageAgreement:
        key = save_key(self.attempt, self._saves)
        return StorageAgreement(
            self.backend, self._require_name(), key, self.options, self._publication
        )

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        self._assignment = assignment = assignment_of(plan)
        items = plan.items if self._collective else items_to_write(plan.items, assignment, planner)
        buckets = _split_evenly(items, self.options.thread_count)
        files = [layout.shard_file_name(assignment.rank, i) for i in range(len(buckets))]
        with self._failure_reported(assignment, rank=assignment.rank):
            try:
                self._publication(assignment.save_id).check()
                results = self._write_rank(assignment, files, buckets, planner)
            except BaseException as exc:
                if not self._collective:
                    self._storage_agreement().failed(assignment, exc, coordinator=self._coordinator)
                self._abandon(assignment, files)
                raise
        self._replicate_rank_part(assignment)
        future: Future[list[WriteResult]] = Future()
        future.set_result(results)
        return future

    def _write_rank(
        self,
        assignment: _Assignment,
        files: list[str],
        buckets: list[list[WriteItem]],
        planner: SavePlanner,
    ) -> list[WriteResult]:
        name = self._require_name()
        # A worker per file, and two for hashing: an item's checksum and its block digests.
        with ThreadPoolExecutor(max_workers=max(1, len(buckets)) + 2) as pool:
            hash_pool = pool if self.options.checksum is not ChecksumAlgorithm.CRC32 else None
            writes = [
                pool.submit(self._write_file, assignment, f, bucket, planner, hash_pool)
                for f, bucket in zip(files, buckets, strict=True)
            ]
            per_file = [w.result() for w in writes]
        records = [record for _, items in per_file for record in items]
        manifest = RankManifest(
            name=name,
            save_id=assignment.save_id,
            rank=assignment.rank,
            checksum_algorithm=self.options.checksum.value,
            files=tuple(file for file, _ in per_file),
            items=tuple(record for record, _ in records),
        )
        rank_manifest = f"{assignment.work_dir}/{layout.rank_manifest_name(assignment.rank)}"
        written = manifest.to_json()
        self.backend.write_bytes(rank_manifest, written)
        results = [
            WriteResult(index=item.index, size_in_bytes=record.length, storage_data=record)
            for record, item in records
        ]
        # The coordinator checks the manifest from this report, not by reading it back.
        return attach_report(results, report_for(manifest, written, self.options.checksum))

    def _abandon(self, assignment: _Assignment, files: list[str]) -> None:
        """After this rank failed (DCP will not call ``finish``, so nobody else would)."""
        own = [*files, layout.rank_manifest_name(assignment.rank)]
        self._publication(assignment.save_id).abandon(own, shared=assignment.world_size > 1)

    def _publication(
        self, save_id: str, backend: Backend | None = None, name: str | None = None
    ) -> Publication:
        """The publication of ``save_id`` of ``name`` (default: the current save's) on
        ``backend`` (default: the writer's own root). Background work passes its own name:
        the writer may have moved on to the next save."""
        on, name = backend or self.backend, name or self._require_name()
        return strategy_for(on).publication(on, name, save_id, self.claimant)

    def _remote_work(self, assignment: _Assignment, name: str | None = None) -> str:
        """The save's work directory on the root it uploads to (``name`` as for _publication)."""
        assert self.remote is not None
        return strategy_for(self.remote).work_dir(name or self._require_name(), assignment.save_id)

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Verify every rank's results, then publish (coordinator only).

        Raises:
            CommitError: a planned item has no result, or a file does not match its manifest.
            CheckpointExistsError: another save committed this name meanwhile.
            StorageError: writing the metadata, manifest or marker failed.
        """
        assignment = self._require_assignment()
        name = self._require_name()
        if not self._collective:
            if not self._coordinator:
                self._storage_agreement().report(assignment, metadata, results)
                return
            with self._failure_reported(assignment, rank=None):
                metadata, results = self._storage_agreement().gather(assignment, metadata, results)
        self._publish(assignment, metadata, results)
        if self._replicator is not None and assignment.world_size == 1:
            self._replicator.submit(name)

    def _replicate_rank_part(self, assignment: _Assignment) -> None:
        """After this rank wrote its files: in a save of several ranks with ``replicate_to``,
        upload them once the save is committed locally (in the background)."""
        if self._rank_replicator is not None and assignment.world_size > 1:
            save = RankSave(assignment.save_id, assignment.rank, assignment.world_size)
            self._rank_replicator.begin(self._require_name(), save)

    def _publish(
        self,
        assignment: _Assignment,
        metadata: Metadata,
        results: list[list[WriteResult]],
        on: Backend | None = None,
        name: str | None = None,
    ) -> Manifest:
        """Verify every rank's results, then publish on ``on`` (default: this root); a failure
        is reported to the ranks waiting for the commit (``name`` as for :meth:`_publication`)."""
        with self._failure_reported(assignment, rank=None, name=name):
            manifest = Committer(on or self.backend, self.options).publish(
                self._publication(assignment.save_id, on, name),
                world_size=assignment.world_size,
                step=self.step,
                metrics=self.metrics,
                metadata=metadata,
                results=results,
            )
        return manifest

    @contextlib.contextmanager
    def _failure_reported(
        self, assignment: _Assignment, *, rank: int | None, name: str | None = None
    ) -> Iterator[None]:
        """If the block raises, tell the ranks waiting for this save's local commit that it will
        not come: ``rank``'s write failed, or (``None``) the gather or publish. Best effort,
        through remote markers (a single rank's replica waits on nobody; a node-local save's
        commit waits even then); ``name`` as for :meth:`_publication`."""
        try:
            yield
        except BaseException as exc:
            if self.remote is not None and (assignment.world_size > 1 or self._node_local):
                work = self._remote_work(assignment, name)
                if rank is None:
                    report_commit_failure(self.remote, work, assignment.save_id, exc)
                else:
                    report_rank_failure(self.remote, work, rank, assignment.save_id, exc)
                if self._rank_replicator is not None:
                    self._rank_replicator.end_saves()
            raise

    def missing_ranks(self) -> list[int] | None:
        """Ranks of the current save whose rank manifest (written last) is not on storage: after
        a failed collective, those that died or hung (``None`` before ``write_data``)."""
        assignment = self._assignment
        if assignment is None:
            return None
        present = set(self.backend.list_dir(f"{assignment.work_dir}/{layout.RANKS_DIR}"))
        return [
            rank
            for rank in range(assignment.world_size)
            if layout.rank_manifest_name(rank).rpartition("/")[2] not in present
        ]

    def replication(self, name: str, *, poll_s: float = 0.5) -> Future_[Any]:
        """A future that resolves once checkpoint ``name`` is committed on the remote tier.

        In the process that ran the save it is this rank's replication, failing with the cause
        (``CommitError`` naming ranks, ``ReplicationSkippedError`` if a newer checkpoint
        superseded it); elsewhere it watches the remote ``_COMMITTED`` marker.

        Raises:
            ConfigError: the writer has no ``replicate_to``.
        """
        name = layout.validate_name(name)
        if self.remote is None:
            raise ConfigError("this writer was created without replicate_to")
        for replicator in (self._rank_replicator, self._replicator):
            if replicator is not None:
                with contextlib.suppress(KeyError):
                    return replicator.future(name)
        return watch_for_commit(self.remote, name, poll_s=poll_s)

    @property
    def upload_buffer_bytes(self) -> int | None:
        """The most host bytes this writer's uploads hold at once, beside the state it writes
        (docs/s3.md): 0 for a local root without ``replicate_to``; None where a root buffers by
        an amount not known here (an object store other than S3). With peer copies (a node-local
        topology's), the peer tier's chunk buffers too."""
        direct = write_buffer_bytes(self.backend)
        if direct is None:
            return None
        total = direct * self.options.thread_count
        if self.remote is not None:
            # The single-process replicator reads DEFAULT_CHUNK_BYTES at a time, the per-rank
            # one the replication options' chunk; one of them runs.
            chunk = max(DEFAULT_CHUNK_BYTES, self.replication_options.chunk_bytes)
            replication = copy_buffer_bytes(self.remote, chunk)
            if replication is None:
                return None
            total += replication
        if self.topology.peer_copies > 1:
            total += peer_buffer_bytes()
        return total

    def close(self, timeout_s: float | None = None) -> None:
        """Drain background replication (bounded by ``timeout_s`` each) and stop its threads.

        Raises:
            ReplicationTimeoutError: still busy after ``timeout_s``.
            BaseException: the first replication failure whose future nobody retrieved.
        """
        try:
            if self._rank_replicator is not None:
                self._rank_replicator.close(timeout_s)
        finally:
            if self._replicator is not None:
                self._replicator.close(timeout_s)

    def storage_meta(self) -> Any:
        return StorageMeta(checkpoint_id=self._name)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return layout.is_valid_name(os.fspath(checkpoint_id))

    # ----------------------------------------------------------------- helpers

    @property
    def checkpoint_id(self) -> str | None:
        return self._name

    def _require_name(self) -> str:
        if self._name is None:
            raise ConfigError(
                "no checkpoint name: pass checkpoint_id='step_000100' to dcp.save/async_save"
            )
        return self._name

    def _require_assignment(self) -> _Assignment:
        if self._assignment is None:
            raise ConfigError("finish() called before write_data()")
        return self._assignment

    def _refuse_committed(self, name: str) -> None:
        if not self.options.overwrite and self.backend.exists(f"{name}/{layout.COMMITTED_MARKER}"):
            raise CheckpointExistsError(self.backend.full_path(name))

    def _write_file(
        self,
        assignment: _Assignment,
        file_name: str,
        items: Sequence[WriteItem],
        planner: SavePlanner,
        hash_pool: ThreadPoolExecutor | None,
    ) -> tuple[FileRecord, list[tuple[ItemRecord, WriteItem]]]:
        path = f"{assignment.work_dir}/{file_name}"

        def write() -> tuple[FileRecord, list[tuple[ItemRecord, WriteItem]]]:
            with self.backend.open_write(path) as target:
                sink = HashingSink(target, self.options.checksum, hash_pool)
                records = [
                    (self._write_item(sink, file_name, item, planner), item) for item in items
                ]
                size = sink.tell()
            return FileRecord(path=file_name, size=size), records

        # A streamed write cannot be resumed where it failed; its items are still in memory
        # (staged or live), so a transient failure rewrites the whole file from the start.
        return call_with_retries("write", self.backend.full_path(path), write, self.retry)

    def _write_item(
        self, sink: HashingSink, file_name: str, item: WriteItem, planner: SavePlanner
    ) -> ItemRecord:
        start = sink.tell()
        sink.expect(_item_bytes(item))
        compressed = self.options.compression == "zstd"
        blocks = BLOCK_BYTES if self.options.block_digests else None
        data = planner.resolve_data(item)
        transforms = write_item(sink, item, data, compressed=compressed, block_bytes=blocks)
        offset = item.index.offset
        return ItemRecord(
            fqn=item.index.fqn,
            offset=None if offset is None else tuple(offset),
            file=file_name,
            start=start,
            length=sink.tell() - start,
            checksum=sink.take_checksum(),
            transforms=transforms,
            blocks=sink.take_blocks(),
        )

    def __getstate__(self) -> dict[str, Any]:
        # DCP's process-based executor pickles the writer: no per-save state into the child.
        state = {k: v for k, v in self.__dict__.items() if k not in self._ENGINES}
        state["_assignment"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._start_engines()


def _split_evenly(items: Sequence[WriteItem], bins: int) -> list[list[WriteItem]]:
    """Spread items over at most ``bins`` files, largest first, by bytes; byte items round-robin."""
    if bins <= 1 or len(items) <= 1:
        return [list(items)]
    buckets: list[list[WriteItem]] = [[] for _ in range(bins)]
    sizes = [0] * bins
    for item in sorted(items, key=_item_bytes, reverse=True):
        target = sizes.index(min(sizes))
        buckets[target].append(item)
        sizes[target] += max(_item_bytes(item), 1)
    return [b for b in buckets if b]


def _item_bytes(item: WriteItem) -> int:
    if item.tensor_data is None:
        return 0
    return item.tensor_data.size.numel() * item.tensor_data.properties.dtype.itemsize
