"""Whole saves and loads on an S3 root (moto): the marker-publish path end to end."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from s3_fixtures import BLOCK_BYTES
from support import assert_state_equal, blank_like, make_state
from torch.distributed.checkpoint import DefaultSavePlanner

import dcp_safe
from dcp_safe import (
    CheckpointCorruptError,
    CommitError,
    SafeStorageReader,
    SafeStorageWriter,
    StorageError,
    WriterOptions,
    layout,
)
from dcp_safe.errors import CheckpointExistsError
from dcp_safe.manifest.schema import Manifest
from dcp_safe.testing.s3 import LocalS3

pytestmark = pytest.mark.s3

Options = dict[str, Any]


def _save(root: str, opts: Options, name: str, state: dict[str, Any], **kw: Any) -> None:
    writer = SafeStorageWriter(root, storage_options=opts, **kw)
    dcp_safe.save(state, checkpoint_id=name, storage_writer=writer)


def _load(root: str, opts: Options, name: str, like: dict[str, Any]) -> dict[str, Any]:
    target = blank_like(like)
    reader = SafeStorageReader(root, storage_options=opts)
    dcp_safe.load(target, checkpoint_id=name, storage_reader=reader)
    return target


def _key_prefix(root: str) -> str:
    return root.removeprefix("s3://").split("/", 1)[1] + "/"


@pytest.mark.parametrize("compression", ["none", "zstd"])
def test_round_trip_on_s3(s3_root: str, s3_options: Options, compression: str) -> None:
    state = make_state(3)
    options = WriterOptions(compression=compression, thread_count=2)
    _save(s3_root, s3_options, "step_1", state, options=options)
    assert_state_equal(_load(s3_root, s3_options, "step_1", state), state)
    assert_state_equal(_load(s3_root, s3_options, "latest", state), state)


def test_list_and_verify_on_s3(s3_root: str, s3_options: Options) -> None:
    _save(s3_root, s3_options, "step_1", make_state(1), step=1)
    zstd = WriterOptions(compression="zstd")
    _save(s3_root, s3_options, "step_2", make_state(2), step=2, options=zstd)
    listed = dcp_safe.list_checkpoints(s3_root, storage_options=s3_options)
    assert [(c.name, c.step) for c in listed] == [("step_1", 1), ("step_2", 2)]
    assert listed[0].path == f"{s3_root}/step_1"
    report = dcp_safe.verify_checkpoint(s3_root, "latest", storage_options=s3_options)
    assert report.name == "step_2" and report.items_checked > 0 and report.bytes_read > 0


def test_a_flipped_byte_in_a_shard_object_is_detected(
    s3: LocalS3,
    s3_bucket: str,
    s3_root: str,
    s3_options: Options,
) -> None:
    state = make_state(4)
    _save(s3_root, s3_options, "step_1", state)
    prefix = f"{_key_prefix(s3_root)}step_1/"
    client = s3.client()
    manifest = Manifest.from_json(
        client.get_object(Bucket=s3_bucket, Key=prefix + layout.MANIFEST)["Body"].read(), "m"
    )
    # An item load reads (DCP plans no read for a zero-element tensor).
    item = next(i for i in manifest.items if i.fqn == "f32")
    key = prefix + item.file
    data = bytearray(client.get_object(Bucket=s3_bucket, Key=key)["Body"].read())
    data[item.start + item.length // 2] ^= 0x10
    client.put_object(Bucket=s3_bucket, Key=key, Body=bytes(data))
    with pytest.raises(CheckpointCorruptError, match="distcp"):
        dcp_safe.verify_checkpoint(s3_root, "step_1", storage_options=s3_options)
    with pytest.raises(CheckpointCorruptError):
        _load(s3_root, s3_options, "step_1", state)


def test_saving_to_a_committed_name_is_refused(s3_root: str, s3_options: Options) -> None:
    state = make_state(5)
    _save(s3_root, s3_options, "step_1", state)
    with pytest.raises(CheckpointExistsError):
        _save(s3_root, s3_options, "step_1", make_state(6))
    assert_state_equal(_load(s3_root, s3_options, "step_1", state), state)


class _FailAfter(DefaultSavePlanner):
    """Resolves ``good`` items, then fails: the failure lands mid-shard."""

    def __init__(self, good: int) -> None:
        super().__init__()
        self.good = good

    def resolve_data(self, write_item: Any) -> Any:
        if self.good == 0:
            raise RuntimeError("serializer failed mid-shard (injected)")
        self.good -= 1
        return super().resolve_data(write_item)


@pytest.mark.parametrize("big", [False, True], ids=["one-shot-put", "multipart"])
def test_failure_mid_shard_leaves_no_trace(
    s3: LocalS3,
    s3_bucket: str,
    s3_root: str,
    s3_options: Options,
    big: bool,
) -> None:
    elements = (BLOCK_BYTES + 2**20) // 4 if big else 100
    state = {f"t{i}": torch.full((elements,), float(i)) for i in range(3)}
    writer = SafeStorageWriter(s3_root, storage_options=s3_options)
    with pytest.raises(CommitError, match="mid-shard"):
        dcp_safe.save(state, checkpoint_id="step_1", storage_writer=writer, planner=_FailAfter(2))
    assert dcp_safe.list_checkpoints(s3_root, storage_options=s3_options) == []
    assert s3.keys(s3_bucket, _key_prefix(s3_root)) == []  # no shard, no _COMMITTED
    assert s3.open_uploads(s3_bucket) == []
    _save(s3_root, s3_options, "step_1", state)  # nothing left behind blocks the retry
    assert [c.name for c in dcp_safe.list_checkpoints(s3_root, storage_options=s3_options)] == [
        "step_1"
    ]


class _LateWriter(SafeStorageWriter):
    """A writer whose committed-name check ran before another save committed the name (two
    jobs, or a retry racing its own first attempt)."""

    def _refuse_committed(self, name: str) -> None:
        return None


def test_a_losing_concurrent_save_never_damages_the_committed_one(
    s3_root: str,
    s3_options: Options,
) -> None:
    winner, loser = make_state(7), make_state(8)
    _save(s3_root, s3_options, "step_1", winner)
    with pytest.raises(CheckpointExistsError):
        late = _LateWriter(s3_root, storage_options=s3_options)
        dcp_safe.save(loser, checkpoint_id="step_1", storage_writer=late)
    dcp_safe.verify_checkpoint(s3_root, "step_1", storage_options=s3_options)
    assert_state_equal(_load(s3_root, s3_options, "step_1", winner), winner)


def test_two_publishers_racing_for_a_name_give_one_checkpoint_and_a_clear_error(
    s3_root: str,
    s3_options: Options,
) -> None:
    import threading

    states = {0: make_state(20), 1: make_state(21)}
    outcomes: dict[int, BaseException | None] = {}
    start = threading.Barrier(2)

    def publish(who: int) -> None:
        start.wait()
        try:
            _save(s3_root, s3_options, "step_1", states[who])
            outcomes[who] = None
        except BaseException as exc:
            outcomes[who] = exc

    threads = [threading.Thread(target=publish, args=(who,)) for who in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    winners = [who for who, error in outcomes.items() if error is None]
    losers = [error for error in outcomes.values() if error is not None]
    assert len(winners) == 1 and len(losers) == 1
    assert isinstance(losers[0], CheckpointExistsError)
    dcp_safe.verify_checkpoint(s3_root, "step_1", storage_options=s3_options)
    winner = states[winners[0]]
    assert_state_equal(_load(s3_root, s3_options, "step_1", winner), winner)


def test_missing_credentials_are_a_storage_error_saying_what_to_check(
    s3_root: str,
    s3_options: Options,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    # Nowhere else to look: no files, and never the EC2 metadata address.
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent/credentials")
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent/config")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    no_keys = {"endpoint_url": s3_options["endpoint_url"], "anon": False}
    with pytest.raises(StorageError, match="credentials") as raised:
        dcp_safe.save(
            make_state(1),
            checkpoint_id="step_1",
            storage_writer=SafeStorageWriter(s3_root, storage_options=no_keys),
        )
    assert s3_root.removeprefix("s3://") in str(raised.value)
    with pytest.raises(StorageError, match="credentials"):
        dcp_safe.list_checkpoints(s3_root, storage_options=no_keys)
