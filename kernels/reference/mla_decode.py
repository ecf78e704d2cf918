"""PyTorch reference and random inputs of the MLA decode kernel (host code no kernel hash covers); design:
docs/architecture.md (map).
``split_reference`` replays the kernels' split-K algorithm (per-split partials, then the combine).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from kimik3.kernels.common import device as C
from kimik3.kernels.fused.mla_decode import TT, default_splits
from kimik3.kernels.reference import common as ref_common


def make_inputs(variant: str = "mla", *, B: int, nh: int, DL: int, DR: int, S: int, nsplit: int | None = None,
                scale: float | None = None, device: str = "cpu", seed: int = 0, **_: Any) -> dict[str, Any]:
    """Random q and cache; ragged lengths (first sequence full, one of length 1 when B > 1)."""
    nsplit = nsplit or default_splits(B, nh, S)
    rng = ref_common.Rng(seed, device)
    lens = rng.randint(1, S + 1, B, dtype=torch.int32)
    lens[0] = S
    if B > 1:
        lens[1] = 1
    t: dict[str, Any] = {
        "q": rng.randn(B, nh, DL + DR, dtype=torch.bfloat16),
        "kv": rng.randn(B, S, DL + DR, dtype=torch.bfloat16),
        "lens": lens,
        "part_o": rng.poisoned((B, nh, nsplit, DL), torch.float32),
        "part_m": rng.poisoned((B, nh, nsplit), torch.float32),
        "part_l": rng.poisoned((B, nh, nsplit), torch.float32),
        "o": rng.poisoned((B, nh, DL), torch.bfloat16),
    }
    # the softmax scale is a runtime argument; K3 uses qk_head_dim^-0.5 = (128 + 64)^-0.5 (pitfall 9)
    t["scale"] = float(scale if scale is not None else (3 * DR) ** -0.5)
    return t


def reference(variant: str, t: dict[str, Any], **_: Any) -> dict[str, torch.Tensor]:
    """Full (unsplit) softmax attention per sequence in fp32: o_lat[h] = softmax(q·kv^T·scale) · c.

    Not kimik3.model.modeling.MLA, which attends in the unabsorbed form over its own cache object: this latent-space
    form is checked against it algebraically in tests/test_kernel_references.py."""
    q, kv, lens = t["q"].float(), t["kv"].float(), t["lens"]
    DL = t["o"].shape[-1]
    out = torch.empty(q.shape[0], q.shape[1], DL, device=q.device)
    for b in range(q.shape[0]):
        n = int(lens[b])
        p = torch.softmax(q[b] @ kv[b, :n].T * t["scale"], dim=-1)  # [nh, n]
        out[b] = p @ kv[b, :n, :DL]
    return {"o": out}


def split_reference(t: dict[str, Any], nsplit: int) -> dict[str, torch.Tensor]:
    """The kernels' algorithm in PyTorch: per-split partial (m, l, o) in the log2 domain, then the combine."""
    q, kv, lens = t["q"].float(), t["kv"].float(), t["lens"]
    B, nh, _ = q.shape
    DL = t["o"].shape[-1]
    pm = torch.full((B, nh, nsplit), -math.inf, device=q.device)
    pl = torch.zeros(B, nh, nsplit, device=q.device)
    po = torch.zeros(B, nh, nsplit, DL, device=q.device)
    for b in range(B):
        n = int(lens[b])
        per_split = C.ceil_div(n, nsplit)
        chunk = C.ceil_div(per_split, TT) * TT  # as the kernel: split length rounded up to TT tokens
        for sp in range(nsplit):
            lo, hi = sp * chunk, min(sp * chunk + chunk, n)
            if lo >= hi:
                continue
            s = (q[b] @ kv[b, lo:hi].T) * (t["scale"] * C.LOG2E)  # [nh, hi-lo]
            mx = s.max(-1).values
            p = torch.exp2(s - mx[:, None])
            pm[b, :, sp], pl[b, :, sp], po[b, :, sp] = mx, p.sum(-1), p @ kv[b, lo:hi, :DL]
    M = pm.max(-1, keepdim=True).values
    w = torch.exp2(pm - M)
    o = (w[..., None] * po).sum(2) / (w * pl).sum(-1)[..., None]
    return {"o": o, "part_m": pm, "part_l": pl, "part_o": po}
