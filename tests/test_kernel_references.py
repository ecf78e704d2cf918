"""CPU checks of the kernels' PyTorch references, and of the algorithms the kernels implement.

Each module's ``reference`` (which delegates to ``kimik3.model.modeling`` where the semantics match) is compared
with an independent plain computation on fresh random inputs. Where a kernel restructures the math
(flash-decoding splits, the single-pass KDA state update, the MXFP4 bit tricks, the warp top-k, the
counting sort of the MoE align kernel), a NumPy/PyTorch model of exactly those steps is checked too.
Nothing here runs a kernel: there is no GPU.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from kimik3.kernels.common import device as _common
from kimik3.kernels.fused import gemv, mla_decode, moe
from kimik3.kernels.reference import attn_res as attn_res_ref
from kimik3.kernels.reference import gemv as gemv_ref
from kimik3.kernels.reference import kda as kda_ref
from kimik3.kernels.reference import mla_decode as mla_ref
from kimik3.kernels.reference import moe as moe_ref
from kimik3.kernels.reference import router as router_ref
from kimik3.kernels.toolchain import registry as R

E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def err(a: torch.Tensor, b: torch.Tensor) -> float:
    """validation.md: ‖a − b‖₂ / ‖b‖₂ in float64; NaN/inf anywhere fails."""
    a, b = a.double(), b.double()
    assert torch.isfinite(a).all() and torch.isfinite(b).all()
    return float((a - b).norm() / b.norm())


# the fused families (the persistent megakernel has no per-kernel inputs: its reference is the CPU interpreter)
@pytest.mark.parametrize("v", R.variants_for(["tiny"], [1, 8], list(R.FAMILIES)), ids=lambda v: v.name)
def test_outputs_are_poisoned_and_references_finite(v: R.KernelVariant) -> None:
    t = v.reference.make_inputs(v.variant, **v.shapes, **v.runtime, seed=3)
    for name in v.module.OUTPUTS[v.variant]:
        if name in ("S", "conv"):  # KDA state is in/out: initialised, not poisoned
            continue
        out = t[name]
        assert (out.isnan().all() if out.dtype.is_floating_point else (out == -1).all()), name
    ref = v.reference.reference(v.variant, t, **v.shapes, **v.runtime)
    assert all(torch.isfinite(r.double()).all() for r in ref.values())


# ---------------------------------------------------------------------------------------------- GEMV
@pytest.mark.parametrize("variant", ["plain", "residual", "f32out"])
def test_gemv_reference(variant: str) -> None:
    B, N, K = 3, 20, 136
    t = gemv_ref.make_inputs(variant, B=B, N=N, K=K, seed=1)
    y = gemv_ref.reference(variant, t)["y"]
    x, W = t["x"].double().numpy(), t["W"].double().numpy()
    for b, n in [(0, 0), (1, 7), (2, 19)]:  # scalar dot products, fsum
        want = math.fsum(x[b, k] * W[n, k] for k in range(K))
        if variant == "residual":
            want += float(t["residual"][b, n])
        assert float(y[b, n]) == pytest.approx(want, rel=1e-5, abs=1e-5)


def test_gemv_rmsnorm_reference_and_fused_form() -> None:
    B, N, K = 4, 24, 384
    t = gemv_ref.make_inputs("rmsnorm", B=B, N=N, K=K, seed=2)
    y = gemv_ref.reference("rmsnorm", t)["y"]
    x = t["x"].double()
    xhat = (x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + gemv.RMS_EPS)).to(torch.bfloat16)
    normed = (xhat * t["gamma"]).double()  # bf16 x bf16 -> bf16, as the model's RMSNorm
    assert err(y, normed @ t["W"].double().T) < 1e-3
    # the kernel's fused form: rstd applied once after Σ W·g·x, no bf16 intermediate
    rstd = torch.rsqrt(x.pow(2).mean(-1) + gemv.RMS_EPS)
    fused = rstd[:, None] * ((x * t["gamma"].double()) @ t["W"].double().T)
    assert err(fused, y) < 1e-2


def test_lm_head_reference() -> None:
    t = gemv_ref.make_inputs("lm_head", B=3, N=512, K=128, seed=4)
    ref = gemv_ref.reference("lm_head", t)
    assert ref["token"].dtype == torch.int32
    assert torch.equal(ref["token"].long(), torch.from_numpy(ref["logits"].numpy().argmax(-1)))
    x = t["x"].double()
    rstd = torch.rsqrt(x.pow(2).mean(-1) + gemv.RMS_EPS)
    fused = rstd[:, None] * ((x * t["gamma"].double()) @ t["W"].double().T)
    assert err(fused, ref["logits"]) < 1e-2


def test_lm_head_partial_argmax_model() -> None:
    """Per-CTA partial arg-max then a reduction over partials equals a global arg-max (ties: lowest)."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randint(-5, 5, (4, 256), generator=g).float()  # many ties
    rows = gemv.WARPS * gemv.LM_ROWS_PER_WARP
    parts = logits.view(4, -1, rows)
    pv, pi_local = parts.max(-1)  # torch.max returns the first maximal index
    pi = pi_local + torch.arange(parts.shape[1])[None] * rows
    best = pv.argmax(-1)  # first maximal partial = lowest vocabulary index among ties
    assert torch.equal(pi.gather(1, best[:, None])[:, 0], logits.argmax(-1))


