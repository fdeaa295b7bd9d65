"""The contenders of an async-save benchmark: one small adapter per way of saving.

Every contender is driven through ``dcp.async_save`` the way a training loop would drive it, so
the figures mean the same thing for all of them: the *stall* is the time from the call until
the training loop may touch its tensors again (``staging_completion``, or the call's return
for DCP's blocking stagers), the *local commit* is when the upload future resolves, the
*remote commit* (where there is one) is when the checkpoint is committed on the remote tier.

A :class:`Saver` builds its storage writer in :meth:`Saver.writer_for` *before* the clock
starts (constructing a writer is not part of a save) and starts the save in
:meth:`Saver.call`. Contenders:

* :class:`DcpSafeSaver`: ``BudgetedStager`` + ``SafeStorageWriter`` (optionally replicated);
* :class:`TorchSaver`: torch's ``FileSystemWriter`` (or ``FsspecWriter``) with DCP's default
  async path (the writer is its own blocking stager), ``DefaultStager`` with CPU options, or
  ``BlockingAsyncStager(cache_staged_state_dict=True)``.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from enum import Enum
from typing import Any, Protocol

from torch.distributed.checkpoint._extension import ZStandard
from torch.distributed.checkpoint.filesystem import FileSystemWriter
from torch.distributed.checkpoint.staging import (
    AsyncStager,
    BlockingAsyncStager,
    DefaultStager,
    StagingOptions,
)
from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse, async_save

from dcp_safe.adapters.options import Compression, WriterOptions
from dcp_safe.adapters.writer import SafeStorageWriter
from dcp_safe.bench.measure import State
from dcp_safe.choices import parse_choice
from dcp_safe.staging import BudgetedStager, PinMemory, StagerOptions
from dcp_safe.topology import RootLike, as_root


@dataclass(frozen=True)
class Started:
    """A save in flight.

    Attributes:
        staged: resolves when the live state may change again (``None``: the call returned
            only after staging).
        upload: resolves when the checkpoint is committed where the writer writes.
        remote: called after ``upload`` resolved, returns a future of the remote commit.
    """

    staged: Future[Any] | None
    upload: Future[Any]
    remote: Callable[[], Future[Any]] | None = None


class Saver(Protocol):
    """One way of saving; see the module docstring for the call order."""

    label: str
    remote_root: bool  # the writer's own root is remote: its upload *is* the remote commit

    def writer_for(self, name: str) -> Any: ...

    def call(self, state: State, name: str, writer: Any) -> Started: ...

    def close(self) -> None: ...


def _split(response: Any) -> tuple[Future[Any] | None, Future[Any]]:
    if isinstance(response, AsyncSaveResponse):
        return response.staging_completion, response.upload_completion
    return None, response


class DcpSafeSaver:
    """An unpinned ``BudgetedStager`` + a fresh ``SafeStorageWriter`` per save.

    Args:
        root: local folder or URL the writer saves under (a ``Root``: with fsspec options).
        compression: the writer's ``compression``.
        replicate_to: a remote root every checkpoint is replicated to (a ``Root``, likewise).
        thread_count: the writer's ``thread_count``.
    """

    def __init__(
        self,
        root: RootLike,
        *,
        compression: str = "none",
        replicate_to: RootLike | None = None,
        thread_count: int = 1,
    ) -> None:
        self.label = "dcp_safe"
        self.root = as_root(root)
        self.remote_root = "://" in self.root.url
        self._writer_args: dict[str, Any] = {
            "replicate_to": replicate_to,
            "options": WriterOptions(
                compression=parse_choice(Compression, compression, "compression"),
                thread_count=thread_count,
            ),
        }
        self.stager = BudgetedStager(options=StagerOptions(pin_memory=PinMemory.OFF))
        self._writers: list[SafeStorageWriter] = []

    def writer_for(self, name: str) -> SafeStorageWriter:
        writer = SafeStorageWriter(self.root, **self._writer_args)
        self._writers.append(writer)
        return writer

    def call(self, state: State, name: str, writer: Any) -> Started:
        response = self.stager.async_save(
            state, checkpoint_id=name, storage_writer=writer, no_dist=True
        )
        remote = None
        if writer.remote is not None:
            remote = lambda: writer.replication(name)  # noqa: E731 - bound per save
        return Started(response.staging_completion, response.upload_completion, remote)

    def close(self) -> None:
        for writer in self._writers:
            writer.close()
        self._writers.clear()
        self.stager.close()


class TorchStaging(str, Enum):
    """Which of DCP's staging paths a :class:`TorchSaver` uses."""

    DEFAULT_ASYNC = "default_async"  # no async_stager: FileSystemWriter stages (blocking)
    DEFAULT_STAGER = "default_stager"  # DefaultStager, CPU options (async, no pinning)
    BLOCKING_CACHED = "blocking_cached"  # BlockingAsyncStager(cache_staged_state_dict=True)


def _torch_stager(staging: TorchStaging) -> AsyncStager | None:
    if staging is TorchStaging.DEFAULT_STAGER:
        # use_pinned_memory, use_shared_memory, use_async_staging, use_non_blocking_copy
        return DefaultStager(StagingOptions(False, False, True, False))
    if staging is TorchStaging.BLOCKING_CACHED:
        return BlockingAsyncStager(cache_staged_state_dict=True)
    return None


class TorchSaver:
    """torch's writer per save, staged by one of DCP's own paths.

    Args:
        root: local folder, or an fsspec URL (then ``FsspecWriter``, ``sync_files=False``:
            on a stream ``sync_files=True`` makes torch ``os.sync()`` the whole machine); a
            ``Root``'s fsspec options are ``FsspecWriter`` keyword arguments.
        staging: see :class:`TorchStaging`.
        zstd: add DCP's ``ZStandard`` extension (local writer only).
        thread_count: the writer's ``thread_count``.
    """

    def __init__(
        self,
        root: RootLike,
        *,
        staging: TorchStaging = TorchStaging.DEFAULT_ASYNC,
        zstd: bool = False,
        thread_count: int = 1,
    ) -> None:
        root = as_root(root)
        self.root, self._fsspec_kwargs = root.url, root.storage_options or {}
        self.remote_root = "://" in self.root
        self.staging = staging
        self.label = f"torch_{staging.value}"
        self.zstd = zstd
        self.thread_count = thread_count
        self.stager = _torch_stager(staging)

    def writer_for(self, name: str) -> FileSystemWriter:
        path = f"{self.root}/{name}"
        if self.remote_root:
            from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

            return FsspecWriter(
                path, sync_files=False, thread_count=self.thread_count, **self._fsspec_kwargs
            )
        extensions = [ZStandard()] if self.zstd else None
        return FileSystemWriter(
            path, sync_files=True, thread_count=self.thread_count, _extensions=extensions
        )

    def call(self, state: State, name: str, writer: Any) -> Started:
        response = async_save(state, storage_writer=writer, async_stager=self.stager, no_dist=True)
        staged, upload = _split(response)
        return Started(staged, upload)

    def close(self) -> None:
        if self.stager is not None:
            self.stager.close()
