"""S3 upload benchmark: dcp_safe against raw boto3 and torch's FsspecWriter, on a local moto server.

Usage::

    .venv/bin/python benchmarks/bench_s3.py --size-gib 1 --rounds 3 [--profile]

One state dict (``bench_storage.make_state``: 16 float32 tensors of 64 MiB per GiB, plus small
tensors and a non-tensor entry) is uploaded to one moto S3 server on ``127.0.0.1`` by:

* ``safe_t{1,2}[_bs64]``: ``SafeStorageWriter("s3://bench/<prefix>")`` direct save
  (``dcp.save``), ``thread_count`` 1 and 2, with s3fs's default block size (50 MiB) and with
  ``default_block_size`` = 64 MiB in ``storage_options``;
* ``replicate``: ``replicate_checkpoint(local, remote, name)`` of a checkpoint committed once,
  before the rounds, on local disk (thread_count 1, so one 1 GiB shard); timed from the call to
  the remote ``_COMMITTED`` marker, which is what ``writer.replication(name).result()`` waits for;
  the default of 4 parts in flight; ``replicate_p1``: the same with ``max_concurrency=1`` in the
  remote's storage options (one part in flight while the next fills, as before 4 was the default);
* ``boto3_c{1,2,4}``: the floor, boto3's ``upload_fileobj`` of the same tensor bytes (one object,
  read from a seekable stream over the tensors' memory) with
  ``TransferConfig(multipart_chunksize=64 MiB, max_concurrency=N)``;
* ``fsspec_t{1,2}``: torch's ``FsspecWriter`` with the same storage options as keyword
  arguments, ``sync_files=False`` (on an fsspec stream ``sync_files=True`` makes torch call
  ``os.sync()`` for the whole machine, which says nothing about S3);
* ``s3tc_t{1,2}`` (only where ``s3torchconnector[dcp]`` is installed: ``pip install
  dcp-safe[s3tc]``): AWS's ``S3StorageWriter`` (the CRT-based client), pointed at the same moto
  server through ``S3Client(endpoint="http://127.0.0.1:<port>")`` with
  ``S3ClientConfig(force_path_style=True, part_size=64 MiB)`` and moto's dummy credentials in
  the environment (``AWS_EC2_METADATA_DISABLED=true``: nothing is asked of any other host).

``--contenders`` runs a subset (the boto3 and FsspecWriter contenders each one is compared with
are added).

Everything runs in this one process and the order of contenders rotates from round to round;
medians are reported. The moto server (``dcp_safe.testing.s3.start_local_s3``) runs in a child
process: in this process it would compete with the uploaders for the GIL and its stored objects
would show up as the uploaders' RSS. Its CPU time and RSS are recorded separately. Every upload's
objects are deleted before the next one starts, so moto never holds more than one checkpoint.

Results print as markdown tables and go to ``benchmarks/results/s3.json``. ``--profile`` (or a
missed target) adds one cProfile'd dcp_safe upload (thread_count 1), profiled in the thread that
writes the shard.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import os
import pstats
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _common import (
    MIB,
    RssSampler,
    describe_machine,
    describe_machine_line,
    format_size,
    markdown_table,
    rotate,
    run_and_report,
    write_results,
)
from bench_storage import NAME, make_state, measure, summarize, tensor_bytes

from dcp_safe import SafeStorageWriter, WriterOptions, layout
from dcp_safe.backends.roots import open_backend
from dcp_safe.replication.replicator import replicate_checkpoint
from dcp_safe.testing.s3 import ACCESS_KEY, REGION, SECRET_KEY, LocalS3

BUCKET = "bench"
PART_BYTES = 64 * MIB
DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "s3.json"
BOTO3_TARGET = 0.9  # dcp_safe throughput / boto3 throughput, at least (direct saves)
REPLICATION_TARGET = 0.95  # replicate_checkpoint / boto3_c1, at least (issue 18)

State = dict[str, Any]


# ----------------------------------------------------------------------------- the server


@contextlib.contextmanager
def moto_server() -> Iterator[tuple[LocalS3, psutil.Process]]:
    """``start_local_s3()`` in a child process; yields a client-side handle and the child."""
    code = (
        "import sys\n"
        "from dcp_safe.testing.s3 import start_local_s3\n"
        "s3 = start_local_s3()\n"
        "print(s3.endpoint_url, flush=True)\n"
        "sys.stdin.read()\n"
        "s3.stop()\n"
    )
    repo = Path(__file__).resolve().parent.parent
    child = subprocess.Popen(
        [sys.executable, "-c", code],
        cwd=repo,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,  # werkzeug logs every request
        text=True,
    )
    try:
        assert child.stdout is not None
        endpoint = child.stdout.readline().strip()
        if not endpoint.startswith("http://127.0.0.1:"):
            raise SystemExit(f"moto server did not start (got {endpoint!r})")
        yield LocalS3(endpoint_url=endpoint, _server=None), psutil.Process(child.pid)
    finally:
        if child.stdin is not None:
            child.stdin.close()
        try:
            child.wait(timeout=30)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()


def cpu_of(process: psutil.Process) -> float:
    times = process.cpu_times()
    return float(times.user + times.system)


def list_objects(client: Any, prefix: str) -> list[dict[str, Any]]:
    found: list[dict[str, Any]] = []
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix):
        found.extend(page.get("Contents", []))
    return found


def delete_prefix(client: Any, prefix: str) -> None:
    """Delete every object (and abort every open upload) under ``prefix``."""
    keys = [obj["Key"] for obj in list_objects(client, prefix)]
    for start in range(0, len(keys), 1000):
        batch = [{"Key": k} for k in keys[start : start + 1000]]
        client.delete_objects(Bucket=BUCKET, Delete={"Objects": batch, "Quiet": True})
    uploads = client.list_multipart_uploads(Bucket=BUCKET, Prefix=prefix).get("Uploads", [])
    for up in uploads:
        client.abort_multipart_upload(Bucket=BUCKET, Key=up["Key"], UploadId=up["UploadId"])


def stored_summary(client: Any, prefix: str) -> dict[str, Any]:
    """Objects under ``prefix``: count, bytes, and the part count of the largest (its ETag)."""
    objects = list_objects(client, prefix)
    largest = max(objects, key=lambda o: o["Size"], default=None)
    parts = 1
    if largest is not None and "-" in largest["ETag"]:
        parts = int(largest["ETag"].strip('"').rsplit("-", 1)[1])
    return {
        "objects": len(objects),
        "bytes": sum(o["Size"] for o in objects),
        "largest_bytes": 0 if largest is None else largest["Size"],
        "largest_parts": parts,
        "keys": sorted(o["Key"].removeprefix(prefix + "/") for o in objects),
    }


# ----------------------------------------------------------------------------- contenders


class TensorStream(io.RawIOBase):
    """A seekable read-only stream over the bytes of every tensor in ``state``, in order.

    ``read(n)`` copies at most once (``bytes`` of a memoryview slice, or one join where a read
    spans tensors), as any upload from memory must to hand botocore a body.
    """

    def __init__(self, state: State) -> None:
        super().__init__()
        self._views = [
            memoryview(v.contiguous().view(-1).view(torch.uint8).numpy())
            for v in state.values()
            if isinstance(v, torch.Tensor)
        ]
        self._starts: list[int] = []
        total = 0
        for view in self._views:
            self._starts.append(total)
            total += view.nbytes
        self._size = total
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._size}[whence]
        self._pos = max(0, min(self._size, base + offset))
        return self._pos

    def read(self, size: int | None = -1) -> bytes:
        end = self._size if size is None or size < 0 else min(self._size, self._pos + size)
        pieces = []
        for start, view in zip(self._starts, self._views, strict=True):
            lo, hi = max(self._pos, start), min(end, start + view.nbytes)
            if lo < hi:
                pieces.append(view[lo - start : hi - start])
        self._pos = end
        if len(pieces) == 1:
            return bytes(pieces[0])
        return b"".join(pieces)

    def readinto(self, buffer: Any) -> int:  # io.RawIOBase's read() would come here
        data = self.read(memoryview(buffer).nbytes)
        memoryview(buffer).cast("B")[: len(data)] = data
        return len(data)


@dataclass(frozen=True)
class Contender:
    label: str
    kind: str  # "dcp_safe", "replicate", "boto3", "fsspec" or "s3tc"
    threads: int
    block: str  # s3fs block size, or the boto3 part size
    run: Callable[[str], Any]  # called with the key prefix to upload under
    floor: str  # the boto3 contender to compare with
    peer: str | None  # the FsspecWriter contender to compare with


def make_contenders(
    state: State, local_root: Path, s3: LocalS3, read_timeout_s: float
) -> dict[str, Contender]:
    # dcp_safe's own read timeout (15 s, single_try_s3_options) is shorter than moto's
    # CompleteMultipartUpload of a 1 GiB object on this machine (moto sends nothing until it
    # is done): the upload then times out and is rewritten. Caller config_kwargs win there.
    timeouts = {"config_kwargs": {"read_timeout": read_timeout_s}}
    opts = s3.storage_options(**timeouts)
    opts64 = s3.storage_options(default_block_size=PART_BYTES, **timeouts)
    local_backend = open_backend(str(local_root))
    client = s3.client()

    def safe(threads: int, options: dict[str, Any]) -> Callable[[str], Any]:
        def run(prefix: str) -> None:
            writer = SafeStorageWriter(
                f"s3://{BUCKET}/{prefix}",
                storage_options=options,
                options=WriterOptions(thread_count=threads),
            )
            dcp.save(state, checkpoint_id=NAME, storage_writer=writer, no_dist=True)

        return run

    def replicate(options: dict[str, Any]) -> Callable[[str], Any]:
        def run(prefix: str) -> None:
            remote = open_backend(f"s3://{BUCKET}/{prefix}", options)
            replicate_checkpoint(local_backend, remote, NAME)

        return run

    def boto3_upload(threads: int, sdk_checksums: bool = True) -> Callable[[str], Any]:
        from boto3.s3.transfer import TransferConfig
        from botocore.config import Config

        # Without SDK checksums CreateMultipartUpload names no checksum algorithm, as s3fs's
        # does not: moto then builds a full-object CRC64NVME (a whole extra copy of the object
        # at CompleteMultipartUpload) instead of a CRC32 of the part checksums.
        uploader = client
        if not sdk_checksums:
            uploader = s3.client(Config(request_checksum_calculation="when_required"))

        config = TransferConfig(
            multipart_threshold=PART_BYTES,
            multipart_chunksize=PART_BYTES,
            max_concurrency=threads,
            preferred_transfer_client="classic",
        )
        # Parts read ahead of the uploads, bounded like the others (s3transfer's default: 10).
        config.max_in_memory_upload_chunks = threads + 1

        def run(prefix: str) -> None:
            uploader.upload_fileobj(TensorStream(state), BUCKET, f"{prefix}/raw.bin", Config=config)

        return run

    def fsspec(threads: int) -> Callable[[str], Any]:
        def run(prefix: str) -> None:
            writer = FsspecWriter(
                f"s3://{BUCKET}/{prefix}", sync_files=False, thread_count=threads, **opts
            )
            dcp.save(state, storage_writer=writer, no_dist=True)

        return run

    bs = "50 MiB (s3fs default)"
    bs64 = "64 MiB"
    return s3tc_contenders(state, s3) | {
        "safe_t1": Contender("dcp_safe", "dcp_safe", 1, bs, safe(1, opts), "boto3_c1", "fsspec_t1"),
        "safe_t1_bs64": Contender(
            "dcp_safe", "dcp_safe", 1, bs64, safe(1, opts64), "boto3_c1", "fsspec_t1"
        ),
        "safe_t2": Contender("dcp_safe", "dcp_safe", 2, bs, safe(2, opts), "boto3_c2", "fsspec_t2"),
        "safe_t2_bs64": Contender(
            "dcp_safe", "dcp_safe", 2, bs64, safe(2, opts64), "boto3_c2", "fsspec_t2"
        ),
        "replicate": Contender(
            "dcp_safe replicate_checkpoint, 4 parts in flight",
            "replicate",
            1,
            bs,
            replicate(opts),
            "boto3_c1",
            None,
        ),
        "replicate_p1": Contender(
            "dcp_safe replicate_checkpoint, 1 part in flight",
            "replicate",
            1,
            bs,
            replicate({**opts, "max_concurrency": 1}),
            "boto3_c1",
            None,
        ),
        "boto3_c1": Contender(
            "boto3 upload_fileobj", "boto3", 1, "64 MiB parts", boto3_upload(1), "boto3_c1", None
        ),
        "boto3_c2": Contender(
            "boto3 upload_fileobj", "boto3", 2, "64 MiB parts", boto3_upload(2), "boto3_c2", None
        ),
        "boto3_c4": Contender(
            "boto3 upload_fileobj", "boto3", 4, "64 MiB parts", boto3_upload(4), "boto3_c4", None
        ),
        "boto3_c1_nocrc": Contender(
            "boto3 upload_fileobj, no SDK checksums",
            "boto3",
            1,
            "64 MiB parts",
            boto3_upload(1, sdk_checksums=False),
            "boto3_c1_nocrc",
            None,
        ),
        "fsspec_t1": Contender("torch FsspecWriter", "fsspec", 1, bs, fsspec(1), "boto3_c1", None),
        "fsspec_t2": Contender("torch FsspecWriter", "fsspec", 2, bs, fsspec(2), "boto3_c2", None),
    }


def s3tc_contenders(state: State, s3: LocalS3) -> dict[str, Contender]:
    """AWS's s3torchconnector DCP writer on the same moto server, where it is installed."""
    try:
        from s3torchconnector import S3ClientConfig
        from s3torchconnector._s3client import S3Client
        from s3torchconnector.dcp import S3FileSystem, S3StorageWriter
    except ImportError:
        return {}
    # The CRT client takes credentials from the environment; never from an instance metadata
    # service, which would be a request to another host.
    os.environ.update(
        AWS_ACCESS_KEY_ID=ACCESS_KEY,
        AWS_SECRET_ACCESS_KEY=SECRET_KEY,
        AWS_EC2_METADATA_DISABLED="true",
    )
    config = S3ClientConfig(force_path_style=True, part_size=PART_BYTES)

    def s3tc(threads: int) -> Callable[[str], Any]:
        def run(prefix: str) -> None:
            writer = S3StorageWriter(
                REGION, f"s3://{BUCKET}/{prefix}", s3client_config=config, thread_count=threads
            )
            # S3StorageWriter has no endpoint option; its file system takes a client that does.
            client = S3Client(REGION, endpoint=s3.endpoint_url, s3client_config=config)
            writer.fs = S3FileSystem(REGION, s3_client=client)
            dcp.save(state, storage_writer=writer, no_dist=True)

        return run

    label, part = "s3torchconnector S3StorageWriter", "64 MiB parts (CRT)"
    return {
        f"s3tc_t{n}": Contender(label, "s3tc", n, part, s3tc(n), f"boto3_c{n}", f"fsspec_t{n}")
        for n in (1, 2)
    }


