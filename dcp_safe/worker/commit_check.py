"""The check a new checkpoint passes before the manager trusts it, wherever it runs.

The thread executor runs it on the manager's thread; the process executor in the checkpoint
worker, right after the commit (a node-local save: after its remote commit), so that the
training process parses no manifest of its own saves: at 10,000 items a parse is ~0.3 s of
Python, and every bytecode of it is taken from the training thread. The worker sends back what
it found as a :class:`Checked`; the parent keeps the header, so its retention lists the new
checkpoint without parsing it either (:func:`~dcp_safe.checkpoints.committed.open_header`).
"""

from __future__ import annotations

from dataclasses import dataclass

from dcp_safe.adapters.writer import SafeStorageWriter
from dcp_safe.checkpoints.catalog import verify_opened
from dcp_safe.checkpoints.committed import CommittedHeader, open_committed, remember_header
from dcp_safe.checkpoints.signed import check_signed

__all__ = ["Checked", "check_commit"]


@dataclass(frozen=True)
class Checked:
    """A new checkpoint's check, as the worker reports it.

    Attributes:
        error: the check's error, pickled with its worker traceback
            (:func:`~dcp_safe.worker.transport.encode_error`); ``None``: it passed.
        digest: the manifest digest the check read (empty when it failed).
        header: that manifest's header (``None`` when it failed).
    """

    error: bytes | None = None
    digest: str = ""
    header: CommittedHeader | None = None

    def remember(self) -> None:
        """Let this process list the checkpoint without parsing its manifest again."""
        if self.header is not None:
            remember_header(self.digest, self.header)


def check_commit(
    writer: SafeStorageWriter, name: str, *, deep: bool
) -> tuple[str, CommittedHeader]:
    """Check ``name``, committed through ``writer``: its marker and manifest (and signature,
    with a signing writer), or with ``deep`` every byte; its manifest digest and header.

    Raises:
        CheckpointCorruptError: the checkpoint does not hold what its manifest says
            (``SignatureError`` / ``UnsignedCheckpointError``: not signed with the key).
        CheckpointNotFoundError: no commit marker.
        OSError: storage failed.
    """
    backend, key = writer.commit_backend, writer.options.signing_key
    opened = open_committed(backend, name)  # its marker and manifest, read once
    if deep:
        verify_opened(backend, opened, signing_key=key)
    elif key is not None:
        check_signed(backend, opened, key)
    return opened.digest, CommittedHeader.of(opened.manifest)
