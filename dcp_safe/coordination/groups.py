"""The manager's three gloo groups (one per concurrent stream of collectives), replaced when broken.

A broken gloo group cannot be reused, so it is replaced at a point every rank reaches: the
policy group at the next vote, a save group after the next exchange of votes. See
docs/multirank.md, "A broken group is replaced, never reused".
"""

from __future__ import annotations

import threading
from typing import Any

import torch.distributed as dist

from dcp_safe.coordination.group import (
    checkpoint_group,
    discard_group,
    is_group_failure,
    peers_failed,
)
from dcp_safe.errors import CommitError

POLICY = "manager-policy"
FOREGROUND = "manager-sync"
BACKGROUND = "manager-async"
_ORDER = (POLICY, FOREGROUND, BACKGROUND)  # creation order, the same on every rank
# The process executor's workers form their group themselves (worker_group.py): this
# manager holds no group for it, only its health and how many times it was replaced.
WORKERS = "manager-workers"


class ManagerGroups:
    """The three groups of one manager in a multi-rank job, with their health; ``deadline_s`` is
    every group's timeout.

    Call order: construct on every rank at the same point (creating the groups is collective);
    :meth:`group` from any thread; :meth:`replace` only where every rank calls it with the same
    purposes (after a vote).
    """

    def __init__(self, deadline_s: float) -> None:
        self.deadline_s = deadline_s
        self._lock = threading.Lock()
        # Held for a whole replacement: another thread waits for the new group rather than
        # create one itself, which would be a collective no peer meets.
        self._replacing = threading.RLock()
        self._current: dict[str, Any] = {}  # purpose -> its group; only created here
        # purpose -> the group this rank saw failing (None: a group it does not hold, WORKERS)
        self._broken: dict[str, Any] = {}
        self.dead: CommitError | None = None
        self._generations: dict[str, int] = {}  # purpose -> times replaced
        # Every group holds every rank of the default group: a rank is the same in each.
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        for purpose in _ORDER:
            # A peer that does not join in time: every rank constructs the manager at the same
            # point; one slow to start misses it.
            self._current[purpose] = self._fresh(
                purpose,
                f"could not create the manager's {purpose} group: not every rank joined within"
                f" the {deadline_s:g} s deadline (every rank constructs CheckpointManager at the"
                " same point; a rank slow to start needs a longer deadline_s); restart the job",
                f"did not join the {purpose} group",
            )

    def group(self, purpose: str) -> Any:
        """The current group for ``purpose`` (replacing a broken policy group first).

        Raises:
            CommitError: a replacement failed earlier (a peer is gone), or fails now.
        """
        with self._replacing:
            if self.dead is not None:
                raise self.dead
            with self._lock:
                broken = purpose == POLICY and POLICY in self._broken
            if broken:
                self.replace((POLICY,))
            with self._lock:
                return self._current[purpose]

    def release(self) -> None:
        """Drop this manager's references to its groups (at close); any later use raises.

        A gloo group still referenced when the interpreter finalizes is destroyed there, where its
        threads can abort the process (``terminate called without an active exception``) after
        the job's own ``destroy_process_group()``. A thread still inside a collective keeps the
        group it holds until it returns.
        """
        with self._lock:  # not _replacing: a replacement stuck past a drain timeout holds it
            self._current.clear()
            self._broken.clear()
            if self.dead is None:
                self.dead = CommitError("the CheckpointManager is closed: its groups are released")

    def collectives(self, purpose: str) -> dict[str, Any]:
        return {"process_group": self.group(purpose), "deadline_s": self.deadline_s}

    def saw_failure(self, purpose: str, error: BaseException | None, group: Any) -> bool:
        """Mark ``purpose``'s group broken if ``error`` is a failed collective on ``group``
        (not on a group replaced since); whether it was marked."""
        if not is_group_failure(error):
            return False
        with self._lock:
            if group is not self._current.get(purpose):
                return False
            self._broken.setdefault(purpose, group)
        return True

    def mark_broken(self, purpose: str) -> None:
        """A group this manager does not hold broke (:data:`WORKERS`): the next vote replaces
        it on every rank."""
        with self._lock:
            self._broken.setdefault(purpose, None)

    def generation(self, purpose: str) -> int:
        """How many times ``purpose``'s group was replaced: the same on every rank between
        votes."""
        with self._lock:
            return self._generations.get(purpose, 0)

    def broken(self) -> tuple[str, ...]:
        """The save groups this rank saw fail (what its next vote reports)."""
        with self._lock:
            return tuple(p for p in (*_ORDER, WORKERS) if p in self._broken and p != POLICY)

    def replace(self, purposes: tuple[str, ...]) -> None:
        """Create fresh groups for ``purposes`` (every rank calls this with the same ones).

        A group only a peer saw fail is forgotten, not destroyed: this rank's upload thread may
        still be inside a collective on it.

        Raises:
            CommitError: a group could not be created within the deadline; the manager is dead.
        """
        with self._replacing:
            for purpose in (p for p in (*_ORDER, WORKERS) if p in purposes):
                with self._lock:
                    # A failure seen now is on a stale group: the current one goes too.
                    old, current = self._broken.pop(purpose, None), self._current.pop(purpose, None)
                    self._generations[purpose] = self._generations.get(purpose, 0) + 1
                if purpose == WORKERS:
                    continue  # the workers form their next group themselves
                stale = old if old is not None else current
                if stale is not None:  # destroyed where this rank saw it fail itself
                    discard_group(stale, destroy=old is not None)
                fresh = self._fresh(
                    purpose,
                    f"the manager's {purpose} group broke and a new one could not be made: a peer"
                    f" died or did not respond within the {self.deadline_s:g} s deadline; restart"
                    " the job (the previous checkpoint is intact)",
                    f"did not join the new {purpose} group",
                )
                with self._lock:
                    self._current[purpose] = fresh

    def _fresh(self, purpose: str, message: str, why: str) -> Any:
        """A new group for ``purpose``; where a peer does not join, the manager is dead: a
        CommitError with ``message``, each peer failed with ``why``."""
        try:
            return checkpoint_group(self.deadline_s, purpose=purpose)
        except (RuntimeError, ValueError) as exc:  # gloo's connect timeout, the store's (DistError)
            self.dead = peers_failed(message, why, exc, rank=self.rank, world_size=self.world_size)
            raise self.dead from exc
