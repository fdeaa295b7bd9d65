"""A model and its optimizer as one state dict, through DCP's ``state_dict`` API: how a
training loop hands FSDP state to a save, and takes it back from a load.

Not re-exported by ``support``: importing it loads ``torch.distributed.checkpoint``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

import dcp_safe
from dcp_safe import SafeStorageReader


def app_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """``{"model": ..., "optim": ...}``, sharded as ``model`` is."""
    model_sd, optim_sd = get_state_dict(model, optimizer)
    return {"model": model_sd, "optim": optim_sd}


def restore(model: nn.Module, optimizer: torch.optim.Optimizer, root: str, name: str) -> None:
    """Load ``name`` into ``model``/``optimizer``, resharding to however they are laid out."""
    target = app_state(model, optimizer)
    dcp_safe.load(target, checkpoint_id=name, storage_reader=SafeStorageReader(root))
    set_state_dict(
        model, optimizer, model_state_dict=target["model"], optim_state_dict=target["optim"]
    )
