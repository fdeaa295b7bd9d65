"""dcp_safe.torch_compat: the private torch APIs, each behaving as its caller relies on."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

import dcp_safe
from dcp_safe import SafeStorageWriter
from dcp_safe.torch_compat import dcp_debug_logs_unheard

DCP_LOGGER = logging.getLogger("c10d-NullHandler-dcp_logger")


class _Count(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records = 0

    def emit(self, record: logging.LogRecord) -> None:
        self.records += 1


def _save_flat(root: Path, keys: int) -> None:
    state = {f"k{i}": torch.zeros(2) for i in range(keys)}
    dcp_safe.save(state, storage_writer=SafeStorageWriter(root), checkpoint_id="c", no_dist=True)


def test_dcps_per_key_debug_records_are_not_made_while_nobody_listens(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert DCP_LOGGER.level == logging.DEBUG  # torch's setting, which this works around
    made: list[str] = []
    real = logging.Logger.makeRecord

    def counting(self: logging.Logger, *args: object, **kwargs: object) -> logging.LogRecord:
        if self is DCP_LOGGER:
            made.append(self.name)
        return real(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(logging.Logger, "makeRecord", counting)
    # As outside pytest: torch's NullHandler only (pytest hangs its capture on every logger).
    quiet = [h for h in DCP_LOGGER.handlers if type(h) is logging.NullHandler]
    monkeypatch.setattr(DCP_LOGGER, "handlers", quiet)
    _save_flat(tmp_path, 50)
    assert made == []
    assert DCP_LOGGER.level == logging.DEBUG  # restored after the call


def test_a_handler_that_takes_debug_records_still_gets_every_one(tmp_path: Path) -> None:
    handler = _Count()
    DCP_LOGGER.addHandler(handler)
    try:
        with dcp_debug_logs_unheard():
            assert DCP_LOGGER.level == logging.DEBUG  # someone listens: nothing changes
        _save_flat(tmp_path, 50)
    finally:
        DCP_LOGGER.removeHandler(handler)
    assert handler.records >= 100  # two a key, and the save's own
