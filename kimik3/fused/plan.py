"""The fused decode step as a plan: which compiled op runs where, on which buffers, in which order.

An op (:class:`FusedOp`) is one CuTe DSL kernel at static shapes; a launch (:class:`Launch`) is one entry of the
step, a kernel call or a small PyTorch glue op; :class:`FusedStep` lays the launches out for a model, batch size
and cache length; :func:`plan_errors` says, from the config alone, why no kernel path exists. Nothing here needs a
GPU or the CuTe DSL: on a ``meta`` model the plan is built with every buffer shaped and none allocated, which is
what the prebuilt export, the device check's plan and the performance model read. Running it is the runners'
job (:mod:`kimik3.fused.runners`), getting the kernels the loader's (:mod:`kimik3.fused.loading`).

Design: docs/architecture.md (map: one decode step, end to end; how to add a kernel).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from kimik3.fused.launch_cost import launch_bytes, launch_flops

# The kernels' metadata the host needs is defined once in kernels/contracts/meta.py, which imports no CuTe DSL (a
# GPU machine running prebuilt kernels has none); the kernel modules import the same definitions. LM_ROWS_PER_CTA:
# vocabulary rows per lm_head arg-max partial. The rules the kernels put on a config: the fused scope gate.
from kimik3.kernels.contracts.meta import LM_ROWS_PER_CTA, SUPPORTED_ARCHS, head_routing, mla_default_splits
from kimik3.kernels.toolchain.loader import norm_shapes
from kimik3.kernels.toolchain.registry import FAMILIES as _REGISTRY_FAMILIES
from kimik3.kernels.toolchain.registry import MLA_CONTEXT, Budget, KernelVariant
from kimik3.model.config import ModelConfig, get_preset
from kimik3.model.modeling import KDAState, KimiForCausalLM, acc_dtype, f32, rms_norm
from kimik3.model.quant import experts_mxfp4
from kimik3.model.random_init import build_model
from kimik3.scope.gates import fused_rules_errors

if TYPE_CHECKING:
    import pandas as pd

__all__ = ["EXPERT_DTYPES", "FAMILY_MODULES", "FusedOp", "Launch", "FusedStep", "plan_errors", "meta_plan",
           "fused_ops"]

EXPERT_DTYPES = ("bf16", "mxfp4")

# family -> (kernel module, variant): the registry's families (kernels/toolchain/registry.py, DSL-free, defines
# them) plus the per-head GEMV op of kernels/fused/moe.py
FAMILY_MODULES: dict[str, tuple[str, str]] = {
    **{name: (f.module, f.variant) for name, f in _REGISTRY_FAMILIES.items()}, "moe.heads": ("moe", "heads")}


# ====================================================================== ops and launches


@dataclass(frozen=True)
class FusedOp(KernelVariant):
    """One compiled op at static shapes: what the JIT compiles, a prebuilt directory ships, and a launch calls.

    A :class:`~kimik3.kernels.toolchain.registry.KernelVariant` (so ``toolchain.prebuilt.build_prebuilt`` exports it
    unchanged) whose family may also be the per-head GEMV op (``moe.heads``), named by its shapes.
    """

    @property
    def module_name(self) -> str:
        return FAMILY_MODULES[self.family][0]

    @property
    def variant(self) -> str:
        return FAMILY_MODULES[self.family][1]

    @property
    def key(self) -> tuple[str, str, str]:
        """Identity for deduplication and prebuilt lookup: two uses of one (N, K) GEMV share a kernel."""
        return self.module_name, self.variant, norm_shapes(self.shapes)

    @property
    def name(self) -> str:
        tag = "-".join(f"{k}{v}" for k, v in self.shape_items if k != "B")
        return f"fused/{self.family}/{self.preset}/b{self.batch}/{tag}"

    @property
    def archs(self) -> tuple[str, ...]:
        return SUPPORTED_ARCHS

    @property
    def budget(self) -> Budget:
        fam = _REGISTRY_FAMILIES.get(self.family)
        return fam.budget if fam is not None else Budget(max_registers=128)

    def compile(self, arch: str, **kw: Any) -> Any:
        """A fresh compile of this op (needs the CuTe DSL; no GPU)."""
        mod = self.module
        if self.variant == "heads":
            return mod.compile_heads_for(arch, **self.shapes, **kw)
        return mod.compile_for(arch, variant=self.variant, **self.shapes, **kw)


def _op(family: str, cfg: ModelConfig, B: int, runtime: dict[str, Any] | None = None, **shapes: Any) -> FusedOp:
    return FusedOp(family, cfg.name or "custom", B, tuple(sorted(dict(B=B, **shapes).items())),
                   tuple(sorted((runtime or {}).items())))


@dataclass
class Launch:
    """One entry of the step program: a kernel launch (``op`` + named ``args``) or a PyTorch glue op (``fn``).

    ``args`` of a glue op name the tensors it reads and writes (for the byte count), nothing more.
    """

    name: str
    kind: str  # "kernel" | "glue"
    op: FusedOp | None = None
    args: dict[str, Any] = field(default_factory=dict)
    fn: Callable[[], Any] | None = None
    note: str = ""


# ====================================================================== what the kernels support


def plan_errors(cfg: ModelConfig, batch_size: int, cache_len: int, expert_format: str = "bf16") -> list[str]:
    """Every reason the fused kernels cannot run this config (empty list = supported). Config-only, no GPU: the
    fused scope gate's features and rules (:data:`kimik3.scope.gates.FUSED`)."""
    return fused_rules_errors(cfg, batch_size, cache_len, expert_format)


