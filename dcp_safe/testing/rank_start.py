"""How :func:`dcp_safe.testing.multiproc.run_ranks` starts a rank: forked from a fork server.

multiprocessing's fork server is a process started once from a fresh interpreter that imports
torch (and this package) and runs nothing else; each rank is forked from it, so it starts with
torch imported instead of paying seconds of ``import torch`` as a spawned rank does. Forking the
caller instead would copy its threads' locks in whatever state they were (torch's intra-op
pool, gloo, pytest's capture and timeout machinery), which deadlocks intermittently.

What a spawned rank inherits at the call and a server started earlier does not hold travels with
the rank: its stdout and stderr here (:class:`StdStreams`: pytest's capture of the current test,
not of the test that started the server); its environment goes in ``run_ranks``' payload.
Where there is no fork server (Windows), ranks are spawned.
"""

from __future__ import annotations

import os
from multiprocessing import get_all_start_methods, get_context, reduction
from multiprocessing.context import ForkServerContext, SpawnContext
from typing import Any

__all__ = ["StdStreams", "rank_context"]

# Imported once by the fork server, so that no rank pays for them (seconds each on a busy host):
# dcp_safe's own imports are lazy, and a rank that saves through a manager, on S3 or not, needs
# most of them (0.9 s of CPU a rank, measured, before they were here). A module that does not
# import is skipped by the server.
_PRELOAD = (
    "torch",
    "torch.distributed",
    "torch.distributed.checkpoint",
    "torch._dynamo",  # what DTensor's collectives import on first use: 0.45 s a rank
    "dcp_safe",
    "dcp_safe.testing.multiproc",
    "dcp_safe.manager",
    "dcp_safe.adapters.api",
    "dcp_safe.reading",
    "dcp_safe.replication",
    "s3fs",
)


def rank_context() -> ForkServerContext | SpawnContext:
    """The fork server, preloaded with what every rank imports; spawn where there is none."""
    if "forkserver" not in get_all_start_methods():
        return get_context("spawn")
    ctx = get_context("forkserver")
    # Takes effect when the server starts (the first call); later calls reuse that server.
    ctx.set_forkserver_preload(list(_PRELOAD))
    return ctx


class StdStreams:
    """The caller's stdout and stderr descriptors, for a rank to take as its own.

    Pickled while multiprocessing starts the rank, when ``DupFd`` sends the descriptors along;
    unpickled in the rank, where they replace its descriptors 1 and 2 (and become ``None``).
    """

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return (_adopt_streams, (reduction.DupFd(1), reduction.DupFd(2)))


def _adopt_streams(stdout: Any, stderr: Any) -> None:
    for source, target in ((stdout, 1), (stderr, 2)):
        fd = source.detach()
        os.dup2(fd, target)
        os.close(fd)
