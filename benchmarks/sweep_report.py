"""Turn ``results/sweep-*.json`` into the tables of ``docs/benchmarks.md`` and its figures.

Only the part of ``docs/benchmarks.md`` between ``<!-- sweep:begin -->`` and
``<!-- sweep:end -->`` is generated; the prose around it (what the figures mean, why a target
is missed and what would close it) is written by hand and kept across renders.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from plots import render_figures

BEGIN, END = "<!-- sweep:begin -->", "<!-- sweep:end -->"
MIB = 1 << 20
SAFE, TORCH = "dcp_safe", "torch_default_async"
FIG_DIR = "benchmarks"  # under docs/


def _load(results: Path) -> dict[str, dict[str, Any]]:
    """Every ``sweep-*.json``, merged by part (a part may be run in several pieces, e.g. the
    4 GiB point on its own); the earliest piece's metadata describes the part, and every
    piece's command is kept under ``"commands"``."""
    parts: dict[str, dict[str, Any]] = {}
    for path in sorted(results.glob("sweep-*.json")):
        data = json.loads(path.read_text())
        piece = {
            "command": data["command"],
            "started_at": data["started_at"],
            "finished_at": data["finished_at"],
            "machine": data["machine"],
            "machine_after": data["machine_after"],
            "args": data["args"],
        }
        if data["part"] in parts:
            merged = parts[data["part"]]
            merged["points"].update(data["points"])
            merged["pieces"].append(piece)
        else:
            parts[data["part"]] = dict(data, pieces=[piece])
    for part in parts.values():
        part["pieces"].sort(key=lambda p: p["started_at"])
    return parts