# ====================================================================== the step program


class FusedStep:
    """The composed decode step for one model, batch size and cache length: buffers, prepared weights and the
    ordered launch program. Runs on whatever ``runner`` executes its kernel launches (compiled kernels on a GPU,
    :class:`kimik3.fused.runners.ReferenceRunner` on a CPU); on a ``meta`` model it only describes the program (no
    memory).

    Why this layout: the absorbed step is a few hundred small PyTorch kernels per token, most of them re-reading
    activations that the previous one just wrote. Here every block that moves real bytes is one of the hand-written
    decode kernels (``kernels/README.md``), with the cheap work fused into the kernel that reads the bytes anyway:

    * RMSNorm-fused GEMVs for the mixers' projections (the norm is a per-row scalar computed from the x chunks
      each warp already loads), the KDA step kernel (conv + gates + delta rule + gated norm in one CTA per head),
      MLA in the latent space (flash-decoding split + combine over a ``[B, S, kv_lora + rope]`` cache), the
      router kernel writing expert ids / weights on the device, the grouped MoE GEMV over the selected experts
      only (bf16 or MXFP4 weights), o-proj with the residual add in its epilogue, the AttnRes mix and
      final-norm + lm_head + arg-max;
    * MLA's weight absorption (q_lat = W_UKᵀ q_nope, o = W_UV o_lat) is a per-head GEMV: the expert GEMV kernel
      with a constant routing (head h = expert h, ``kimik3.kernels.fused.moe.head_gemv``). The W_UK weight is
      augmented with an identity block for the rope dimensions, so one launch writes the whole MLA query
      ``[q_lat ; q_rope]`` and no copy is needed;
    * dense MLPs and shared experts are the MoE kernel with one expert that every token picks with weight 1;
    * what is left is small PyTorch "glue", listed in every program (:meth:`describe`): the embedding gather, the
      RMSNorm feeding router and experts (the router and MoE kernels take a normed input), the MLA latent norm +
      cache append, the MLA output gate σ(g)·o, the residual adds after the FFN. Each touches O(B·H) bytes; the
      megakernel stage removes them.

    Weights are prepared once here (concatenated q/k/v, the augmented W_UK, W_UV, fp32 AttnRes ω, MXFP4 packing of
    the routed experts when ``expert_format="mxfp4"``, or the bytes of a model that holds them as MXFP4 —
    ``from_pretrained(..., quantized_experts="keep")`` — passed as they are).

    Known numerical deviation: the fused GEMV normalises with eps = 1e-5 (``RMS_EPS``, kernels/contracts/meta.py),
    while the model's ``q_a_layernorm`` uses 1e-6; rstd differs by a relative (1e-5 − 1e-6) / (2·mean(x²)), far
    below bf16 rounding for O(1) activations.

    The residual stream lives in ``resid`` [slots + 1, B, H]: AttnRes block sums ``R`` occupy the first slots and
    the running partial sum ``p`` the next one, so every mix reads a contiguous prefix ``resid[:s + 1]`` and
    freezing ``p`` into ``R`` at a block boundary needs no copy.
    """

    def __init__(self, model: KimiForCausalLM, batch_size: int, cache_len: int, expert_format: str = "bf16") -> None:
        cfg = model.config
        errs = plan_errors(cfg, batch_size, cache_len, expert_format)
        if errs:
            raise ValueError("stage 'fused' " + "; ".join(errs))
        if model.expert_storage == "mxfp4" and expert_format != "mxfp4":
            raise ValueError(f"stage 'fused' with expert_format={expert_format!r} reads dense experts, but this model "
                             "holds them as MXFP4: use expert_format='mxfp4' (the held bytes, as loaded) or call "
                             f"model.dequantize_experts() first ({model.expert_memory()})")
        self.model, self.cfg, self.B, self.S, self.expert_format = model, cfg, batch_size, cache_len, expert_format
        self.device = model.device
        self.program: list[Launch] = []
        self.runner: Callable[[Launch], None] | None = None
        self._scratch: dict[tuple, dict[str, torch.Tensor]] = {}
        with torch.no_grad():
            self._allocate()
            self._build()

    # ------------------------------------------------------------------ buffers
    def _zeros(self, *shape: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        return torch.zeros(shape, dtype=dtype, device=self.device)

    def _allocate(self) -> None:
        c, B, dev = self.cfg, self.B, self.device
        self.ids = torch.zeros(B, dtype=torch.long, device=dev)
        self.positions = torch.zeros(B, dtype=torch.long, device=dev)
        self.lens = torch.ones(B, dtype=torch.int32, device=dev)
        self.rows = torch.arange(B, device=dev)
        self.n_slots = c.attn_res_slots + 1
        self.resid = self._zeros(self.n_slots, B, c.hidden_size)
        self.xmix = self._zeros(B, c.hidden_size)
        self.kda_states: dict[int, KDAState] = {}
        self.kv: dict[int, torch.Tensor] = {}
        for i, layer in enumerate(self.model.model.layers):
            if layer.kind == "kda":
                self.kda_states[i] = layer.self_attn.new_state(B, dev, self.model.dtype)
            else:
                self.kv[i] = self._zeros(B, self.S, c.kv_lora_rank + c.qk_rope_head_dim)
        self.logits = self._zeros(B, c.vocab_size, dtype=torch.float32)
        self.token = self._zeros(B, dtype=torch.int32)
        parts = c.vocab_size // LM_ROWS_PER_CTA
        self.part_v = self._zeros(B, parts, dtype=torch.float32)
        self.part_i = self._zeros(B, parts, dtype=torch.int32)

    def state_tensors(self) -> list[torch.Tensor]:
        """Everything carried across steps (KDA state, MLA caches): saved around warm-up runs, reset by reset()."""
        out: list[torch.Tensor] = []
        for st in self.kda_states.values():
            out += [st.S, st.conv]
        return out + list(self.kv.values())

    def _buf(self, op: FusedOp, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """Per-op scratch, shared by every launch of the same op (launches are sequential on one stream)."""
        bufs = self._scratch.setdefault(op.key, {})
        if name not in bufs:
            bufs[name] = self._zeros(*shape, dtype=dtype)
        return bufs[name]

    # ------------------------------------------------------------------ program helpers
    def _kernel(self, name: str, op: FusedOp, note: str = "", **args: Any) -> None:
        self.program.append(Launch(name, "kernel", op, args, note=note))

    def _glue(self, name: str, fn: Callable[[], Any], note: str = "", **touched: torch.Tensor) -> None:
        self.program.append(Launch(name, "glue", None, touched, fn=fn, note=note))

    @staticmethod
    def _w(t: torch.Tensor) -> torch.Tensor:
        """A parameter as a plain tensor (DLPack refuses tensors that require grad); no copy."""
        return t.detach()

    def _gemv(self, name: str, variant: str, W: torch.Tensor, x: torch.Tensor, y: torch.Tensor,
              gamma: torch.Tensor | None = None, residual: torch.Tensor | None = None, note: str = "") -> None:
        N, K = W.shape
        op = _op(f"gemv.{variant}", self.cfg, self.B, N=N, K=K)
        self._kernel(name, op, note, W=self._w(W), x=x, gamma=None if gamma is None else self._w(gamma),
                     residual=residual, y=y)

    def _mix(self, name: str, s: int, norm_w: torch.Tensor, proj_w: torch.Tensor) -> None:
        c = self.cfg
        nc = s + 1
        omega = (f32(norm_w.detach()).to(torch.float32) * f32(proj_w.detach()).to(torch.float32).reshape(-1))
        op = _op("attn_res", c, self.B, H=c.hidden_size, NC=nc)
        self._kernel(name, op, f"AttnRes over {nc} candidates", cand=self.resid[:nc], omega=omega.contiguous(),
                     out=self.xmix, norm_w=self._w(norm_w), proj_w=self._w(proj_w))

    def _glu_expert(self, name: str, x: torch.Tensor, gate_w: torch.Tensor, up_w: torch.Tensor,
                    down_w: torch.Tensor, out: torch.Tensor, note: str) -> None:
        """A dense GLU MLP as the MoE kernel with one expert that every token picks with weight 1."""
        width, L = gate_w.shape
        op = _op("moe.bf16", self.cfg, self.B, E=1, L=L, I=width, topk=1)
        self._moe_call(name, op, x, self._ones_ids, self._ones_w, self._w(gate_w)[None], self._w(up_w)[None],
                       self._w(down_w)[None], None, out, note)

    def _moe_call(self, name: str, op: FusedOp, x: torch.Tensor, ids: torch.Tensor, wts: torch.Tensor,
                  w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor, scales: tuple | None, out: torch.Tensor,
                  note: str) -> None:
        sh = op.shapes
        B, E, L, inner, k = sh["B"], sh["E"], sh["L"], sh["I"], sh["topk"]
        P, A = B * k, min(E, B * k)
        s1, s3, s2 = scales if scales is not None else (None, None, None)
        i32 = torch.int32
        self._kernel(name, op, note, x=x, ids=ids, weights=wts, w1=w1, w3=w3, w2=w2, s1=s1, s3=s3, s2=s2,
                     h=self._buf(op, "h", (P, inner), torch.bfloat16), y=self._buf(op, "y", (P, L), torch.bfloat16),
                     sorted=self._buf(op, "sorted", (P,), i32), act_e=self._buf(op, "act_e", (A,), i32),
                     act_start=self._buf(op, "act_start", (A,), i32), act_count=self._buf(op, "act_count", (A,), i32),
                     n_act=self._buf(op, "n_act", (1,), i32), out=out)

    # ------------------------------------------------------------------ the program
    def _build(self) -> None:
        c, B, H = self.cfg, self.B, self.cfg.hidden_size
        model = self.model
        self._ones_ids = self._zeros(B, 1, dtype=torch.int32)  # dense MLP / shared experts: expert 0, weight 1
        self._ones_w = torch.ones(B, 1, dtype=torch.float32, device=self.device)
        self.xn = self._zeros(B, H)  # normed FFN input (router, shared experts)
        embed = self._w(model.model.embed_tokens.weight)
        self._glue("embed", lambda: torch.index_select(embed, 0, self.ids, out=self.resid[0]),
                   "embedding gather into the first residual slot", rows=self.resid[0], out=self.resid[0])
        s = 0
        for i, layer in enumerate(model.model.layers):
            tag = f"L{i}"
            if s:
                self._mix(f"{tag}.attn_res.attn", s, layer.self_attention_res_norm.weight,
                          layer.self_attention_res_proj.weight)
                x_in = self.xmix
            else:
                x_in = self.resid[s]
            fresh = False
            if i % c.attn_res_block_size == 0:  # block boundary: p is frozen into R, the new p starts empty
                s, fresh = s + 1, True
            out = self.resid[s]
            if fresh:
                self._glue(f"{tag}.zero_p", out.zero_, "new block: the partial sum starts at zero", out=out)
            if layer.kind == "kda":
                self._kda(tag, layer, x_in, out, self.kda_states[i])
            else:
                self._mla(tag, layer, x_in, out, self.kv[i])
            self._mix(f"{tag}.attn_res.mlp", s, layer.mlp_res_norm.weight, layer.mlp_res_proj.weight)
            self._ffn(tag, layer, self.xmix, out)
        m = model.model
        self._mix("out.attn_res", s, m.output_attn_res_norm.weight, m.output_attn_res_proj.weight)
        V = c.vocab_size
        op = _op("gemv.lm_head", c, B, N=V, K=H)
        self._kernel("lm_head", op, "final RMSNorm + lm_head + arg-max", W=self._w(model.lm_head.weight),
                     x=self.xmix, gamma=self._w(m.norm.weight), logits=self.logits, part_v=self.part_v,
                     part_i=self.part_i, token=self.token)

    def _kda(self, tag: str, layer: Any, x: torch.Tensor, out: torch.Tensor, st: KDAState) -> None:
        c, B, P = self.cfg, self.B, self.cfg.kda_proj_dim
        a, gamma = layer.self_attn, layer.input_layernorm.weight
        w_qkv = torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight], 0).detach().contiguous()
        qkv, gate, fa = self._zeros(B, 3 * P), self._zeros(B, P), self._zeros(B, c.kda_head_dim)
        u, beta, o = self._zeros(B, P), self._zeros(B, c.kda_num_heads), self._zeros(B, P)
        self._gemv(f"{tag}.kda.qkv", "rmsnorm", w_qkv, x, qkv, gamma, note="input RMSNorm + q/k/v [3P, H]")
        self._gemv(f"{tag}.kda.g", "rmsnorm", a.g_proj.weight, x, gate, gamma, note="output gate g_proj")
        self._gemv(f"{tag}.kda.f_a", "rmsnorm", a.f_a_proj.weight, x, fa, gamma, note="decay gate f_a")
        self._gemv(f"{tag}.kda.f_b", "plain", a.f_b_proj.weight, fa, u, note="decay gate f_b")
        self._gemv(f"{tag}.kda.b", "rmsnorm", a.b_proj.weight, x, beta, gamma, note="beta projection")
        op = _op("kda", c, B, nh=c.kda_num_heads, D=c.kda_head_dim, W=c.kda_conv_size,
                 lower_bound=c.kda_gate_lower_bound)
        self._kernel(f"{tag}.kda.step", op, "conv + gates + delta rule + gated norm, state in place", qkv=qkv, u=u,
                     b=beta, gate=gate, conv_w=a.conv_weight().detach().float().contiguous(),
                     dt_bias=self._w(a.dt_bias).float(), A_log=self._w(a.A_log).float(),
                     o_norm=self._w(a.o_norm.weight).float(), conv=st.conv, S=st.S, out=o)
        self._gemv(f"{tag}.kda.o_proj", "residual", a.o_proj.weight, o, out, residual=out,
                   note="o_proj + residual add (in place)")

    def _mla(self, tag: str, layer: Any, x: torch.Tensor, out: torch.Tensor, kv: torch.Tensor) -> None:
        c, B = self.cfg, self.B
        a, gamma = layer.self_attn, layer.input_layernorm.weight
        nh, nope, DR, DL, dv = (c.num_attention_heads, c.qk_nope_head_dim, c.qk_rope_head_dim, c.kv_lora_rank,
                                c.v_head_dim)
        qk, DQ = nope + DR, DL + DR
        w = a.kv_b_proj.weight.detach().view(nh, nope + dv, DL)
        # q = [W_UK^T q_nope ; q_rope]: W_UK transposed per head, plus an identity block that copies the rope dims
        w_q = torch.zeros(nh, DQ, qk, dtype=w.dtype, device=w.device)
        w_q[:, :DL, :nope] = w[:, :nope].transpose(1, 2)
        w_q[:, DL:, nope:] = torch.eye(DR, dtype=w.dtype, device=w.device)
        w_uv = w[:, nope:].contiguous()  # [nh, dv, DL]
        qa, qb = self._zeros(B, c.q_lora_rank), self._zeros(B, nh * qk)
        q, ckv = self._zeros(B * nh, DQ), self._zeros(B, DQ)
        nsplit = mla_default_splits(B, nh, self.S)
        po, pm, pl = (self._zeros(B, nh, nsplit, DL, dtype=torch.float32),
                      self._zeros(B, nh, nsplit, dtype=torch.float32), self._zeros(B, nh, nsplit, dtype=torch.float32))
        o_lat, o = self._zeros(B * nh, DL), self._zeros(B * nh, dv)
        self._gemv(f"{tag}.mla.q_a", "rmsnorm", a.q_a_proj.weight, x, qa, gamma, note="input RMSNorm + q_a")
        self._gemv(f"{tag}.mla.q_b", "rmsnorm", a.q_b_proj.weight, qa, qb, a.q_a_layernorm.weight,
                   note="q_a_layernorm + q_b (kernel eps 1e-5; model 1e-6)")
        route = head_routing(B, nh, self.device)
        op = _op("moe.heads", c, B, NH=nh, R=DQ, K=qk)
        self._kernel(f"{tag}.mla.w_uk", op, "per-head W_UK^T absorption + rope copy -> MLA query", W=w_q,
                     x=qb.view(B * nh, qk), out=q, **route)
        self._gemv(f"{tag}.mla.kv_a", "rmsnorm", a.kv_a_proj_with_mqa.weight, x, ckv, gamma,
                   note="input RMSNorm + kv_a (latent + rope key)")
        ln = self._w(a.kv_a_layernorm.weight)
        rows, pos = self.rows, self.positions

        def append() -> None:
            row = torch.cat([rms_norm(ckv[:, :DL], ln, 1e-6), ckv[:, DL:]], -1)
            kv[rows, pos] = row

        self._glue(f"{tag}.mla.cache_append", append, "kv_a_layernorm (eps 1e-6) + cache write at each position",
                   ckv=ckv, kv_row=kv[:, 0])
        op = _op("mla", c, B, runtime={"scale": c.mla_softmax_scale}, nh=nh, DL=DL, DR=DR, S=self.S)
        self._kernel(f"{tag}.mla.attn", op, f"latent flash-decoding, {nsplit} split(s) + combine",
                     q=q.view(B, nh, DQ), kv=kv, lens=self.lens, part_o=po, part_m=pm, part_l=pl,
                     o=o_lat.view(B, nh, DL), scale=float(c.mla_softmax_scale))
        op = _op("moe.heads", c, B, NH=nh, R=dv, K=DL)
        self._kernel(f"{tag}.mla.w_uv", op, "per-head W_UV", W=w_uv, x=o_lat, out=o, **route)
        o2 = o.view(B, nh * dv)
        if c.mla_use_output_gate:
            g = self._zeros(B, nh * dv)
            self._gemv(f"{tag}.mla.g", "rmsnorm", a.g_proj.weight, x, g, gamma, note="output gate g_proj")
            self._glue(f"{tag}.mla.gate", lambda: o2.mul_(torch.sigmoid(g)), "o * sigmoid(g)", o=o2, g=g)
        self._gemv(f"{tag}.mla.o_proj", "residual", a.o_proj.weight, o2, out, residual=out,
                   note="o_proj + residual add (in place)")

    def _ffn(self, tag: str, layer: Any, x: torch.Tensor, out: torch.Tensor) -> None:
        c, B, H = self.cfg, self.B, self.cfg.hidden_size
        ln = self._w(layer.post_attention_layernorm.weight)
        xn = self.xn
        self._glue(f"{tag}.ffn.norm", lambda: xn.copy_(rms_norm(x, ln, c.rms_norm_eps)),
                   "post-attention RMSNorm (router and experts take a normed input)", x=x, xn=xn)
        if not layer.is_moe:
            mlp = layer.mlp
            y = self._zeros(B, H)
            self._glu_expert(f"{tag}.mlp", xn, mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight, y,
                             "dense SiTU MLP as a one-expert MoE")
            self._glue(f"{tag}.ffn.residual", lambda: out.add_(y), "p += mlp", out=out, y=y)
            return
        moe = layer.block_sparse_moe
        E, k, L, inner = c.n_routed_experts, c.num_experts_per_tok, c.expert_in_dim, c.moe_intermediate_size
        scores = self._zeros(B, E, dtype=torch.float32)
        ids, wts = self._zeros(B, k, dtype=torch.int32), self._zeros(B, k, dtype=torch.float32)
        op = _op("router", c, B, E=E, H=H, topk=k, n_group=c.n_group, topk_group=c.topk_group,
                 scale=c.routed_scaling_factor, renorm=c.norm_topk_prob)
        self._kernel(f"{tag}.moe.router", op, "sigmoid router + biased top-k + renormalise, ids on device",
                     W=self._w(moe.gate.weight), x=xn, bias=self._w(moe.gate.e_score_correction_bias).float(),
                     scores=scores, ids=ids, weights=wts)
        xl, acc, up = self._zeros(B, L), self._zeros(B, L), self._zeros(B, H)
        self._gemv(f"{tag}.moe.to_latent", "plain", moe.routed_expert_down_proj.weight, xn, xl,
                   note="latent down-projection")
        ex = moe.experts
        scales = None
        if self.expert_format == "mxfp4":  # experts held as MXFP4 go to the kernel as they are, else packed here
            (w1, s1), (w3, s3), (w2, s2) = (experts_mxfp4(ex, n) for n in ("w1", "w3", "w2"))
            scales = (s1, s3, s2)
        else:
            w1, w3, w2 = self._w(ex.w1), self._w(ex.w3), self._w(ex.w2)
        op = _op(f"moe.{self.expert_format}", c, B, E=E, L=L, I=inner, topk=k)
        self._moe_call(f"{tag}.moe.experts", op, xl, ids, wts, w1, w3, w2, scales, acc,
                       f"selected experts only ({self.expert_format}): align + gate/up SiTU + down + combine")
        self._gemv(f"{tag}.moe.from_latent", "rmsnorm", moe.routed_expert_up_proj.weight, acc, up,
                   moe.routed_expert_norm.weight, note="latent norm + up-projection")
        if moe.shared_experts is not None:
            sh_m = moe.shared_experts
            sh = self._zeros(B, H)
            self._glu_expert(f"{tag}.moe.shared", xn, sh_m.gate_proj.weight, sh_m.up_proj.weight,
                             sh_m.down_proj.weight, sh, "shared experts as a one-expert MoE")
            self._glue(f"{tag}.ffn.residual", lambda: out.add_(up.add_(sh)), "p += routed + shared", out=out,
                       up=up, shared=sh)
        else:
            self._glue(f"{tag}.ffn.residual", lambda: out.add_(up), "p += routed", out=out, up=up)

    # ------------------------------------------------------------------ running
    @property
    def ops(self) -> dict[tuple[str, str, str], FusedOp]:
        """The distinct compiled ops of the program, in first-use order."""
        out: dict[tuple[str, str, str], FusedOp] = {}
        for ln in self.program:
            if ln.op is not None:
                out.setdefault(ln.op.key, ln.op)
        return out

    def bind(self, runner: Callable[[Launch], None]) -> FusedStep:
        self.runner = runner
        return self

    def run(self) -> None:
        """Execute the program once (the inputs are the static ``ids`` / ``positions`` / ``lens`` buffers)."""
        if self.runner is None:
            raise RuntimeError("FusedStep.run: no runner bound (bind KernelRunner or ReferenceRunner first)")
        for ln in self.program:
            if ln.kind == "glue":
                ln.fn()
            else:
                self.runner(ln)

    def set_inputs(self, ids: torch.Tensor, positions: torch.Tensor) -> None:
        self.ids.copy_(ids)
        self.positions.copy_(positions)
        self.lens.copy_(positions + 1)  # each sequence attends to its cached tokens and the new one

    def reset(self) -> None:
        for t in self.state_tensors():
            t.zero_()

    @torch.no_grad()
    def prefill(self, input_ids: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """The prompt through the model's own chunked forward (as stages absorbed/graphs do), then its state copied
        into the fused layouts: KDA state as is, MLA latent + rope key interleaved into ``[B, S, kv_lora + rope]``.
        Only decode steps run on the kernels."""
        B, T = input_ids.shape
        tmp = self.model.new_state(B, T)
        pos = torch.arange(T, device=input_ids.device).expand(B, T)
        logits = self.model.forward_tokens(input_ids, tmp, pos, pos < lengths[:, None])
        self.reset()
        n = min(T, self.S)
        for i, st in enumerate(tmp.layers):
            if i in self.kda_states:
                self.kda_states[i].S.copy_(st.S)
                self.kda_states[i].conv.copy_(st.conv)
            else:
                DL = self.cfg.kv_lora_rank
                self.kv[i][:, :n, :DL] = st.latent[:, :n]
                self.kv[i][:, :n, DL:] = st.k_r[:, :n]
        rows = torch.arange(B, device=input_ids.device)
        return logits[rows, lengths - 1].to(acc_dtype(self.model.dtype))

    @torch.no_grad()
    def step(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """One eager decode step (no graph): fp32 logits [B, V]."""
        self.set_inputs(ids, positions)
        self.run()
        return self.logits.clone()

    # ------------------------------------------------------------------ description
    def describe(self, context: int | None = None, distinct_experts: float | None = None) -> pd.DataFrame:
        """One row per launch: name, kind, family, shapes, analytic bytes / FLOPs (see
        :func:`kimik3.fused.launch_cost.launch_bytes`)."""
        import pandas as pd

        rows = []
        for ln in self.program:
            rows.append({"launch": ln.name, "kind": ln.kind, "family": ln.op.family if ln.op else "torch",
                         "shapes": ln.op.shapes if ln.op else {k: list(v.shape) for k, v in ln.args.items()},
                         "bytes": launch_bytes(ln, context=context or self.S, distinct_experts=distinct_experts),
                         "flops": launch_flops(ln, context=context or self.S), "note": ln.note,
                         "op": ln.op.name if ln.op else ""})
        return pd.DataFrame(rows)


def _mla_context(cfg: ModelConfig) -> int:
    """The registry's static MLA cache length for a preset (what `kernels build` compiles), else 4096."""
    return MLA_CONTEXT.get(cfg.name, 4096)


def meta_plan(preset: str | ModelConfig, batch: int, cache_len: int | None = None,
              expert_format: str = "bf16") -> FusedStep:
    """A config's fused step built on a ``meta`` model: the whole plan with real shapes, no memory, no GPU.
    ``cache_len`` defaults to the registry's static MLA context of the preset."""
    cfg = get_preset(preset)
    model = build_model(cfg, "meta").cast_(torch.bfloat16)
    return FusedStep(model, batch, cache_len or _mla_context(cfg), expert_format)


def fused_ops(preset: str | ModelConfig, batch: int, expert_format: str = "bf16",
              cache_len: int | None = None) -> list[FusedOp]:
    """The distinct ops of a config's fused step (:func:`meta_plan`: no memory, no GPU).
    ``cache_len`` defaults to the registry's static MLA context of the preset."""
    return list(meta_plan(preset, batch, cache_len, expert_format).ops.values())
