"""The checkpoint's files treated as untrusted input: headers, index and paths are checked before any read.

Every problem is a ``ValueError`` naming the file and, where there is one, the tensor key or field:

* only regular files are opened (a FIFO or device named as a shard or config would block or stream forever);
* an index may only name shards inside the checkpoint folder (no absolute paths, no ``..``);
* a safetensors header must be a JSON object of well-formed entries whose byte ranges fit the file, tile the
  data section exactly and agree with dtype x shape — so the reader never seeks outside the file or hands a
  malformed entry to the safetensors library;
* a key may appear only once: twice in one header, or in two shards, is refused (the last one silently winning
  would mix weights).
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path, PurePosixPath
from typing import Any

from kimik3.util.files import read_regular_bytes, require_regular_file

__all__ = ["require_regular_file", "read_json_file", "read_index", "read_header", "safe_member", "DTYPE_BYTES"]

MAX_HEADER_BYTES = 100_000_000  # the safetensors library's own limit
MAX_JSON_BYTES = 64_000_000  # config.json / index files are kilobytes to a few megabytes

DTYPE_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "F8_E8M0": 1, "I16": 2, "U16": 2, "F16": 2,
               "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict:
    out: dict = {}
    for k, v in pairs:
        if k in out:
            raise _DuplicateKey(k)
        out[k] = v
    return out


class _DuplicateKey(Exception):
    pass


def _loads(data: bytes | str, where: str) -> Any:
    try:
        return json.loads(data, object_pairs_hook=_no_duplicates)
    except _DuplicateKey as e:
        raise ValueError(f"{where}: key {e.args[0]!r} appears twice") from None
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
        raise ValueError(f"{where}: not valid JSON ({type(e).__name__}: {str(e)[:200]})") from None


def read_json_file(path: Path, what: str = "file") -> Any:
    """Parse a small JSON file (config.json, an index), refusing non-regular files and absurd sizes."""
    return _loads(read_regular_bytes(path, what, MAX_JSON_BYTES), str(path))


def safe_member(root: Path, name: Any, where: str) -> Path:
    """A file name from an index -> path inside ``root``; anything that could leave the folder is refused."""
    if not isinstance(name, str) or not name or "\x00" in name or "\\" in name:
        raise ValueError(f"{where}: shard name {name!r} is not a plain relative file name")
    pure = PurePosixPath(name)
    if pure.is_absolute() or ".." in pure.parts or name.startswith("~"):
        raise ValueError(f"{where}: shard name {name!r} points outside the checkpoint folder {root}")
    return root / pure


def read_index(index: Path, root: Path) -> dict[str, Path]:
    """``model.safetensors.index.json`` -> {tensor key: shard path inside ``root``}."""
    data = read_json_file(index, "checkpoint index")
    if not isinstance(data, dict):
        raise ValueError(f"{index}: malformed index: expected a JSON object, got {type(data).__name__}")
    if "weight_map" not in data:
        raise ValueError(f"{index}: malformed index: no 'weight_map'")
    wm = data["weight_map"]
    if not isinstance(wm, dict):
        raise ValueError(f"{index}: malformed index: 'weight_map' must be an object, got {type(wm).__name__}")
    if not wm:
        raise ValueError(f"{index}: malformed index: 'weight_map' is empty")
    return {k: safe_member(root, v, f"{index} (key {k!r})") for k, v in wm.items()}


def read_header(f: Path) -> dict[str, dict]:
    """Validate a safetensors file's header against its size; returns {key: entry} without ``__metadata__``."""
    st = require_regular_file(f, "safetensors shard")
    size = st.st_size
    try:
        fh = open(f, "rb")
    except OSError as e:
        raise ValueError(f"safetensors shard {f} cannot be read: {e.strerror or e}") from None
    with fh:
        head = fh.read(8)
        if len(head) < 8:
            raise ValueError(f"{f}: truncated safetensors file ({size} bytes, no header)")
        (n,) = struct.unpack("<Q", head)
        if n > size - 8:
            raise ValueError(f"{f}: truncated safetensors file (header claims {n} bytes, file has {size})")
        if n > MAX_HEADER_BYTES:
            raise ValueError(f"{f}: safetensors header of {n} bytes exceeds the {MAX_HEADER_BYTES}-byte limit")
        raw = fh.read(n)
    header = _loads(raw, f"{f}: corrupt safetensors header")
    if not isinstance(header, dict):
        raise ValueError(f"{f}: corrupt safetensors header: expected a JSON object, got {type(header).__name__}")
    meta = header.pop("__metadata__", None)
    if meta is not None and not (isinstance(meta, dict) and all(isinstance(v, str) for v in meta.values())):
        raise ValueError(f"{f}: corrupt safetensors header: '__metadata__' must map strings to strings")
    data_size = size - 8 - n
    spans = []
    for key, e in header.items():
        where = f"{f}: tensor {key!r}"
        if not isinstance(e, dict):
            raise ValueError(f"{where}: header entry must be an object, got {type(e).__name__}")
        for field in ("dtype", "shape", "data_offsets"):
            if field not in e:
                raise ValueError(f"{where}: header entry has no {field!r}")
        dt, shape, offs = e["dtype"], e["shape"], e["data_offsets"]
        if not isinstance(dt, str) or dt not in DTYPE_BYTES:
            raise ValueError(f"{where}: unsupported dtype {dt!r}")
        if not (isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape)):
            raise ValueError(f"{where}: shape {shape!r} must be a list of non-negative integers")
        if not (isinstance(offs, list) and len(offs) == 2 and all(type(o) is int for o in offs)
                and 0 <= offs[0] <= offs[1]):
            raise ValueError(f"{where}: data_offsets {offs!r} must be [begin, end] with 0 <= begin <= end")
        if offs[1] > data_size:
            raise ValueError(f"{f}: truncated safetensors file: tensor {key!r} ends at byte {offs[1]} of a "
                             f"{data_size}-byte data section")
        need = math.prod(shape) * DTYPE_BYTES[dt]
        if offs[1] - offs[0] != need:
            raise ValueError(f"{where}: data_offsets span {offs[1] - offs[0]} bytes, but {dt} {shape} needs {need}")
        spans.append((offs[0], offs[1], key))
    pos = 0
    for begin, end, key in sorted(spans):
        if begin != pos:
            what = "overlaps the previous tensor" if begin < pos else f"leaves a gap at byte {pos}"
            raise ValueError(f"{f}: tensor {key!r}: data_offsets {[begin, end]} {what}")
        pos = end
    if pos != data_size:
        raise ValueError(f"{f}: the tensors cover {pos} bytes of a {data_size}-byte data section "
                         "(truncated or trailing data)")
    return header
