"""Per-kernel metadata of the fused decode kernels: the one definition the kernel modules and the host both use.

The host side (``kimik3.stages.fused``: buffer sizes, plan checks, launch argument lists; the prebuilt loader on a
GPU machine) needs a few facts about each kernel — thread layout, compiled split count, eps values, parameter
order — without importing the kernel module and with it the CuTe DSL; the kernel modules in ``kernels/fused/``
import the same facts from here, so there is nothing to keep in sync. Standard library only at import time
(``tests/test_contracts.py`` loads it by path with torch and cutlass blocked; :func:`head_routing` imports torch
when called); the source hash of every kernel that imports it covers it (``kernels/toolchain/source.py``). See
docs/architecture.md (map).
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "SUPPORTED_ARCHS", "VEC", "RMS_EPS",
    "GEMV_WARPS", "GEMV_UNROLL", "ROW_LOOP_FROM", "LM_ROWS_PER_WARP", "LM_ROWS_PER_CTA", "KDA_THREADS", "KDA_QK_EPS",
    "ATTN_RES_KEEP_MAX_CANDIDATES", "ATTN_RES_CHUNK_BUDGET", "SITU_BETA", "SITU_BETA_LIN", "SITU_BETAS",
    "MOE_ORDER", "HEADS_ORDER", "ARG_ORDER", "mla_head_layout", "mla_default_splits", "attn_res_threads",
    "kda_layout", "kda_head_dim_ok", "head_routing",
]

# Every kernel uses only sm_80-era instructions (ld.global.nc.v4, shfl.sync, ex2/tanh.approx, bar.sync): no
# wgmma/TMA, so nothing is Hopper-only and sm_100a compiles too. The architectures kernels are built and loaded for.
SUPPORTED_ARCHS = ("sm_90a", "sm_100a")
VEC = 8  # bf16 elements per 16-byte vector load
# eps of every RMSNorm a fused kernel computes (gemv's fused norm, the AttnRes mix, KDA's gated output norm); the
# fused stage refuses a config whose rms_norm_eps differs
RMS_EPS = 1e-5

# ---------------------------------------------------------------------------------------------- gemv
GEMV_WARPS = 4  # rows per CTA (one warp each)
GEMV_UNROLL = 7  # 16-byte weight loads in flight per lane per loop step of the fused GEMVs
# batch rows per GEMV step from which a step loops over its rows instead of unrolling them (fused gemv._dot_step,
# moe._bf16_step, the megakernel's device_fns._dot_step): unrolled, ptxas interleaves the rows' x loads with the
# step's weight loads and consumes the first weight chunk before the step's last weight loads are issued
ROW_LOOP_FROM = 3
LM_ROWS_PER_WARP = 8  # lm_head: rows per warp
LM_ROWS_PER_CTA = GEMV_WARPS * LM_ROWS_PER_WARP  # one arg-max partial per 32 vocabulary rows

# ---------------------------------------------------------------------------------------------- kda
KDA_THREADS = 256  # one CTA per (sequence, head)
KDA_QK_EPS = 1e-6  # l2norm of q and k (eps inside the root, as the model)


def kda_layout(D: int) -> tuple[int, int, int] | None:
    """(JG, KS, RS) of the KDA kernel for head dim ``D`` — column groups of 4, row splits, rows per thread — or
    None when one ``KDA_THREADS`` CTA cannot hold the q/k and v channels of a head."""
    JG = D // 4
    if D % 32 or 2 * D > KDA_THREADS or KDA_THREADS % JG:
        return None
    KS = KDA_THREADS // JG
    if D % KS:
        return None
    return JG, KS, D // KS


def kda_head_dim_ok(D: int) -> bool:
    """True when the KDA kernel supports head dim ``D``."""
    return kda_layout(D) is not None


# ---------------------------------------------------------------------------------------------- mla_decode
def mla_head_layout(nh: int) -> tuple[int, int]:
    """(heads per warp, warps per CTA) with nh divisible by their product.

    Two heads per warp keep q (2 x 18) + o (2 x 16) + a 4-token fp32 K/V tile (72) within the
    register budget at K3 widths; four heads per warp exhaust the registers.
    """
    for hpw in (2, 1):
        if nh % hpw == 0:
            warps = max(w for w in (4, 3, 2, 1) if (nh // hpw) % w == 0)
            return hpw, warps
    raise AssertionError(nh)


def mla_default_splits(B: int, nh: int, S: int) -> int:
    """The split count a compiled MLA op is built with: enough CTAs to fill ~2 waves of 132 SMs, never more splits
    than 64 or than S / 64 tokens."""
    hpw, warps = mla_head_layout(nh)
    ctas = B * (nh // (hpw * warps))
    want = max(1, 264 // max(ctas, 1))
    return int(max(1, min(want, 64, S // 64)))


# ---------------------------------------------------------------------------------------------- attn_res
ATTN_RES_KEEP_MAX_CANDIDATES = 4  # above this the mix re-reads the candidates (L1/L2) instead of keeping them live
ATTN_RES_CHUNK_BUDGET = 8  # candidate chunks (16 B = 4 registers each) a thread keeps: NC x CH <= 8 -> <= 32 regs


def attn_res_threads(H: int, NC: int) -> int:
    """Threads per CTA of the AttnRes mix: CH = max(1, 8 // NC) chunks per candidate per thread (2 when the
    candidates are re-read for the mix), enough warps to cover H. May exceed 1024: the kernel refuses that, the
    fused stage's plan reports it.

    The register-resident candidates cost NC x CH x 4 registers; a CTA of T threads may use at most
    65536 / T registers per thread, so more candidates -> fewer chunks per thread -> more threads.
    """
    ch = max(1, ATTN_RES_CHUNK_BUDGET // NC) if NC <= ATTN_RES_KEEP_MAX_CANDIDATES else 2
    chunks_per_thread = -(-(H // VEC) // ch)
    return 32 * -(-chunks_per_thread // 32)


# ---------------------------------------------------------------------------------------------- moe
SITU_BETA = 4.0  # SiTU-GLU constants the MoE kernel is compiled with (the fused stage refuses other configs)
SITU_BETA_LIN = 25.0
SITU_BETAS = (SITU_BETA, SITU_BETA_LIN)


def head_routing(B: int, NH: int, device: Any = "cpu") -> dict[str, Any]:
    """The constant routing tables of the per-head GEMV (``moe.head_gemv``): head h owns the rows b·NH + h,
    b = 0..B-1. int32 torch tensors on ``device``."""
    import torch  # here, not at the top: the rest of this module must load without torch

    h = torch.arange(NH, dtype=torch.int32, device=device)
    b = torch.arange(B, dtype=torch.int32, device=device)
    return {"sorted": (b[None, :] * NH + h[:, None]).reshape(-1).contiguous(), "act_e": h.clone(),
            "act_start": h * B, "act_count": torch.full((NH,), B, dtype=torch.int32, device=device),
            "n_act": torch.tensor([NH], dtype=torch.int32, device=device)}


# ---------------------------------------------------------------------------------------------- parameter order
# Positional parameter order of every compiled op, (module, variant) -> names: what each module's launch() passes
# and what a prebuilt op (TVM-FFI, no DSL on the machine) is called with.
MOE_ORDER = ("x", "ids", "weights", "w1", "w3", "w2", "s1", "s3", "s2", "h", "y", "sorted", "act_e", "act_start",
             "act_count", "n_act", "out")
HEADS_ORDER = ("W", "x", "out", "sorted", "act_e", "act_start", "act_count", "n_act")
ARG_ORDER: dict[tuple[str, str], tuple[str, ...]] = {
    **{("gemv", v): ("W", "x", "gamma", "residual", "y") for v in ("plain", "rmsnorm", "residual", "f32out")},
    ("gemv", "lm_head"): ("W", "x", "gamma", "logits", "part_v", "part_i", "token"),
    ("router", "router"): ("W", "x", "bias", "scores", "ids", "weights"),
    ("kda", "kda"): ("qkv", "u", "b", "gate", "conv_w", "dt_bias", "A_log", "o_norm", "conv", "S", "out"),
    ("mla_decode", "mla"): ("q", "kv", "lens", "part_o", "part_m", "part_l", "o", "scale"),
    ("moe", "bf16"): MOE_ORDER, ("moe", "mxfp4"): MOE_ORDER,
    ("moe", "heads"): HEADS_ORDER,
    ("attn_res", "mix"): ("cand", "omega", "out"),
}
