"""What dcp_safe's two ``StorageReader``\\ s share (``SafeStorageReader``, ``SafetensorsReader``):
``reset`` builds ``_metadata`` (``read_metadata`` calls it when DCP did not), the plans pass
through unchanged, and ``read_data`` is done when it returns (:func:`done`)."""

from __future__ import annotations

from typing import Any

from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadPlan
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future


class PlainReader(StorageReader):
    """A ``StorageReader`` whose ``reset`` sets ``_metadata`` and whose plans need no storage
    data."""

    _metadata: Metadata | None = None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if self._metadata is None:
            self.reset()
        assert self._metadata is not None
        return self._metadata

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans


def done() -> Future[None]:
    """The future ``read_data`` returns: its reads have ended when it returns."""
    future: Future[None] = Future()
    future.set_result(None)
    return future
