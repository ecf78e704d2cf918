"""Checkpoints: Hugging Face-format directories in, and out. Safetensors only — no pickle, no remote code.

Reads DeepSeek-V3 / Kimi K2 (``DeepseekV3ForCausalLM``), Kimi-Linear (``KimiLinearForCausalLM``) and the
Kimi K3 release layout (spec §6–7: ``text_config`` nested in config.json, tensors under ``language_model.``,
vision tensors skipped, routed experts plain ``w1/w2/w3.weight`` or MXFP4 ``weight_packed``/``weight_scale``
dequantised on load per §5.5), and the quantized releases: FP8 128×128 block-scaled (DeepSeek-V3, Kimi-K2) and
compressed-tensors INT4 ``pack-quantized`` (Kimi-K2-Thinking); the formats are defined in :mod:`kimik3.model.quant`.
Subsets of layers and experts read only what they keep (:mod:`kimik3.model.subset`). Every problem is a ``ValueError``
naming the file, tensor or field.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm.auto import tqdm

from kimik3.model.checks import check_device, require_memory, resolve_dtype
from kimik3.model.config import ModelConfig, load_config, to_hf_dict
from kimik3.model.hf_layouts import is_fused, to_release
from kimik3.model.modeling import KimiForCausalLM, keeps_fp32
from kimik3.model.quant import (
    E2M1_VALUES,
    EXPERT_WEIGHTS,
    EXPORT_FORMATS,
    MXFP4_GROUP,
    QUANT_SUFFIXES,
    QuantizedExperts,
    e8m0_to_float,
    export_quantization_config,
    export_tensors,
    mxfp4_dequantize,
    mxfp4_quantize,
    parse_quantization_config,
)
from kimik3.model.random_init import build_model
from kimik3.model.safetensors_reader import read_header, read_index, read_json_file, require_regular_file
from kimik3.model.subset import k3_shard_selection, select
from kimik3.util.files import staged_directory
from kimik3.util.text import escaped_errors

__all__ = ["from_pretrained", "save_pretrained", "load_k3_shard", "mxfp4_quantize", "mxfp4_dequantize", "E2M1_VALUES",
           "MXFP4_GROUP", "e8m0_to_float"]

_log = logging.getLogger(__name__)
QUANTIZED_EXPERTS = ("dequantize", "keep")
_SKIP_PREFIXES = ("vision_tower.", "mm_projector.", "multi_modal_projector.")
_FLOAT_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}


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


def _shard_files(path: Path) -> tuple[list[Path], dict[str, Path] | None]:
    """The shards to read, and the index's {tensor key: shard} when there is an index (checked against what the
    shards hold as they are read)."""
    index = path / "model.safetensors.index.json"
    if index.exists() or index.is_symlink():
        where = read_index(index, path)
        files = sorted(set(where.values()))
        missing = [f.name for f in files if not f.exists()]
        if missing:
            more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
            raise ValueError(f"{index} lists {len(missing)} shard(s) that do not exist: "
                             f"{', '.join(map(repr, missing[:5]))}{more}")
        for f in files:
            require_regular_file(f, "safetensors shard")
        return files, where
    if (path / "model.safetensors").exists():
        return [path / "model.safetensors"], None
    files = sorted(path.glob("model-*-of-*.safetensors")) or sorted(path.glob("*.safetensors"))
    if not files:
        bad = sorted(p.name for p in path.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".ckpt"))
        hint = f" (found {', '.join(bad)}: pickle-based formats are refused)" if bad else ""
        raise ValueError(f"no *.safetensors files in {path}{hint}")
    return files, None


def _check_shard(f: Path) -> None:
    """Catch a truncated, corrupt or hostile shard with a clear message before safetensors reads it."""
    read_header(f)


def _iter_tensors(files: list[Path], wanted: Callable[[str], bool] | None = None, progress: bool = False,
                  index: Mapping[str, Path] | None = None) -> Iterator[tuple[Path, str, torch.Tensor]]:
    """(shard, key, tensor) for every tensor ``wanted(key)`` accepts, shard by shard. safe_open memory-maps the
    shard, so a tensor that is not fetched is never read. With ``index``, every key must sit in the shard the
    index names for it, and every key the index names must be found: an index that contradicts its shards is
    refused (which of two disagreeing sources is right cannot be known)."""
    seen: dict[str, Path] = {}
    bar = tqdm(files, desc="loading shards", unit="shard", disable=not progress)
    for f in bar:
        _check_shard(f)
        try:
            with safe_open(f, framework="pt") as fh:
                for key in fh.keys():
                    if key in seen:  # which copy wins would depend on file order: refuse instead
                        raise ValueError(f"tensor {key!r} appears in both {seen[key].name} and {f.name}")
                    if index is not None and index.get(key) != f:
                        said = f"in {index[key].name}" if key in index else "nowhere (it does not list it)"
                        raise ValueError(f"tensor {key!r} is in {f.name}, but the checkpoint index puts it {said}")
                    seen[key] = f
                    if wanted is None or wanted(key):
                        yield f, key, fh.get_tensor(key)
        except ValueError:
            raise
        except Exception as e:  # safetensors raises its own error types
            raise ValueError(f"{f}: cannot read safetensors ({e})") from None
    if index is not None and len(seen) < len(index):
        lost = [k for k in index if k not in seen]
        more = f" and {len(lost) - 5} more" if len(lost) > 5 else ""
        raise ValueError(f"the checkpoint index lists {len(lost)} tensor(s) its shards do not hold: "
                         f"{', '.join(f'{k!r} (in {index[k].name})' for k in lost[:5])}{more}")


def _a_log(t: torch.Tensor, nh: int, key: str, f: Path) -> torch.Tensor:
    """A_log as stored -> [nh]: [nh], Kimi-Linear's [1, 1, nh, 1], or K3's longer vector whose tail is zero.
    Anything else (a matrix, a non-zero tail) is some other tensor under this name and is refused."""
    flat = t.reshape(-1)
    vector = sum(d != 1 for d in t.shape) <= 1
    if vector and (flat.numel() == nh or (flat.numel() > nh and not flat[nh:].any())):
        return flat[:nh]
    raise ValueError(f"tensor {key!r} in {f.name} has shape {list(t.shape)}; expected A_log as [{nh}], "
                     f"[1, 1, {nh}, 1] or a longer vector whose entries past {nh} are zero")


@escaped_errors
def from_pretrained(path: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                    layers: Iterable[int] | None = None,
                    experts: Iterable[int] | Mapping[int, Iterable[int]] | None = None,
                    preset: str | None = None, progress: bool | None = None,
                    quantized_experts: str = "dequantize") -> KimiForCausalLM:
    """Load an HF-format checkpoint directory. ``dtype`` applies to the bf16 tensors; the spec's fp32 tensors
    (KDA A_log, dt_bias, conv weights, o_norm; router bias) stay fp32. Quantized tensors (FP8 block-scaled,
    compressed-tensors INT pack-quantized or MXFP4, as the config's ``quantization_config`` says) are
    dequantised in fp32 (stored value × scale) and cast once to the parameter's dtype.

    ``layers`` / ``experts`` build a model from a subset of the checkpoint, reading only the tensors it keeps
    (see :mod:`kimik3.model.subset`: layers renumbered in order, the router restricted to the kept experts);
    ``preset="k3-shard"`` checks the subset against that preset. ``progress``: a progress bar over the shards
    (default: when there is more than one).

    ``quantized_experts``: "dequantize" (the default: routed experts become dense parameters in ``dtype``) or
    "keep": MXFP4 routed experts stay as the file stores them, byte for byte
    (:class:`kimik3.model.quant.QuantizedExperts`), which the fused stage's MXFP4 kernel reads directly
    (``expert_format="mxfp4"``) and the naive reference path dequantises one expert at a time; the other stages
    refuse them until ``model.dequantize_experts()``. What each form costs is logged at load and given by
    ``model.expert_memory()`` (:func:`kimik3.model.quant.expert_memory`); for k3-shard: 3.66 GiB kept, 13.78 GiB as
    bf16. Only MXFP4 experts can be kept: no kernel here reads FP8 or INT4 weights, so those are always
    dequantised."""
    path = Path(path)
    dtype = resolve_dtype(dtype)
    check_device(device)
    if quantized_experts not in QUANTIZED_EXPERTS:
        raise ValueError(f"quantized_experts must be one of {QUANTIZED_EXPERTS}, got {quantized_experts!r}")
    if not path.is_dir():
        raise ValueError(f"checkpoint directory {path} does not exist")
    cfg = load_config(path)
    raw = read_json_file(path / "config.json", "config")
    text = raw.get("text_config", raw)
    cfg = cfg.replace(extra={"num_nextn_predict_layers": int(text.get("num_nextn_predict_layers") or 0)})
    files, index = _shard_files(path)
    quant = _quant_spec(raw)
    keep = quantized_experts == "keep"
    if keep and (quant is None or quant.method != "mxfp4-pack-quantized"):
        what = "no quantization_config" if quant is None else f"quantization method {quant.method!r}"
        raise ValueError(f"quantized_experts='keep' holds MXFP4 routed experts as stored, but {path / 'config.json'} "
                         f"has {what}; only the fused stage's MXFP4 kernel reads quantized experts (no kernel reads "
                         "FP8 or INT4 weights): load with quantized_experts='dequantize'")
    sel = None
    if layers is not None or experts is not None or preset is not None:
        sel = select(cfg, layers, experts, preset)
        cfg = sel.config

    model = build_model(cfg, "meta")
    model.cast_(dtype)
    kept: dict[str, tuple[QuantizedExperts, str]] = {}  # internal name "...experts.w1" -> (holder, "w1")
    if keep:
        for i, layer in enumerate(model.model.layers):
            if layer.is_moe:
                q = QuantizedExperts(cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.expert_in_dim, "meta")
                layer.block_sparse_moe.experts = q
                kept.update({f"model.layers.{i}.block_sparse_moe.experts.{n}": (q, n) for n in EXPERT_WEIGHTS})
    require_memory(sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers())), device,
                   f"the weights of {path / 'config.json'}")
    model = model.to_empty(device=device)
    model.reset_buffers()
    params = dict(model.named_parameters())
    filled: set[str] = set()
    experts_filled: dict[str, set[int]] = {}

    def put(name: str, e: int | None, t: torch.Tensor, f: Path, key: str) -> None:
        p = params[name]
        want = p.shape[1:] if e is not None else p.shape
        if name.endswith(".A_log"):  # K3 stores 128 entries (zero tail), Kimi-Linear [1, 1, nh, 1]: use first nh
            t = _a_log(t, p.shape[0], key, f)
        if tuple(t.shape) != tuple(want):
            raise ValueError(f"tensor {key!r} in {f.name} has shape {list(t.shape)}, expected {list(want)}")
        if not t.is_floating_point() or not torch.isfinite(t).all():
            kind = "non-finite values" if t.is_floating_point() else f"dtype {t.dtype}"
            raise ValueError(f"tensor {key!r} in {f.name} has {kind}; expected finite floating-point weights")
        cast = t.to(p.dtype)
        if cast.dtype != t.dtype and not torch.isfinite(cast).all():
            big = t.abs().max().item()
            raise ValueError(f"tensor {key!r} in {f.name} holds values up to {big:.4g}, beyond what {p.dtype} "
                             f"represents (finite in {t.dtype}, inf once cast); load with a wider dtype")
        with torch.no_grad():
            (p.data[e] if e is not None else p.data).copy_(cast)
        if e is None:
            filled.add(name)
        else:
            experts_filled.setdefault(name, set()).add(e)

    def plan(key: str) -> tuple[str, torch.Tensor | None, str, tuple[str, int | None, str] | None] | None:
        """key -> (key in the model's numbering, router rows to keep, tensor suffix, internal name), or None to
        skip without reading; the name is None for a tensor the model has no place for (an error once read)."""
        rows = None
        if sel is not None:
            hit = sel.map_key(key)
            if hit is None:
                return None
            key, rows = hit
        module, _, suffix = key.rpartition(".")
        if suffix not in QUANT_SUFFIXES:
            return key, rows, "", _internal_name(key, cfg)
        mapped = _internal_name(module + ".weight", cfg)
        return key, rows, suffix, mapped

    def wanted(key: str) -> bool:
        if is_fused(key):  # transformers' in-memory layout: read when its layer is kept, split once read
            return sel is None or sel.map_key(key) is not None
        p = plan(key)
        if p is None or p[3] is None:
            return False  # skipped tensors (vision tower, multi-token prediction, another subset's) are not read
        if cfg.tie_word_embeddings and p[3][0] == "lm_head.weight":
            return False  # a tied lm_head is the embedding: a stored copy is redundant (as transformers treats it)
        return True

    pending: dict[tuple[str, int | None], tuple[str, Path, dict[str, torch.Tensor]]] = {}
    show = progress if progress is not None else len(files) > 1
    for f, orig_key, t in ((f, k, t) for f, key0, t0 in _iter_tensors(files, wanted, show, index)
                           for k, t in to_release(key0, t0)):
        if not wanted(orig_key):
            continue  # a part of a fused tensor the subset does not keep
        key, rows, suffix, mapped = plan(orig_key)
        name, e, _ = mapped
        n_slots = params[name].shape[0] if name in params else kept[name][0].n_experts if name in kept else None
        if n_slots is None or (e is not None and not 0 <= e < n_slots):
            raise ValueError(f"unexpected tensor {orig_key!r} in {f.name}: the {cfg.family} config "
                             f"({cfg.num_hidden_layers} layers, {cfg.n_routed_experts} experts) has no such weight")
        if rows is not None:
            if t.dim() == 0 or t.shape[0] != sel.source.n_routed_experts:
                raise ValueError(f"tensor {orig_key!r} in {f.name} has shape {list(t.shape)}; the router needs "
                                 f"{sel.source.n_routed_experts} rows, one per expert")
            t = t[rows]
        if suffix == "" and t.dtype != torch.float8_e4m3fn:
            if t.dtype not in _FLOAT_DTYPES.values():
                raise ValueError(f"tensor {orig_key!r} in {f.name} has dtype {t.dtype}; expected F32, BF16 or F16 "
                                 "(or a quantized format declared in config.json's quantization_config)")
            if name in kept:
                raise ValueError(f"tensor {orig_key!r} in {f.name} is a routed expert stored unquantized ({t.dtype}); "
                                 "quantized_experts='keep' holds MXFP4 experts only: load with "
                                 "quantized_experts='dequantize'")
            put(name, e, t, f, orig_key)
            continue
        # a part of a quantized weight: collect the module's parts, dequantise once they are all there
        module = orig_key.rpartition(".")[0] if suffix else orig_key.removesuffix(".weight")
        if quant is None:
            raise ValueError(f"tensor {orig_key!r} in {f.name} is quantized ({suffix or t.dtype}) but config.json "
                             "has no quantization_config saying how to read it")
        if quant.ignored(module):
            raise ValueError(f"tensor {orig_key!r} in {f.name} is stored quantized but its module is in "
                             "quantization_config's ignore list (or matches none of its targets)")
        slot = pending.setdefault((name, e), (module, f, {}))[2]
        if (suffix or "weight") in slot:
            raise ValueError(f"{module}: {suffix or 'weight'} appears twice")
        slot[suffix or "weight"] = t
        if set(slot) >= quant.parts():
            if name in kept:
                _keep_mxfp4(kept[name], e, module, slot, f)
                experts_filled.setdefault(name, set()).add(e)
            else:
                put(name, e, quant.dequantize(module, slot), f, module + ".weight")
            del pending[(name, e)]
    for (name, e), (module, _f, slot) in pending.items():  # quantized weights with a part missing
        lacking = sorted(quant.parts() - set(slot))
        who = name if e is None else f"expert {e} of {name}"
        raise ValueError(f"{who}: has {', '.join(sorted(slot))} but not its {', '.join(lacking)} "
                         f"({module}, {quant.method} format)")
    missing = []
    for name, (q, _leaf) in kept.items():
        got = experts_filled.get(name, set())
        missing += [f"{name}[{e}]" for e in range(q.n_experts) if e not in got]
    for name, p in params.items():
        if name.endswith("experts.w1") or name.endswith("experts.w2") or name.endswith("experts.w3"):
            got = experts_filled.get(name, set())
            missing += [f"{name}[{e}]" for e in range(p.shape[0]) if e not in got]
        elif name not in filled:
            missing.append(name)
    if missing:
        more = f" (and {len(missing) - 8} more)" if len(missing) > 8 else ""
        raise ValueError(f"checkpoint {path} is missing {len(missing)} tensor(s): {', '.join(missing[:8])}{more}")
    if cfg.n_routed_experts:
        _log.info("%s: %s; held %s", path, model.expert_memory(), "as MXFP4" if kept else "dense")
    return model.eval()


def _keep_mxfp4(dest: tuple[QuantizedExperts, str], e: int, module: str, parts: dict[str, torch.Tensor],
                f: Path) -> None:
    """Copy one expert's MXFP4 codes and scales into the held stacks, unchanged, after the checks a dequantising
    load makes (dtype, shapes, and no NaN scale byte 255, which would dequantise to non-finite weights)."""
    q, leaf = dest
    packed, scale = parts["weight_packed"], parts["weight_scale"]
    p_dst, s_dst = q.packed(leaf)
    if packed.dtype != torch.uint8 or scale.dtype != torch.uint8:
        raise ValueError(f"{module} in {f.name}: MXFP4 tensors must be uint8, got weight_packed {packed.dtype} and "
                         f"weight_scale {scale.dtype}")
    for what, t, want in (("weight_packed", packed, p_dst.shape[1:]), ("weight_scale", scale, s_dst.shape[1:])):
        if tuple(t.shape) != tuple(want):
            raise ValueError(f"{module}.{what} in {f.name} has shape {list(t.shape)}, expected {list(want)}")
    if bool((scale == 255).any()):
        raise ValueError(f"{module}.weight_scale in {f.name} holds the E8M0 NaN byte 255; expected finite scales")
    p_dst[e].copy_(packed)
    s_dst[e].copy_(scale)


def _quant_spec(raw: dict):
    """The checkpoint's quantization_config (top level, or in K3's text_config) parsed; None when absent."""
    text = raw.get("text_config") if isinstance(raw.get("text_config"), dict) else {}
    top, inner = raw.get("quantization_config"), text.get("quantization_config")
    if top is not None and inner is not None and top != inner:
        raise ValueError("config.json has different quantization_config objects at the top level and in "
                         "text_config")
    try:
        return parse_quantization_config(top if top is not None else inner)
    except ValueError as e:
        raise ValueError(f"config.json: {e}") from None


# ====================================================================== writing


def _external_names(cfg: ModelConfig, name: str) -> str:
    """Internal parameter name -> the family's checkpoint key (experts handled by the caller)."""
    if cfg.family in ("deepseek_v3", "kimi_k2"):
        name = name.replace(".block_sparse_moe.", ".mlp.")
    elif cfg.family == "kimi_linear":  # what transformers writes for Kimi-Linear: every FFN under block_sparse_moe
        name = re.sub(r"(model\.layers\.\d+)\.mlp\.", r"\1.block_sparse_moe.", name)
    return ("language_model." + name) if cfg.family == "kimi_k3" else name


def state_items(model: KimiForCausalLM, expert_format: str = "bf16") -> Iterator[tuple[str, torch.Tensor]]:
    """(checkpoint key, tensor) pairs in the family's release layout; experts split per expert. ``expert_format``:
    "bf16" (as stored), "mxfp4" / "int4" (routed experts quantized, K3 / K2-Thinking) or "fp8" (every linear
    weight block-scaled, DeepSeek-V3 / K2): see :func:`kimik3.model.quant.export_tensors`."""
    cfg = model.config
    if expert_format not in EXPORT_FORMATS:
        raise ValueError(f"expert_format must be one of {EXPORT_FORMATS}, got {expert_format!r}")
    ds = cfg.family in ("deepseek_v3", "kimi_k2")
    ename = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"} if ds else {k: k for k in ("w1", "w2", "w3")}
    for name, p in model.named_parameters():
        t = p.detach().cpu()
        base, _, leaf = name.rpartition(".")
        if base.endswith("block_sparse_moe.experts"):
            prefix = _external_names(cfg, base)
            for e in range(t.shape[0]):
                yield from export_tensors(expert_format, f"{prefix}.{e}.{ename[leaf]}.weight", t[e], expert=True)
            continue
        if name.endswith(".A_log") and cfg.family == "kimi_linear":
            t = t.view(1, 1, -1, 1)
        yield from export_tensors(expert_format, _external_names(cfg, name), t, expert=False)
    for name, mod in model.named_modules():  # routed experts held as MXFP4 (not parameters)
        if not isinstance(mod, QuantizedExperts):
            continue
        prefix = _external_names(cfg, name)
        for leaf in EXPERT_WEIGHTS:
            packed, scale = (t.detach().cpu() for t in mod.packed(leaf))
            for e in range(mod.n_experts):
                key = f"{prefix}.{e}.{ename[leaf]}"
                if expert_format == "mxfp4":  # the held bytes, unchanged (not dequantised and packed again)
                    yield key + ".weight_packed", packed[e].contiguous()
                    yield key + ".weight_scale", scale[e].contiguous()
                else:
                    w = mxfp4_dequantize(packed[e], scale[e], torch.float32).to(model.dtype)
                    yield from export_tensors(expert_format, key + ".weight", w, expert=True)


# written last into every export: its files and their sizes, so a folder is recognised as a kimik3 export by its
# content, not by file names another tool's checkpoint also uses
EXPORT_MANIFEST = "kimik3-export.json"


def is_export(path: Path) -> bool:
    """Whether ``path`` holds exactly what :func:`save_pretrained` wrote there (so replacing it loses nothing):
    its manifest, and the files the manifest lists with their sizes, nothing else."""
    try:
        entries = {e.name: e for e in Path(path).iterdir()}
        m = entries.get(EXPORT_MANIFEST)
        if m is None or m.is_symlink() or not m.is_file() or m.stat().st_size > 1 << 20:
            return False
        doc = json.loads(m.read_text())
        files = doc.get("files") if isinstance(doc, dict) and doc.get("kimik3_export") == 1 else None
        if not isinstance(files, dict) or set(entries) != {*files, EXPORT_MANIFEST}:
            return False
        return all(not entries[n].is_symlink() and entries[n].is_file() and entries[n].stat().st_size == size
                   for n, size in files.items())
    except (OSError, ValueError):
        return False


def save_pretrained(model: KimiForCausalLM, path: str | Path, expert_format: str = "bf16",
                    max_shard_bytes: int | None = None, overwrite: bool = False) -> Path:
    """Write ``model`` as an HF-format checkpoint (config.json + safetensors, sharded with an index when
    ``max_shard_bytes`` is given). K3-family models use the K3 release layout.

    The export is built in a temporary sibling folder and swapped in whole: an earlier export at ``path`` is
    replaced, never mixed with the new files, and an interrupted export leaves it intact. A non-empty ``path``
    that is not a kimik3 export is refused unless ``overwrite``."""
    if not isinstance(model, KimiForCausalLM):
        raise TypeError(f"save_pretrained writes a kimik3 model (KimiForCausalLM), got {type(model).__name__}")
    if expert_format not in EXPORT_FORMATS:
        raise ValueError(f"expert_format must be one of {EXPORT_FORMATS}, got {expert_format!r}")
    if max_shard_bytes is not None and (isinstance(max_shard_bytes, bool) or not isinstance(max_shard_bytes, int)
                                        or max_shard_bytes < 1):
        raise ValueError(f"max_shard_bytes must be a positive int or None, got {max_shard_bytes!r}")
    with staged_directory(path, overwrite=overwrite, replaceable=is_export) as stage:
        _write_checkpoint(model, stage, expert_format, max_shard_bytes)
    return Path(path)


def _write_checkpoint(model: KimiForCausalLM, path: Path, expert_format: str, max_shard_bytes: int | None) -> Path:
    """The files of an export, written into the (empty, staging) folder ``path``."""
    cfg = model.config
    hf = to_hf_dict(cfg)
    qc = export_quantization_config(expert_format)
    if qc is not None:
        (hf["text_config"] if cfg.family == "kimi_k3" else hf)["quantization_config"] = qc
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
    biggest = max(sum(t.numel() * t.element_size() for t in shard.values()) for shard in shards)
    require_memory(biggest, "cpu", f"writing a {len(shards)}-shard export (the safetensors writer holds a copy of "
                   "each shard's bytes)", "write smaller shards: max_shard_bytes= (--max-shard-mb)")
    if len(shards) == 1:
        save_file(shards[0], str(path / "model.safetensors"), metadata={"format": "pt"})
        _write_manifest(path)
        return path
    weight_map = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(path / fname), metadata={"format": "pt"})
        weight_map.update({k: fname for k in shard})
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map},
                                                                  indent=1))
    _write_manifest(path)
    return path


def _write_manifest(path: Path) -> None:
    files = {f.name: f.stat().st_size for f in sorted(path.iterdir())}
    (path / EXPORT_MANIFEST).write_text(json.dumps({"kimik3_export": 1, "files": files}, indent=1) + "\n")


def fp32_parameter_names(model: KimiForCausalLM) -> list[str]:
    return [n for n, _ in model.named_parameters() if keeps_fp32(n)]


@escaped_errors
def load_k3_shard(path: str | Path, rank: int, first_layer: int | None = None, **kwargs) -> torch.nn.Module:
    """The ``k3-shard`` benchmark model cut from a K3-layout checkpoint (the real release: real weights) for
    expert-parallel ``rank``; ``kwargs`` go to :func:`kimik3.from_pretrained` (``dtype``, ``device``, ...)."""
    layers, experts = k3_shard_selection(load_config(path), rank, first_layer)
    return from_pretrained(path, layers=layers, experts=experts, preset="k3-shard", **kwargs)