# ---------------------------------------------------------------------------------------------- router
def _route_plain(x, W, bias, k, n_group, topk_group, scale, renorm):
    s = 1.0 / (1.0 + np.exp(-(x.astype(np.float64) @ W.astype(np.float64).T)))
    c = s + bias.astype(np.float64)
    E = W.shape[0]
    ids, wts = [], []
    for b in range(x.shape[0]):
        cb = c[b].copy()
        if n_group > 1 and topk_group < n_group:
            gs = E // n_group
            gscore = [sum(sorted(cb[g * gs:(g + 1) * gs])[-2:]) for g in range(n_group)]
            keep = sorted(range(n_group), key=lambda g: (-gscore[g], g))[:topk_group]
            for g in range(n_group):
                if g not in keep:
                    cb[g * gs:(g + 1) * gs] = -np.inf
        idx = sorted(range(E), key=lambda e: (-cb[e], e))[:k]
        w = s[b, idx]
        if renorm and k > 1:
            w = w / (w.sum() + 1e-20)
        ids.append(idx)
        wts.append(w * scale)
    return np.array(ids), np.array(wts)


@pytest.mark.parametrize("E,k,G,TG,scale", [(32, 4, 1, 1, 1.0), (56, 16, 1, 1, 1.0), (64, 6, 8, 3, 2.5)])
def test_router_reference(E: int, k: int, G: int, TG: int, scale: float) -> None:
    t = router_ref.make_inputs(B=5, E=E, H=64, topk=k, seed=E)
    ref = router_ref.reference("router", t, topk=k, n_group=G, topk_group=TG, scale=scale)
    ids, wts = _route_plain(t["x"].float().numpy(), t["W"].float().numpy(), t["bias"].numpy(), k, G, TG, scale, True)
    assert np.array_equal(ref["ids"].numpy(), ids)
    np.testing.assert_allclose(ref["weights"].numpy(), wts, rtol=1e-5)
    if G == 1:
        top = torch.topk(ref["scores"] + t["bias"], k, dim=-1).indices
        assert torch.equal(top.to(torch.int32), ref["ids"])


