"""The fused MoE router for decode (spec §5.2): two kernels launched back to back by one ``@cute.jit`` op.

``gemv_kernel`` (:mod:`gemv`) with a sigmoid epilogue writes the fp32 scores s[B, E] = σ(x · W_gateᵀ); ``topk_kernel``
(one warp per token) adds the selection bias, masks groups (grouped routing), takes k rounds of lane arg-max,
butterfly arg-max across the warp (``common.device.warp_argmax``, ties to the lower expert id) and retirement, then
renormalises the unbiased scores of the chosen experts. Outputs: ids int32 [B, k], weights fp32 [B, k], scores.
The per-lane work is in ``@cute.jit`` helpers taking the token and lane as plain integers (``topk_*``,
``_local_argmax``, ``common.device.argmax_take``); ``kernels/verify/host_exec_router.py`` runs them on the host and
replays the butterfly in the shuffle order. Design: ``docs/architecture.md`` (appendix: design notes by room,
``kernels/fused/router.py``)."""

from __future__ import annotations

from typing import Any

import cutlass
import cutlass.cute as cute
import torch
from cutlass import BFloat16, Float32, Int32, const_expr
from kimik3.kernels.common import device as C
from kimik3.kernels.common.device import argmax_take, warp_argmax
from kimik3.kernels.contracts.meta import ARG_ORDER
from kimik3.kernels.fused.gemv import CTAS_PER_SM as GEMV_CTAS_PER_SM
from kimik3.kernels.fused.gemv import WARPS as GEMV_WARPS
from kimik3.kernels.fused.gemv import gemv_kernel, resident_ctas
from kimik3.kernels.toolchain import dsl
from kimik3.kernels.toolchain.source import kernel_source_hash

# hash of the source as imported: the build cache and prebuilt manifests key on the code that runs
SOURCE_HASH = kernel_source_hash(__name__.rsplit(".", 1)[-1])
TOKENS_PER_CTA = 4  # one warp per token
VARIANTS = ("router",)
OUTPUTS = {"router": ("weights", "ids")}


@cute.jit
def _local_argmax(v: cute.Tensor, ix: cute.Tensor) -> tuple[Float32, Int32]:
    bv, bi = v[0], ix[0]
    for j in cutlass.range_constexpr(1, cute.size(v)):
        take = argmax_take(v[j], ix[j], bv, bi)
        bv, bi = (v[j], ix[j]) if take else (bv, bi)
    return bv, bi


@cute.jit
def topk_token(bidx: Int32, warp: Int32) -> Int32:
    """The token a warp routes: one warp per token, TOKENS_PER_CTA per CTA."""
    return bidx * TOKENS_PER_CTA + warp


@cute.jit
def topk_candidates(mS: cute.Tensor, mBias: cute.Tensor, tok: Int32, lane: Int32, v: cute.Tensor,
                    ix: cute.Tensor) -> None:
    """A lane's candidates: experts lane, lane + 32, ... (coalesced: 32 lanes read 128 contiguous bytes) with their
    choice scores c = s + bias; -inf past E."""
    E = cute.size(mS, mode=[1])
    for j in cutlass.range_constexpr(cute.size(v)):
        e = j * 32 + lane
        ix[j] = e
        v[j] = -Float32.inf
        if e < E:
            v[j] = mS[tok, e] + mBias[e]


@cute.jit
def topk_retire(v: cute.Tensor, ix: cute.Tensor, bi: Int32) -> None:
    """The owner of the round's winner takes it out of the race."""
    for j in cutlass.range_constexpr(cute.size(v)):
        v[j] = -Float32.inf if ix[j] == bi else v[j]


@cute.jit
def topk_group_candidates(v: cute.Tensor, ix: cute.Tensor, g: Int32, GS: cutlass.Constexpr, mv: cute.Tensor
                          ) -> None:
    """The lane's candidates of group g (the others -inf), for the group score."""
    for j in cutlass.range_constexpr(cute.size(v)):
        mv[j] = v[j] if ix[j] // GS == g else -Float32.inf