def select(contenders: dict[str, Contender], names: str | None) -> dict[str, Contender]:
    """The contenders named (comma-separated), with the ones each is compared with."""
    if not names:
        return contenders
    wanted = {n.strip() for n in names.split(",") if n.strip()}
    unknown = wanted - set(contenders)
    if unknown:
        raise SystemExit(f"unknown contenders {sorted(unknown)}; known: {sorted(contenders)}")
    for name in list(wanted):
        c = contenders[name]
        wanted |= {c.floor} | ({c.peer} if c.peer else set())
    return {n: c for n, c in contenders.items() if n in wanted}


def save_local(state: State, root: Path) -> None:
    writer = SafeStorageWriter(root, options=WriterOptions(thread_count=1))
    dcp.save(state, checkpoint_id=NAME, storage_writer=writer, no_dist=True)


def check_stored(name: str, kind: str, stored: dict[str, Any], payload: int) -> None:
    keys = stored["keys"]
    if kind in ("dcp_safe", "replicate"):
        ok = f"{NAME}/{layout.COMMITTED_MARKER}" in keys
    elif kind in ("fsspec", "s3tc"):
        ok = ".metadata" in keys
    else:
        ok = stored["bytes"] == payload
    if not ok or stored["bytes"] < payload:
        raise SystemExit(f"{name}: the upload is incomplete: {stored}")


