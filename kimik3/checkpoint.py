"""Checkpoints: Hugging Face-format directories in, and out. Safetensors only — no pickle, no remote code.

Reads DeepSeek-V3 / Kimi K2 (``DeepseekV3ForCausalLM``), Kimi-Linear (``KimiLinearForCausalLM``) and the
Kimi K3 release layout (spec §6–7: ``text_config`` nested in config.json, tensors under ``language_model.``,
vision tensors skipped, routed experts plain ``w1/w2/w3.weight`` or MXFP4 ``weight_packed``/``weight_scale``
dequantised on load per §5.5). Every problem is a ``ValueError`` naming the file, tensor or field.
"""

from __future__ import annotations

import json
import re
import struct
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from kimik3.config import ModelConfig, load_config, to_hf_dict
from kimik3.init import build_model
from kimik3.model import KimiForCausalLM, keeps_fp32

__all__ = ["from_pretrained", "save_pretrained", "mxfp4_quantize", "mxfp4_dequantize", "E2M1_VALUES"]

# E2M1 code -> value (§5.5): bit 3 is the sign.
E2M1_VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])
MXFP4_GROUP = 32

_SKIP_PREFIXES = ("vision_tower.", "mm_projector.", "multi_modal_projector.")
_FLOAT_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}


# ====================================================================== MXFP4 (§5.5)


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
    R, half = packed.shape
    C = 2 * half
    if scale.shape != (R, C // MXFP4_GROUP) or C % MXFP4_GROUP:
        raise ValueError(f"MXFP4 scale shape {tuple(scale.shape)} does not match packed {tuple(packed.shape)} "
                         f"(expected [{R}, {C // MXFP4_GROUP}])")
    codes = torch.stack([packed & 0xF, packed >> 4], -1).reshape(R, C).long()
    vals = E2M1_VALUES.to(packed.device)[codes]
    return (vals * e8m0_to_float(scale).repeat_interleave(MXFP4_GROUP, 1)).to(dtype)


def mxfp4_quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Our own packer (the release's is not public): per 32 columns the scale is the smallest power of two that
    fits the block's max |w| into E2M1's range (6), each weight rounds to the nearest code (ties to the smaller
    magnitude). Returns (packed U8 [R, C/2], scale U8 [R, C/32])."""
    R, C = w.shape
    if C % MXFP4_GROUP:
        raise ValueError(f"MXFP4 needs the input width to be a multiple of {MXFP4_GROUP}, got {C}")
    blocks = w.float().reshape(R, C // MXFP4_GROUP, MXFP4_GROUP)
    amax = blocks.abs().amax(-1).clamp_min(2.0**-126)
    exp = torch.ceil(torch.log2(amax / 6.0)).clamp(-127, 127)
    scale = (exp + 127).to(torch.uint8)
    x = blocks / e8m0_to_float(scale)[..., None]
    mags = E2M1_VALUES[:8]
    code = (x.abs()[..., None] - mags).abs().argmin(-1)  # nearest magnitude, first (smaller) on ties
    code = code + 8 * ((x < 0) & (code > 0)).long()
    code = code.reshape(R, C).to(torch.uint8)
    return code[:, 0::2] | (code[:, 1::2] << 4), scale


# ====================================================================== key mapping

_EXPERT = re.compile(r"^(model\.layers\.\d+)\.(?:block_sparse_moe|mlp)\.experts\.(\d+)\."
                     r"(w1|w2|w3|gate_proj|up_proj|down_proj)\.(weight|weight_packed|weight_scale)$")
_FFN = re.compile(r"^(model\.layers\.(\d+))\.(?:mlp|block_sparse_moe)\.(.+)$")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
_EXPERT_NAMES = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2", "w1": "w1", "w2": "w2", "w3": "w3"}


def _internal_name(key: str, cfg: ModelConfig) -> tuple[str, int | None, str] | None:
    """Checkpoint key -> (internal parameter name, expert index or None, kind) or None to skip."""
    if key.startswith("language_model."):
        key = key[len("language_model."):]
    if key.startswith(_SKIP_PREFIXES) or key.endswith("rotary_emb.inv_freq"):
        return None
    m = _LAYER.match(key)
    if m and int(m.group(1)) >= cfg.num_hidden_layers and cfg.extra.get("num_nextn_predict_layers", 0):
        return None  # multi-token-prediction layers are not part of the decode path
    m = _EXPERT.match(key)
    if m:
        layer, e, w, kind = m.groups()
        return f"{layer}.block_sparse_moe.experts.{_EXPERT_NAMES[w]}", int(e), kind
    m = _FFN.match(key)
    if m:  # DeepSeek names the MoE `mlp`, Kimi-Linear names its dense MLP `block_sparse_moe`: go by the config
        prefix, layer, rest = m.groups()
        block = "block_sparse_moe" if cfg.ffn(int(layer)) == "moe" else "mlp"
        return f"{prefix}.{block}.{rest}", None, "weight"
    return key, None, "weight"


# ====================================================================== reading


def _shard_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise ValueError(f"{index}: malformed index ({e})") from None
        files = sorted(set(weight_map.values()))
        missing = [f for f in files if not (path / f).exists()]
        if missing:
            raise ValueError(f"{index} lists shard(s) that do not exist: {', '.join(missing)}")
        return [path / f for f in files]
    if (path / "model.safetensors").exists():
        return [path / "model.safetensors"]
    files = sorted(path.glob("model-*-of-*.safetensors")) or sorted(path.glob("*.safetensors"))
    if not files:
        bad = sorted(p.name for p in path.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".ckpt"))
        hint = f" (found {', '.join(bad)}: pickle-based formats are refused)" if bad else ""
        raise ValueError(f"no *.safetensors files in {path}{hint}")
    return files


def _check_shard(f: Path) -> None:
    """Catch a truncated or corrupt shard with a clear message before safetensors does something obscure."""
    size = f.stat().st_size
    with open(f, "rb") as fh:
        head = fh.read(8)
        if len(head) < 8:
            raise ValueError(f"{f}: truncated safetensors file ({size} bytes, no header)")
        (n,) = struct.unpack("<Q", head)
        if n > size - 8:
            raise ValueError(f"{f}: truncated safetensors file (header claims {n} bytes, file has {size})")
        try:
            header = json.loads(fh.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise ValueError(f"{f}: corrupt safetensors header") from None
    end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    if 8 + n + end > size:
        raise ValueError(f"{f}: truncated safetensors shard: tensors need {8 + n + end} bytes, file has {size}")


def _iter_tensors(files: list[Path]) -> Iterator[tuple[Path, str, torch.Tensor]]:
    for f in files:
        _check_shard(f)
        try:
            with safe_open(f, framework="pt") as fh:
                for key in fh.keys():
                    yield f, key, fh.get_tensor(key)
        except ValueError:
            raise
        except Exception as e:  # safetensors raises its own error types
            raise ValueError(f"{f}: cannot read safetensors ({e})") from None


def from_pretrained(path: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                    ) -> KimiForCausalLM:
    """Load an HF-format checkpoint directory. ``dtype`` applies to the bf16 tensors; the spec's fp32 tensors
    (KDA A_log, dt_bias, conv weights, o_norm; router bias) stay fp32."""
    path = Path(path)
    if not path.is_dir():
        raise ValueError(f"checkpoint directory {path} does not exist")
    cfg = load_config(path)
    raw = json.loads((path / "config.json").read_text())
    text = raw.get("text_config", raw)
    cfg = cfg.replace(extra={"num_nextn_predict_layers": int(text.get("num_nextn_predict_layers") or 0)})
    files = _shard_files(path)

    model = build_model(cfg, "meta")
    model.cast_(dtype)
    model = model.to_empty(device=device)
    model.reset_buffers()
    params = dict(model.named_parameters())
    filled: set[str] = set()
    experts_filled: dict[str, set[int]] = {}
    packed: dict[tuple[str, int], dict[str, tuple[Path, torch.Tensor]]] = {}

    def put(name: str, e: int | None, t: torch.Tensor, f: Path, key: str) -> None:
        p = params[name]
        want = p.shape[1:] if e is not None else p.shape
        if name.endswith(".A_log"):  # K3 stores 128 entries (zero tail), Kimi-Linear [1, 1, nh, 1]: use first nh
            t = t.reshape(-1)[: p.shape[0]] if t.numel() >= p.shape[0] else t
        if tuple(t.shape) != tuple(want):
            raise ValueError(f"tensor {key!r} in {f.name} has shape {list(t.shape)}, expected {list(want)}")
        if not t.is_floating_point() or not torch.isfinite(t).all():
            kind = "non-finite values" if t.is_floating_point() else f"dtype {t.dtype}"
            raise ValueError(f"tensor {key!r} in {f.name} has {kind}; expected finite floating-point weights")
        with torch.no_grad():
            (p.data[e] if e is not None else p.data).copy_(t.to(p.dtype))
        if e is None:
            filled.add(name)
        else:
            experts_filled.setdefault(name, set()).add(e)

    for f, key, t in _iter_tensors(files):
        mapped = _internal_name(key, cfg)
        if mapped is None:
            continue
        name, e, kind = mapped
        if name not in params or (e is not None and not 0 <= e < params[name].shape[0]):
            raise ValueError(f"unexpected tensor {key!r} in {f.name}: the {cfg.family} config "
                             f"({cfg.num_hidden_layers} layers, {cfg.n_routed_experts} experts) has no such weight")
        if kind == "weight":
            if t.dtype not in _FLOAT_DTYPES.values():
                raise ValueError(f"tensor {key!r} in {f.name} has dtype {t.dtype}; expected F32, BF16 or F16")
            put(name, e, t, f, key)
        else:  # MXFP4 halves: collect both, dequantise when the pair is complete
            if t.dtype != torch.uint8:
                raise ValueError(f"tensor {key!r} in {f.name} has dtype {t.dtype}; MXFP4 {kind} must be U8")
            slot = packed.setdefault((name, e), {})
            slot[kind] = (f, t)
            if len(slot) == 2:
                pf, pk = slot["weight_packed"]
                try:
                    w = mxfp4_dequantize(pk, slot["weight_scale"][1], torch.float32)
                except ValueError as err:
                    raise ValueError(f"{key.rsplit('.', 1)[0]} in {pf.name}: {err}") from None
                put(name, e, w, pf, key.rsplit(".", 1)[0] + ".weight_packed")
                del packed[(name, e)]
    if packed:
        (name, e), slot = next(iter(packed.items()))
        have = next(iter(slot))
        raise ValueError(f"expert {e} of {name}: has {have} but not its "
                         f"{'weight_scale' if have == 'weight_packed' else 'weight_packed'}")
    missing = []
    for name, p in params.items():
        if name.endswith("experts.w1") or name.endswith("experts.w2") or name.endswith("experts.w3"):
            got = experts_filled.get(name, set())
            missing += [f"{name}[{e}]" for e in range(p.shape[0]) if e not in got]
        elif name not in filled:
            missing.append(name)
    if missing:
        more = f" (and {len(missing) - 8} more)" if len(missing) > 8 else ""
        raise ValueError(f"checkpoint {path} is missing {len(missing)} tensor(s): {', '.join(missing[:8])}{more}")
    return model.eval()


# ====================================================================== writing


def _external_names(cfg: ModelConfig, name: str) -> str:
    """Internal parameter name -> the family's checkpoint key (experts handled by the caller)."""
    if cfg.family in ("deepseek_v3", "kimi_k2"):
        name = name.replace(".block_sparse_moe.", ".mlp.")
    elif cfg.family == "kimi_linear":  # what transformers writes for Kimi-Linear: every FFN under block_sparse_moe
        name = re.sub(r"(model\.layers\.\d+)\.mlp\.", r"\1.block_sparse_moe.", name)
    return ("language_model." + name) if cfg.family == "kimi_k3" else name


def state_items(model: KimiForCausalLM, expert_format: str = "bf16") -> Iterator[tuple[str, torch.Tensor]]:
    """(checkpoint key, tensor) pairs in the family's release layout; experts split per expert."""
    cfg = model.config
    if expert_format not in ("bf16", "mxfp4"):
        raise ValueError(f"expert_format must be 'bf16' or 'mxfp4', got {expert_format!r}")
    ds = cfg.family in ("deepseek_v3", "kimi_k2")
    ename = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"} if ds else {k: k for k in ("w1", "w2", "w3")}
    for name, p in model.named_parameters():
        t = p.detach().cpu()
        base, _, leaf = name.rpartition(".")
        if base.endswith("block_sparse_moe.experts"):
            prefix = _external_names(cfg, base)
            for e in range(t.shape[0]):
                key = f"{prefix}.{e}.{ename[leaf]}"
                if expert_format == "mxfp4":
                    packed, scale = mxfp4_quantize(t[e])
                    yield key + ".weight_packed", packed
                    yield key + ".weight_scale", scale
                else:
                    yield key + ".weight", t[e].contiguous()
            continue
        if name.endswith(".A_log") and cfg.family == "kimi_linear":
            t = t.view(1, 1, -1, 1)
        yield _external_names(cfg, name), t.contiguous()


def save_pretrained(model: KimiForCausalLM, path: str | Path, expert_format: str = "bf16",
                    max_shard_bytes: int | None = None) -> Path:
    """Write ``model`` as an HF-format checkpoint (config.json + safetensors, sharded with an index when
    ``max_shard_bytes`` is given). K3-family models use the K3 release layout."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    cfg = model.config
    hf = to_hf_dict(cfg)
    if expert_format == "mxfp4" and cfg.family == "kimi_k3":
        hf["text_config"]["quantization_config"] = {"format": "mxfp4-pack-quantized", "group_size": MXFP4_GROUP}
    (path / "config.json").write_text(json.dumps(hf, indent=1))
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for key, t in state_items(model, expert_format):
        nbytes = t.numel() * t.element_size()
        if max_shard_bytes and size and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][key] = t
        size += nbytes
    if len(shards) == 1:
        save_file(shards[0], str(path / "model.safetensors"), metadata={"format": "pt"})
        return path
    weight_map = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(path / fname), metadata={"format": "pt"})
        weight_map.update({k: fname for k in shard})
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map},
                                                                  indent=1))
    return path


def fp32_parameter_names(model: KimiForCausalLM) -> list[str]:
    return [n for n, _ in model.named_parameters() if keeps_fp32(n)]
