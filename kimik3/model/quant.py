"""Quantized weight formats, each defined once: what the releases ship, read exactly and written back.

* **MXFP4** (compressed-tensors ``mxfp4-pack-quantized``, the K3 release's routed experts, spec §5.5);
* **FP8 block-scaled** (``quant_method: "fp8"``, DeepSeek-V3 / Kimi-K2 Instruct: one fp32 scale per 128×128 block);
* **INT pack-quantized** (compressed-tensors ``pack-quantized``, Kimi-K2-Thinking's INT4 experts).

Every decoder returns fp32 stored value × scale (exact), so the caller casts once. The checkpoint's
``quantization_config`` (:func:`parse_quantization_config`) decides which tensors are quantized; an inconsistency
is a ``ValueError`` naming the tensor. :class:`QuantizedExperts` keeps MXFP4 experts as the checkpoint's bytes
(``quantized_experts="keep"``); :func:`expert_memory` states what each form costs. Format details:
docs/architecture.md#appendix-design-notes-by-room.
"""

from __future__ import annotations

import functools
import math
import re
from dataclasses import dataclass, field

import torch

from kimik3.model.patterns import Pattern, compile_pattern

__all__ = [
    "E2M1_VALUES", "MXFP4_GROUP", "FP8_BLOCK", "FP8_MAX", "QUANT_SUFFIXES", "QuantSpec", "e8m0_to_float",
    "mxfp4_dequantize", "mxfp4_quantize", "fp8_block_dequantize", "fp8_block_quantize", "pack_int32",
    "unpack_int32", "int_group_dequantize", "int_group_quantize", "parse_quantization_config", "EXPORT_FORMATS",
    "export_quantization_config", "export_tensors", "EXPERT_WEIGHTS", "mxfp4_nbytes", "expert_memory",
    "describe_expert_memory", "format_bytes", "QuantizedExperts", "experts_mxfp4",
]

# ====================================================================== MXFP4 (§5.5)

# E2M1 code -> value: bit 3 is the sign.
E2M1_VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])
MXFP4_GROUP = 32


def e8m0_to_float(scale: torch.Tensor) -> torch.Tensor:
    """Scale byte e -> 2^(e-127) exactly, built from fp32 bit patterns (e = 0 is the subnormal 2^-127; 255 is NaN)."""
    e = scale.to(torch.int32)
    bits = torch.where(e > 0, e << 23, torch.full_like(e, 1 << 22))
    out = bits.view(torch.float32)
    return torch.where(e == 255, torch.full_like(out, float("nan")), out)


