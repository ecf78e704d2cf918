"""Looking inside the model: layer map, per-block shapes, cache sizes, one traced decode step.

Everything here is read off the model's own config and modules (no second table of sizes), so the notebook
tables are true for whatever preset or checkpoint is loaded.
"""

from __future__ import annotations

from collections import defaultdict

import pandas as pd
import plotly.graph_objects as go
import torch
from torch import nn

from kimik3.model.config import ModelConfig
from kimik3.model.modeling import KDAState, KimiForCausalLM, MLACache

__all__ = ["layer_map", "layer_map_figure", "block_table", "cache_bytes_per_sequence", "trace_step"]


def layer_map(cfg: ModelConfig) -> pd.DataFrame:
    """One row per layer: token mixer, FFN kind, AttnRes block and whether the layer opens a block."""
    bs = cfg.attn_res_block_size
    return pd.DataFrame([{
        "layer": i,
        "mixer": cfg.mixer(i).upper(),
        "ffn": "LatentMoE" if cfg.ffn(i) == "moe" and cfg.moe_latent_size else cfg.ffn(i).replace("moe", "MoE"),
        "attn_res_block": (i // bs) if bs else None,
        "opens_block": bool(bs) and i % bs == 0,
    } for i in range(cfg.num_hidden_layers)])


def layer_map_figure(cfg: ModelConfig) -> go.Figure:
    """The layer pattern as two coloured strips (mixer, FFN), AttnRes block boundaries as vertical lines."""
    df = layer_map(cfg)
    colours = {"KDA": "#4C78A8", "MLA": "#F58518", "dense": "#54A24B", "LatentMoE": "#B279A2", "MoE": "#B279A2"}
    fig = go.Figure()
    for row, col in (("token mixer", "mixer"), ("feed-forward", "ffn")):
        for kind, sub in df.groupby(col):
            fig.add_trace(go.Bar(x=[1] * len(sub), base=sub["layer"] - 0.5, y=[row] * len(sub), orientation="h",
                                 name=kind, marker_color=colours.get(kind, "#999"), hovertext=sub["layer"].astype(str),
                                 showlegend=True))
    if cfg.attn_res_block_size:
        for i in range(0, cfg.num_hidden_layers, cfg.attn_res_block_size):
            fig.add_vline(x=i - 0.5, line_dash="dot", line_color="black")
    fig.update_layout(barmode="overlay", height=230, title=f"{cfg.name or cfg.family}: layer map "
                      f"(dotted: AttnRes block boundaries)", xaxis_title="layer", margin=dict(l=10, r=10, t=40, b=30))
    return fig


def _block_of(name: str) -> str:
    parts = name.split(".")
    if parts[0] == "lm_head":
        return "lm_head"
    if parts[1] in ("embed_tokens", "norm"):
        return parts[1]
    if parts[1].startswith("output_attn_res"):
        return "attn_res (output)"
    sub = parts[3]
    if sub.endswith("_res_norm") or sub.endswith("_res_proj"):
        return "attn_res"
    if sub.endswith("layernorm"):
        return "block norms"
    if sub == "self_attn":
        return "kda" if parts[4] in ("q_proj", "q_conv1d", "A_log", "dt_bias", "f_a_proj", "f_b_proj", "b_proj",
                                     "k_proj", "v_proj", "k_conv1d", "v_conv1d", "o_norm", "g_a_proj",
                                     "g_b_proj") else "mla"
    if sub == "block_sparse_moe":
        return {"experts": "routed experts", "gate": "router", "shared_experts": "shared experts"}.get(
            parts[4], "latent down/up/norm")
    return "dense mlp"


def block_table(model: KimiForCausalLM, layer: int | None = None) -> pd.DataFrame:
    """Every parameter with its block, shape, dtype and bytes (of one layer, or the whole model)."""
    rows = []
    for name, p in model.named_parameters():
        parts = name.split(".")
        li = int(parts[2]) if parts[1] == "layers" else None
        if layer is not None and li != layer:
            continue
        rows.append({"layer": li, "block": _block_of(name), "parameter": name, "shape": list(p.shape),
                     "dtype": str(p.dtype).replace("torch.", ""), "params": p.numel(),
                     "bytes": p.numel() * p.element_size()})
    return pd.DataFrame(rows)


def cache_bytes_per_sequence(model: KimiForCausalLM, context_len: int) -> pd.DataFrame:
    """Decode-state bytes per sequence by layer kind, measured on real (1-sequence) state tensors."""
    state = model.new_state(1, max(1, context_len))
    out: dict[str, int] = defaultdict(int)
    for s in state.layers:
        if isinstance(s, KDAState):
            out["KDA recurrent state S (fp32)"] += s.S.numel() * s.S.element_size()
            out["KDA conv history"] += s.conv.numel() * s.conv.element_size()
        elif isinstance(s, MLACache):
            out["MLA latent cache"] += (s.latent.numel() * s.latent.element_size()
                                        + s.k_r.numel() * s.k_r.element_size())
    return pd.DataFrame([{"state": k, "bytes": v, "MB": v / 1e6} for k, v in out.items()])


def trace_step(model: KimiForCausalLM, run) -> pd.DataFrame:
    """Run ``run()`` (e.g. one ``Decoder.step``) with forward hooks on every block; one row per block call with
    its input and output shapes, in execution order."""
    rows = []
    hooks = []
    kinds = ("KDA", "MLA", "MoE", "MLP", "Router", "RMSNorm", "Embedding", "Linear")

    def hook(mod: nn.Module, inp, out, name: str):
        first = inp[0] if inp else None
        res = out[0] if isinstance(out, tuple) else out
        rows.append({"module": name, "type": type(mod).__name__,
                     "input": list(first.shape) if isinstance(first, torch.Tensor) else None,
                     "output": list(res.shape) if isinstance(res, torch.Tensor) else None})

    for name, mod in model.named_modules():
        if type(mod).__name__ in kinds and name.count(".") <= 4 and not name.endswith(("_proj", "layernorm")):
            hooks.append(mod.register_forward_hook(lambda m, i, o, n=name: hook(m, i, o, n)))
    try:
        with torch.no_grad():
            run()
    finally:
        for h in hooks:
            h.remove()
    return pd.DataFrame(rows)
