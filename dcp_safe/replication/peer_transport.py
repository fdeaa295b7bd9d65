"""Files between ranks over a gloo group: the peer tier's transport (copies and restores).

A file travels as point-to-point messages on a dcp_safe-owned gloo group (its timeout is the
deadline of every message): its recorded size in chunks of at most ``chunk_bytes`` (both ends
know the size from the manifest, so no header), then a one-element status, 1 when the sender
read the whole file and 0 when it could not (the chunks it could not read were zeros, sent so
that both ends stay in step). The receiver checks the bytes against the manifest as they land
(:class:`~dcp_safe.manifest.verify.FileCheck`: every item's checksum) and writes them through
``open_write``, so a file that fails any check is never visible.

Why the ranks' own network and not a shared disk: a node's local disk is what a node loss takes
away; the copy must be on another node's disk, and only the ranks reach another node. Why gloo
point to point and not a TCP server of our own: the group already has the addresses, the
rendezvous and a deadline, and a sender and its receiver are the only ranks involved.

Holds two chunk buffers per transfer in flight (one each end): :func:`peer_buffer_bytes`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from dcp_safe.backends.backend import Backend
from dcp_safe.errors import CheckpointCorruptError, describe
from dcp_safe.manifest.schema import FileRecord, ItemRecord
from dcp_safe.manifest.streams import read_fully
from dcp_safe.manifest.verify import FileCheck

T = TypeVar("T")

DEFAULT_PEER_CHUNK_BYTES = 8 << 20
#: The purpose of the gloo group a restore's peer fetches travel on.
PEER_RESTORE = "peer-restore"
_SENT_WHOLE = 1
_SEND_FAILED = 0


class SenderFailedError(OSError):
    """The sending rank could not read the file (the receiver got filler)."""


def peer_buffer_bytes(chunk_bytes: int = DEFAULT_PEER_CHUNK_BYTES) -> int:
    """Host bytes one rank's peer transfers hold at once: a send and a receive chunk."""
    return 2 * chunk_bytes


def exchange(send: Callable[[], None], receive: Callable[[], T], thread_name: str) -> T:
    """Run ``send`` on a thread while ``receive`` runs on this one: a rank's transfers both ways
    at once (either alone could wait on a peer doing the other); ``receive``'s result, once
    both ended.

    Raises:
        BaseException: what ``send`` raised (the transport's error), after ``receive`` ended.
    """
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix=thread_name) as sender:
        sent = sender.submit(send)
        result = receive()  # leaving the block waits for ``send`` to end, whatever happened
    sent.result()  # what ``send`` raised, if anything
    return result


def send_file(
    group: Any,
    dst: int,
    backend: Backend,
    rel: str,
    size: int,
    *,
    tag: int,
    chunk_bytes: int = DEFAULT_PEER_CHUNK_BYTES,
) -> str | None:
    """Send ``rel`` (``size`` bytes, as the manifest records) to group rank ``dst``: ``None``
    when the whole file was sent, else why it could not be read (the peer then got zeros for
    the rest and a failed status, and rejects it). The transport's error (a peer died or the
    deadline passed) is raised as it is, a RuntimeError.
    """
    buffer = torch.zeros(max(1, min(chunk_bytes, size)), dtype=torch.uint8)
    view = buffer.numpy()
    error: str | None = None
    with contextlib.ExitStack() as stack:
        try:
            stream = stack.enter_context(backend.open_read(rel))
        except (OSError, CheckpointCorruptError) as exc:
            error = describe(exc)
        for sent in range(0, size, chunk_bytes):
            n = min(chunk_bytes, size - sent)
            if error is None:
                try:
                    if read_fully(stream, view[:n].data) < n:
                        error = f"{rel} is shorter than the manifest says"
                except OSError as exc:
                    error = describe(exc)
            if error is not None:
                view[:n] = 0
            dist.send(buffer[:n], group=group, group_dst=dst, tag=tag)
    status = _SENT_WHOLE if error is None else _SEND_FAILED
    dist.send(torch.tensor([status], dtype=torch.int64), group=group, group_dst=dst, tag=tag)
    return error


def receive_file(
    group: Any,
    src: int,
    backend: Backend,
    rel: str,
    record: FileRecord,
    items: list[ItemRecord],
    *,
    tag: int,
    chunk_bytes: int = DEFAULT_PEER_CHUNK_BYTES,
) -> None:
    """Receive ``record``'s file from group rank ``src`` into ``rel``, checked as it lands.

    Every chunk is received whatever fails locally, so the two ends stay in step.

    Raises:
        CheckpointCorruptError: a checksum or the size differs; nothing is left under ``rel``.
        SenderFailedError: the sender could not read its copy; nothing is left under ``rel``.
        OSError: writing here failed; nothing is left under ``rel``.
        RuntimeError: the transport's error (a peer died or the deadline passed).
    """
    path = backend.full_path(rel)
    buffer = torch.empty(max(1, min(chunk_bytes, record.size)), dtype=torch.uint8)
    failure: Exception | None = None
    try:
        with contextlib.ExitStack() as stack:
            try:  # whatever fails here, every chunk is still received: the sender sends them
                check = FileCheck(path, record, items)
                out = stack.enter_context(backend.open_write(rel))
            except (CheckpointCorruptError, OSError) as exc:
                failure = exc
            for received in range(0, record.size, chunk_bytes):
                n = min(chunk_bytes, record.size - received)
                dist.recv(buffer[:n], group=group, group_src=src, tag=tag)
                if failure is None:
                    data = buffer[:n].numpy().tobytes()
                    try:
                        check.update(data)
                        out.write(data)
                    except (CheckpointCorruptError, OSError) as exc:
                        failure = exc
            status = torch.zeros(1, dtype=torch.int64)
            dist.recv(status, group=group, group_src=src, tag=tag)
            if int(status.item()) != _SENT_WHOLE:
                failure = SenderFailedError(f"rank {src} could not read its copy of {record.path}")
            if failure is None:
                check.finish()
            else:
                raise _Discard  # open_write leaves nothing behind (and would wrap an OSError)
    except _Discard:
        assert failure is not None
        raise failure from None


class _Discard(Exception):
    """Leaves ``open_write`` without a trace; the failure itself is raised after."""
