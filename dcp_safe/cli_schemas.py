"""The ``--json`` output of each ``dcp-safe`` subcommand, as data: what scripts may rely on.

A schema is a JSON value's shape: a dict is an object with exactly those keys (none added,
none left out: a key whose value is unknown is ``null``); a one-element list is an array of
objects of that shape; a string is a type, ``"str"``, ``"int"``, ``"number"`` (int or float),
``"bool"`` or ``"object"`` (any JSON object: free-form fields), followed by ``[]`` for an
array of them and by ``?`` where ``null`` is allowed. docs/cli.md prints them;
tests/test_cli_json.py checks every subcommand's output against its own. A key is added only
with a new entry in docs/cli.md, never removed or renamed.
"""

from __future__ import annotations

from typing import Any

_CHECKPOINT = {
    "name": "str",
    "step": "int?",
    "tiers": "str[]",
    "size_bytes": "int",
    "created_at": "number",
    "world_size": "int",
    "path": "str",
    "save_id": "str",
    "metrics": "object?",
}

_ENTRY = {
    "fqn": "str",
    "kind": "str",
    "shape": "int[]?",
    "dtype": "str",
    "bytes": "int",
    "stored_bytes": "int",
    "shards": "int",
}

_EVENT = {
    "event": "str",
    "time": "number",
    "step": "int?",
    "name": "str?",
    "tier": "str?",
    "reason": "str?",
    "validated": "bool?",
    "fields": "object",
}

_KEY = {
    "key": "str",
    "kind": "str?",
    "dtype": "str?",
    "shape": "int[]?",
    "items": "int",
    "stored_bytes": "int",
}

SCHEMAS: dict[str, Any] = {
    "ls": [_CHECKPOINT],
    "verify": {
        "name": "str",
        "ok": "bool",
        "deep": "bool",
        "format": "str",
        "files_checked": "int",
        "items_checked": "int",
        "objects_checked": "int",
        "bytes_read": "int",
        "signature_checked": "bool",
        "pickle_checked": "bool",
        "seconds": "number",
    },
    "inspect": {
        "name": "str",
        "metrics": "object?",
        "entries": [_ENTRY],
        "totals": {"entries": "int", "tensors": "int", "bytes": "int", "stored_bytes": "int"},
    },
    "export": {
        "name": "str",
        "dest": "str",
        "format": "str",
        "files": "str[]",
        "tensors": "int",
        "tensor_bytes": "int",
        "objects": "int",
        "skipped": "object",
    },
    "gc": {
        "restored": "str[]",
        "trash_removed": "str[]",
        "trash_kept": "str[]",
        "dry_run": "bool",
        "kept": "str[]",
        "removed": "str[]",
        "not_counted": "str[]",
        "partials_removed": "str[]",
        "partials_too_recent": "str[]",
        "uploads_aborted": "str[]",
    },
    "history": {"root": "str", "events": [_EVENT]},
    "show": {
        "name": "str",
        "path": "str",
        "step": "int?",
        "save_id": "str",
        "created_at": "number",
        "world_size": "int",
        "format": "str",
        "manifest_version": "int",
        "dcp_safe_version": "str",
        "torch_version": "str",
        "checksum_algorithm": "str",
        "compression": "str",
        "attempt": "int?",
        "signature": "str?",
        "digest": "str",
        "metrics": "object?",
        "total_bytes": "int",
        "files": "int",
        "items": "int",
        "keys": [_KEY],
    },
    "diff": {
        "a": "str",
        "b": "str",
        "same": "bool",
        "added": "str[]",
        "removed": "str[]",
        "changed": "str[]",
        "incomparable": [{"key": "str", "reason": "str"}],
        "unchanged": "int",
    },
    "replicate": {
        "name": "str",
        "source": "str",
        "dest": "str",
        "files": "int",
        "bytes": "int",
        "verified": "str",
        "seconds": "number",
    },
    "adopt": {
        "name": "str",
        "path": "str",
        "copied": "bool",
        "world_size": "int",
        "files": "int",
        "items": "int",
        "bytes_read": "int",
        "objects_checked": "int",
        "unchecked": "str[]",
    },
    # Any subcommand's failure with --json (the exit status is exit_code).
    "error": {"error": "str", "message": "str", "exit_code": "int"},
}
