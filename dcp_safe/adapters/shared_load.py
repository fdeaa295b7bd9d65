"""``dcp.load``, with the entries read once sent to the other ranks before it hands the state over.

``dcp.load`` loads into a copy of the top-level state dict (a ``Stateful`` entry's
``state_dict()``), then calls each ``Stateful``'s ``load_state_dict`` and puts the other
entries back. The entries other ranks read for this one (:mod:`dcp_safe.reading.read_once`) must
have arrived before that, so this is ``dcp.load``'s own sequence (torch 2.13's
``state_dict_loader.load``, step for step) with :func:`~dcp_safe.adapters.broadcast.deliver_shared`
between DCP's ``_load_state_dict`` and the hand-over. DCP's private ``_load_state_dict`` and
``_storage_setup`` do the work (through :mod:`dcp_safe.torch_compat`), so the reads, plans and
collectives are DCP's unchanged.
"""

from __future__ import annotations

import os
from typing import Any, cast

import torch.distributed as dist
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.checkpoint.storage import StorageReader

from dcp_safe.adapters.broadcast import deliver_shared
from dcp_safe.adapters.planners import SafeLoadPlanner
from dcp_safe.torch_compat import dcp_load_state_dict, storage_setup

__all__ = ["load_and_share"]


def load_and_share(
    state_dict: dict[str, Any],
    *,
    planner: SafeLoadPlanner,
    process_group: dist.ProcessGroup,
    timeout_s: float | None,
    checkpoint_id: str | os.PathLike[str] | None = None,
    storage_reader: StorageReader | None = None,
    no_dist: bool = False,
) -> None:
    """Load ``state_dict`` in place as ``dcp.load`` does, receiving the shared entries.

    Sets ``planner.bytes_received``. Raises what DCP's load raises; a peer lost while entries
    travel raises the transport's error within ``timeout_s`` (``None``: the group's timeout).
    """
    reader = cast(StorageReader, storage_setup(storage_reader, checkpoint_id, reader=True))
    keys = sorted(state_dict)  # as dcp.load: the same order on every rank
    loaded = {
        key: value.state_dict() if isinstance(value, Stateful) else value
        for key in keys
        for value in (state_dict[key],)
    }
    dcp_load_state_dict(
        state_dict=loaded,
        storage_reader=reader,
        process_group=process_group,
        no_dist=no_dist,
        planner=planner,
    )
    if planner.transfers:
        planner.bytes_received = deliver_shared(
            planner,
            planner.transfers,
            planner.sent_objects(),
            rank=dist.get_rank(process_group),
            group=process_group,
            timeout_s=timeout_s,
        )
        planner.sent_objects().payloads.clear()
    for key in keys:
        value = state_dict[key]
        if isinstance(value, Stateful):
            value.load_state_dict(loaded[key])
        else:
            state_dict[key] = loaded[key]
