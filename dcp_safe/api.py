"""``save`` / ``async_save`` / ``load``: DCP's own calls, with errors from dcp_safe's tree.

These are thin: they call ``torch.distributed.checkpoint`` unchanged and only translate DCP's
``CheckpointException`` (a ``BaseException``, which ``except Exception`` misses) into the
:mod:`dcp_safe.errors` tree, on the calling thread and on every future handed back. Calling
``dcp.save(..., storage_writer=SafeStorageWriter(...))`` directly works just as well; you then
see DCP's exception type, with dcp_safe's typed errors inside its ``failures``.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from typing import Any, TypeVar

import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.state_dict_loader import load as _dcp_load
from torch.distributed.checkpoint.state_dict_saver import async_save as _dcp_async_save
from torch.distributed.checkpoint.state_dict_saver import save as _dcp_save

from dcp_safe.errors import from_checkpoint_exception

__all__ = ["async_save", "load", "save", "translate_errors"]

T = TypeVar("T")


# DCP warns on every single-process call, even when no_dist=True says so explicitly.
_SINGLE_PROCESS_WARNING = "torch.distributed is disabled, unavailable or uninitialized"


@contextmanager
def _quiet_single_process(kwargs: dict[str, Any]) -> Iterator[None]:
    with warnings.catch_warnings():
        if kwargs.get("no_dist"):
            warnings.filterwarnings("ignore", message=_SINGLE_PROCESS_WARNING)
        yield


@contextmanager
def translate_errors() -> Iterator[None]:
    """Re-raise DCP's ``CheckpointException`` as the matching dcp_safe error."""
    try:
        yield
    except CheckpointException as exc:
        raise from_checkpoint_exception(exc) from exc


def _default_no_dist(kwargs: dict[str, Any]) -> dict[str, Any]:
    # Say it explicitly rather than let DCP warn that it guessed.
    if "no_dist" not in kwargs and "process_group" not in kwargs:
        kwargs["no_dist"] = not (dist.is_available() and dist.is_initialized())
    return kwargs


def save(state_dict: dict[str, Any], **kwargs: Any) -> Metadata:
    """``dcp.save`` with translated errors. Takes the same keyword arguments."""
    kwargs = _default_no_dist(kwargs)
    with translate_errors(), _quiet_single_process(kwargs):
        metadata: Metadata = _dcp_save(state_dict, **kwargs)
        return metadata


def load(state_dict: dict[str, Any], **kwargs: Any) -> None:
    """``dcp.load`` with translated errors. Takes the same keyword arguments."""
    kwargs = _default_no_dist(kwargs)
    with translate_errors(), _quiet_single_process(kwargs):
        _dcp_load(state_dict, **kwargs)


def async_save(state_dict: dict[str, Any], **kwargs: Any) -> Any:
    """``dcp.async_save`` whose futures fail with dcp_safe errors.

    Returns what DCP returns (an ``AsyncSaveResponse`` when the stager returns a future, else a
    future), with every future replaced by one that carries the translated error.
    """
    with translate_errors():
        response = _dcp_async_save(state_dict, **kwargs)
    if isinstance(response, Future):
        return _translated(response)
    response.staging_completion = _translated(response.staging_completion)
    response.upload_completion = _translated(response.upload_completion)
    return response


def _translated(source: Future[T]) -> Future[T]:
    target: Future[T] = Future()

    def forward(done: Future[T]) -> None:
        try:
            target.set_result(done.result())
        except CheckpointException as exc:
            target.set_exception(from_checkpoint_exception(exc))
        except BaseException as exc:
            target.set_exception(exc)

    source.add_done_callback(forward)
    return target
