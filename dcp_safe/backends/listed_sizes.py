"""File sizes from folder listings: one request per folder, a lone ``size`` only for a gap.

This module owns the "listed, or else asked" rule every check of a checkpoint's sizes follows
(the coordinator before it publishes, quick verification after a save, replication after an
upload). Sizing N files one ``size`` call each is N requests on an object store (a HEAD per
file: thousands at thousands of ranks), while :meth:`Backend.sizes` sizes a whole folder from
one listing (a request per 1,000 keys). A listing is a snapshot, though, and on some stores an
eventually consistent one: a name it lacks is asked for on its own before anyone calls the file
missing, so a missing file's error stays what a lone ``size`` call would have raised.
"""

from __future__ import annotations

from collections.abc import Callable

from dcp_safe.backends.backend import Backend

__all__ = ["ListedSizes"]


class ListedSizes:
    """Sizes of files under ``base``, each folder listed once, on first use.

    Args:
        backend: where the files are.
        base: the folder that the relative paths given to :meth:`size` start from.
        lister: lists one folder (a path relative to the backend's root) as ``{name: size}``;
            :meth:`Backend.sizes` by default. A caller that lists folders ahead (in parallel)
            passes them as ``listed``.
        listed: folders already listed, by path relative to ``base`` (``""``: ``base`` itself).
    """

    def __init__(
        self,
        backend: Backend,
        base: str,
        *,
        lister: Callable[[str], dict[str, int]] | None = None,
        listed: dict[str, dict[str, int]] | None = None,
    ) -> None:
        self.backend = backend
        self.base = base
        self._lister = lister if lister is not None else backend.sizes
        self.listed: dict[str, dict[str, int]] = listed if listed is not None else {}

    def path(self, rel: str) -> str:
        """``rel`` as a path relative to the backend's root."""
        return f"{self.base}/{rel}" if self.base else rel

    def size(self, rel: str) -> int:
        """The size of the file at ``rel`` (relative to ``base``).

        Raises:
            FileNotFoundError: neither its folder's listing nor a lone ``size`` call found it.
            OSError: storage failed (whatever the lister or :meth:`Backend.size` raise).
        """
        folder, _, name = rel.rpartition("/")
        if folder not in self.listed:
            self.listed[folder] = self._lister(self.path(folder) if folder else self.base)
        found = self.listed[folder].get(name)
        return self.backend.size(self.path(rel)) if found is None else found