# ----------------------------------------------------------------------------- measuring


def measure_upload(
    name: str, contender: Contender, prefix: str, s3: LocalS3, server: psutil.Process, payload: int
) -> dict[str, Any]:
    """One upload, timed; then what was stored is checked and deleted."""
    server_cpu = cpu_of(server)
    with RssSampler(interval_s=0.02, pid=server.pid) as server_rss:
        run: dict[str, Any] = measure(lambda: contender.run(prefix))
    run["server_cpu_s"] = cpu_of(server) - server_cpu
    run["server_rss_peak_bytes"] = server_rss.peak_bytes
    client = s3.client()
    stored = stored_summary(client, prefix)
    check_stored(name, contender.kind, stored, payload)
    stored.pop("keys")
    run["stored"] = stored
    delete_prefix(client, prefix)
    run["server_rss_after_delete_bytes"] = int(server.memory_info().rss)
    return run


def warm_up(
    s3: LocalS3, server: psutil.Process, work: Path, read_timeout_s: float, names: str | None
) -> None:
    """Every contender once on a small state (imports, connections, s3fs instances)."""
    small = {k: v for k, v in make_state(0).items() if not k.startswith("layers.00.weight")}
    save_local(small, work / "warm_local")
    contenders = select(make_contenders(small, work / "warm_local", s3, read_timeout_s), names)
    for name, contender in contenders.items():
        measure_upload(name, contender, f"warm-{name}", s3, server, tensor_bytes(small))
    shutil.rmtree(work / "warm_local")