def mxfp4_dequantize(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """U8 [R, C/2] codes (low nibble = even column) and U8 [R, C/32] E8M0 scales -> [R, C] weights."""
    if packed.dtype != torch.uint8 or scale.dtype != torch.uint8:
        raise ValueError(f"MXFP4 tensors must be uint8, got packed {packed.dtype} and scale {scale.dtype}")
    if packed.dim() != 2:
        raise ValueError(f"MXFP4 packed weights must be 2-D, got shape {list(packed.shape)}")
    R, half = packed.shape
    C = 2 * half
    if C % MXFP4_GROUP or tuple(scale.shape) != (R, C // MXFP4_GROUP):
        raise ValueError(f"MXFP4 scale shape {tuple(scale.shape)} does not match packed {tuple(packed.shape)} "
                         f"(expected [{R}, {C // MXFP4_GROUP}] and a width that is a multiple of {MXFP4_GROUP})")
    if bool((scale == 255).any()):
        raise ValueError("weight_scale holds the E8M0 NaN byte 255; expected finite scales")
    codes = torch.stack([packed & 0xF, packed >> 4], -1).reshape(R, C).long()
    vals = E2M1_VALUES.to(packed.device)[codes]
    return (vals * e8m0_to_float(scale).repeat_interleave(MXFP4_GROUP, 1)).to(dtype)


def mxfp4_quantize(w: torch.Tensor, rows_per_chunk: int = 4096) -> tuple[torch.Tensor, torch.Tensor]:
    """Our own packer (the release's is not public), for [..., C] weights on any device, in row chunks so that
    packing a K3 expert stack on a GPU stays within a few hundred MB of scratch.

    Per 32 columns the scale is the smallest power of two that fits the block's max |w| into E2M1's range (6);
    each weight rounds to the nearest code (ties to the smaller magnitude). Low nibble = even column.
    Returns (packed U8 [..., C/2], scale U8 [..., C/32])."""
    lead, C = tuple(w.shape[:-1]), w.shape[-1]
    if C % MXFP4_GROUP:
        raise ValueError(f"MXFP4 needs the input width to be a multiple of {MXFP4_GROUP}, got {C}")
    flat = w.reshape(-1, C)
    R = flat.shape[0]
    packed = torch.empty(R, C // 2, dtype=torch.uint8, device=w.device)
    scale = torch.empty(R, C // MXFP4_GROUP, dtype=torch.uint8, device=w.device)
    if w.device.type == "meta":
        return packed.view(*lead, C // 2), scale.view(*lead, C // MXFP4_GROUP)
    mags = E2M1_VALUES[:8].to(w.device)
    for r0 in range(0, R, rows_per_chunk):
        blocks = flat[r0:r0 + rows_per_chunk].float().reshape(-1, C // MXFP4_GROUP, MXFP4_GROUP)
        amax = blocks.abs().amax(-1).clamp_min(2.0**-126)
        exp = torch.ceil(torch.log2(amax / 6.0)).clamp(-127, 127)
        sc = (exp + 127).to(torch.uint8)
        x = blocks / e8m0_to_float(sc)[..., None]
        code = (x.abs()[..., None] - mags).abs().argmin(-1)  # nearest magnitude, first (smaller) on ties
        code = code + 8 * ((x < 0) & (code > 0)).long()
        code = code.reshape(-1, C).to(torch.uint8)
        packed[r0:r0 + rows_per_chunk] = code[:, 0::2] | (code[:, 1::2] << 4)
        scale[r0:r0 + rows_per_chunk] = sc
    return packed.view(*lead, C // 2), scale.view(*lead, C // MXFP4_GROUP)


# ====================================================================== FP8 e4m3, 128×128 blocks

FP8_BLOCK = (128, 128)
FP8_MAX = 448.0  # largest finite e4m3fn value


def fp8_block_dequantize(w: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int] = FP8_BLOCK
                         ) -> torch.Tensor:
    """F8_E4M3 [R, C] and per-block multipliers [⌈R/b0⌉, ⌈C/b1⌉] -> fp32 [R, C] = w × scale_inv (DeepSeek's
    ``weight_dequant``; despite the name the stored value multiplies)."""
    if w.dtype != torch.float8_e4m3fn:
        raise ValueError(f"FP8 weight must be F8_E4M3 (float8_e4m3fn), got {w.dtype}")
    if w.dim() != 2:
        raise ValueError(f"FP8 weight must be 2-D, got shape {list(w.shape)}")
    R, C = w.shape
    want = (math.ceil(R / block[0]), math.ceil(C / block[1]))
    if tuple(scale_inv.shape) != want:
        raise ValueError(f"weight_scale_inv has shape {list(scale_inv.shape)}, expected {list(want)} for a "
                         f"[{R}, {C}] weight in {block[0]}x{block[1]} blocks")
    if not scale_inv.is_floating_point() or scale_inv.dtype == torch.float8_e4m3fn:
        raise ValueError(f"weight_scale_inv must be F32/BF16/F16, got {scale_inv.dtype}")
    s = scale_inv.float().repeat_interleave(block[0], 0)[:R].repeat_interleave(block[1], 1)[:, :C]
    return w.float() * s


def fp8_block_quantize(w: torch.Tensor, block: tuple[int, int] = FP8_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """[R, C] -> (F8_E4M3 weight, fp32 scale_inv [⌈R/b0⌉, ⌈C/b1⌉]): each block scaled so its max |w| maps to 448."""
    R, C = w.shape
    nb0, nb1 = math.ceil(R / block[0]), math.ceil(C / block[1])
    padded = torch.zeros(nb0 * block[0], nb1 * block[1], dtype=torch.float32, device=w.device)
    padded[:R, :C] = w.float()
    blocks = padded.view(nb0, block[0], nb1, block[1])
    amax = blocks.abs().amax(dim=(1, 3))
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    s = scale.repeat_interleave(block[0], 0)[:R].repeat_interleave(block[1], 1)[:, :C]
    q = (w.float() / s).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale


# ====================================================================== INT pack-quantized (compressed-tensors)


def pack_int32(q: torch.Tensor, num_bits: int) -> torch.Tensor:
    """Signed ints [R, C] in [-2^(b-1), 2^(b-1)) -> int32 [R, ⌈C·b/32⌉]: element i at bit i·b of the row, offset by
    2^(b-1), little-endian words (compressed-tensors ``pack_to_int32``, packed_dim 1)."""
    if not 1 <= num_bits <= 8:
        raise ValueError(f"num_bits must be in 1..8, got {num_bits}")
    R, C = q.shape
    v = (q.to(torch.int64) + (1 << (num_bits - 1))) & ((1 << num_bits) - 1)
    words = math.ceil(C * num_bits / 32)
    out = torch.zeros(R, words + 1, dtype=torch.int64, device=q.device)
    start = torch.arange(C, device=q.device) * num_bits
    w_idx, off = start // 32, start % 32
    out.index_add_(1, w_idx, v << off)  # disjoint bit ranges: addition is bitwise or
    spill = off + num_bits > 32
    if spill.any():
        out.index_add_(1, w_idx[spill] + 1, v[:, spill] >> (32 - off[spill]))
    out = out[:, :words] & 0xFFFFFFFF
    return torch.where(out >= 2**31, out - 2**32, out).to(torch.int32)


def unpack_int32(packed: torch.Tensor, num_bits: int, cols: int) -> torch.Tensor:
    """Inverse of :func:`pack_int32`: int32 [R, ⌈cols·b/32⌉] -> int64 [R, cols] signed values."""
    R, words = packed.shape
    if words != math.ceil(cols * num_bits / 32):
        raise ValueError(f"packed width {words} int32 words does not hold {cols} {num_bits}-bit values "
                         f"(expected {math.ceil(cols * num_bits / 32)})")
    u = packed.to(torch.int64) & 0xFFFFFFFF
    u = torch.cat([u, torch.zeros(R, 1, dtype=torch.int64, device=packed.device)], 1)
    start = torch.arange(cols, device=packed.device) * num_bits
    w_idx, off = start // 32, start % 32
    both = u[:, w_idx] | (u[:, w_idx + 1] << 32)  # a value may straddle two words
    v = (both >> off) & ((1 << num_bits) - 1)
    return v - (1 << (num_bits - 1))


def int_group_dequantize(packed: torch.Tensor, scale: torch.Tensor, shape: torch.Tensor | tuple[int, ...],
                         num_bits: int, group_size: int | None, zero_point: torch.Tensor | None = None
                         ) -> torch.Tensor:
    """compressed-tensors ``pack-quantized`` -> fp32 [R, C] = (q − zero_point) × scale, one scale per
    ``group_size`` columns (``None``: one per row, the channel strategy)."""
    if packed.dtype != torch.int32 or packed.dim() != 2:
        raise ValueError(f"weight_packed must be a 2-D int32 tensor, got {packed.dtype} {list(packed.shape)}")
    dims = [int(x) for x in (shape.tolist() if isinstance(shape, torch.Tensor) else shape)]
    if len(dims) != 2 or dims[0] != packed.shape[0] or dims[1] <= 0:
        raise ValueError(f"weight_shape {dims} does not match weight_packed {list(packed.shape)} (expected "
                         f"[{packed.shape[0]}, columns])")
    R, C = dims
    if packed.shape[1] != math.ceil(C * num_bits / 32):
        raise ValueError(f"weight_packed has {packed.shape[1]} int32 words per row; {C} {num_bits}-bit values "
                         f"need {math.ceil(C * num_bits / 32)}")
    groups = math.ceil(C / group_size) if group_size else 1
    if tuple(scale.shape) != (R, groups):
        raise ValueError(f"weight_scale has shape {list(scale.shape)}, expected [{R}, {groups}] "
                         f"(group size {group_size or 'per row'} over {C} columns)")
    if not scale.is_floating_point():
        raise ValueError(f"weight_scale must be floating point, got {scale.dtype}")
    q = unpack_int32(packed, num_bits, C).float()
    if zero_point is not None:
        want = math.ceil(R * num_bits / 32)
        if zero_point.dtype != torch.int32 or tuple(zero_point.shape) != (want, groups):
            raise ValueError(f"weight_zero_point has {zero_point.dtype} {list(zero_point.shape)}, expected int32 "
                             f"[{want}, {groups}] (packed along the output dimension)")
        zp = unpack_int32(zero_point.t().contiguous(), num_bits, R).t().float()
        q = q - _expand_groups(zp, group_size, C)
    return q * _expand_groups(scale.float(), group_size, C)


def _expand_groups(t: torch.Tensor, group_size: int | None, cols: int) -> torch.Tensor:
    return t.expand(-1, cols) if not group_size else t.repeat_interleave(group_size, 1)[:, :cols]


def int_group_quantize(w: torch.Tensor, num_bits: int = 4, group_size: int = 32,
                       scale_dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """Symmetric round-to-nearest: scale = max|w| / (2^(b-1) − 0.5) per group (stored in ``scale_dtype``),
    q = round(w / scale) clamped to the signed range. Returns the compressed-tensors tensors of one module."""
    R, C = w.shape
    groups = math.ceil(C / group_size)
    padded = torch.zeros(R, groups * group_size, dtype=torch.float32, device=w.device)
    padded[:, :C] = w.float()
    amax = padded.view(R, groups, group_size).abs().amax(-1)
    qmax = 1 << (num_bits - 1)
    scale = torch.where(amax > 0, amax / (qmax - 0.5), torch.ones_like(amax)).to(scale_dtype)
    q = torch.round(w.float() / _expand_groups(scale.float(), group_size, C)).clamp(-qmax, qmax - 1)
    return {"weight_packed": pack_int32(q.to(torch.int64), num_bits), "weight_scale": scale,
            "weight_shape": torch.tensor([R, C], dtype=torch.int64)}


# ====================================================================== quantization_config

QUANT_SUFFIXES = ("weight_packed", "weight_scale", "weight_shape", "weight_zero_point", "weight_scale_inv")


@dataclass(frozen=True)
class QuantSpec:
    """What a checkpoint's ``quantization_config`` says. ``method``: "fp8" (block-scaled e4m3),
    "pack-quantized" (INT) or "mxfp4-pack-quantized"."""

    method: str
    num_bits: int = 4
    group_size: int | None = 32
    symmetric: bool = True
    block: tuple[int, int] = FP8_BLOCK
    ignore: tuple[str, ...] = ()
    targets: tuple[str, ...] = ()
    raw: dict = field(default_factory=dict, compare=False, repr=False)

    def parts(self) -> frozenset[str]:
        """The tensors (by suffix) that make up one quantized module."""
        if self.method == "fp8":
            return frozenset({"weight", "weight_scale_inv"})
        if self.method == "mxfp4-pack-quantized":
            return frozenset({"weight_packed", "weight_scale"})
        extra = set() if self.symmetric else {"weight_zero_point"}
        return frozenset({"weight_packed", "weight_scale", "weight_shape"} | extra)

    def ignored(self, module: str) -> bool:
        """Whether ``module`` is outside the quantized set: in the ignore list, or matched by none of the
        targets when the targets name modules (a bare class name such as "Linear" matches every linear layer).
        compressed-tensors rule: an entry is a module name, or ``re:`` + a regex matched at the start."""
        by_name = tuple(t for t in self.targets if t.startswith("re:") or "." in t)
        if by_name and len(by_name) == len(self.targets) and not _matcher(self.targets).matches(module):
            return True
        return _matcher(self.ignore).matches(module)

    def dequantize(self, module: str, parts: dict[str, torch.Tensor]) -> torch.Tensor:
        """One module's stored tensors -> its fp32 weight; errors name the module."""
        need = self.parts()
        missing = sorted(need - set(parts))
        if missing:
            raise ValueError(f"{module}: {self.method} weight is missing {', '.join(missing)} "
                             f"(has {', '.join(sorted(parts))})")
        extra = sorted(set(parts) - need)
        if extra:
            raise ValueError(f"{module}: unexpected {', '.join(extra)} for the {self.method} format")
        try:
            if self.method == "fp8":
                return fp8_block_dequantize(parts["weight"], parts["weight_scale_inv"], self.block)
            if self.method == "mxfp4-pack-quantized":
                return mxfp4_dequantize(parts["weight_packed"], parts["weight_scale"], torch.float32)
            return int_group_dequantize(parts["weight_packed"], parts["weight_scale"], parts["weight_shape"],
                                        self.num_bits, self.group_size, parts.get("weight_zero_point"))
        except ValueError as e:
            raise ValueError(f"{module}: {e}") from None


MAX_PATTERNS = 1024  # ``re:`` entries in one list: real configs have a handful (plain names are not limited)


@functools.lru_cache(maxsize=4 * MAX_PATTERNS)
def _pattern(text: str) -> Pattern:
    return compile_pattern(text)


class _Matcher:
    """One ignore / targets list, split once into plain names (a set lookup) and compiled patterns."""

    def __init__(self, entries: tuple[str, ...]) -> None:
        self.entries = entries
        self.names = frozenset(e for e in entries if not e.startswith("re:"))
        self.patterns = tuple(_pattern(e[3:]) for e in entries if e.startswith("re:"))

    def matches(self, module: str) -> bool:
        for name in {module, module.removeprefix("language_model.")}:
            if name in self.names or any(p.match(name) for p in self.patterns):
                return True
        return False


_MATCHERS: dict[int, _Matcher] = {}


def _matcher(entries: tuple[str, ...]) -> _Matcher:
    """The matcher of a spec's list, built on first use (keyed by the tuple itself: the spec is immutable)."""
    m = _MATCHERS.get(id(entries))
    if m is None or m.entries is not entries:
        if len(_MATCHERS) > 64:
            _MATCHERS.clear()
        m = _MATCHERS[id(entries)] = _Matcher(entries)
    return m


def _module_names(qc: dict, key: str) -> tuple[str, ...]:
    """``qc[key]`` (absent: empty), a list of module names and ``re:`` patterns, each pattern compiled now by the
    linear-time matcher (``kimik3.model.patterns``): a pattern that could not be matched fails here, naming it."""
    items = qc.get(key) or ()
    if not isinstance(items, (list, tuple)):
        raise ValueError(f"quantization_config.{key} must be a list of module names, got {type(items).__name__}")
    n_patterns = sum(isinstance(item, str) and item.startswith("re:") for item in items)
    if n_patterns > MAX_PATTERNS:
        raise ValueError(f"quantization_config.{key} holds {n_patterns} 're:' patterns, more than the {MAX_PATTERNS} "
                         "a config may hold (list module names instead)")
    for i, item in enumerate(items):
        if not isinstance(item, str):
            raise ValueError(f"quantization_config.{key}[{i}] must be a string, got {item!r}"[:300])
        if item.startswith("re:"):
            try:
                _pattern(item[3:])
            except ValueError as e:
                raise ValueError(f"quantization_config.{key}[{i}]: {e}") from None
    return tuple(items)


def parse_quantization_config(qc: dict | None) -> QuantSpec | None:
    """A checkpoint's ``quantization_config`` -> :class:`QuantSpec` (None: nothing quantized). The forms read:
    ``{"quant_method": "fp8", "weight_block_size": [128, 128], "modules_to_not_convert": [...]}`` (DeepSeek / K2),
    compressed-tensors ``{"quant_method": "compressed-tensors", "format": ..., "config_groups": {...},
    "ignore": [...]}`` (K2-Thinking, K3) and the short K3 form ``{"format": "mxfp4-pack-quantized",
    "group_size": 32}``."""
    if qc is None:
        return None
    if not isinstance(qc, dict):
        raise ValueError(f"quantization_config must be an object, got {type(qc).__name__}")
    method = qc.get("quant_method")
    if method == "fp8":
        fmt = qc.get("fmt", "e4m3")
        if fmt != "e4m3":
            raise ValueError(f"quantization_config: unsupported fp8 fmt {fmt!r} (supported: 'e4m3')")
        block = qc.get("weight_block_size")
        if not (isinstance(block, (list, tuple)) and len(block) == 2 and all(isinstance(b, int) and b > 0
                                                                              for b in block)):
            raise ValueError(f"quantization_config: fp8 needs weight_block_size [rows, cols], got {block!r}")
        ignore = _module_names(qc, "modules_to_not_convert") + _module_names(qc, "ignore")
        return QuantSpec("fp8", num_bits=8, group_size=None, block=(block[0], block[1]), ignore=ignore, raw=qc)
    if method not in (None, "compressed-tensors"):
        raise ValueError(f"quantization_config: unknown quant_method {method!r} "
                         "(supported: 'fp8', 'compressed-tensors')")
    groups = qc.get("config_groups") or {}
    if not isinstance(groups, dict):
        raise ValueError("quantization_config.config_groups must be an object")
    fmt = qc.get("format")
    group_formats = {g.get("format") for g in groups.values() if isinstance(g, dict) and g.get("format")}
    if fmt in (None, "mixed-precision") and len(group_formats) == 1:  # the format given per group instead
        fmt = group_formats.pop()
    if fmt not in ("pack-quantized", "mxfp4-pack-quantized"):
        raise ValueError(f"quantization_config: unknown format {fmt!r} "
                         "(supported: 'pack-quantized', 'mxfp4-pack-quantized', and quant_method 'fp8')")
    weights = [g.get("weights") for g in groups.values() if isinstance(g, dict) and g.get("weights")]
    if len(weights) > 1 and any(w != weights[0] for w in weights):
        raise ValueError("quantization_config: config_groups with different weight schemes are not supported")
    args = dict(weights[0]) if weights else {}
    for k in ("num_bits", "group_size", "symmetric", "type", "strategy"):
        if k in qc and k not in args:
            args[k] = qc[k]
    ignore = _module_names(qc, "ignore")
    targets = tuple(t for name, g in groups.items() if isinstance(g, dict)
                    for t in _module_names({f"config_groups.{name}.targets": g.get("targets")},
                                           f"config_groups.{name}.targets"))
    if fmt == "mxfp4-pack-quantized":
        bad = {k: args[k] for k, want in (("num_bits", 4), ("group_size", MXFP4_GROUP), ("type", "float"))
               if k in args and args[k] != want}
        if bad:
            raise ValueError(f"quantization_config: mxfp4-pack-quantized needs 4-bit float groups of 32, got {bad}")
        return QuantSpec("mxfp4-pack-quantized", 4, MXFP4_GROUP, True, ignore=ignore, targets=targets, raw=qc)
    num_bits = args.get("num_bits", 4)
    if args.get("type", "int") != "int" or not isinstance(num_bits, int) or not 1 <= num_bits <= 8:
        raise ValueError(f"quantization_config: pack-quantized needs integer weights of 1..8 bits, got "
                         f"type {args.get('type')!r}, num_bits {num_bits!r}")
    strategy = args.get("strategy", "group")
    if strategy not in ("group", "channel"):
        raise ValueError(f"quantization_config: unsupported pack-quantized strategy {strategy!r} "
                         "(supported: 'group', 'channel')")
    group = args.get("group_size") if strategy == "group" else None
    if strategy == "group" and not (isinstance(group, int) and group > 0):
        raise ValueError(f"quantization_config: group strategy needs a positive group_size, got {group!r}")
    return QuantSpec("pack-quantized", num_bits, group, bool(args.get("symmetric", True)), ignore=ignore,
                     targets=targets, raw=qc)


# ====================================================================== writing (export)

EXPORT_FORMATS = ("bf16", "mxfp4", "int4", "fp8")
INT4_GROUP = 32
# What the releases leave unquantized when only the routed experts are (K2-Thinking's list, plus the K3 and
# Kimi-Linear names of the same modules); compressed-tensors matching rules.
_EXPERTS_ONLY_IGNORE = ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*",
                        "re:.*(mlp|block_sparse_moe)\\.(gate|up|down)_proj$", "re:.*routed_expert_(down|up)_proj$",
                        "re:.*(mlp|block_sparse_moe)\\.gate$"]
_FP8_SKIP = re.compile(r"(embed_tokens|lm_head|\.gate|_res_proj|_norm|layernorm|conv1d)\.weight$")


def export_quantization_config(fmt: str) -> dict | None:
    """The ``quantization_config`` an export in ``fmt`` carries (None for bf16), in the releases' own forms."""
    if fmt not in EXPORT_FORMATS:
        raise ValueError(f"weight format must be one of {EXPORT_FORMATS}, got {fmt!r}")
    if fmt == "fp8":  # DeepSeek-V3 / Kimi-K2 Instruct
        return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                "weight_block_size": list(FP8_BLOCK)}
    if fmt == "bf16":
        return None
    weights = ({"num_bits": 4, "type": "int", "symmetric": True, "group_size": INT4_GROUP, "strategy": "group",
                "dynamic": False} if fmt == "int4" else
               {"num_bits": 4, "type": "float", "symmetric": True, "group_size": MXFP4_GROUP, "strategy": "group",
                "dynamic": False, "scale_dtype": "torch.uint8"})
    return {"quant_method": "compressed-tensors",
            "format": "pack-quantized" if fmt == "int4" else "mxfp4-pack-quantized",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights}},
            "ignore": list(_EXPERTS_ONLY_IGNORE)}


def export_tensors(fmt: str, key: str, t: torch.Tensor, expert: bool) -> list[tuple[str, torch.Tensor]]:
    """The stored tensors for the weight ``key`` (``….weight``) in ``fmt``: mxfp4 / int4 quantize the routed
    experts only (K3 / K2-Thinking), fp8 every linear-layer weight but the embedding, lm_head, router and norms
    (DeepSeek-V3 / K2); the rest is written as it is."""
    module = key.removesuffix(".weight")
    if fmt == "mxfp4" and expert:
        packed, scale = mxfp4_quantize(t)
        return [(module + ".weight_packed", packed), (module + ".weight_scale", scale)]
    if fmt == "int4" and expert:
        return [(f"{module}.{k}", v) for k, v in int_group_quantize(t, 4, INT4_GROUP).items()]
    if fmt == "fp8" and t.dim() == 2 and key.endswith(".weight") and not _FP8_SKIP.search(key):
        q, scale_inv = fp8_block_quantize(t)
        return [(key, q), (module + ".weight_scale_inv", scale_inv)]
    return [(key, t.contiguous())]


# ====================================================================== routed experts kept as MXFP4 in memory

EXPERT_WEIGHTS = ("w1", "w3", "w2")


def mxfp4_nbytes(rows: int, cols: int) -> int:
    """Bytes of one [rows, cols] weight as MXFP4: half a byte per code plus one scale byte per 32 columns."""
    if cols % MXFP4_GROUP:
        raise ValueError(f"MXFP4 needs the input width to be a multiple of {MXFP4_GROUP}, got {cols}")
    return rows * (cols // 2 + cols // MXFP4_GROUP)


def _expert_shapes(n_experts: int, inner: int, width: int) -> dict[str, tuple[int, int, int]]:
    """w1 (gate) / w3 (up) [E, I, D], w2 (down) [E, D, I]: the stacked layout of
    :class:`kimik3.model.modeling.Experts`."""
    return {"w1": (n_experts, inner, width), "w3": (n_experts, inner, width), "w2": (n_experts, width, inner)}


def expert_memory(cfg, dtype: torch.dtype = torch.bfloat16) -> dict[str, int | None]:  # noqa: ANN001 (a ModelConfig)
    """Bytes the routed experts of ``cfg`` take in memory, from the shapes alone: ``"dense"`` (stacked in
    ``dtype``, what the PyTorch stages read) and ``"mxfp4"`` (packed codes + E8M0 scales, what the fused stage's
    MXFP4 kernel reads; None when an input width is not a multiple of 32, which MXFP4 cannot hold). Layers × 3
    matrices × experts; a config without routed experts takes 0."""
    layers = sum(1 for i in range(cfg.num_hidden_layers) if cfg.ffn(i) == "moe")
    shapes = _expert_shapes(cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.expert_in_dim)
    elem = torch.empty(0, dtype=dtype).element_size()
    dense = sum(E * R * C for E, R, C in shapes.values()) * elem
    if any(C % MXFP4_GROUP for _, _, C in shapes.values()):
        return {"dense": layers * dense, "mxfp4": None}
    packed = sum(E * mxfp4_nbytes(R, C) for E, R, C in shapes.values())
    return {"dense": layers * dense, "mxfp4": layers * packed}


def describe_expert_memory(cfg, dtype: torch.dtype = torch.bfloat16) -> str:  # noqa: ANN001 (a ModelConfig)
    """One line stating what holding the routed experts of ``cfg`` costs in each form."""
    m = expert_memory(cfg, dtype)
    dt = str(dtype).removeprefix("torch.")
    if m["mxfp4"] is None:
        return f"routed experts: {format_bytes(m['dense'])} dense in {dt} (widths not a multiple of 32: no MXFP4 form)"
    return (f"routed experts: {format_bytes(m['mxfp4'])} kept as MXFP4, {format_bytes(m['dense'])} dequantised to "
            f"{dt} ({m['dense'] - m['mxfp4']:,} bytes more)")


def format_bytes(n: int) -> str:
    """``n`` bytes in the largest binary unit that keeps at least 1 of it, two decimals."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


class QuantizedExperts(torch.nn.Module):
    """The routed experts of one MoE layer held as the checkpoint stores them: MXFP4 codes and E8M0 scales,
    stacked like :class:`kimik3.model.modeling.Experts` (``w1_packed`` [E, I, D/2] + ``w1_scale`` [E, I, D/32], the same
    for ``w3``; ``w2_packed`` [E, D, I/2] + ``w2_scale`` [E, D, I/32]), uint8 buffers. Expert ``e``'s tensors
    are byte for byte the checkpoint's ``experts.e.w*.weight_packed`` / ``weight_scale``.

    Why: MXFP4 is 4.25 bits per weight against 16 for bf16 (:func:`expert_memory`), and the fused stage's MXFP4
    kernel reads exactly these bytes, so nothing is dequantised and re-quantised between the file and the kernel.
    PyTorch code that wants the dense stack (``experts.w1`` …) gets a ``ValueError`` saying how to dequantise;
    :meth:`expert` dequantises one expert (what the reference forward uses)."""

    format = "mxfp4"

    def __init__(self, n_experts: int, inner: int, width: int, device: str | torch.device | None = None) -> None:
        super().__init__()
        self.shapes = _expert_shapes(n_experts, inner, width)
        for name, (E, R, C) in self.shapes.items():
            if C % MXFP4_GROUP:
                raise ValueError(f"experts.{name}: MXFP4 needs the input width to be a multiple of {MXFP4_GROUP}, "
                                 f"got {C}")
            self.register_buffer(f"{name}_packed", torch.empty(E, R, C // 2, dtype=torch.uint8, device=device))
            self.register_buffer(f"{name}_scale", torch.empty(E, R, C // MXFP4_GROUP, dtype=torch.uint8,
                                                              device=device))

    @property
    def n_experts(self) -> int:
        return self.shapes["w1"][0]

    def packed(self, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(codes [E, R, C/2], scales [E, R, C/32]) of ``name`` ("w1", "w3" or "w2"): the held tensors, no copy."""
        if name not in self.shapes:
            raise ValueError(f"expert weight must be one of {EXPERT_WEIGHTS}, got {name!r}")
        return getattr(self, f"{name}_packed"), getattr(self, f"{name}_scale")

    def expert(self, name: str, e: int, dtype: torch.dtype) -> torch.Tensor:
        """Expert ``e``'s ``name`` weight [R, C] dequantised to ``dtype`` (value × scale in fp32, cast once: the
        same numbers a dequantising load stores)."""
        p, s = self.packed(name)
        return mxfp4_dequantize(p[e], s[e], torch.float32).to(dtype)

    def dequantized(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        """The whole dense stack [E, R, C] of ``name`` in ``dtype``, one expert at a time (the scratch stays at
        one expert's fp32 weights)."""
        E, R, C = self.shapes[name]
        out = torch.empty(E, R, C, dtype=dtype, device=self.w1_packed.device)
        for e in range(E):
            out[e] = self.expert(name, e, dtype)
        return out

    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers())

    def num_weights(self) -> int:
        """Logical parameter count (the dense stack's elements)."""
        return sum(E * R * C for E, R, C in self.shapes.values())

    def _dense_refused(self) -> ValueError:
        return ValueError("these routed experts are held as MXFP4 (quantized_experts='keep'): code that reads the "
                          "dense stack needs model.dequantize_experts() first, or a load with "
                          "quantized_experts='dequantize'")

    @property
    def w1(self) -> torch.Tensor:
        raise self._dense_refused()

    @property
    def w3(self) -> torch.Tensor:
        raise self._dense_refused()

    @property
    def w2(self) -> torch.Tensor:
        raise self._dense_refused()

    def extra_repr(self) -> str:
        E, inner, width = self.shapes["w1"]
        return f"mxfp4, experts={E}, inner={inner}, width={width}, {self.nbytes():,} bytes"


def experts_mxfp4(experts: torch.nn.Module, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes, scales) of a layer's ``name`` expert stack for an MXFP4 kernel: the held bytes of
    :class:`QuantizedExperts` as they are (the checkpoint's), else the dense stack packed by :func:`mxfp4_quantize`
    (exact for weights that were MXFP4 values, a quantisation otherwise)."""
    if isinstance(experts, QuantizedExperts):
        return experts.packed(name)
    return mxfp4_quantize(getattr(experts, name).detach())
