"""The manager's roots once a checkpoint is committed: verification, retention, ``latest``,
readers, and the peer tier's background copies (a
:class:`~dcp_safe.replication.peer_copy.PeerCopier`).

It keeps what must not be pruned yet (names being read or replicated, the newest one this
manager committed) and writes the ``pruned`` history events. One manager owns a root:
retention treats every committed checkpoint with a step as its own.

Thread safety: any thread; the sets share the manager's condition.

A restore (``CheckpointManager.restore``): the coordinator resolves the name once while every
rank waits in rounds, so a commit or prune meanwhile cannot split the ranks. The manager's own
tiers come first; another run's (``initial_load_from``, :class:`WarmStart`) only when they hold
no committed checkpoint at all; with a signing key, every reader here holds it, the warm
start's too. Every restore is recorded in the history (``restored``, with where it came from).
Keys and the report: docs/resume.md.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import posixpath
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

from dcp_safe import layout
from dcp_safe.adapters.reader import SafeStorageReader
from dcp_safe.adapters.writer import SafeStorageWriter
from dcp_safe.backends.backend import Backend
from dcp_safe.checkpoints.catalog import list_checkpoints
from dcp_safe.commit.strategy import strategy_for
from dcp_safe.errors import (
    CheckpointCorruptError,
    CheckpointNotFoundError,
    ConfigError,
    DcpSafeError,
    SignatureError,
)
from dcp_safe.manager.ledger import Ledger
from dcp_safe.manager.options import Retention
from dcp_safe.reading.safetensors_import import (
    NameMap,
    SafetensorsReader,
    SafetensorsSource,
    is_safetensors_file,
    locate,
)
from dcp_safe.replication.peer_copy import PeerCopier
from dcp_safe.retention.policy import CheckpointRecord, decide
from dcp_safe.retention.sweeper import sweep_partials, sweep_trash
from dcp_safe.retention.trash import trash
from dcp_safe.topology import Root


class Tiers:
    """Retention and reading on the local root and the replica (the writer's ``topology`` says
    which root is which). Only the ``coordinator`` prunes and sweeps; pruning runs inside
    ``deferred`` (a preemption signal waits for it). With ``peer_copies`` the peer tier's groups
    are built here, on every rank at the same point, unless ``read_only``: such a manager makes
    no copies and fetches none (a fetch lands on this node's disk), so it holds no group for them.
    """

    def __init__(
        self,
        writer: SafeStorageWriter,
        *,
        retention: Retention,
        ledger: Ledger,
        deferred: Callable[[], AbstractContextManager[Any]],
        coordinator: bool,
        load_budget_bytes: int | None,
        deadline_s: float,
        read_only: bool = False,
    ) -> None:
        self.coordinator = coordinator
        self.load_budget_bytes = load_budget_bytes
        self.writer = writer
        topology = writer.topology
        self.commit = topology.commit
        self.replica = topology.replica
        self.backend: Backend = writer.commit_backend
        # The replica's backend (a node-local writer's remote is the commit root: not a tier).
        self.remote = None if self.replica is None else writer.remote
        self.policy = retention.policy()
        self.partial_grace_s = retention.partial_grace_s
        self.trash_grace_s = retention.trash_grace_s
        self._expiry: threading.Thread | None = None
        self._history = ledger
        self._cond = ledger.cond
        self._deferred = deferred
        self._prune_lock = threading.Lock()
        # With a signing writer only what its key signed counts, in every reader built here:
        # a planted unsigned checkpoint neither stands in for ``latest`` nor evicts a signed one.
        self.signing_key: bytes | None = writer.options.signing_key
        self._newest_own: str | None = None  # never pruned, whatever a listing says
        self._validated = ledger.history.validated_names()
        self._replications: dict[str, Future[Any]] = {}
        self._reading: set[str] = set()
        self.pruned = 0
        self.peers: PeerCopier | None = None
        if topology.peer_copies > 1 and not read_only:
            node_options = getattr(writer, "node_options", None)  # a node-local writer's
            self.peers = PeerCopier(
                copies=topology.peer_copies,
                local=writer.backend,
                remote=writer.commit_backend,
                keep=None if node_options is None else node_options.keep_node_caches,
                deadline_s=deadline_s,
            )

    def trust(self, name: str) -> None:
        """``name`` passed its check (here, or in the checkpoint worker): retention may count
        it, and prune behind it."""
        with self._cond:
            self._validated.add(name)
            self._newest_own = name

    def is_validated(self, name: str) -> bool:
        with self._cond:
            return name in self._validated

    def track_replication(self, name: str, future: Future[Any]) -> None:
        with self._cond:
            self._replications[name] = future

        def done(_: Future[Any]) -> None:
            with self._cond:
                if self._replications.get(name) is future:
                    del self._replications[name]

        future.add_done_callback(done)

    def replications(self) -> list[Future[Any]]:
        with self._cond:
            return list(self._replications.values())

    @contextlib.contextmanager
    def reading(self, name: str | None) -> Iterator[None]:
        with self._cond:
            self._reading.add(name or "")
        try:
            yield
        finally:
            with self._cond:
                self._reading.discard(name or "")

    def prune(self) -> tuple[str, ...]:
        """Apply retention to both tiers now; returns the local names removed.

        Checkpoints being read or replicated are kept until a later prune; names with no step
        in the manifest are left alone. A committed remote checkpoint counts as validated (the
        replicator checked every byte before its marker). Abandoned partials older than
        ``partial_grace_s`` are collected locally. Only the coordinator prunes. With
        ``trash_grace_s``, what is dropped goes to the trash, and what the trash holds past it
        is deleted on a thread of its own.
        """
        if not self.coordinator:
            return ()
        dropped = self._prune(self.backend, self.commit, "local")
        if self.remote is not None and self.replica is not None:
            self._prune(self.remote, self.replica, "remote")
        sweep_partials(self.commit, grace_s=self.partial_grace_s)
        if self.trash_grace_s:
            with self._cond:  # one pass at a time; deleting never holds up a save's commit
                if self._expiry is None or not self._expiry.is_alive():
                    self._expiry = threading.Thread(target=self._expire, name="dcp_safe-trash")
                    self._expiry.daemon = True  # killed mid-delete, the trash stays consistent
                    self._expiry.start()
        return dropped

    def _expire(self) -> None:
        for backend in (self.backend, *([self.remote] if self.remote is not None else [])):
            try:
                sweep_trash(backend, self.trash_grace_s)
            except (DcpSafeError, OSError) as exc:  # raised by close(), as a prune's would be
                self._history.keep(exc)

    def _prune(self, backend: Backend, root: Root, tier: str) -> tuple[str, ...]:
        local = tier == "local"  # the names validated, read and counted here are local ones
        with self._deferred(), self._prune_lock:
            infos = list_checkpoints(root, signing_key=self.signing_key)
            with self._cond:
                # A committed remote checkpoint counts as validated (see prune).
                counted = self._validated if local else {i.name for i in infos}
                records = [
                    CheckpointRecord(i.name, i.step, i.name in counted, i.created_at, i.metrics)
                    for i in infos
                    if i.step is not None
                ]
                protected = {n for n, f in self._replications.items() if not f.done()}
                protected |= self._reading if local else set()
                if self._newest_own is not None:  # never pruned, whatever a listing says
                    protected.add(self._newest_own)
            decision = decide(records, self.policy, protected=protected)
            for name in decision.drop:
                step = next(r.step for r in records if r.name == name)
                error: Exception | None = None
                reason = "retention"
                if self.trash_grace_s:
                    reason = f"retention; in the trash for {self.trash_grace_s:g} s"
                try:
                    (trash if self.trash_grace_s else strategy_for(backend).retire)(backend, name)
                except Exception as exc:
                    try:
                        committed = backend.exists(f"{name}/{layout.COMMITTED_MARKER}")
                    except OSError:  # cannot tell: do not claim it was pruned
                        committed = True
                    if committed:
                        raise
                    # Gone from the listing: recorded as pruned, with why, and the error raised.
                    error = exc
                    reason = f"retention; unpublished, but removing its files failed: {exc}"[:500]
                self._history.append("pruned", step, name, tier=tier, reason=reason)
                if local:
                    with self._cond:
                        self._validated.discard(name)
                        self._replications.pop(name, None)
                        self.pruned += 1
                if error is not None:
                    raise error
            return decision.drop

    def withdraw(self, name: str, tier: str = "local") -> None:
        """Retire ``name``, committed on ``tier``'s root but failed on every rank (its verdict
        lost): out of the listings first, then its files. Never counted, never pruned."""
        backend = self.backend if tier == "local" else self.remote
        assert backend is not None  # a remote verdict exists only with replicate_to
        with self._deferred(), self._prune_lock:
            strategy_for(backend).retire(backend, name)
            with self._cond:
                self._validated.discard(name)

    def latest(self, tier: str = "local") -> str | None:
        if tier not in ("local", "remote"):
            raise ConfigError(f"tier must be 'local' or 'remote', got {tier!r}")
        root = self.commit if tier == "local" else self.replica
        if root is None:
            raise ConfigError("this manager has no replicate_to")
        found = list_checkpoints(root, signing_key=self.signing_key)
        return found[-1].name if found else None

    def reader(self) -> SafeStorageReader:
        """A reader of the local root with the replica as its fallback (or, node-local: of the
        remote root, reading from this node's cache what it can, then from peers' copies)."""
        return SafeStorageReader(  # a topology has a replica or a node cache, never both
            self.commit,
            fallback=self.replica,
            node_cache=None if (cache := self.writer.topology.node_cache) is None else cache.url,
            peers=self.peers is not None,
            process_group=None if self.peers is None else self.peers.restore_group,
            signing_key=self.signing_key,
            load_budget_bytes=self.load_budget_bytes,
        )


@dataclass(frozen=True)
class WarmStart:
    """Another run's checkpoints (or Hugging Face weights) to start from when the manager's
    own roots hold none, or to restore from when ``restore(source=)`` names them.

    ``source``: a root (its newest committed checkpoint) or ``ROOT/NAME`` (that checkpoint), or
    a safetensors file or model folder. ``safetensors``: read as safetensors whatever it holds;
    else so only where ``source`` names such a file or a folder holding one.
    """

    source: Root
    keys: tuple[str, ...] | None = None  # None: every key the state dict asks for
    name_map: NameMap | None = None
    safetensors: bool = False

    @classmethod
    def of(
        cls,
        value: str | os.PathLike[str] | SafetensorsSource,
        commit: Root,
        keys: tuple[str, ...] | None = None,
    ) -> WarmStart:
        """``value`` read with the storage options of ``commit`` unless it brings its own."""
        if not isinstance(value, SafetensorsSource):
            return cls(dataclasses.replace(commit, url=os.fspath(value)), keys)
        given = value.storage_options
        root = Root(str(value.url), commit.storage_options if given is None else given)
        return cls(root, keys, value.name_map, safetensors=True)

    def reader(self, url: str, tiers: Tiers) -> SafeStorageReader | SafetensorsReader:
        """The reader of ``url`` (which :meth:`resolve` gave), bounded and keyed as ``tiers``'."""
        source = dataclasses.replace(self.source, url=url)
        if is_safetensors_file(url):
            return SafetensorsReader(source, self.name_map)
        return SafeStorageReader(
            source, load_budget_bytes=tiers.load_budget_bytes, signing_key=tiers.signing_key
        )

    def resolve(self, signing_key: bytes | None) -> tuple[str, str]:
        """``(root, name)`` of the checkpoint to start from: with ``signing_key`` (the
        manager's), only one it signed counts, as for the manager's own checkpoints. For
        safetensors, ``(the file or index to read, its name)``: not signed, whatever the key
        (the user named it; its digest goes to the history).

        Raises:
            CheckpointNotFoundError: no committed checkpoint there (nor, for a safetensors
                folder, a ``model.safetensors[.index.json]``).
            SignatureError: with a key, ``source`` holds committed checkpoints, none signed
                with it (``UnsignedCheckpointError``: the one named is not signed at all).
        """
        file = locate(self.source, required=self.safetensors)
        if file is not None:
            return file, posixpath.basename(file)
        refused: dict[str, CheckpointCorruptError] = {}

        def listed(url: str) -> list[str]:
            found = list_checkpoints(
                dataclasses.replace(self.source, url=url),
                signing_key=signing_key,
                on_damaged=refused.__setitem__,
            )
            return [c.name for c in found]

        found = listed(self.source.url)
        if found:
            return self.source.url, found[-1]
        root, name = posixpath.split(self.source.url.rstrip("/"))
        if root and name in listed(root):
            return root, name
        # Say why, not "nothing there": a checkpoint the key did not sign is not a warm start.
        refusals = (refused.get(name), *refused.values())
        signature = next((e for e in refusals if isinstance(e, SignatureError)), None)
        if signature is not None:
            raise signature
        raise CheckpointNotFoundError(self.source.url, "no committed checkpoint to warm-start from")