def _summaries(part: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {
        key: dict(point["summary"], payload_bytes=point["payload_bytes"])
        for key, point in part["points"].items()
    }


def _f(x: Any, digits: int = 3) -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "-"
    return f"{x:.{digits}f}"


def _ratio(a: Any, b: Any) -> float | None:
    if not isinstance(a, (int, float)) or not isinstance(b, (int, float)) or b <= 0:
        return None
    return float(a) / float(b)


def _mib(n: Any) -> str:
    return "-" if n is None else f"{n / MIB:,.0f}"


def _table(headers: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def _size_label(key: str) -> str:
    mib = int(key)
    return f"{mib // 1024} GiB" if mib >= 1024 else f"{mib} MiB"


def _get(summary: dict[str, Any], name: str, metric: str) -> Any:
    entry = summary.get(name)
    return entry.get(metric) if isinstance(entry, dict) else None


# ----------------------------------------------------------------------------- targets


def _verdict(value: float | None, limit: float, at_most: bool) -> str:
    if value is None:
        return "n/a"
    ok = value <= limit if at_most else value >= limit
    return "met" if ok else "**missed**"


def _slope(counts: dict[str, dict[str, Any]], name: str, metric: str) -> float | None:
    keys = sorted(counts, key=int)
    lo, hi = keys[0], keys[-1]
    a, b = _get(counts[lo], name, metric), _get(counts[hi], name, metric)
    if a is None or b is None or int(hi) == int(lo):
        return None
    return (b - a) / (int(hi) - int(lo))


def targets_table(parts: dict[str, dict[str, Any]]) -> str:
    rows: list[list[str]] = []

    def add(what: str, key: str, value: float | None, limit: float, at_most: bool) -> None:
        sign = "<=" if at_most else ">="
        rows.append([what, key, _f(value, 2), f"{sign} {limit}", _verdict(value, limit, at_most)])

    sizes = _summaries(parts["sizes"]) if "sizes" in parts else {}
    for key in sorted(sizes, key=int):
        s, label = sizes[key], _size_label(key)
        stall = _get(s, SAFE, "stall_s")
        add("2nd-save stall / copy_ floor", label, _ratio(stall, s.get("copy_floor")), 1.2, True)
        add(
            "2nd-save stall / torch default async_save stall",
            label,
            _ratio(stall, _get(s, TORCH, "stall_s")),
            0.5,
            True,
        )
        add(
            "time to local commit / FileSystemWriter (both from the call)",
            label,
            _ratio(_get(s, SAFE, "local_commit_s"), _get(s, TORCH, "local_commit_s")),
            1.15,
            True,
        )
        add(
            "raw write+fsync floor / time to local commit",
            label,
            _ratio(s.get("raw_floor"), _get(s, SAFE, "local_commit_s")),
            0.85,
            False,
        )
        add(
            "raw write+fsync floor / write phase (staging done to local commit)",
            label,
            _ratio(s.get("raw_floor"), _get(s, SAFE, "write_s")),
            0.85,
            False,
        )
        add(
            "verified load / FileSystemReader load",
            label,
            _ratio(s.get(f"load:{SAFE}"), s.get(f"load:{TORCH}")),
            0.8,
            True,
        )
        payload = s["payload_bytes"]
        add(
            "peak RSS above state / one generation",
            label,
            _ratio(_get(s, SAFE, "peak_over_state_bytes"), payload),
            1.1,
            True,
        )
        add(
            "the same, two back-to-back save requests",
            label,
            _ratio(_get(s, SAFE, "pair_peak_over_state_bytes"), payload),
            1.1,
            True,
        )
    s3 = _summaries(parts["s3"]) if "s3" in parts else {}
    for key in sorted(s3, key=int):
        s, label = s3[key], _size_label(key)
        floor = s.get("boto3_floor")
        add(
            "boto3 multipart / dcp_safe direct S3 save (call to commit)",
            label,
            _ratio(floor, _get(s, "dcp_safe_s3", "remote_commit_s")),
            0.9,
            False,
        )
        add(
            "boto3 multipart / dcp_safe replication (local to remote commit)",
            label,
            _ratio(floor, _get(s, "dcp_safe_replicated", "upload_after_local_s")),
            0.95,
            False,
        )
    counts = _summaries(parts["counts"]) if "counts" in parts else {}
    for key in sorted(counts, key=int):
        if int(key) < 4096:
            continue
        s, label = counts[key], f"{key} tensors"
        add(
            "time to local commit / FileSystemWriter (both from the call)",
            label,
            _ratio(_get(s, SAFE, "local_commit_s"), _get(s, TORCH, "local_commit_s")),
            0.5,
            True,
        )
        add(
            "verified load / FileSystemReader load",
            label,
            _ratio(s.get(f"load:{SAFE}"), s.get(f"load:{TORCH}")),
            0.5,
            True,
        )
        add(
            "2nd-save stall / DefaultStager's",
            label,
            _ratio(_get(s, SAFE, "stall_s"), _get(s, "torch_default_stager", "stall_s")),
            0.5,
            True,
        )
    if counts:
        hi = max(counts, key=int)
        for metric, what in (("local_commit_s", "time to commit"), ("stall_s", "stall")):
            ours = _slope(counts, SAFE, metric)
            add(
                f"per-item {what} overhead / torch default async_save's",
                f"{hi} tensors",
                _ratio(ours, _slope(counts, TORCH, metric)),
                1.0,
                True,
            )
    return _table(["target", "at", "measured", "target", "verdict"], rows)


# ----------------------------------------------------------------------------- detail tables


def sizes_table(sizes: dict[str, dict[str, Any]]) -> str:
    rows = []
    for key in sorted(sizes, key=int):
        s = sizes[key]
        payload = s["payload_bytes"]
        for name, entry in s.items():
            if not isinstance(entry, dict):
                continue
            if "error" in entry:
                rows.append(
                    [_size_label(key), name, f"cannot run here: {entry['error']}"] + [""] * 10
                )
                continue
            rows.append(
                [
                    _size_label(key),
                    name,
                    _f(entry["first_stall_s"]),
                    _f(entry["stall_s"]),
                    _f(_ratio(entry["stall_s"], s.get("copy_floor")), 2),
                    _f(entry["local_commit_s"]),
                    _f(_ratio(entry["local_commit_s"], _get(s, TORCH, "local_commit_s")), 2),
                    _f(_ratio(s.get("raw_floor"), entry["local_commit_s"]), 2),
                    f"{_mib(entry['first_alloc_bytes'])} / {_mib(entry['alloc_bytes'])}",
                    _f(entry["peak_over_state_bytes"] / payload, 2),
                    _f(_ratio(entry.get("pair_peak_over_state_bytes"), payload), 2),
                    _f(entry.get("pair_second_stall_s")),
                    _f(s.get(f"load:{name}")),
                ]
            )
        rows.append(
            [
                _size_label(key),
                "floors",
                f"copy_ {_f(s.get('copy_floor'))}",
                "",
                "",
                f"raw {_f(s.get('raw_floor'))}",
                "",
                "",
                "",
                "",
                "",
                "",
                "",
            ]
        )
    return _table(
        [
            "size",
            "contender",
            "1st stall s",
            "2nd stall s",
            "/ copy_ floor",
            "commit s",
            "/ torch default",
            "raw floor / commit",
            "alloc MiB 1st / 2nd",
            "peak / gen",
            "pair peak / gen",
            "pair 2nd stall s",
            "load s",
        ],
        rows,
    )


def s3_table(s3: dict[str, dict[str, Any]]) -> str:
    rows = []
    for key in sorted(s3, key=int):
        s = s3[key]
        floor = s.get("boto3_floor")
        payload = s["payload_bytes"]
        for name, entry in s.items():
            if not isinstance(entry, dict):
                continue
            if "error" in entry:
                rows.append(
                    [_size_label(key), name, f"cannot run here: {entry['error']}"] + [""] * 6
                )
                continue
            upload = entry.get("upload_after_local_s") or entry.get("remote_commit_s")
            rows.append(
                [
                    _size_label(key),
                    name,
                    _f(entry["stall_s"]),
                    _f(entry["local_commit_s"]),
                    _f(entry.get("remote_commit_s")),
                    _f(upload),
                    _f(_ratio(floor, upload), 2),
                    f"{payload / upload / 1e6:.0f}" if upload else "-",
                    _f(entry["peak_over_state_bytes"] / payload, 2),
                ]
            )
        rows.append(
            [
                _size_label(key),
                "boto3 multipart floor",
                "",
                "",
                "",
                _f(floor),
                "1.00",
                f"{payload / floor / 1e6:.0f}" if floor else "-",
                "",
            ]
        )
    return _table(
        [
            "size",
            "contender",
            "stall s",
            "local commit s",
            "S3 commit s",
            "upload s",
            "boto3 / upload",
            "upload MB/s",
            "peak / gen",
        ],
        rows,
    )


def counts_table(counts: dict[str, dict[str, Any]]) -> str:
    rows = []
    keys = sorted(counts, key=int)
    for key in keys:
        s = counts[key]
        for name, entry in s.items():
            if not isinstance(entry, dict) or "error" in entry:
                continue
            rows.append(
                [
                    key,
                    name,
                    _f(entry["stall_s"]),
                    _f(entry["local_commit_s"]),
                    _f(_ratio(entry["local_commit_s"], _get(s, TORCH, "local_commit_s")), 2),
                    _f(s.get(f"load:{name}")),
                ]
            )
        rows.append(
            [
                key,
                "floors",
                f"copy_ {_f(s.get('copy_floor'))}",
                f"raw {_f(s.get('raw_floor'))}",
                "",
                "",
            ]
        )
    slopes = []
    for name in (SAFE, TORCH, "torch_default_stager"):
        commit, stall = _slope(counts, name, "local_commit_s"), _slope(counts, name, "stall_s")
        slopes.append(
            [
                name,
                _f(None if stall is None else stall * 1e6, 1),
                _f(None if commit is None else commit * 1e6, 1),
            ]
        )
    return (
        _table(
            ["tensors", "contender", "2nd stall s", "commit s", "commit / torch default", "load s"],
            rows,
        )
        + f"\n\nPer-item overhead, the slope from {keys[0]} to {keys[-1]} tensors "
        "(microseconds per extra tensor):\n\n"
        + _table(["contender", "stall us / tensor", "commit us / tensor"], slopes)
    )


def compression_table(part: dict[str, Any]) -> str:
    ((key, point),) = part["points"].items()
    s = point["summary"]
    payload = point["payload_bytes"]
    rows = []
    for name, entry in s.items():
        if not isinstance(entry, dict) or "error" in entry:
            continue
        rows.append(
            [
                name,
                _f(entry["stall_s"]),
                _f(entry["local_commit_s"]),
                _f(_ratio(entry["local_commit_s"], _get(s, "dcp_safe", "local_commit_s")), 2),
                _f(s.get(f"load:{name}")),
            ]
        )
    shards = point.get("shard_bytes", {})
    return (
        f"{_size_label(key)} of compressible tensors (small integers, ~75% zeros), "
        f"{point['tensors']} tensors:\n\n"
        + _table(
            ["contender", "2nd stall s", "commit s", "/ dcp_safe uncompressed", "load s"], rows
        )
        + "\n\n"
        + f"zstd (level 3, one thread) over these bytes: {point['zstd_rate_bps'] / 1e9:.2f} GB/s; "
        f"xxh3-128: {point['checksum_rate_bps'] / 1e9:.2f} GB/s; raw write+fsync: "
        f"{payload / s['raw_floor'] / 1e9:.2f} GB/s. Shards on disk: dcp_safe zstd "
        f"{_mib(shards.get('dcp_safe_zstd'))} MiB, torch zstd {_mib(shards.get('torch_zstd'))} "
        f"MiB, of {_mib(payload)} MiB."
    )


# ----------------------------------------------------------------------------- the document


def _machine(parts: dict[str, dict[str, Any]]) -> str:
    any_part = next(iter(parts.values()))
    m = any_part["machine"]
    lines = [
        f"- Machine: {m['cpu_model']}, {m['logical_cpus']} logical CPUs, "
        f"{m['memory_total_bytes'] / (1 << 30):.1f} GiB RAM, {m['platform']}, "
        f"Python {m['python']}, torch {m['torch']}. Shared: other engineers' test runs used "
        "the same CPUs and disk throughout, so only same-run ratios are meaningful.",
    ]
    for name in ("sizes", "s3", "counts", "compression"):
        for p in parts.get(name, {}).get("pieces", []):
            load_before = " / ".join(f"{x:.1f}" for x in p["machine"]["load_average"])
            load_after = " / ".join(f"{x:.1f}" for x in p["machine_after"]["load_average"])
            lines.append(
                f"- `{name}`: {p['started_at']} .. {p['finished_at']}, load average "
                f"{load_before} before, {load_after} after; rounds {p['args']['rounds']}"
                + (
                    f" ({p['args']['rounds_large']} at 4 GiB and above)"
                    if name == "sizes" and max(p["args"]["sizes"]) >= 4096
                    else ""
                )
                + f".\n  Command: `{p['command']}`"
            )
    return "\n".join(lines)


def generated_section(parts: dict[str, dict[str, Any]], figures: list[Path]) -> str:
    out = [BEGIN, "", "### Where and how", "", _machine(parts), "", "### Targets", ""]
    out.append(targets_table(parts))
    if "sizes" in parts:
        out += [
            "",
            "### State size sweep (16 tensors, medians)",
            "",
            sizes_table(_summaries(parts["sizes"])),
        ]
    if "s3" in parts:
        out += ["", "### S3 (moto on 127.0.0.1, medians)", "", s3_table(_summaries(parts["s3"]))]
    if "counts" in parts:
        size = parts["counts"]["args"]["count_size_mib"]
        out += [
            "",
            f"### Tensor count sweep ({size} MiB in all, medians)",
            "",
            counts_table(_summaries(parts["counts"])),
        ]
    if "compression" in parts:
        out += ["", "### Compression", "", compression_table(parts["compression"])]
    if figures:
        out += ["", "### Figures", ""]
        out += [f"![{p.stem.replace('_', ' ')}]({FIG_DIR}/{p.name})" for p in figures]
    out += ["", END]
    return "\n".join(out)


def render(results: Path, docs: Path) -> int:
    parts = _load(results)
    if not parts:
        print(f"no sweep-*.json under {results}")
        return 1
    sweep = {name: _summaries(p) for name, p in parts.items() if name != "compression"}
    figures = render_figures(sweep, docs / FIG_DIR)
    section = generated_section(parts, figures)
    doc = docs / "benchmarks.md"
    text = doc.read_text() if doc.exists() else f"# Benchmarks\n\n{BEGIN}\n{END}\n"
    if BEGIN not in text or END not in text:
        text = text.rstrip() + f"\n\n{BEGIN}\n{END}\n"
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    doc.write_text(head + section + tail)
    print(f"wrote {doc} and {len(figures)} figure(s)")
    return 0
