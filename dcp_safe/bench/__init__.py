"""Benchmarks shipped with the package: ``dcp-safe bench`` and the sweep's measuring code.

``benchmarks/`` (not installed) holds the long sweep; everything it shares with the quick pass
lives here so that ``dcp-safe bench`` works from an installed wheel:

* :mod:`dcp_safe.bench.measure`: state dicts, RSS sampling, medians, rotation, the machine;
* :mod:`dcp_safe.bench.savers`: the contenders (dcp_safe and DCP's own staging paths);
* :mod:`dcp_safe.bench.session`: one contender's cold, warm and back-to-back saves;
* :mod:`dcp_safe.bench.floors`: copy, raw-write, checksum and zstd floors, and load timing;
* :mod:`dcp_safe.bench.compare`: ratios and the regression guard (pure functions);
* :mod:`dcp_safe.bench.quick`: ``main(argv)``, the quick pass behind ``dcp-safe bench``.

Nothing is imported here, so ``import dcp_safe.bench`` stays cheap.
"""

from __future__ import annotations

__all__: list[str] = []
