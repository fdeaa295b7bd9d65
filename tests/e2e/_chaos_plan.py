"""What a chaos run does, drawn from its seed; and the state it saves, a function of the step.

:func:`scenario_for` turns a seed into a :class:`Scenario`: a variant (world size, the roots,
``when_busy``, ``staging``, deadlines, the pace of the training loop) and one or two
:class:`Fault` values, each struck at a seeded point (a step, or a delay after the ranks' loops
started). The same seed always gives the same scenario, on any machine.

The saved state is a function of the step alone (:func:`global_state`), sharded over whatever
ranks there are (:func:`sharded_state`, built locally: no collective, so a dead peer can never
block it), so what any checkpoint must hold is computable on any world size.

The fault kinds (:data:`FAULT_KINDS`), by what they do to the job:

* rank loss (:data:`RANK_LOSS`): ``kill_rank``/``kill_all`` (SIGKILL from inside a write),
  ``kill_timer`` (the parent SIGKILLs one or every rank after a delay), ``stop_rank``
  (SIGSTOP from inside a write: a hung peer, past every deadline);
* benign (:data:`BENIGN`: nothing dies and every deadline can be met, so no save may fail):
  ``slow_rank`` (a sleep before each item on one rank), ``slow_follow_up`` (rank 0's storage
  deletes, hence its retention, take longer than ``deadline_s``), ``s3_error`` (a few 503s),
  ``s3_delay`` (a few held replies);
* storage failures: ``fsize`` (RLIMIT_FSIZE on one rank: EFBIG, a full disk),
  ``storage_error`` (``faulty_fs`` fails one rank's writes with EIO/ENOSPC), ``s3_outage``
  (every S3 request fails for a window), ``s3_history_error`` (the history's PUTs refused).

About half the seeds (:data:`DEFAULT_PATH_SHARE`, drawn from a generator of their own, so the
other seeds keep the scenarios they always drew) run **the default path**: managers built with
no ``writer=`` or ``stager=``, so ``executor="auto"`` takes the checkpoint worker process of
each rank, as a user's job does. A writer of ours cannot travel there, so every fault of those
runs comes from outside the rank (:data:`DEFAULT_FAULTS_BY_ROOTS`): the parent SIGKILLs or
SIGSTOPs a rank (``kill_timer``, ``kill_all``, ``stop_timer``) or its checkpoint worker
(``kill_worker``, ``stop_worker``), kills the worker (``kill_worker_startup``, once or twice)
or its rank (``kill_rank_startup``) the moment the worker process appears, before it could
import anything; the rank sets RLIMIT_FSIZE on itself and lifts it two steps later (``fsize``:
from step 1, before its worker starts, the limit is inherited); and the S3 faults as above.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

__all__ = [
    "BENIGN",
    "BUSY_POLICIES",
    "DEFAULT_FAULTS_BY_ROOTS",
    "DEFAULT_PATH_SHARE",
    "FAULT_KINDS",
    "RANK_LOSS",
    "ROOT_KINDS",
    "STAGING_MODES",
    "STARTUP_KINDS",
    "RESTART_SAVES",
    "STEPS",
    "WORKER_LOSS",
    "Fault",
    "Scenario",
    "blank_full",
    "blank_sharded",
    "differences",
    "global_state",
    "local_part",
    "name_of",
    "scenario_for",
    "sharded_state",
    "step_of",
    "update_in_place",
]

ROOT_KINDS = ("local", "replica", "node_local")
BUSY_POLICIES = ("skip", "wait", "coalesce")
STAGING_MODES = ("snapshot", "overlap")
RANK_LOSS = frozenset(
    {"kill_rank", "kill_all", "kill_timer", "stop_rank", "stop_timer", "kill_rank_startup"}
)
# The rank lives on: its save fails, and the job must save again.
WORKER_LOSS = frozenset({"kill_worker", "stop_worker", "kill_worker_startup"})
# Struck by the parent the moment the victim's checkpoint worker process appears.
STARTUP_KINDS = frozenset({"kill_worker_startup", "kill_rank_startup"})
BENIGN = frozenset({"slow_rank", "slow_follow_up", "s3_error", "s3_delay"})
_LOCAL_FAULTS = (
    "kill_rank",
    "kill_all",
    "kill_timer",
    "stop_rank",
    "slow_rank",
    "slow_follow_up",
    "fsize",
)
_S3_FAULTS = ("s3_error", "s3_delay", "s3_outage")
FAULTS_BY_ROOTS: dict[str, tuple[str, ...]] = {
    "local": (*_LOCAL_FAULTS, "storage_error"),
    "replica": (*_LOCAL_FAULTS, "storage_error", *_S3_FAULTS),
    "node_local": (*_LOCAL_FAULTS, *_S3_FAULTS, "s3_history_error"),
}
_OUTSIDE = (
    "kill_timer",
    "kill_all",
    "stop_timer",
    "kill_worker",
    "stop_worker",
    "kill_worker_startup",
    "kill_rank_startup",
    "fsize",
)
DEFAULT_FAULTS_BY_ROOTS: dict[str, tuple[str, ...]] = {
    "local": _OUTSIDE,
    "replica": (*_OUTSIDE, *_S3_FAULTS),
    "node_local": (*_OUTSIDE, *_S3_FAULTS, "s3_history_error"),
}
DEFAULT_PATH_SHARE = 0.6  # of the seeds; "at least half the runs" with room for chance
FAULT_KINDS = tuple(
    sorted(
        {
            kind
            for table in (FAULTS_BY_ROOTS, DEFAULT_FAULTS_BY_ROOTS)
            for kinds in table.values()
            for kind in kinds
        }
    )
)

STEPS = 6  # save requests in the faulty phase
RESTART_SAVES = 2  # saves of the restarted job
_ROWS, _COLS = 16, 8

# -- the plan of one run ------------------------------------------------------------------------


@dataclass(frozen=True)
class Fault:
    """One fault of a run.

    Attributes:
        kind: one of :data:`FAULT_KINDS`.
        rank: the rank it strikes (-1: every rank).
        step: in-rank faults strike the first save at or after this step.
        at_s: parent-timed faults strike this long after the ranks' loops started.
        seconds: a slow fault's delay per item or per delete, an S3 delay, an outage window.
        count: how many S3 requests an ``s3_error``/``s3_delay`` hits; ``storage_error``: the
            victim's write operation that fails first; ``kill_worker_startup``: how many
            start-ups in a row are killed; ``fsize``: the step whose save the limit is lifted
            before (0: never).
        error: ``storage_error``: ``"eio"`` or ``"enospc"``.
        persistent: ``storage_error``: every write from then on fails too.
    """

    kind: str
    rank: int = 0
    step: int = 0
    at_s: float = 0.0
    seconds: float = 0.0
    count: int = 0
    error: str = ""
    persistent: bool = False

    @property
    def label(self) -> str:
        who = "all" if self.rank < 0 else f"r{self.rank}"
        when = f"@{self.at_s:.1f}s" if self.at_s else f"@s{self.step}" if self.step else ""
        if self.kind == "fsize" and self.count:
            when += f"-s{self.count}"  # lifted then
        elif self.kind == "kill_worker_startup" and self.count > 1:
            when += f"x{self.count}"
        return f"{self.kind}({who}{when})"

    @property
    def from_parent(self) -> bool:
        """Struck by the parent (a timer, or the victim's worker appearing), not in the rank."""
        return bool(self.at_s) or self.kind in STARTUP_KINDS


@dataclass(frozen=True)
class Scenario:
    """Everything a run does, drawn from its seed by :func:`scenario_for`."""

    seed: int
    world_size: int
    restart_world_size: int
    roots: str
    when_busy: str
    staging: str
    faults: tuple[Fault, ...]
    deadline_s: float
    wait_timeout_s: float
    step_s: float
    steps: int = STEPS
    default_path: bool = False  # managers built with no writer= (the checkpoint worker)

    @property
    def variant(self) -> str:
        """The variant's name: ``default:`` for the default path, roots, policy, staging,
        world sizes."""
        return (
            f"{'default:' if self.default_path else ''}{self.roots}/{self.when_busy}"
            f"/{self.staging}/ws{self.world_size}->{self.restart_world_size}"
        )

    @property
    def label(self) -> str:
        return f"seed {self.seed}: {self.variant} " + " + ".join(f.label for f in self.faults)

    @property
    def benign(self) -> bool:
        return all(f.kind in BENIGN for f in self.faults)

    @property
    def loses_a_rank(self) -> bool:
        return any(f.kind in RANK_LOSS for f in self.faults)

    @property
    def faulty_root(self) -> bool:
        """The local root is opened as ``faulty://`` (a ``storage_error`` run)."""
        return any(f.kind == "storage_error" for f in self.faults)

    def fault(self, kind: str) -> Fault | None:
        return next((f for f in self.faults if f.kind == kind), None)

    def bound_s(self, world_size: int) -> float:
        """How long one phase may take before it counts as a hang (spawning included)."""
        slow = sum(f.seconds for f in self.faults if f.kind in ("slow_follow_up", "s3_outage"))
        per_step = self.step_s + self.wait_timeout_s + 2 * self.deadline_s + slow
        return 60.0 + 15.0 * world_size + self.steps * per_step + 6 * self.deadline_s


def scenario_for(
    seed: int, *, long_mode: bool = False, default_path: bool | None = None
) -> Scenario:
    """The scenario of ``seed``: the same seed always gives the same scenario.

    The short mode draws world size 2 and restarts on 1 or 2 ranks; the long mode also draws 4.
    ``default_path`` forces the path (``None``: drawn); forced to False, a seed draws the
    scenario it drew before the default path was added.
    """
    rng = random.Random(seed)
    world_size = rng.choice((2, 4)) if long_mode else 2
    restart_world_size = rng.choice((1, 2, 4) if long_mode else (1, 2))
    roots = rng.choice(ROOT_KINDS)
    when_busy = rng.choice(BUSY_POLICIES)
    staging = rng.choice(STAGING_MODES)
    deadline_s = rng.choice((3.0, 4.0, 5.0))
    scenario = dict(
        seed=seed,
        world_size=world_size,
        restart_world_size=restart_world_size,
        roots=roots,
        when_busy=when_busy,
        staging=staging,
        deadline_s=deadline_s,
        wait_timeout_s=rng.choice((2.0, 8.0)),
        step_s=rng.choice((0.1, 0.3, 0.5)),
    )
    allowed = FAULTS_BY_ROOTS[roots]
    first = _draw_fault(rng, rng.choice(allowed), world_size, deadline_s)
    faults = [first]
    if rng.random() < 0.35:
        others = [k for k in allowed if k != first.kind and k not in RANK_LOSS]
        if first.kind in ("storage_error", "fsize"):
            others = [k for k in others if k not in ("storage_error", "fsize")]
        faults.append(_draw_fault(rng, rng.choice(others), world_size, deadline_s))
    # A generator of its own: a seed drawn for the writer's path keeps its old scenario.
    outside = random.Random(f"default path {seed}")
    drawn = outside.random() < DEFAULT_PATH_SHARE
    if drawn if default_path is None else default_path:
        allowed = DEFAULT_FAULTS_BY_ROOTS[roots]
        first = _draw_outside(outside, outside.choice(allowed), world_size, deadline_s)
        faults = [first]
        if outside.random() < 0.35:
            others = [k for k in allowed if k != first.kind and k not in RANK_LOSS]
            if first.kind in WORKER_LOSS:  # one worker fault at a time: each names its cause
                others = [k for k in others if k not in WORKER_LOSS]
            kind = outside.choice(others)
            faults.append(_draw_outside(outside, kind, world_size, deadline_s))
        scenario["default_path"] = True
    return Scenario(faults=tuple(faults), **scenario)  # type: ignore[arg-type]


def _draw_outside(rng: random.Random, kind: str, world_size: int, deadline_s: float) -> Fault:
    """A fault of the default path: struck from outside the rank (the rank's own RLIMIT_FSIZE
    aside, which it lifts two steps later)."""
    victim = rng.randrange(world_size)
    if kind in ("kill_timer", "stop_timer", "kill_worker", "stop_worker", "kill_all"):
        at_s = round(rng.uniform(0.3, 3.0), 1)
        return Fault(kind, rank=-1 if kind == "kill_all" else victim, at_s=at_s)
    if kind == "kill_worker_startup":
        return Fault(kind, rank=victim, count=rng.choice((1, 2)))
    if kind == "kill_rank_startup":
        return Fault(kind, rank=victim)
    if kind == "fsize":
        step = rng.randint(1, 3)
        return Fault(kind, rank=victim, step=step, count=step + 2)
    return _draw_fault(rng, kind, world_size, deadline_s)


def _draw_fault(rng: random.Random, kind: str, world_size: int, deadline_s: float) -> Fault:
    victim = rng.randrange(world_size)
    step = rng.randint(2, STEPS - 1)
    if kind in ("kill_rank", "stop_rank", "fsize"):
        return Fault(kind, rank=victim, step=step)
    if kind == "kill_all":
        return Fault(kind, rank=-1, step=step)
    if kind == "kill_timer":
        return Fault(kind, rank=rng.choice((victim, -1)), at_s=round(rng.uniform(0.5, 3.0), 1))
    if kind == "slow_rank":  # a few items per save: their sum stays well under deadline_s
        return Fault(kind, rank=victim, step=1, seconds=rng.choice((0.1, 0.2, 0.3)))
    if kind == "slow_follow_up":
        return Fault(kind, rank=0, step=1, seconds=deadline_s + rng.choice((1.0, 2.0)))
    if kind == "storage_error":
        return Fault(
            kind,
            rank=victim,
            count=rng.randint(3, 30),
            error=rng.choice(("eio", "enospc")),
            persistent=rng.random() < 0.5,
        )
    if kind == "s3_error":
        return Fault(kind, rank=-1, at_s=round(rng.uniform(0.2, 2.0), 1), count=rng.randint(1, 3))
    if kind == "s3_delay":
        at_s = round(rng.uniform(0.2, 2.0), 1)
        return Fault(kind, rank=-1, at_s=at_s, seconds=rng.choice((0.5, 1.0)), count=3)
    if kind == "s3_outage":
        at_s = round(rng.uniform(0.5, 2.5), 1)
        return Fault(kind, rank=-1, at_s=at_s, seconds=rng.choice((2.0, 4.0, 6.0)))
    if kind == "s3_history_error":
        return Fault(kind, rank=0, at_s=round(rng.uniform(0.5, 3.0), 1))
    raise ValueError(f"unknown fault kind {kind!r}")


# -- the state: a function of the step, sharded over any number of ranks ------------------------


def global_state(step: int) -> dict[str, Any]:
    """The whole state at ``step``, as one process holds it."""
    gen = torch.Generator().manual_seed(1000 + step)
    return {
        "w_rows": torch.randn(_ROWS, _COLS, generator=gen),
        "w_cols": torch.randn(_COLS, _ROWS, generator=gen),
        "bias": torch.randn(_ROWS, generator=gen),
        "plain": torch.full((4,), float(step)),
        "meta": {"step": step},
    }


_PLACEMENTS = {"w_rows": Shard(0), "w_cols": Shard(1), "bias": Replicate()}


def local_part(name: str, full: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    placement = _PLACEMENTS[name]
    if isinstance(placement, Shard):
        return torch.chunk(full, world_size, dim=placement.dim)[rank].clone()
    return full.clone()


def sharded_state(mesh: DeviceMesh, step: int) -> dict[str, Any]:
    """``global_state(step)`` as DTensors over ``mesh``, built locally (no collective: a dead
    peer must never block building it)."""
    rank, world_size = mesh.get_local_rank(), mesh.size()
    full = global_state(step)
    state: dict[str, Any] = {"plain": full["plain"], "meta": dict(full["meta"])}
    for name in _PLACEMENTS:
        local = local_part(name, full[name], rank, world_size)
        state[name] = DTensor.from_local(
            local,
            mesh,
            [_PLACEMENTS[name]],
            run_check=False,
            shape=full[name].shape,
            stride=full[name].stride(),
        )
    return state


def update_in_place(state: dict[str, Any], step: int, rank: int, world_size: int) -> None:
    """A training step: the state becomes ``global_state(step)``, updated in place."""
    full = global_state(step)
    for name in _PLACEMENTS:
        state[name].to_local().copy_(local_part(name, full[name], rank, world_size))
    state["plain"].copy_(full["plain"])
    state["meta"]["step"] = step


def differences(state: dict[str, Any], step: int, rank: int, world_size: int) -> list[str]:
    """The keys of ``state`` that do not hold exactly this rank's part of ``global_state(step)``."""
    full = global_state(step)
    wrong = [
        name
        for name in _PLACEMENTS
        if not torch.equal(state[name].to_local(), local_part(name, full[name], rank, world_size))
    ]
    if not torch.equal(state["plain"], full["plain"]):
        wrong.append("plain")
    if state["meta"] != full["meta"]:
        wrong.append("meta")
    return wrong


def blank_sharded(mesh: DeviceMesh) -> dict[str, Any]:
    """A restore target: the state's structure on ``mesh``, every value wrong."""
    target = sharded_state(mesh, 0)
    for name in _PLACEMENTS:
        target[name].to_local().fill_(-1.0)
    target["plain"].fill_(-1.0)
    target["meta"]["step"] = -1
    return target


def blank_full() -> dict[str, Any]:
    full = global_state(0)
    blank: dict[str, Any] = {k: torch.zeros_like(v) for k, v in full.items() if k != "meta"}
    blank["meta"] = {"step": -1}
    return blank


def step_of(name: str) -> int:
    return int(name.rsplit("_", 1)[1])


def name_of(step: int) -> str:
    return f"step_{step:09d}"  # the manager's default name_format