def bench_uploads(
    state: State,
    local_root: Path,
    s3: LocalS3,
    server: psutil.Process,
    rounds: int,
    read_timeout_s: float,
    names: str | None = None,
) -> dict[str, Any]:
    payload = tensor_bytes(state)
    contenders = select(make_contenders(state, local_root, s3, read_timeout_s), names)
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in contenders}
    orders = []
    for r in range(rounds):
        order = rotate(list(contenders), r)
        orders.append(order)
        for name in order:
            run = measure_upload(name, contenders[name], f"r{r}-{name}", s3, server, payload)
            runs[name].append(run)
            print(
                f"  round {r} {name:13s} {run['seconds']:7.2f} s "
                f"{payload / run['seconds'] / 1e6:6.1f} MB/s"
                f"  parts {run['stored']['largest_parts']}"
                f"  RSS +{format_size(run['rss_peak_delta_bytes'])}"
                f"  moto RSS {format_size(run['server_rss_peak_bytes'])}"
                f" -> {format_size(run['server_rss_after_delete_bytes'])}",
                flush=True,
            )
    out: dict[str, Any] = {}
    for name, rs in runs.items():
        c = contenders[name]
        out[name] = summarize(rs, payload) | {
            "label": c.label,
            "kind": c.kind,
            "threads": c.threads,
            "block": c.block,
            "floor": c.floor,
            "peer": c.peer,
            "median_mbps": payload / summarize(rs, payload)["median_s"] / 1e6,
            "median_server_cpu_s": sorted(r["server_cpu_s"] for r in rs)[len(rs) // 2],
            "server_rss_peak_bytes_max": max(r["server_rss_peak_bytes"] for r in rs),
            "server_rss_after_delete_bytes": [r["server_rss_after_delete_bytes"] for r in rs],
            "stored": rs[0]["stored"],
        }
    out["orders"] = orders
    return out


# ----------------------------------------------------------------------------- profiling


class _ProfiledWriter(SafeStorageWriter):
    """SafeStorageWriter with a cProfile around each shard file's write, in its own thread.

    (cProfile sees only the thread it runs in; dcp_safe writes shards on pool threads.)
    """

    profiles: list[cProfile.Profile]

    def _write_file(self, *args: Any, **kwargs: Any) -> Any:
        prof = cProfile.Profile()
        prof.enable()
        try:
            return super()._write_file(*args, **kwargs)
        finally:
            prof.disable()
            self.profiles.append(prof)


# Where the writing thread's time goes: (label, file suffix, function name, use cumulative).
_PROFILE_BUCKETS = [
    ("blocked in s3fs sync() (request on the IO loop)", "fsspec/asyn.py", "sync", True),
    ("  of which upload_part", "s3fs/core.py", "upload_part", True),
    ("  of which complete/commit", "s3fs/core.py", "commit", True),
    (
        "BytesIO.write (fsspec buffer append)",
        "~",
        "<method 'write' of '_io.BytesIO' objects>",
        False,
    ),
    (
        "BytesIO.read (part copied out of buffer)",
        "~",
        "<method 'read' of '_io.BytesIO' objects>",
        False,
    ),
    (
        "torch serialization (save_tensor_without_crc)",
        "torch_compat.py",
        "save_tensor_without_crc",
        True,
    ),
    ("waiting for the hash thread", "concurrent/futures/_base.py", "result", True),
]


def profile_one_upload(
    state: State, s3: LocalS3, threads: int, read_timeout_s: float
) -> dict[str, Any]:
    prefix = "profile"
    options = s3.storage_options(config_kwargs={"read_timeout": read_timeout_s})
    writer = _ProfiledWriter(
        f"s3://{BUCKET}/{prefix}",
        storage_options=options,
        options=WriterOptions(thread_count=threads),
    )
    writer.profiles = []
    start = time.perf_counter()
    dcp.save(state, checkpoint_id=NAME, storage_writer=writer, no_dist=True)
    seconds = time.perf_counter() - start
    delete_prefix(s3.client(), prefix)
    text = io.StringIO()
    stats = pstats.Stats(writer.profiles[0], stream=text)
    for prof in writer.profiles[1:]:
        stats.add(prof)
    stats.sort_stats("tottime").print_stats(15)
    raw: dict[Any, Any] = stats.stats  # type: ignore[attr-defined]
    total = max(
        (ct for (_f, _l, fn), (_cc, _nc, _tt, ct, _cl) in raw.items() if fn == "_write_file"),
        default=0.0,
    )
    buckets = []
    for label, suffix, func, cumulative in _PROFILE_BUCKETS:
        secs = sum(
            (ct if cumulative else tt)
            for (file, _line, fn), (_cc, _nc, tt, ct, _callers) in raw.items()
            if fn == func and file.endswith(suffix)
        )
        buckets.append({"what": label, "seconds": secs})
    return {
        "threads": threads,
        "wall_s": seconds,
        "write_file_s": total,
        "buckets": buckets,
        "top_tottime": text.getvalue(),
    }


# ----------------------------------------------------------------------------- reporting


def _verdict(ok: bool) -> str:
    return "met" if ok else "**missed**"


def report(results: dict[str, Any]) -> str:
    up = results["uploads"]
    payload = results["payload_bytes"]
    names = [n for n in up if n != "orders"]
    rows = []
    for name in names:
        r = up[name]
        floor = up[r["floor"]]
        rows.append(
            [
                name,
                r["label"],
                r["threads"],
                r["block"],
                f"{r['median_s']:.2f}",
                f"{r['min_s']:.2f} .. {r['max_s']:.2f}",
                f"{r['median_mbps']:.1f}",
                f"{floor['median_s'] / r['median_s']:.2f}",
                f"{up[r['peer']]['median_s'] / r['median_s']:.2f}" if r["peer"] else "",
                f"{r['median_cpu_s']:.1f}",
                f"{r['median_server_cpu_s']:.1f}",
                format_size(r["rss_peak_delta_bytes_max"]),
                r["stored"]["largest_parts"],
                format_size(r["server_rss_peak_bytes_max"]),
            ]
        )
    lines = [
        f"## S3 upload benchmark: {format_size(payload)} of tensors to moto on 127.0.0.1, "
        f"{results['args']['rounds']} rounds (medians)",
        "",
        describe_machine_line(results["machine"]),
        f"Load average at start {_load(results['machine'])}, at end {_load(results)}. "
        "MB/s = 10^6 bytes of tensor payload per second. Ratios are of medians "
        "(>1 = faster than the reference). Client CPU = this process (uploader); "
        "server CPU = the moto child. Peak RSS growth is this process's.",
        "",
        markdown_table(
            [
                "contender",
                "what",
                "threads",
                "block / part",
                "median s",
                "min .. max s",
                "MB/s",
                "/ boto3",
                "/ FsspecWriter",
                "client CPU s",
                "moto CPU s",
                "peak RSS growth",
                "parts",
                "moto RSS peak",
            ],
            rows,
        ),
        "",
    ]
    ratio_rows = []
    targets: dict[str, Any] = {}
    for name in names:
        r = up[name]
        if r["kind"] not in ("dcp_safe", "replicate"):
            continue
        ratio = up[r["floor"]]["median_s"] / r["median_s"]
        ratio_min = up[r["floor"]]["min_s"] / r["min_s"]
        targets[name] = {"vs_boto3": ratio, "vs_boto3_minima": ratio_min}
        if r["peer"]:
            targets[name]["vs_fsspec"] = up[r["peer"]]["median_s"] / r["median_s"]
        if r["threads"] == 1 and "boto3_c1_nocrc" in up:
            targets[name]["vs_boto3_nocrc"] = up["boto3_c1_nocrc"]["median_s"] / r["median_s"]
        target = REPLICATION_TARGET if r["kind"] == "replicate" else BOTO3_TARGET
        ratio_rows.append(
            [
                f"{name} / {r['floor']}",
                f"{ratio:.2f}",
                f"{ratio_min:.2f}",
                f">= {target}",
                _verdict(ratio >= target),
                f"{targets[name].get('vs_fsspec', float('nan')):.2f}" if r["peer"] else "",
                f"{targets[name]['vs_boto3_nocrc']:.2f}"
                if "vs_boto3_nocrc" in targets[name]
                else "",
            ]
        )
    results["ratios"] = targets
    lines += [
        "### dcp_safe throughput vs the boto3 floor",
        "",
        markdown_table(
            [
                "ratio",
                "median",
                "of minima",
                "target",
                "verdict",
                "dcp_safe / FsspecWriter",
                "/ boto3_c1_nocrc",
            ],
            ratio_rows,
        ),
    ]
    prof = results.get("profile")
    if prof:
        lines += [
            "",
            f"### Where one dcp_safe upload's writing thread spends its time "
            f"(thread_count {prof['threads']}, cProfile, {prof['wall_s']:.2f} s wall, "
            f"_write_file {prof['write_file_s']:.2f} s)",
            "",
            markdown_table(
                ["where", "s", "share of _write_file"],
                [
                    [
                        b["what"],
                        f"{b['seconds']:.2f}",
                        f"{100 * b['seconds'] / prof['write_file_s']:.0f}%",
                    ]
                    for b in prof["buckets"]
                ],
            ),
        ]
    return "\n".join(lines)


def _load(info: dict[str, Any]) -> str:
    return " / ".join(f"{x:.1f}" for x in info.get("load_average") or ())


# ----------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-gib", type=float, default=1.0, help="tensor bytes to upload")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of every contender")
    parser.add_argument("--profile", action="store_true", help="always profile one upload")
    parser.add_argument(
        "--read-timeout",
        type=float,
        default=300.0,
        help="botocore read_timeout for the s3fs-based writers (dcp_safe's default: 15 s)",
    )
    parser.add_argument(
        "--contenders",
        default=None,
        help="comma-separated subset, e.g. replicate,replicate_p1 (default: all)",
    )
    parser.add_argument("--dir", default=None, help="local checkpoint folder (default: temp)")
    parser.add_argument("--out", default=str(DEFAULT_OUT), help="JSON results file")
    return parser.parse_args(argv)


def run(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    size_bytes = int(args.size_gib * (1 << 30))
    results: dict[str, Any] = {
        "args": vars(args),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": describe_machine(str(work)),
        "notes": {
            "read_timeout": "config_kwargs read_timeout=--read-timeout for dcp_safe and "
            "FsspecWriter: dcp_safe's 15 s default times out on moto's CompleteMultipartUpload "
            "of a 1 GiB object (a direct save then rewrites the file; replication fails)",
            "server": "moto ThreadedMotoServer (dcp_safe.testing.s3.start_local_s3) in a child "
            "process on 127.0.0.1, dummy credentials",
            "boto3": "client.upload_fileobj from a seekable stream over the tensors' memory, "
            f"TransferConfig(multipart_threshold=multipart_chunksize={PART_BYTES}, "
            "max_concurrency=N, max_in_memory_upload_chunks=N+1)",
            "fsspec": "torch FsspecWriter(path, sync_files=False, thread_count=N, "
            "**storage_options)",
            "replicate": "replicate_checkpoint(open_backend(local), open_backend(s3 url), name) "
            "of a local checkpoint saved with thread_count=1; default chunk_bytes; replicate_p1 "
            "with max_concurrency=1 in the remote's storage options",
            "s3tc": "s3torchconnector S3StorageWriter(region, url, S3ClientConfig("
            f"force_path_style=True, part_size={PART_BYTES}), thread_count=N) with its file "
            "system's client replaced by S3Client(region, endpoint=moto URL); dummy credentials "
            "in the environment, AWS_EC2_METADATA_DISABLED=true",
        },
    }
    with moto_server() as (s3, server):
        s3.create_bucket(BUCKET)
        print(f"moto at {s3.endpoint_url} (pid {server.pid}); warming up", flush=True)
        warm_up(s3, server, work, args.read_timeout, args.contenders)
        state = make_state(size_bytes)
        results["payload_bytes"] = tensor_bytes(state)
        local_root = work / "local"
        save_local(state, local_root)
        print(
            f"uploading {format_size(results['payload_bytes'])}, {args.rounds} rounds", flush=True
        )
        results["uploads"] = bench_uploads(
            state, local_root, s3, server, args.rounds, args.read_timeout, args.contenders
        )
        up = results["uploads"]
        missed = "safe_t1" in up and (
            up["boto3_c1"]["median_s"] / up["safe_t1"]["median_s"] < BOTO3_TARGET
        )
        if args.profile or missed:
            print("profiling one dcp_safe upload (thread_count 1)", flush=True)
            results["profile"] = profile_one_upload(state, s3, 1, args.read_timeout)
            print(results["profile"]["top_tottime"])
    results["load_average"] = os.getloadavg()
    return results


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return run_and_report(
        "bench_s3_",
        args.dir,
        lambda work: run(args, work),
        report,
        lambda r: write_results(Path(args.out), r),
    )


if __name__ == "__main__":
    sys.exit(main())