@cute.jit
def topk_group_mask(v: cute.Tensor, ix: cute.Tensor, gscore: cute.Tensor, GS: cutlass.Constexpr,
                    NGROUP: cutlass.Constexpr, TOPK_GROUP: cutlass.Constexpr) -> None:
    """Keep the candidates of the best TOPK_GROUP groups (ties -> lower group id), mask the others with -inf."""
    for j in cutlass.range_constexpr(cute.size(v)):
        keep = False
        for g in cutlass.range_constexpr(NGROUP):
            rank = Int32(0)  # groups strictly better than g (ties -> lower group id)
            for h in cutlass.range_constexpr(NGROUP):
                if const_expr(h != g):
                    better = (gscore[h] > gscore[g]) | ((gscore[h] == gscore[g]) & (h < g))
                    rank = rank + (1 if better else 0)
            keep = keep | ((ix[j] // GS == g) & (rank < TOPK_GROUP))
        v[j] = v[j] if keep else -Float32.inf


@cute.jit
def topk_weight(mS: cute.Tensor, tok: Int32, lane: Int32, my_id: Int32, TOPK: cutlass.Constexpr) -> Float32:
    """Lane r < k holds the r-th choice; its weight is the UNBIASED sigmoid score (0 on the other lanes)."""
    w = Float32(0.0)
    if lane < TOPK:
        w = mS[tok, my_id]
    return w


@cute.kernel
def topk_kernel(mS: cute.Tensor, mBias: cute.Tensor, mIds: cute.Tensor, mWts: cute.Tensor,
                TOPK: cutlass.Constexpr, NGROUP: cutlass.Constexpr, TOPK_GROUP: cutlass.Constexpr,
                SCALE: cutlass.Constexpr, RENORM: cutlass.Constexpr):
    tidx, _, _ = cute.arch.thread_idx()
    bidx, _, _ = cute.arch.block_idx()
    warp, lane = tidx // 32, tidx % 32
    B, E = cute.size(mS, mode=[0]), cute.size(mS, mode=[1])
    J = C.ceil_div(E, 32)
    tok = topk_token(bidx, warp)
    if tok < B:  # warp-uniform
        v = cute.make_rmem_tensor((J,), Float32)
        ix = cute.make_rmem_tensor((J,), Int32)
        topk_candidates(mS, mBias, tok, lane, v, ix)
        if const_expr(NGROUP > 1 and TOPK_GROUP < NGROUP):
            GS = E // NGROUP
            gscore = cute.make_rmem_tensor((NGROUP,), Float32)
            for g in cutlass.range_constexpr(NGROUP):
                # group score = sum of its two largest choice scores
                mv = cute.make_rmem_tensor((J,), Float32)
                topk_group_candidates(v, ix, g, GS, mv)
                b1, i1 = warp_argmax(*_local_argmax(mv, ix))
                topk_retire(mv, ix, i1)
                b2, _ = warp_argmax(*_local_argmax(mv, ix))
                gscore[g] = b1 + b2
            topk_group_mask(v, ix, gscore, GS, NGROUP, TOPK_GROUP)
        my_id = Int32(0)
        for r in cutlass.range_constexpr(TOPK):
            bv, bi = warp_argmax(*_local_argmax(v, ix))
            topk_retire(v, ix, bi)
            my_id = bi if lane == r else my_id
        w = topk_weight(mS, tok, lane, my_id, TOPK)
        if const_expr(RENORM and TOPK > 1):
            w = w / (C.warp_sum(w) + 1e-20)
        if lane < TOPK:
            mIds[tok, lane] = my_id
            mWts[tok, lane] = w * SCALE


@cute.jit
def router(mW: cute.Tensor, mX: cute.Tensor, mBias: cute.Tensor, mScores: cute.Tensor, mIds: cute.Tensor,
           mWts: cute.Tensor, stream: Any, TOPK: cutlass.Constexpr, NGROUP: cutlass.Constexpr,
           TOPK_GROUP: cutlass.Constexpr, SCALE: cutlass.Constexpr, RENORM: cutlass.Constexpr):
    E, H = cute.size(mW, mode=[0]), cute.size(mW, mode=[1])
    B = cute.size(mX, mode=[0])
    assert H % C.VEC == 0 and TOPK <= 32 and TOPK <= E and E % NGROUP == 0
    BT = C.batch_tile(B)
    gemv_kernel(mW, mX, None, None, mScores, BT, "sigmoid").launch(
        grid=[B // BT, C.ceil_div(E, GEMV_WARPS), 1], block=[GEMV_WARPS * 32, 1, 1], stream=stream,
        **resident_ctas(GEMV_CTAS_PER_SM))  # compiled for gemv's occupancy, as gemv.gemv launches it
    topk_kernel(mScores, mBias, mIds, mWts, TOPK, NGROUP, TOPK_GROUP, SCALE, RENORM).launch(
        grid=[C.ceil_div(B, TOKENS_PER_CTA), 1, 1], block=[TOKENS_PER_CTA * 32, 1, 1], stream=stream)


def _specs(B: int, E: int, H: int, topk: int) -> dict[str, tuple[Any, tuple[int, ...]]]:
    return {"W": (BFloat16, (E, H)), "x": (BFloat16, (B, H)), "bias": (Float32, (E,)), "scores": (Float32, (B, E)),
            "ids": (Int32, (B, topk)), "weights": (Float32, (B, topk))}


def compile_for(arch: str, *, variant: str = "router", B: int, E: int, H: int, topk: int, n_group: int = 1,
                topk_group: int = 1, scale: float = 1.0, renorm: bool = True, tvm_ffi: bool = False,
                remark_file: str | None = None) -> Any:
    f = {k: dsl.fake(dt, shp) for k, (dt, shp) in _specs(B, E, H, topk).items()}
    opts = dsl.compile_options(arch, tvm_ffi=tvm_ffi, remark_file=remark_file)
    with dsl.arch_scope(arch):
        return cute.compile(router, f["W"], f["x"], f["bias"], f["scores"], f["ids"], f["weights"],
                            dsl.fake_stream(tvm_ffi), topk, n_group, topk_group, float(scale), bool(renorm),
                            options=opts)


def launch(compiled: Any, variant: str, t: dict[str, torch.Tensor], tvm_ffi: bool = False) -> None:
    dsl.launch(compiled, [t[k] for k in ARG_ORDER[("router", variant)]], tvm_ffi)
