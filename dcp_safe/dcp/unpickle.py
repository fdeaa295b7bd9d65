"""Loading what a checkpoint pickled, without running code from storage: the readers' name for
:mod:`dcp_safe.checkpoints.restricted`, which holds the checks so that deep verification (a
lower layer) applies exactly the ones a load applies.
"""

from __future__ import annotations

from dcp_safe.checkpoints.restricted import load_metadata, sanitized_object_stream

__all__ = ["load_metadata", "sanitized_object_stream"]
