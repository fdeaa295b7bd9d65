"""File sizes from folder listings: one request per folder, a lone ``size`` only for a gap.

The "listed, or else asked" rule every size check of a checkpoint follows: a listing costs a
request per 1,000 keys where a ``size`` per file costs a HEAD each. A listing is a snapshot,
possibly eventually consistent, so a name it lacks is asked for on its own before the file is
called missing (the error stays what a lone ``size`` would raise).
"""

from __future__ import annotations

from collections.abc import Callable

from dcp_safe.backends.backend import Backend

__all__ = ["ListedSizes"]


class ListedSizes:
    """Sizes of files under ``base``, each folder listed once, on first use.

    Args:
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
