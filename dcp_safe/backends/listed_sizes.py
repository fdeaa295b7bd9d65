"""File sizes from folder listings: one request per folder, a lone ``size`` only for a gap.

The "listed, or else asked" rule every size check of a checkpoint follows: a listing costs a
request per 1,000 keys where a ``size`` per file costs a HEAD each. A listing is a snapshot,
possibly eventually consistent, so a name it lacks is asked for on its own before the file is
called missing (the error stays what a lone ``size`` would raise).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dcp_safe.backends.backend import Backend


@dataclass
class ListedSizes:
    """Sizes of files under the folder ``base``, each folder listed once, on first use.

    ``listed``: folders already listed, by path relative to ``base`` (``""``: ``base`` itself),
    by a caller that lists them ahead (in parallel).
    """

    backend: Backend
    base: str
    listed: dict[str, dict[str, int]] = field(default_factory=dict, kw_only=True)

    def path(self, rel: str) -> str:
        # ``rel`` as a path relative to the backend's root.
        return f"{self.base}/{rel}" if self.base else rel

    def size(self, rel: str) -> int:
        # FileNotFoundError when neither its folder's listing nor a lone ``size`` found it.
        folder, _, name = rel.rpartition("/")
        if folder not in self.listed:
            self.listed[folder] = self.backend.sizes(self.path(folder) if folder else self.base)
        found = self.listed[folder].get(name)
        return self.backend.size(self.path(rel)) if found is None else found
