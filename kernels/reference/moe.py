"""PyTorch reference and random inputs of the routed-expert MoE kernel (host code no kernel hash covers); design:
docs/architecture.md (map).
Also the MXFP4 dequantisation (spec §5.5) and the per-head GEMV's inputs and reference.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from kimik3.kernels.contracts.meta import SITU_BETA, SITU_BETA_LIN, head_routing
from kimik3.kernels.fused.moe import _specs
from kimik3.kernels.reference import common as ref_common
from kimik3.kernels.toolchain import dsl

E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # |value| of the E2M1 codes 0-7 (bit 3: sign)


def mxfp4_dequant(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Spec §5.5 MXFP4 -> fp32: low nibble = even column; E2M1 codes, sign bit 3; 2^(e-127) per 32 columns."""
    lut = torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES), dtype=torch.float32, device=packed.device)
    p = packed.to(torch.int64)
    codes = torch.stack([p & 0xF, p >> 4], dim=-1).flatten(-2)  # [.., K]: (even, odd) per byte
    w = lut[codes]
    s = torch.exp2(scale.to(torch.float32) - 127.0).repeat_interleave(32, dim=-1)
    return w * s


def make_inputs(variant: str = "bf16", *, B: int, E: int, L: int, I: int, topk: int, device: str = "cpu",  # noqa: E741
                seed: int = 0, **_: Any) -> dict[str, torch.Tensor]:
    """Random routing (distinct experts per token) and expert weights; outputs poisoned with NaN / -1."""
    rng = ref_common.Rng(seed, device)
    ids = torch.stack([rng.randperm(E)[:topk] for _ in range(B)]).to(torch.int32)
    w = rng.rand(B, topk)
    t: dict[str, torch.Tensor] = {"x": rng.randn(B, L, dtype=torch.bfloat16), "ids": ids,
                                  "weights": w / w.sum(-1, keepdim=True)}
    for name, (dt, shp) in _specs(variant, B, E, L, I, topk).items():
        if name in t:
            continue
        fan_in = I if name in ("w2", "s2") else L
        if name in ("w1", "w3", "w2"):
            if variant == "mxfp4":
                t[name] = rng.randint(0, 256, *shp, dtype=torch.uint8)
            else:
                t[name] = rng.randn(*shp, scale=fan_in**-0.5, dtype=torch.bfloat16)
        elif name in ("s1", "s3", "s2"):
            # |E2M1| ~ 2 on average: pick e so that weights are ~ fan_in^-0.5, +-1 binade of spread
            e0 = 127 - round(math.log2(2.0 * fan_in**0.5))
            t[name] = rng.randint(e0 - 1, e0 + 2, *shp, dtype=torch.uint8)
        else:
            t[name] = rng.poisoned(shp, dsl.torch_dtype(dt))
    return t


def expert_weights(variant: str, t: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(w1, w3, w2) as fp32 [E, out, in]: the bf16 weights, or the MXFP4 ones dequantised (§5.5)."""
    if variant == "mxfp4":
        return (mxfp4_dequant(t["w1"], t["s1"]), mxfp4_dequant(t["w3"], t["s3"]), mxfp4_dequant(t["w2"], t["s2"]))
    return t["w1"].float(), t["w3"].float(), t["w2"].float()


def reference(variant: str, t: dict[str, torch.Tensor], **_: Any) -> dict[str, torch.Tensor]:
    """The reference MoE expert path (§5.3, §10): experts in bf16 (each projection rounded to bf16),
    SiTU-GLU from the model (kimik3.model.modeling.situ_glu), expert outputs bf16, fp32 weighted combine.

    Written out rather than calling kimik3.model.modeling.MoE.expert(), which runs one expert on module parameters (bf16
    nn.Linear) and takes neither weight tensors nor dequantised MXFP4 weights."""
    from kimik3.model.modeling import situ_glu

    w1, w3, w2 = expert_weights(variant, t)
    x, ids, wts = t["x"].float(), t["ids"].long(), t["weights"].float()
    B, topk = ids.shape
    out = torch.zeros(B, x.shape[1], device=x.device)
    for b in range(B):
        for j in range(topk):
            e = int(ids[b, j])
            a = (x[b] @ w1[e].T).to(torch.bfloat16)
            u = (x[b] @ w3[e].T).to(torch.bfloat16)
            h = situ_glu(a, u, SITU_BETA, SITU_BETA_LIN)
            y = (h.float() @ w2[e].T).to(torch.bfloat16)
            out[b] += y.float() * wts[b, j]
    return {"out": out}


def make_heads_inputs(*, B: int, NH: int, R: int, K: int, device: str = "cpu", seed: int = 0, **_: Any
                      ) -> dict[str, torch.Tensor]:
    rng = ref_common.Rng(seed, device)
    return {"W": rng.randn(NH, R, K, scale=K**-0.5, dtype=torch.bfloat16), "x": rng.randn(B * NH, K,
            dtype=torch.bfloat16), "out": rng.poisoned((B * NH, R), torch.bfloat16), **head_routing(B, NH, device)}


def heads_reference(t: dict[str, torch.Tensor], **_: Any) -> dict[str, torch.Tensor]:
    """fp32 reference: out[b·NH + h] = W[h] · x[b·NH + h]."""
    NH, R, K = t["W"].shape
    x = t["x"].float().view(-1, NH, K)
    return {"out": torch.einsum("hrk,bhk->bhr", t["W"].float(), x).reshape(-1, R)}
