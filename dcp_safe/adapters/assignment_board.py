"""A save without collectives: how the ranks agree on it, and who writes which entry.

With ``use_collectives=False`` DCP plans on every rank alone and never hands rank 0's plan to
the others, so the save id rank 0 claims reaches them through storage: a small file beside the
checkpoints (:func:`~dcp_safe.layout.assignment_file_name`), named by a key that every rank of
one save computes alike (:func:`save_key`) and that no earlier save of the same name shares:

    key = <run id>-<attempt>-<saves of this name begun through this writer>

(run id and attempt as :mod:`dcp_safe.commit.fencing` reads them, ``none`` without an
attempt). The assumption: every rank's writer is made the same way and sees the same sequence of
saves. Rank 0 removes the file when its save ends, committed or not, so only a process killed
mid-save leaves one behind, and its job restarts with a higher attempt (torchrun sets
``TORCHELASTIC_RESTART_COUNT``). Without an attempt, a crashed run's leftover could be read by the
next run's first save of that name: the ranks then disagree on the save id, the save fails typed
(rank 0 sees a rank never report) and commits nothing. docs/multirank.md, "Saves without
collectives".

With a signing key, every post carries an HMAC under it
(:func:`~dcp_safe.manifest.signing.part_mac`, bound to the key of the save); the other ranks
take only a post it authenticates, so a writer of the root without the key cannot hand them
another save id or other plain entries (nor skip their divergence check): at most it delays
them, to the deadline.

Who writes what, without DCP's plan exchange (which keeps one copy of each replicated entry):
a plain entry (a tensor or object that is not sharded) is written by rank 0 when rank 0 holds
it, else by each rank that holds it; the file carries rank 0's plain keys and fingerprints, so
the others skip those, and refuse a copy that differs (:class:`DivergentStateError`, unless
``check_divergence`` is off). A DTensor chunk is written by the ranks at coordinate 0 of each
mesh dimension it is replicated over.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType
from torch.distributed.tensor import DTensor

from dcp_safe import layout
from dcp_safe.adapters.planners import FingerprintedPlan
from dcp_safe.backends.backend import Backend
from dcp_safe.commit.fencing import DEFAULT_RUN_ID, RUN_ID_ENV, Attempt
from dcp_safe.coordination.markers import poll
from dcp_safe.errors import CommitError, DcpSafeError
from dcp_safe.manifest.limits import MANIFEST_MAX_BYTES
from dcp_safe.manifest.signing import part_mac, part_mac_matches

__all__ = ["Assignment", "AssignmentBoard", "items_to_write", "leave_to_rank0", "plain_keys"]


_FORMAT = "dcp_safe/assignment"
_PLAIN = (WriteItemType.TENSOR, WriteItemType.BYTE_IO)


@dataclass(frozen=True)
class Assignment:
    """What every rank of a save needs to know of it (the plan's ``storage_data``).

    Attributes:
        skip: plain keys this rank holds and leaves to rank 0 (a save without collectives).
    """

    rank: int
    world_size: int
    save_id: str
    work_dir: str
    skip: frozenset[str] = frozenset()


def save_key(attempt: Attempt | None, count: int) -> str:
    """The key of the ``count``-th save of a name through a writer of ``attempt``."""
    if attempt is None:
        return f"{os.environ.get(RUN_ID_ENV) or DEFAULT_RUN_ID}-none-{count}"
    return f"{attempt.run_id}-{attempt.number}-{count}"


class AssignmentBoard:
    """The assignment file of one save: rank 0 posts, the others take, rank 0 clears."""

    def __init__(
        self,
        backend: Backend,
        name: str,
        key: str,
        *,
        deadline_s: float,
        signing_key: bytes | None = None,
    ) -> None:
        self.backend = backend
        self.path = layout.assignment_file_name(name, key)
        self.deadline_s = deadline_s
        self._key, self._signing_key = key, signing_key

    def post(self, save_id: str, world_size: int, plain: Mapping[str, int | None]) -> None:
        """Tell the other ranks the save id, and which plain entries rank 0 writes."""
        self._write({"save_id": save_id, "world_size": world_size, "plain": sorted(plain.items())})

    def post_failure(self, exc: BaseException) -> None:
        """Tell the other ranks rank 0 will not save (best effort): they fail at once."""
        with contextlib.suppress(OSError, DcpSafeError):
            self._write({"error": f"{type(exc).__name__}: {exc}"[:2000]})

    def take(self, world_size: int) -> tuple[str, dict[str, int | None]]:
        """Rank 0's save id and plain entries, once posted.

        Raises:
            CommitError: rank 0 failed, posted for another world size, or posted nothing
                within the deadline (naming rank 0).
        """
        found = poll(self._read, self.deadline_s)
        if found is None:
            raise CommitError(
                f"no save id from rank 0 within {self.deadline_s} s (a save without"
                " collectives waits for it on storage; signed, only for one the key"
                " authenticates)",
                {0: f"nothing at {self.backend.full_path(self.path)}"},
            )
        if "error" in found:
            raise CommitError("rank 0 could not start the save", {0: str(found["error"])})
        save_id, world, plain = found.get("save_id"), found.get("world_size"), found.get("plain")
        if not layout.is_save_id(save_id) or world != world_size or not isinstance(plain, list):
            raise CommitError(
                "rank 0's assignment does not fit this save",
                {0: f"save id {str(save_id)[:64]!r}, world size {world} (here {world_size})"},
            )
        assert isinstance(save_id, str)
        return save_id, {str(key): fingerprint for key, fingerprint in plain}

    def clear(self) -> None:
        """Remove the file (best effort): the save is over."""
        with contextlib.suppress(OSError, DcpSafeError):
            self.backend.remove_file(self.path)

    def _write(self, body: dict[str, Any]) -> None:
        body = {"format": _FORMAT, **body}
        if self._signing_key is not None:
            body["mac"] = part_mac(self._signing_key, self._key, 0, body)
        self.backend.write_bytes(self.path, json.dumps(body).encode())

    def _read(self) -> dict[str, Any] | None:
        try:
            raw = self.backend.read_small(self.path, MANIFEST_MAX_BYTES)
            found = json.loads(raw)
        except (FileNotFoundError, ValueError):
            return None  # not there yet (or half written where a write is not atomic)
        if not isinstance(found, dict) or found.get("format") != _FORMAT:
            return None
        mac = found.pop("mac", None)
        key = self._signing_key
        if key is not None and not part_mac_matches(key, self._key, 0, found, mac):
            return None  # not rank 0's: wait on for rank 0's post, which replaces it
        return found


def plain_keys(plan: SavePlan) -> dict[str, int | None]:
    """A local plan's plain entries, each with its fingerprint (None where not taken)."""
    fingerprints = plan.fingerprints if isinstance(plan, FingerprintedPlan) else {}
    return {
        item.index.fqn: fingerprints.get(item.index.fqn)
        for item in plan.items
        if item.type in _PLAIN
    }


def leave_to_rank0(
    own: Mapping[str, int | None], taken: Mapping[str, int | None], rank: int
) -> tuple[frozenset[str], dict[str, list[list[int]]]]:
    """The plain keys this rank leaves to rank 0, and those whose two copies differ (as
    :class:`~dcp_safe.errors.DivergentStateError` names them)."""
    shared = own.keys() & taken.keys()
    divergent = {
        key: [[0], [rank]]
        for key in sorted(shared)
        if own[key] is not None and taken[key] is not None and own[key] != taken[key]
    }
    return frozenset(shared), divergent


def items_to_write(
    items: Sequence[WriteItem], assignment: Assignment, planner: SavePlanner
) -> list[WriteItem]:
    """The items of a save without collectives that this rank writes (the module's rule)."""
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
    return all(
        coordinate[dim] == 0
        for dim, placement in enumerate(value.placements)
        if placement.is_replicate()
    )
