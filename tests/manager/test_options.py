"""The manager's configuration as values: ten parameters, one place per option, and a
``ConfigError`` naming where each keyword of the old layout went."""

from __future__ import annotations

import inspect
import typing
from pathlib import Path

import pytest
import torch

import dcp_safe
from dcp_safe import (
    Bounds,
    CheckpointManager,
    ConfigError,
    Resume,
    Retention,
    Runtime,
    SavePolicy,
    Topology,
)
from dcp_safe.adapters.node_local import writer_for
from dcp_safe.manager import BusyPolicy, StagingMode
from dcp_safe.manager.options import MOVED

OLD_VALUES: dict[str, object] = {
    "replicate_to": "/tmp/elsewhere",
    "executor": "thread",
    "deadline_s": 5.0,
    "keep_in_memory": True,
}


def test_the_manager_takes_at_most_ten_parameters() -> None:
    params = list(inspect.signature(CheckpointManager.__init__).parameters)
    assert params[0] == "self"
    assert len(params) - 1 <= 10, params


def test_every_option_object_in_the_signature_is_exported() -> None:
    hints = typing.get_type_hints(CheckpointManager.__init__)
    for name in ("policy", "retention", "bounds", "resume", "runtime"):
        (option, _none) = typing.get_args(hints[name])
        assert getattr(dcp_safe, option.__name__) is option
        assert option.__name__ in dcp_safe.__all__


@pytest.mark.parametrize("keyword", sorted(MOVED))
def test_a_keyword_of_the_old_layout_says_where_it_moved(keyword: str, tmp_path: Path) -> None:
    where = MOVED[keyword].format(name=keyword).split("(")[0]
    with pytest.raises(ConfigError, match=rf"{keyword}=\) moved to .*{where}"):
        CheckpointManager(tmp_path, **{keyword: OLD_VALUES.get(keyword, 1)})
    assert not list(tmp_path.iterdir())  # refused before anything was built


def test_an_unknown_keyword_is_a_type_error_as_in_python(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="keep_lst"):
        CheckpointManager(tmp_path, keep_lst=3)


def test_every_moved_keyword_is_a_field_of_the_object_it_names() -> None:
    objects = {
        "SavePolicy": SavePolicy,
        "Retention": Retention,
        "Bounds": Bounds,
        "Resume": Resume,
        "Runtime": Runtime,
    }
    for keyword, where in MOVED.items():
        if where.startswith("the root"):
            assert keyword in inspect.signature(Topology.of).parameters
            continue
        kind = where.split("=", 1)[1].split("(")[0]
        fields = inspect.signature(objects[kind]).parameters
        assert keyword in fields or (keyword, kind) == ("fallback", "SavePolicy"), keyword


def test_a_shorthand_replaces_one_field_of_its_object(tmp_path: Path) -> None:
    with CheckpointManager(
        tmp_path,
        keep_last=5,
        when_busy="skip",
        save_every=3,
        policy=SavePolicy(staging="overlap", every=7),
        retention=Retention(keep_every=10),
        runtime=Runtime(executor="thread"),
    ) as manager:
        assert manager.retention == Retention(keep_last=5, keep_every=10)
        assert manager.policy.every == manager.save_every == 3
        assert manager.when_busy is BusyPolicy.SKIP
        assert manager.staging is StagingMode.OVERLAP  # kept from the object


def test_the_root_may_be_a_topology(tmp_path: Path) -> None:
    topology = Topology.of(tmp_path / "local", replicate_to=tmp_path / "remote")
    with CheckpointManager(topology, runtime=Runtime(executor="thread")) as manager:
        assert manager.topology == topology
        assert manager.replicate_to is not None
        handle = manager.save(1, {"x": torch.ones(4)})
        assert handle is not None
        assert handle.replicated.result(timeout=120) is not None  # a replica: its manifest
        manager.wait()
    assert [c.name for c in dcp_safe.list_checkpoints(tmp_path / "remote")] == ["step_000000001"]


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: SavePolicy(every=0), "save_every"),
        (lambda: SavePolicy(when_busy="later"), "when_busy"),
        (lambda: SavePolicy(name_format="ckpt_{epoch}"), "name_format"),
        (lambda: SavePolicy(latency_objective_s=-1), "latency_objective_s"),
        (lambda: Retention(keep_last=-1), "KeepLast"),
        (lambda: Retention(keep_every=0), "KeepEvery"),
        (lambda: Retention(partial_grace_s=-1), "partial_grace_s"),  # refused when built, not
        (lambda: Retention(partial_grace_s=float("nan")), "partial_grace_s"),  # at the sweep
        (lambda: Bounds(deadline_s=float("inf")), "deadline_s"),
        (lambda: Bounds(wait_timeout_s=0), "wait_timeout_s"),
        (lambda: Resume(per_rank="rng"), "per_rank"),
        (lambda: Runtime(executor="fork"), "executor"),
    ],
)
def test_each_option_object_validates_its_fields(build: typing.Any, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        build()


def test_a_writer_with_another_topology_than_the_root_is_refused(tmp_path: Path) -> None:
    writer = writer_for(Topology.of(tmp_path / "a"))
    with pytest.raises(ConfigError, match="its own topology"):
        CheckpointManager(Topology.of(tmp_path / "b"), runtime=Runtime(writer=writer))
