"""The process group the checkpoint workers of several ranks save over (``executor="process"``).

Each rank's worker joins one gloo group with the others, as rank ``r`` of ``world_size`` (the
parent's own rank), and runs the save there exactly as the thread executor does over the
manager's groups: DCP's planning, the write, the commit by rank 0. The workers meet in the job's
own rendezvous store (the ``TCPStore`` behind the default group, which every rank already
reaches), under a key prefix of this manager and of the workers' *generation*.

Why generations, and why through the manager's votes: a gloo group with a dead member cannot be
used again, so when one rank's worker dies (or its group fails) every rank must start a new
worker and a new group, together. The rank that saw it marks :data:`~.groups.WORKERS` broken;
the next vote replaces it on every rank at once (:meth:`ManagerGroups.replace`), which moves the
generation everywhere alike, and each rank's next save starts a worker of the new generation.
Until then a rank does not start a worker of its own: it could only wait for peers that are not
coming. See docs/staging.md, "The process executor".
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch.distributed as dist

# torch re-exports these from its C extension without listing them: strict mypy rejects that.
from torch.distributed import PrefixStore, TCPStore  # type: ignore[attr-defined]

from dcp_safe.coordination.agreement import Agreement
from dcp_safe.coordination.group import peers_failed
from dcp_safe.coordination.groups import WORKERS, ManagerGroups
from dcp_safe.errors import ConfigError
from dcp_safe.torch_compat import default_store


@dataclass(frozen=True, kw_only=True)
class WorkerGroup:
    """Where one generation of workers meets: sent to each worker when it starts."""

    host: str  # the job's rendezvous store
    port: int
    prefix: str  # this manager's and this generation's keys there
    rank: int  # the worker's place in the group (its parent's, in the job)
    world_size: int
    timeout_s: float  # the group's deadline (the manager's deadline_s), joining included
    generation: int  # how many times the workers' group was replaced before this one


class WorkerGroups:
    """The parent's side: which generation this rank's worker belongs to, and its failures
    (the manager's ``groups`` votes replace a broken workers' group)."""

    def __init__(self, groups: ManagerGroups, token: str) -> None:
        self.groups = groups
        self.host, self.port = store_address(default_store())
        self.prefix = f"dcp_safe/manager/{token}/workers"

    def current(self) -> WorkerGroup:
        generation = self.groups.generation(WORKERS)
        return WorkerGroup(
            host=self.host,
            port=self.port,
            prefix=f"{self.prefix}/{generation}/",
            rank=self.groups.rank,
            world_size=self.groups.world_size,
            timeout_s=self.groups.deadline_s,
            generation=generation,
        )

    def broke(self) -> None:
        """This rank's worker died, or its group failed: every rank replaces it at the next
        vote."""
        self.groups.mark_broken(WORKERS)

    @classmethod
    def for_job(cls, agreement: Agreement) -> WorkerGroups | None:
        """The workers' groups of a manager's ranks (``None`` in a single process: a worker
        saves alone).

        Raises:
            ConfigError: the default group's store is not a ``TCPStore`` the workers can reach.
        """
        if agreement.groups is None:
            return None
        return cls(agreement.groups, agreement.token)


def store_address(store: Any) -> tuple[str, int]:
    """Where ``store`` (a ``TCPStore``, perhaps behind prefixes) is served.

    Raises:
        ConfigError: it is another kind of store: the workers could not reach it.
    """
    while isinstance(store, PrefixStore):
        store = store.underlying_store
    if not isinstance(store, TCPStore):
        raise ConfigError(
            "executor='process' with several ranks needs the default process group to"
            f" rendezvous through a TCPStore (env:// or tcp://, as torchrun does), not a"
            f" {type(store).__name__}: its workers meet there. Use executor='thread'"
        )
    return str(store.host), int(store.port)


def join(group: WorkerGroup) -> None:
    """In the worker: join ``group`` as the default process group, within its deadline.

    Raises:
        CommitError: not every rank's worker joined in time; ``failures`` names those missing.
    """
    timeout = timedelta(seconds=group.timeout_s)
    store = None
    try:
        store = PrefixStore(
            group.prefix, TCPStore(group.host, group.port, None, False, timeout=timeout)
        )
        store.set(f"arrived/{group.rank}", "1")
        dist.init_process_group(
            "gloo", store=store, rank=group.rank, world_size=group.world_size, timeout=timeout
        )
        # Gloo's mesh is not necessarily up on every rank when init returns.
        dist.barrier()
    except (RuntimeError, ValueError) as exc:  # the store's timeout is a DistError
        missing: list[int] = []  # none known (the store is gone too): every peer in doubt
        if store is not None:
            with contextlib.suppress(RuntimeError):
                missing = [r for r in range(group.world_size) if not store.check([f"arrived/{r}"])]
        raise peers_failed(
            f"the checkpoint workers could not form their group within {group.timeout_s:g} s"
            " (deadline_s): a rank's worker did not start or died; nothing was published (the"
            " previous checkpoint is intact) and the ranks start new workers at their next save",
            "its checkpoint worker did not join",
            exc,
            rank=group.rank,
            world_size=group.world_size,
            ranks=(r for r in missing if r != group.rank),
        ) from exc
