"""The command line's arguments: a parser whose usage errors are one line, and option checks.

``dcp-safe`` promises one line and exit status 2 for every usage error (``cli.py``'s
docstring). argparse prints its usage block before the error, and the options it cannot judge
(a root URL, ``--storage-options`` that the storage's client refuses, a key file) fail later,
inside a command, as the library's ``ValueError`` or ``TypeError`` with a traceback. This
module turns all of them into :class:`UsageError` (or argparse's one-line exit) before any
command runs, so ``cli.py`` stays about the commands.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any, NoReturn

from dcp_safe.backends.backend import Backend
from dcp_safe.backends.roots import open_backend
from dcp_safe.errors import ConfigError
from dcp_safe.topology import Root
from dcp_safe.untrusted import shown


class UsageError(Exception):
    """A mistake in the command line the user can fix; exit status 2."""


class OneLineParser(argparse.ArgumentParser):
    """An argument parser whose errors are one line (what is wrong, where to read more) and
    exit status 2; its subcommand parsers are of the same class."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"dcp-safe: error: {shown(message)}; see '{self.prog} --help'\n")


def parse_storage_options(text: str | None) -> dict[str, Any] | None:
    """``--storage-options``: a JSON object, or None when not given.

    Raises:
        UsageError: not JSON, or not an object.
    """
    if text is None:
        return None
    try:
        options = json.loads(text)
    except json.JSONDecodeError as exc:
        raise UsageError(f"--storage-options is not valid JSON ({exc}); pass an object") from None
    if not isinstance(options, dict):
        raise UsageError("--storage-options must be a JSON object, e.g. '{\"anon\": false}'")
    return options


def check_roots(args: argparse.Namespace, options: dict[str, Any] | None) -> None:
    """The command's storage roots (``root``, ``--remote``) can be opened with ``options``.

    An unknown protocol is the library's ConfigError (exit 2 as well). The client of an object
    store is built here, which makes no request: it is where storage options it does not know
    are refused (s3fs builds it only at the first request).

    Raises:
        UsageError: a URL names no bucket, or the storage's client refuses ``options``.
    """
    for url in (getattr(args, "root", None), getattr(args, "remote", None)):
        if not isinstance(url, str) or "://" not in url or url.startswith("file://"):
            continue
        if not url.split("://", 1)[1].strip("/"):  # s3fs: "Cannot traverse all of S3"
            raise UsageError(f"{shown(url, 200)} names no bucket; give one, e.g. s3://bucket/run")
        try:
            fs = getattr(_innermost(open_backend(Root(url, options))), "fs", None)
            connect = getattr(fs, "connect", None)
            if callable(connect):
                connect()
        except ConfigError:
            raise  # an unknown protocol: its own message
        except (TypeError, ValueError, AttributeError) as exc:  # a value of the wrong type
            raise UsageError(
                f"--storage-options for {shown(url, 200)}: the storage client refuses them"
                f" ({shown(exc, 300)}); pass only options it knows"
            ) from None


def _innermost(backend: Backend) -> Backend:
    while isinstance(getattr(backend, "inner", None), Backend):
        backend = backend.inner  # type: ignore[attr-defined]
    return backend


def key_from_file(path: str | None) -> str | bytes | None:
    """``--signing-key-file``: the key as text (surrounding whitespace dropped), or raw bytes.

    Raises:
        UsageError: the file cannot be read.
    """
    if path is None:
        return None
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise UsageError(
            f"--signing-key-file {shown(path, 200)} cannot be read ({exc.strerror or exc});"
            " give a file holding the key"
        ) from None
    try:
        return data.decode("utf-8").strip()
    except UnicodeDecodeError:
        return data


def require_root(root: str) -> None:
    """A local root that does not exist is a typo, not an empty root.

    Raises:
        FileNotFoundError: no such directory (exit status 3, "not found").
    """
    if "://" in root and not root.startswith("file://"):
        return
    path = root.removeprefix("file://")
    if not os.path.isdir(path):
        raise FileNotFoundError(
            f"no such directory: {path}; give the checkpoint root (a directory)"
        )