def _warp_topk_model(c: np.ndarray, k: int, n_group: int, topk_group: int) -> list[int]:
    """The lanes of router.topk_kernel: lane l holds experts l, l+32, ...; butterfly arg-max rounds."""
    E = len(c)
    J = -(-E // 32)
    v = np.full((32, J), -np.inf)
    ix = np.zeros((32, J), dtype=np.int64)
    for lane in range(32):
        for j in range(J):
            e = j * 32 + lane
            ix[lane, j] = e
            if e < E:
                v[lane, j] = c[e]

    def warp_argmax(vals: np.ndarray) -> tuple[float, int]:
        bv, bi = vals[:, 0].copy(), ix[:, 0].copy()
        for j in range(1, J):  # local arg-max, ties -> lower index
            take = (vals[:, j] > bv) | ((vals[:, j] == bv) & (ix[:, j] < bi))
            bv, bi = np.where(take, vals[:, j], bv), np.where(take, ix[:, j], bi)
        for off in (16, 8, 4, 2, 1):  # butterfly
            lanes = np.arange(32) ^ off
            ov, oi = bv[lanes], bi[lanes]
            take = (ov > bv) | ((ov == bv) & (oi < bi))
            bv, bi = np.where(take, ov, bv), np.where(take, oi, bi)
        assert (bv == bv[0]).all() and (bi == bi[0]).all()  # every lane agrees
        return bv[0], int(bi[0])

    if n_group > 1 and topk_group < n_group:
        gs = E // n_group
        gscore = []
        for g in range(n_group):
            mv = np.where(ix // gs == g, v, -np.inf)
            b1, i1 = warp_argmax(mv)
            mv = np.where(ix == i1, -np.inf, mv)
            b2, _ = warp_argmax(mv)
            gscore.append(b1 + b2)
        rank = [sum((gscore[h] > gscore[g]) or (gscore[h] == gscore[g] and h < g) for h in range(n_group) if h != g)
                for g in range(n_group)]
        keep = np.array([r < topk_group for r in rank])
        v = np.where(keep[np.minimum(ix // gs, n_group - 1)] & (ix < E), v, -np.inf)
    out = []
    for _ in range(k):
        _, bi = warp_argmax(v)
        v = np.where(ix == bi, -np.inf, v)
        out.append(bi)
    return out


@pytest.mark.parametrize("E,k,G,TG", [(32, 4, 1, 1), (56, 16, 1, 1), (896, 16, 1, 1), (256, 8, 8, 4), (60, 5, 4, 2)])
def test_router_warp_topk_algorithm(E: int, k: int, G: int, TG: int) -> None:
    rng = np.random.default_rng(E + k)
    for trial in range(20):
        c = rng.normal(size=E)
        if trial % 2:
            c = np.round(c * 4) / 4  # many exact ties: lower index must win
        want = [e for e, _ in sorted(enumerate(c), key=lambda p: (-p[1], p[0]))]
        if G > 1:
            gs = E // G
            gscore = [sum(sorted(c[g * gs:(g + 1) * gs])[-2:]) for g in range(G)]
            keep = sorted(range(G), key=lambda g: (-gscore[g], g))[:TG]
            want = [e for e in want if e // gs in keep]
        assert _warp_topk_model(c, k, G, TG) == want[:k]


# ---------------------------------------------------------------------------------------------- MXFP4 / SiTU / MoE
def _dequant_scalar(packed: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """Spec §5.5, one element at a time."""
    rows, half = packed.shape
    out = np.zeros((rows, 2 * half), dtype=np.float64)
    for r in range(rows):
        for c in range(2 * half):
            byte = int(packed[r, c // 2])
            code = byte & 0xF if c % 2 == 0 else byte >> 4
            mag = E2M1[code & 7]
            out[r, c] = (-mag if code & 8 else mag) * 2.0 ** (int(scale[r, c // 32]) - 127)
    return out


def test_mxfp4_dequant_bitwise() -> None:
    g = torch.Generator().manual_seed(5)
    packed = torch.randint(0, 256, (7, 48), generator=g, dtype=torch.uint8)
    scale = torch.randint(100, 140, (7, 3), generator=g, dtype=torch.uint8)
    packed[0, :16] = torch.arange(16, dtype=torch.uint8) * 17  # every code, both nibbles
    got = moe_ref.mxfp4_dequant(packed, scale)
    want = torch.from_numpy(_dequant_scalar(packed.numpy(), scale.numpy())).float()
    assert torch.equal(got, want)  # bitwise (all values are exactly representable)


def _fp4_expand_model(words: np.ndarray) -> np.ndarray:
    """_common.fp4_expand on four uint32 words: (t & 7) << 9 | (t & 8) << 12 as fp16x2, pair order."""
    h32 = np.zeros(16, dtype=np.uint32)
    for j in range(4):
        for s in range(4):
            t = (int(words[j]) >> (4 * s)) & 0x000F000F
            h32[4 * j + s] = ((t & 0x00070007) << 9) | ((t & 0x00080008) << 12)
    return h32.view(np.float16).astype(np.float64)  # little endian: low half first


def _x_pair_order_model(x: np.ndarray) -> np.ndarray:
    """_common.x_pair_order: element q = 8j + 2s + hi holds column 8j + s + 4 hi."""
    return np.array([x[hi * 4 + s + 8 * j] for j in range(4) for s in range(4) for hi in range(2)])


def test_mxfp4_kernel_bit_tricks() -> None:
    """The in-register expansion: fp16(code) · 2^14 == E2M1 value, pair order matches the x layout,
    and the fp32 scale bits (e + 14) << 23 == 2^(e - 127 + 14); a 32-column dot product is exact."""
    rng = np.random.default_rng(0)
    # every byte value appears: fp16 placement of each code
    for byte in range(256):
        words = np.array([byte * 0x01010101] * 4, dtype=np.uint32)
        vals = _fp4_expand_model(words) * 2.0**14
        lo, hi = byte & 0xF, byte >> 4
        want_lo = (-1 if lo & 8 else 1) * E2M1[lo & 7]
        want_hi = (-1 if hi & 8 else 1) * E2M1[hi & 7]
        # q = 2(4j+s) + hi; columns 8j+s (+4): even columns of a byte are lo nibbles
        for q in range(32):
            col = 8 * (q // 8) + (q // 2) % 4 + 4 * (q % 2)
            assert _common.fp4_pair_col(q) == col  # the kernels read x in this order
            assert vals[q] == (want_lo if col % 2 == 0 else want_hi)
    for e in range(0, 241):
        bits = np.array([(e + 14) << 23], dtype=np.uint32)
        assert bits.view(np.float32)[0] == np.float32(2.0 ** (e - 127 + 14))
    for _ in range(50):
        chunk = rng.integers(0, 256, 16, dtype=np.uint8)
        e = int(rng.integers(110, 135))
        x = rng.normal(size=32).astype(np.float32).astype(np.float64)
        w = _dequant_scalar(chunk[None], np.array([[e]]))[0]
        got = float(np.dot(_fp4_expand_model(chunk.view(np.uint32)), _x_pair_order_model(x))) * 2.0 ** (e - 113)
        assert got == pytest.approx(float(np.dot(w, x)), rel=1e-12, abs=1e-300)


def test_situ_formula() -> None:
    from kimik3.model.modeling import situ_glu

    a = torch.linspace(-40, 40, 801)
    b = torch.linspace(60, -60, 801)
    got = situ_glu(a, b, moe.SITU_BETA, moe.SITU_BETA_LIN).double()
    ad, bd = a.double(), b.double()
    want = (4.0 * torch.tanh(ad / 4.0) * torch.sigmoid(ad)) * (25.0 * torch.tanh(bd / 25.0))
    assert err(got, want) < 1e-6
    assert got.abs().max() <= 4.0 * 25.0  # both branches are soft-capped


@pytest.mark.parametrize("variant", ["bf16", "mxfp4"])
def test_moe_reference_vs_dense(variant: str) -> None:
    """Reference (loop over routed pairs) vs every expert on every token, masked by a dense routing matrix."""
    shp = dict(B=5, E=8, L=64, I=96, topk=3)
    t = moe_ref.make_inputs(variant, **shp, seed=7)
    ref = moe_ref.reference(variant, t)["out"]
    w1, w3, w2 = moe_ref.expert_weights(variant, t)
    x = t["x"].double()
    a = torch.einsum("bl,eil->bei", x, w1.double()).to(torch.bfloat16).double()
    u = torch.einsum("bl,eil->bei", x, w3.double()).to(torch.bfloat16).double()
    h = ((4 * torch.tanh(a / 4) * torch.sigmoid(a)) * (25 * torch.tanh(u / 25))).to(torch.bfloat16).double()
    y = torch.einsum("bei,eli->bel", h, w2.double()).to(torch.bfloat16).double()
    route = torch.zeros(shp["B"], shp["E"], dtype=torch.float64)
    route.scatter_(1, t["ids"].long(), t["weights"].double())
    dense = (route[..., None] * y).sum(1)
    assert err(ref, dense) < 5e-3


def _align_model(ids: np.ndarray, E: int) -> tuple[list[int], list[int], list[int], list[int]]:
    """moe_align_kernel: 32 pairs at a time, match.any groups, rank = popc(lower lanes of the group)."""
    flat = ids.reshape(-1)
    P = len(flat)
    cnt = np.zeros(E, dtype=np.int64)
    pos = np.zeros(P, dtype=np.int64)
    for c0 in range(0, P, 32):
        lanes = [(p, int(flat[p])) for p in range(c0, min(c0 + 32, P))]
        base = {e: cnt[e] for _, e in lanes}
        for i, (p, e) in enumerate(lanes):
            pos[p] = base[e] + sum(1 for _, e2 in lanes[:i] if e2 == e)
        for e in base:
            cnt[e] += sum(1 for _, e2 in lanes if e2 == e)
    start = np.concatenate([[0], np.cumsum(cnt)[:-1]])
    sorted_pairs = np.zeros(P, dtype=np.int64)
    for p in range(P):
        sorted_pairs[start[flat[p]] + pos[p]] = p
    act = [e for e in range(E) if cnt[e] > 0]
    return sorted_pairs.tolist(), act, [int(start[e]) for e in act], [int(cnt[e]) for e in act]


def test_moe_align_algorithm() -> None:
    rng = np.random.default_rng(1)
    for B, E, k in [(1, 56, 16), (8, 32, 4), (64, 56, 16), (3, 8, 2)]:
        ids = np.stack([rng.permutation(E)[:k] for _ in range(B)])
        pairs, act, starts, counts = _align_model(ids, E)
        flat = ids.reshape(-1)
        assert pairs == sorted(range(len(flat)), key=lambda p: (flat[p], p))  # stable sort by expert
        assert act == sorted(set(flat.tolist())) and sum(counts) == len(flat)
        for e, s, n in zip(act, starts, counts):
            assert all(flat[p] == e for p in pairs[s:s + n])


# ---------------------------------------------------------------------------------------------- MLA
@pytest.mark.parametrize("nsplit", [1, 3, 8])
def test_mla_split_combine_matches_full_softmax(nsplit: int) -> None:
    t = mla_ref.make_inputs(B=4, nh=4, DL=128, DR=32, S=40, nsplit=nsplit, seed=nsplit)
    t["lens"][2] = 5  # fewer tokens than splits x TT: empty splits must drop out
    full = mla_ref.reference("mla", t)["o"]
    split = mla_ref.split_reference(t, nsplit)
    assert err(split["o"], full) < 1e-5
    assert torch.isinf(split["part_m"]).any() or nsplit == 1 or t["lens"].min() >= nsplit * mla_decode.TT


def test_mla_reference_is_absorbed_attention() -> None:
    """Spec §4.4: attention in the latent space with q_lat = W_UK^T q_n equals the unabsorbed form."""
    g = torch.Generator().manual_seed(9)
    B, nh, dn, dv, DL, DR, S = 2, 3, 16, 16, 128, 32, 10
    W_UK = torch.randn(nh, dn, DL, generator=g, dtype=torch.float64) * DL**-0.5
    W_UV = torch.randn(nh, dv, DL, generator=g, dtype=torch.float64) * DL**-0.5
    q_n = torch.randn(B, nh, dn, generator=g, dtype=torch.float64)
    q_r = torch.randn(B, nh, DR, generator=g, dtype=torch.float64)
    c = torch.randn(B, S, DL, generator=g, dtype=torch.float64)
    k_r = torch.randn(B, S, DR, generator=g, dtype=torch.float64)
    lens = torch.tensor([S, 4], dtype=torch.int32)
    scale = (dn + DR) ** -0.5
    q_lat = torch.einsum("hnl,bhn->bhl", W_UK, q_n)
    t = {"q": torch.cat([q_lat, q_r], -1), "kv": torch.cat([c, k_r], -1), "lens": lens, "scale": scale,
         "o": torch.empty(B, nh, DL)}
    o_lat = mla_ref.reference("mla", t)["o"].double()
    for b in range(B):
        n = int(lens[b])
        k_n = torch.einsum("hnl,tl->htn", W_UK, c[b, :n])  # per-head keys, expanded
        v = torch.einsum("hvl,tl->htv", W_UV, c[b, :n])
        s = (torch.einsum("hn,htn->ht", q_n[b], k_n) + q_r[b] @ k_r[b, :n].T) * scale
        o = torch.einsum("ht,htv->hv", torch.softmax(s, -1), v)
        assert err(torch.einsum("hvl,hl->hv", W_UV, o_lat[b]), o) < 1e-5


# ---------------------------------------------------------------------------------------------- KDA
def _kda_plain(t: dict[str, torch.Tensor], lower_bound: float | None) -> dict[str, torch.Tensor]:
    """Spec §3.2 with explicit loops over sequences and heads; conv in fp32 (as specified), rest float64."""
    B, nh, D, _ = t["S"].shape
    P = nh * D
    W = t["conv_w"].shape[1]
    out = torch.zeros(B, P, dtype=torch.float64)
    S_new = t["S"].double().clone()
    for b in range(B):
        window = torch.cat([t["conv"][b].float(), t["qkv"][b].float()[:, None]], -1)  # [3P, W], oldest first
        acc = torch.zeros(3 * P)
        for j in range(W):
            acc = acc + t["conv_w"][:, j] * window[:, j]
        z = (acc * torch.sigmoid(acc)).to(torch.bfloat16).double()
        for h in range(nh):
            q, k, v = (z[i * P + h * D:i * P + (h + 1) * D] for i in range(3))
            q = q / math.sqrt(float((q * q).sum()) + 1e-6) / math.sqrt(D)
            k = k / math.sqrt(float((k * k).sum()) + 1e-6)
            u = t["u"][b, h * D:(h + 1) * D].double() + t["dt_bias"][h * D:(h + 1) * D].double()
            lam = math.exp(float(t["A_log"][h]))
            if lower_bound is not None:
                gdec = lower_bound * torch.sigmoid(lam * u)
            else:
                gdec = -lam * torch.where(u > 20, u, torch.log1p(torch.exp(u)))
            beta = 1 / (1 + math.exp(-float(t["b"][b, h])))
            S = S_new[b, h] * torch.exp(gdec)[:, None]
            S = S + torch.outer(k, beta * (v - S.T @ k))
            S_new[b, h] = S
            o = (S.T @ q).to(torch.bfloat16).double()
            o = o / math.sqrt(float((o * o).mean()) + 1e-5) * t["o_norm"].double()
            out[b, h * D:(h + 1) * D] = o * torch.sigmoid(t["gate"][b, h * D:(h + 1) * D].double())
    return {"out": out, "S": S_new}


@pytest.mark.parametrize("lower_bound", [-5.0, None])
def test_kda_reference(lower_bound: float | None) -> None:
    t = kda_ref.make_inputs(B=2, nh=3, D=64, seed=11)
    ref = kda_ref.reference("kda", t, lower_bound=lower_bound)
    plain = _kda_plain(t, lower_bound)
    assert err(ref["S"], plain["S"]) < 1e-5
    assert err(ref["out"], plain["out"]) < 1e-3
    assert torch.equal(ref["conv"], torch.cat([t["conv"][..., 1:], t["qkv"][..., None]], -1))  # history shifted


def test_kda_lower_bound_matters() -> None:
    t = kda_ref.make_inputs(B=1, nh=2, D=64, seed=12)
    a, b = kda_ref.reference("kda", t, lower_bound=-5.0), kda_ref.reference("kda", t, lower_bound=None)
    assert err(a["S"], b["S"]) > 1e-2  # spec pitfall 1: the two gate forms really differ


def test_kda_single_pass_algebra() -> None:
    """The kernel reads o without a second pass: o = rq·dk^-½·(p + (q·k)·rk·δ) with p = S'^T q_raw,
    r = rk·S'^T k_raw, δ = β(v − r), S'' = S' + (rk k_raw) δ^T; same as the reference step."""
    from kimik3.model.modeling import kda_recurrent_step

    g = torch.Generator().manual_seed(13)
    D = 64
    S = torch.randn(D, D, generator=g, dtype=torch.float64) * 0.1
    q_raw, k_raw, v = (torch.randn(D, generator=g, dtype=torch.float64) for _ in range(3))
    alpha = torch.rand(D, generator=g, dtype=torch.float64)
    beta = 0.7
    rq, rk = 1 / math.sqrt(float(q_raw @ q_raw) + 1e-6), 1 / math.sqrt(float(k_raw @ k_raw) + 1e-6)
    S1 = S * alpha[:, None]
    p, r = S1.T @ q_raw, rk * (S1.T @ k_raw)
    delta = beta * (v - r)
    S2 = S1 + torch.outer(rk * k_raw, delta)
    o = rq * D**-0.5 * (p + float(q_raw @ k_raw) * rk * delta)
    o_ref, S_ref = kda_recurrent_step((q_raw * rq * D**-0.5)[None, None], (k_raw * rk)[None, None], v[None, None],
                                      alpha.log()[None, None], torch.tensor([[beta]], dtype=torch.float64),
                                      S[None, None])
    assert err(S2, S_ref[0, 0]) < 1e-12 and err(o, o_ref[0, 0]) < 1e-12


# ---------------------------------------------------------------------------------------------- AttnRes
def test_attn_res_reference() -> None:
    t = attn_res_ref.make_inputs(B=3, H=384, NC=5, seed=14)
    ref = attn_res_ref.reference("mix", t)["out"]
    V = t["cand"].double()
    omega = t["norm_w"].double() * t["proj_w"].double()[0]
    assert torch.allclose(t["omega"].double(), omega)
    out = torch.zeros(3, 384, dtype=torch.float64)
    for b in range(3):
        s = torch.stack([(V[j, b] * omega).sum() / torch.sqrt((V[j, b] ** 2).mean() + 1e-5) for j in range(5)])
        a = torch.exp(s - s.max())
        a = a / a.sum()
        out[b] = sum(a[j] * V[j, b] for j in range(5))
    assert err(ref, out.to(torch.bfloat16)) < 1e-6
