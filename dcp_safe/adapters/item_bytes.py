"""One write item's stored form: the bytes ``SafeStorageWriter`` lays down for it.

Shared by the writer and by whatever must reproduce those bytes without storage (the manager's
in-memory tier checks a kept copy against the manifest's checksums by writing each item again
into a hashing sink that stores nothing).
"""

from __future__ import annotations

import io
from typing import IO, Any, cast

import zstandard
from torch.distributed.checkpoint.planner import WriteItem, WriteItemType

from dcp_safe.adapters.tensor_records import minimal_cpu_tensor, template_parts
from dcp_safe.checkpoints.items import ZSTD_DESCRIPTOR
from dcp_safe.errors import ConfigError
from dcp_safe.manifest.blocks import BLOCK_DIGEST_MIN_BYTES
from dcp_safe.manifest.streams import HashingSink
from dcp_safe.torch_compat import save_tensor_without_crc

__all__ = ["write_item"]


def write_item(
    out: HashingSink,
    item: WriteItem,
    data: Any,
    *,
    compressed: bool,
    block_bytes: int | None = None,
) -> tuple[str, ...]:
    """Write ``data`` (the planner's ``resolve_data(item)``) to ``out`` as the writer stores it;
    return the item's transform descriptors.

    ``block_bytes``: also have ``out`` digest a large uncompressed tensor's data in blocks of
    this size (:meth:`HashingSink.take_blocks`); only where the data lies as one run of the
    tensor's raw bytes, which is what a partial read assumes.
    """
    target: Any = (
        zstandard.ZstdCompressor().stream_writer(cast(IO[bytes], out), closefd=False)
        if compressed
        else out
    )
    if item.type == WriteItemType.BYTE_IO:
        if not isinstance(data, io.BytesIO):
            raise ConfigError(f"planner resolved {item.index.fqn} to {type(data).__name__}")
        target.write(data.getbuffer())
    else:
        tensor = minimal_cpu_tensor(data)
        # torch.save's exact bytes from a template where it can (36 us an item instead of
        # 370 here); torch.save itself for the rest.
        parts = template_parts(tensor)
        if parts is None:
            save_tensor_without_crc(tensor, target)
        else:
            prefix, payload, _ = parts
            if block_bytes and not compressed and payload.nbytes >= BLOCK_DIGEST_MIN_BYTES:
                out.hash_blocks(at=len(prefix), length=payload.nbytes, block_bytes=block_bytes)
            for part in parts:
                target.write(part)
    if compressed:
        target.close()
        return (ZSTD_DESCRIPTOR,)
    return ()
