"""What a cubin says about each kernel it holds, read from its ELF sections on any machine: registers
(``EIATTR_REGCOUNT``), the block shape it was compiled for (``EIATTR_REQNTID`` / ``EIATTR_MAX_THREADS``), static
shared memory (``.nv.shared.<kernel>``), the stack frame (``EIATTR_FRAME_SIZE``). The preflight compares these
with the compile report and the design before the first launch. docs/device-check.md."""

from __future__ import annotations

import struct
from typing import Any

# EIATTR codes of the .nv.info sections (the attribute table the CUDA driver reads when it loads a cubin)
EIATTR = {0x05: "max_threads", 0x10: "reqntid", 0x11: "frame_bytes", 0x1B: "maxreg_count", 0x2F: "registers",
          0x12: "min_stack_bytes", 0x23: "max_stack_bytes"}
_EIFMT_NVAL, _EIFMT_BVAL, _EIFMT_HVAL, _EIFMT_SVAL = 0x01, 0x02, 0x03, 0x04


class CubinError(ValueError):
    """A cubin that is not a 64-bit little-endian CUDA ELF, or whose attribute tables are cut."""


def _sections(data: bytes) -> tuple[list[dict[str, Any]], list[str]]:
    if len(data) < 64 or data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        raise CubinError("not a 64-bit little-endian ELF file")
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    if shoff + shnum * shentsize > len(data) or shentsize < 64 or shstrndx >= shnum:
        raise CubinError("section header table out of bounds")
    secs = []
    for i in range(shnum):
        name, typ, _flags, _addr, off, size, link, info, _align, entsize = struct.unpack_from(
            "<IIQQQQIIQQ", data, shoff + i * shentsize)
        secs.append({"name_off": name, "type": typ, "offset": off, "size": size, "link": link, "info": info,
                     "entsize": entsize})
    strtab = secs[shstrndx]
    names = []
    for s in secs:
        start = strtab["offset"] + s["name_off"]
        end = data.find(b"\0", start)
        names.append(data[start:end].decode(errors="replace"))
    return secs, names


def _symbols(data: bytes, secs: list[dict[str, Any]], names: list[str]) -> list[str]:
    """Symbol names by index (``.symtab``): the attribute tables refer to kernels by symbol index."""
    i = names.index(".symtab") if ".symtab" in names else -1
    if i < 0:
        return []
    sym, strtab = secs[i], secs[secs[i]["link"]]
    out = []
    for k in range(sym["size"] // 24):
        st_name, = struct.unpack_from("<I", data, sym["offset"] + 24 * k)
        start = strtab["offset"] + st_name
        out.append(data[start:data.find(b"\0", start)].decode(errors="replace"))
    return out


def _attributes(blob: bytes) -> list[tuple[int, bytes]]:
    out, i = [], 0
    while i + 4 <= len(blob):
        fmt, attr = blob[i], blob[i + 1]
        if fmt == _EIFMT_SVAL:
            size, = struct.unpack_from("<H", blob, i + 2)
            if i + 4 + size > len(blob):
                raise CubinError(f"attribute 0x{attr:02x} runs past its section")
            out.append((attr, blob[i + 4:i + 4 + size]))
            i += 4 + size
        elif fmt in (_EIFMT_NVAL, _EIFMT_BVAL, _EIFMT_HVAL):
            out.append((attr, blob[i + 2:i + 4]))
            i += 4
        else:
            raise CubinError(f"unknown attribute format 0x{fmt:02x} at byte {i}")
    return out


def kernel_attributes(data: bytes) -> dict[str, dict[str, Any]]:
    """Per kernel (entry) name: ``registers``, ``static_shared_bytes``, ``reqntid`` / ``max_threads`` (when the
    kernel was compiled with one), ``frame_bytes``."""
    secs, names = _sections(data)
    syms = _symbols(data, secs, names)
    kernels: dict[str, dict[str, Any]] = {}
    for n in names:
        if n.startswith(".text."):
            kernels[n[len(".text."):]] = {"static_shared_bytes": 0}
    for s, n in zip(secs, names):
        if n.startswith(".nv.shared.") and n[len(".nv.shared."):] in kernels:
            kernels[n[len(".nv.shared."):]]["static_shared_bytes"] = s["size"]
        if not n.startswith(".nv.info"):
            continue
        blob = data[s["offset"]:s["offset"] + s["size"]]
        own = n[len(".nv.info."):] if n.startswith(".nv.info.") else None
        for attr, val in _attributes(blob):
            key = EIATTR.get(attr)
            if key is None:
                continue
            if own is None and len(val) == 8:  # the global table: (symbol index, value) per kernel
                idx, v = struct.unpack("<II", val)
                target = syms[idx] if idx < len(syms) else None
                if target in kernels:
                    kernels[target][key] = v
            elif own in kernels:
                if key in ("reqntid", "max_threads") and len(val) >= 12:
                    kernels[own][key] = list(struct.unpack_from("<III", val))
                elif key == "maxreg_count":
                    kernels[own][key] = struct.unpack("<H", val[:2])[0]
    return kernels
