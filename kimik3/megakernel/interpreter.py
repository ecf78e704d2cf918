"""Run the megakernel's int32 program on the CPU with torch, under random interleavings of the SM queues.

It checks the *program* — instruction decomposition, operand declarations, waits — against the reference model
with nothing else in the way: it decodes the int32 tensor, gives every SM a cursor into its queue and, at each
tick, runs to completion the head instruction of a random SM whose waits are met (``counter[c] ≥ step·total[c] +
target``), then adds to its counter. Only the declared waits constrain the order, so a missing wait shows up as a
wrong answer under some seed; instructions see only their declared boxes, buffers are poisoned each step, and a
deadlock raises :class:`DeadlockError` with a per-SM dump. MXFP4 expert opcodes dequantise exactly the boxes they
are handed. ``MegakernelInterpStage`` (stage ``"megakernel-interp"``) puts this behind :class:`kimik3.Decoder`:
prefill runs the naive path, every decode step runs the program. Its honesty aids:
docs/architecture.md#appendix-design-notes-by-room.
"""

from __future__ import annotations

import copy
import random
from collections.abc import Callable

import torch
import torch.nn.functional as F

from kimik3.megakernel.hazards import check_program, format_violations
from kimik3.megakernel.instructions import (
    CHUNK_BYTES,
    FFN_LATENT_NORM,
    FFN_MLP,
    FFN_ROUTED,
    MXFP4_OPERANDS,
    STAGE_BUFFERS,
    STAGE_BYTES,
    Instruction,
    Kind,
    Op,
    Program,
    decode_program,
    stage_descriptor,
)
from kimik3.megakernel.layout import missing_weight, model_weights, state_views, weight_view
from kimik3.megakernel.scheduler import POLICIES, build_program
from kimik3.megakernel.step import Tiling
from kimik3.model.modeling import (
    DecodeState,
    KDAState,
    KimiForCausalLM,
    attn_res_mix,
    f32,
    glu,
    kda_decay,
    kda_gated_norm,
    kda_recurrent_step,
    kda_short_conv,
    l2norm,
    rms_norm,
    route_from_logits,
    router_logits,
)
from kimik3.model.quant import mxfp4_dequantize
from kimik3.stages import register_stage
from kimik3.stages.base import Stage, StageSupport
from kimik3.stages.naive import NaiveStage
from kimik3.validation.metric import poison

__all__ = ["CPUInterpreter", "DeadlockError", "MegakernelInterpStage"]


class DeadlockError(RuntimeError):
    """No SM can make progress. ``dump``: one dict per SM (queue position, waiting instruction, its waits with
    needed and current counter values); the message renders it."""

    def __init__(self, message: str, dump: list[dict]) -> None:
        super().__init__(message)
        self.dump = dump


class CPUInterpreter:
    """Executes a decoded megakernel program against a model's weights and a decode state."""

    def __init__(self, program: Program | torch.Tensor, model: KimiForCausalLM) -> None:
        self.program = decode_program(program) if isinstance(program, torch.Tensor) else program
        self.model = model
        self.cfg = model.config
        self.dtype = model.dtype
        p = self.program
        if p.expert_format != model.expert_storage:
            raise ValueError(f"the program carries the routed experts as {p.expert_format}, but the model holds them "
                             f"{model.expert_storage}: build it with expert_format=model.expert_storage")
        weights = model_weights(model)
        self.tensors: dict[str, torch.Tensor] = {}
        for spec in p.buffers:
            if spec.kind == Kind.WEIGHT:
                if spec.name not in weights:
                    raise missing_weight(spec.name, model)
                t = weight_view(weights[spec.name])
            elif spec.kind == Kind.STATE:
                continue  # bound to a DecodeState by bind_state
            else:
                t = torch.zeros(spec.shape, dtype=spec.dtype)
            if tuple(t.shape) != spec.shape or t.dtype != spec.dtype:
                raise ValueError(f"buffer {spec.name}: program declares {list(spec.shape)} {spec.dtype}, "
                                 f"model gives {list(t.shape)} {t.dtype}")
            self.tensors[spec.name] = t
        self._scratch = [self.tensors[s.name] for s in p.buffers if s.kind in (Kind.ACT, Kind.OUTPUT)]
        # operands read before the waits that are NOT static weights (only a broken program has any): snapshotted
        self._stale_prefetch = [[k for k, o in enumerate(ins.operands)
                                 if o.prefetch and p.buffers[o.buf].kind != Kind.WEIGHT] for ins in p.instructions]
        self.counters = [0] * len(p.counters)
        self.steps_done = 0
        self.lora_eps: dict[int, tuple[float, float]] = {}
        for i, layer in enumerate(model.model.layers):
            if layer.kind == "mla":
                self.lora_eps[i] = (layer.self_attn.q_a_layernorm.eps, layer.self_attn.kv_a_layernorm.eps)
        self.views: list[list[torch.Tensor]] | None = None
        self.ticks: list[int] = []  # execution order of the last step (instruction ids)
        # per instruction: the bytes its own stage copies at a queue head, and those its next-stage descriptor
        # copies as it starts (flat byte views of the buffers, cut by bind_state); None = nothing
        self._own_src: list[torch.Tensor | None] = []
        self._next_src: list[torch.Tensor | None] = []
        self.staged_copies = 0  # stage copies performed in the last step

    # ------------------------------------------------------------------ binding
    def bind_state(self, state: DecodeState) -> None:
        """Point the program's state buffers at ``state`` (updated in place by later steps) and cut every
        instruction's operand views."""
        for st in state.layers:
            if isinstance(st, KDAState):
                st.conv, st.S = st.conv.contiguous(), st.S.contiguous()
        self.tensors.update(state_views(self.cfg, state))
        views = []
        for ins in self.program.instructions:
            vs = []
            for o in ins.operands:
                spec = self.program.buffers[o.buf]
                t = self.tensors.get(spec.name)
                if t is None or tuple(t.shape) != spec.shape:
                    raise ValueError(f"state buffer {spec.name} is not bound (or has the wrong shape)")
                vs.append(t[o.slices()])
            views.append(vs)
        self.views = views
        p = self.program
        self._own_src = [self._stage_bytes(i, stage_descriptor(ins, p.buffers) if 0 <= ins.stage[0] <
                                           len(ins.operands) else (-1, 0, 0), "its own stage")
                         for i, ins in enumerate(p.instructions)]
        self._next_src = [self._stage_bytes(i, ins.next_stage, "its next-stage descriptor")
                          for i, ins in enumerate(p.instructions)]

    def _stage_bytes(self, i: int, desc: tuple[int, int, int], what: str) -> torch.Tensor | None:
        """The bytes a stage descriptor ``(buffer, element offset, 16-byte chunks)`` names, as a view."""
        buf, elem, chunks = desc
        if buf < 0:
            return None
        p = self.program
        label = f"#{i} {p.instructions[i].label()}: {what} {desc}"
        if buf >= len(p.buffers) or chunks * CHUNK_BYTES > STAGE_BYTES or chunks < 1:
            raise ValueError(f"{label} names no buffer or does not fit the {STAGE_BYTES}-byte stage")
        t = self.tensors[p.buffers[buf].name]
        try:
            flat = t.view(-1).view(torch.uint8)
        except RuntimeError as e:
            raise ValueError(f"{label}: buffer {p.buffers[buf].name} is not contiguous ({e})") from None
        lo = elem * t.element_size()
        if elem < 0 or lo + chunks * CHUNK_BYTES > flat.numel():
            raise ValueError(f"{label} reaches past buffer {p.buffers[buf].name}")
        return flat[lo : lo + chunks * CHUNK_BYTES]

    def _staged_views(self, v: int, views: list[torch.Tensor], stage: torch.Tensor) -> list[torch.Tensor]:
        """``views`` with the leading rows of instruction ``v``'s staged operand read from ``stage`` (bytes)."""
        ins = self.program.instructions[v]
        j, rows, _ = ins.stage
        if not 0 <= j < len(views):
            raise ValueError(f"#{v} {ins.label()} stages operand {j} of {len(views)}")
        view = views[j]
        n1, r, d2 = view.shape
        need = rows * d2 * view.element_size()
        if n1 != 1 or not 1 <= rows <= r or need > stage.numel() or d2 != self.program.buffers[ins.operands[j].buf
                                                                                             ].shape[2]:
            raise ValueError(f"#{v} {ins.label()} stages {rows} rows of operand {j} (box {list(view.shape)}): not "
                             f"whole rows of one slice within the {stage.numel()}-byte stage")
        staged = stage[:need].view(view.dtype).view(1, rows, d2)
        out = list(views)
        out[j] = staged if rows == r else torch.cat([staged, view[:, rows:]], 1)
        return out

    # ------------------------------------------------------------------ running
    @torch.no_grad()
    def run_step(self, ids: torch.Tensor, positions: torch.Tensor, seed: int = 0, poison_scratch: bool = True
                 ) -> torch.Tensor:
        """One decode step: tokens ``ids`` [B] at ``positions`` [B] → fp32 logits [B, V] (the logits buffer)."""
        if self.views is None:
            raise RuntimeError("bind_state() first: the program's state buffers point nowhere")
        p = self.program
        self.tensors["ids"][:, 0, 0] = ids
        self.tensors["pos"][:, 0, 0] = positions
        if poison_scratch:
            for t in self._scratch:
                t.fill_(True) if t.dtype == torch.bool else poison(t)  # (bool has no NaN: "everyone uses it")
        step = self.steps_done
        totals = [c.total for c in p.counters]
        base = [step * t for t in totals]
        rng = random.Random(seed)
        queues = p.queues
        head = [0] * len(queues)
        snap: dict[int, dict[int, torch.Tensor]] = {}
        ins_all = p.instructions

        stale = self._stale_prefetch
        # the shared-memory stage buffers of every SM, poison until something is copied in (0xFF: NaN in bf16/fp32)
        stages = torch.full((len(queues), STAGE_BUFFERS, STAGE_BYTES), 0xFF, dtype=torch.uint8)
        own_src, next_src = self._own_src, self._next_src
        self.staged_copies = 0

        def arrive(sm: int) -> None:  # prefetch: read before the waits (a view for weights, a snapshot otherwise)
            k = head[sm]
            if k < len(queues[sm]):
                v = queues[sm][k]
                for j in stale[v]:
                    snap.setdefault(v, {})[j] = self.views[v][j].clone()
                # the device's stage copies as this instruction starts: its own stage at a queue head, then the
                # next instruction's (copied now, consumed after this instruction ends)
                for src, slot in ((own_src[v] if k == 0 else None, k), (next_src[v], k + 1)):
                    if src is not None:
                        stages[sm, slot % STAGE_BUFFERS, : src.numel()] = src
                        self.staged_copies += 1

        for sm in range(len(queues)):
            arrive(sm)
        counters = self.counters
        self.ticks = []
        remaining = sum(len(q) for q in queues)
        while remaining:
            ready = []
            for sm, q in enumerate(queues):
                if head[sm] < len(q):
                    ins = ins_all[q[head[sm]]]
                    if all(counters[c] >= base[c] + t for c, t in ins.waits):
                        ready.append(sm)
            if not ready:
                raise self._deadlock(step, head, base)
            sm = ready[rng.randrange(len(ready))] if len(ready) > 1 else ready[0]
            v = queues[sm][head[sm]]
            ins = ins_all[v]
            views = self.views[v]
            if v in snap:
                views = list(views)
                for k, t in snap.pop(v).items():
                    views[k] = t
            if ins.stage[0] != -1:
                views = self._staged_views(v, views, stages[sm, head[sm] % STAGE_BUFFERS])
            _OPS[ins.op](self, ins, views)
            if ins.signal >= 0:
                counters[ins.signal] += ins.amount
            self.ticks.append(v)
            head[sm] += 1
            remaining -= 1
            arrive(sm)
        for c, ctr in enumerate(p.counters):
            if counters[c] != (step + 1) * ctr.total:
                raise AssertionError(f"counter {ctr.name} ended step {step} at {counters[c]}, expected "
                                     f"{(step + 1) * ctr.total}")
        self.steps_done += 1
        return self.tensors["logits"][:, 0, :]

    def _deadlock(self, step: int, head: list[int], base: list[int]) -> DeadlockError:
        p = self.program
        dump, lines = [], []
        done = sum(head)
        total = sum(len(q) for q in p.queues)
        lines.append(f"deadlock in step {step}: no SM can proceed ({done}/{total} instructions done)")
        for sm, q in enumerate(p.queues):
            if head[sm] >= len(q):
                dump.append({"sm": sm, "position": head[sm], "length": len(q), "instruction": None, "waits": []})
                lines.append(f"  SM {sm}: finished all {len(q)} instructions")
                continue
            v = q[head[sm]]
            ins = p.instructions[v]
            waits = [{"counter": c, "name": p.counters[c].name, "needs": base[c] + t, "value": self.counters[c],
                      "satisfied": self.counters[c] >= base[c] + t} for c, t in ins.waits]
            dump.append({"sm": sm, "position": head[sm], "length": len(q), "instruction": v, "label": ins.label(),
                         "waits": waits})
            ws = "; ".join(f"counter {w['counter']} '{w['name']}' needs {w['needs']}, is {w['value']}"
                           + ("" if w["satisfied"] else " (BLOCKED)") for w in waits)
            lines.append(f"  SM {sm}: at {head[sm]}/{len(q)} waiting on #{v} {ins.label()}: {ws}")
        lines.append("  counters: " + ", ".join(f"{c.name}={self.counters[i]}" for i, c in enumerate(p.counters)))
        return DeadlockError("\n".join(lines), dump)


# ============================================================================================== instruction bodies
# Each body gets the instruction and views of its declared boxes, in the operand order documented in
# instructions.instruction_set_table(). Constants (eps, SiTU betas, top-k) come from the model config.


def _embed(it: CPUInterpreter, ins: Instruction, v: list[torch.Tensor]) -> None:
    v[2][:, 0, :].copy_(F.embedding(v[0][:, 0, 0], v[1][0]))


def _attn_res_mix(it: CPUInterpreter, ins: Instruction, v: list[torch.Tensor]) -> None:
    K = ins.args[1]
    cands = [v[0][:, j, :] for j in range(K)]
    v[3][:, 0, :].copy_(attn_res_mix(cands, v[1].reshape(-1), v[2].reshape(1, -1), it.cfg.rms_norm_eps))


def _norm_proj(it: CPUInterpreter, ins: Instruction, v: list[torch.Tensor]) -> None:
    xn = rms_norm(v[0][:, 0, :], v[1].reshape(-1), it.cfg.rms_norm_eps)
    if ins.args[0]:  # fp32 logits (router): a row tile of model.route's linear layer
        y = router_logits(xn, v[2][0])
    else:
        y = F.linear(xn, v[2][0])
    v[3][:, 0, :].copy_(y)


def _mlp_gate_up(it: CPUInterpreter, ins: Instruction, v: list[torch.Tensor]) -> None:
    xn = rms_norm(v[0][:, 0, :], v[1].reshape(-1), it.cfg.rms_norm_eps)
    v[4][:, 0, :].copy_(glu(it.cfg, F.linear(xn, v[2][0]), F.linear(xn, v[3][0])))


def _kda_step(it: CPUInterpreter, ins: Instruction, v: list[torch.Tensor]) -> None:
    cfg = it.cfg
    dk, Wc = cfg.kda_head_dim, cfg.kda_conv_size
    h0, h1 = ins.args[0], ins.args[1]
    hh, nb = h1 - h0, v[0].shape[0]
    blk = v[0][:, 0, :].reshape(nb, hh, 4 * dk + 1)  # per head: q, k, v, output gate, beta (raw projections)
    raw = blk[..., : 3 * dk].reshape(nb, hh, 3, dk).transpose(1, 2).reshape(nb, 3, hh * dk)
    gate, braw = blk[..., 3 * dk : 4 * dk], blk[..., 4 * dk]
    conv = v[2].view(nb, 3, hh * dk, Wc - 1)
    window = torch.cat([conv, raw[..., None]], -1)  # oldest first, the new token last
    z = kda_short_conv(window, v[7][0].view(3, hh * dk, Wc), it.dtype)
    q, k, val = f32(z).view(nb, 3, hh, dk).unbind(1)
    q, k = l2norm(q) * dk**-0.5, l2norm(k)
    g = kda_decay(F.linear(v[1][:, 0, :], v[4][0]), v[5].reshape(-1), v[6].reshape(-1), cfg.kda_gate_lower_bound)
    beta = torch.sigmoid(f32(braw))
    S = v[3].view(nb, hh, dk, dk)
    o, S_new = kda_recurrent_step(q, k, val, g, beta, S)
    S.copy_(S_new)
    conv.copy_(window[..., 1:])
    # cast to the activation dtype before the gated norm (pitfall 4)
    out = kda_gated_norm(o.to(it.dtype), gate, v[8].reshape(-1), cfg.rms_norm_eps)
    v[9][:, 0, :].copy_(out.reshape(nb, hh * dk))


def _mla_q(it: CPUInterpreter, ins: Instruction, v: list[torch.Tensor]) -> None:
    cfg = it.cfg
    hh = ins.args[1] - ins.args[0]
    nope, kvl = cfg.qk_nope_head_dim, cfg.kv_lora_rank
    cq = rms_norm(v[0][:, 0, :], v[1].reshape(-1), it.lora_eps[ins.layer][0])
    Q = F.linear(cq, v[2][0]).view(-1, hh, cfg.qk_head_dim)
    q_lat = torch.einsum("bhn,hnl->bhl", Q[..., :nope], v[3][0].view(hh, nope, kvl))  # absorb W_UK (§4.4)
    v[4].copy_(torch.cat([q_lat, Q[..., nope:]], -1))


def _mla_kv_append(it: CPUInterpreter, ins: Instruction, v: list[torch.Tensor]) -> None:
    kvl = it.cfg.kv_lora_rank
    ckv = v[0][:, 0, :]
    c = rms_norm(ckv[:, :kvl], v[1].reshape(-1), it.lora_eps[ins.layer][1])
    rows, pos = torch.arange(ckv.shape[0]), v[2][:, 0, 0]
    v[3][rows, pos] = c
    v[4][rows, pos] = ckv[:, kvl:]  # NoPE: the shared key part is cached raw


def _mla_partial(it: CPUInterpreter, ins: Instruction, v: list[torch.Tensor]) -> None:
    cfg = it.cfg
    kvl = cfg.kv_lora_rank
    t0 = ins.operands[2].box[2]  # first context position of this split
    q_lat, q_r = v[0][..., :kvl], v[0][..., kvl:]
    pos = v[1][:, 0, 0]
    C, KR = v[2], v[3]
    s = f32(torch.einsum("bhl,btl->bht", q_lat, C) + torch.einsum("bhr,btr->bht", q_r, KR)) * cfg.mla_softmax_scale
    valid = (t0 + torch.arange(C.shape[1]))[None, :] <= pos[:, None]  # causal: own cache up to and incl. itself
    s = s.masked_fill(~valid[:, None, :], float("-inf"))
    m = s.amax(-1)
    p = torch.exp(s - torch.where(torch.isfinite(m), m, torch.zeros_like(m))[..., None])
    o = torch.einsum("bht,btl->bhl", p, f32(C))
    v[4].copy_(torch.cat([o, m[..., None], p.sum(-1)[..., None]], -1))


def _mla_reduce(it: CPUInterpreter, ins: Instruction, v: list[torch.Tensor]) -> None:
    cfg = it.cfg
    kvl, dv = cfg.kv_lora_rank, cfg.v_head_dim
    hh = ins.args[1] - ins.args[0]
    B = v[0].shape[0]
    parts = v[0].reshape(B, hh, -1, kvl + 2)
    o_s, m_s, l_s = parts[..., :kvl], parts[..., kvl], parts[..., kvl + 1]
    a = torch.exp(m_s - m_s.amax(-1, keepdim=True))  # split 0 always holds position 0: the max is finite
    o_lat = ((a[..., None] * o_s).sum(-2) / (a * l_s).sum(-1)[..., None]).to(it.dtype)
    o = torch.einsum("bhl,hdl->bhd", o_lat, v[1][0].view(hh, dv, kvl)).reshape(B, hh * dv)  # absorb W_UV
    if ins.args[2]:
        o = o * torch.sigmoid(v[2][:, 0, :])
    v[-1][:, 0, :].copy_(o)


def _o_proj_residual(it: CPUInterpreter, ins: Instruction, v: list[torch.Tensor]) -> None:
    a = F.linear(v[0][:, 0, :], v[1][0])
    out = v[2][:, 0, :]
    out.copy_(out + a if ins.args[0] else a)  # a block boundary starts a new partial sum


def _router(it: CPUInterpreter, ins: Instruction, v: list[torch.Tensor]) -> None:
    """model.route from the logits on (sigmoid scores, biased choice, (grouped) top-k, renormalised weights); then
    compact the distinct chosen experts (ascending, as the naive loop visits them) into slots."""
    w, idx = route_from_logits(v[0][:, 0, :], v[1].reshape(-1), it.cfg)
    write_slots(idx, w, v[2], v[3], v[4])


def write_slots(idx: torch.Tensor, w: torch.Tensor, sel: torch.Tensor, mw: torch.Tensor, use: torch.Tensor) -> None:
    """ROUTER's outputs from the chosen experts ``idx`` [B, k] and their weights ``w``: the distinct experts in
    ascending id into the slots ``sel`` [1, 1, Dmax] (-1 past the last), each token's weight per slot ``mw`` and its use
    flag ``use`` [B, 1, Dmax] (0 where unused)."""
    uniq = idx.unique()
    n = uniq.numel()
    match = idx[:, :, None] == uniq[None, None, :]  # [B, k, n]
    sel.fill_(-1)
    sel[0, 0, :n] = uniq
    mw.zero_()
    mw[:, 0, :n] = (w[:, :, None] * match).sum(1)
    use.zero_()
    use[:, 0, :n] = match.any(1)


def _expert_rows(it: CPUInterpreter, ins: Instruction, v: list[torch.Tensor], j: int, e: int) -> torch.Tensor:
    """Expert ``e``'s weight rows of operand ``j`` as the opcode reads them: the dense view, or for an MXFP4
    program the codes of operand ``j`` and the scales of the operand paired with it dequantised (value × scale in
    fp32, cast once to the activation dtype: what QuantizedExperts.expert gives the naive path)."""
    if it.program.expert_format == "dense":
        return v[j][e]
    js = dict(MXFP4_OPERANDS[ins.op])[j]
    return mxfp4_dequantize(v[j][e], v[js][e], torch.float32).to(it.dtype)


def _expert_gate_up(it: CPUInterpreter, ins: Instruction, v: list[torch.Tensor]) -> None:
    xl = v[0][:, 0, :]
    for j in range(v[1].shape[2]):
        e = int(v[1][0, 0, j])
        if e < 0:
            break  # slots are filled from the front
        rows = v[2][:, 0, j].nonzero().squeeze(1)
        if rows.numel():
            x = xl[rows]
            w1, w3 = _expert_rows(it, ins, v, 3, e), _expert_rows(it, ins, v, 4, e)
            v[5][rows, j, :] = glu(it.cfg, F.linear(x, w1), F.linear(x, w3))


def _expert_down(it: CPUInterpreter, ins: Instruction, v: list[torch.Tensor]) -> None:
    sel = v[1][0, 0]
    n = int((sel >= 0).sum())  # slots are filled from the front
    use, w = v[2][:, 0, :n], v[3][:, 0, :n]
    h = torch.where(use[..., None], v[0][:, :n, :], 0)  # unused (row, slot) pairs hold poison: never read them
    if it.program.expert_format == "dense":
        w2 = v[4][sel[:n]]
    else:  # (no expert chosen: an empty stack, the einsum sums nothing)
        w2 = torch.stack([_expert_rows(it, ins, v, 4, int(e)) for e in sel[:n]]) if n else \
            h.new_zeros(0, v[4].shape[1], h.shape[2])
    y = torch.einsum("bsi,sri->bsr", h, w2)  # every chosen expert's w2 rows, in the activation dtype
    acc = (f32(y) * w[..., None]).sum(1)  # combine in fp32 with the router weights (0 where unused), cast once
    v[5][:, 0, :].copy_(acc.to(it.dtype))


def _ffn_out(it: CPUInterpreter, ins: Instruction, v: list[torch.Tensor]) -> None:
    flags, k, out = ins.args[0], 0, None
    if flags & FFN_ROUTED:
        x = v[k][:, 0, :]
        k += 1
        if flags & FFN_LATENT_NORM:  # latent norm on the COMBINED expert sum (pitfall 13)
            x = rms_norm(x, v[k].reshape(-1), it.cfg.rms_norm_eps)
            k += 1
        out = F.linear(x, v[k][0])
        k += 1
    if flags & FFN_MLP:
        y = F.linear(v[k][:, 0, :], v[k + 1][0])
        out = y if out is None else out + y
        k += 2
    p = v[k][:, 0, :]
    p.copy_(p + out)


def _lm_head(it: CPUInterpreter, ins: Instruction, v: list[torch.Tensor]) -> None:
    xn = rms_norm(v[0][:, 0, :], v[1].reshape(-1), it.cfg.rms_norm_eps)
    y = f32(F.linear(xn, v[2][0]))
    v[3][:, 0, :].copy_(y)
    best = y.argmax(-1)  # first maximum: ties resolve to the lowest vocabulary id, like torch.argmax
    v[4][:, 0, 0] = y.gather(1, best[:, None])[:, 0]
    v[5][:, 0, 0] = best + ins.args[2]


def _argmax(it: CPUInterpreter, ins: Instruction, v: list[torch.Tensor]) -> None:
    tile = v[0][:, 0, :].argmax(-1)  # the lowest tile among equal maxima = the lowest id
    v[2][:, 0, 0] = v[1][:, 0, :].gather(1, tile[:, None])[:, 0]


_OPS: dict[Op, Callable[[CPUInterpreter, Instruction, list[torch.Tensor]], None]] = {
    Op.EMBED: _embed, Op.ATTN_RES_MIX: _attn_res_mix, Op.NORM_PROJ: _norm_proj, Op.MLP_GATE_UP: _mlp_gate_up,
    Op.KDA_STEP: _kda_step, Op.MLA_Q: _mla_q, Op.MLA_KV_APPEND: _mla_kv_append, Op.MLA_PARTIAL: _mla_partial,
    Op.MLA_REDUCE: _mla_reduce, Op.O_PROJ_RESIDUAL: _o_proj_residual, Op.ROUTER: _router,
    Op.EXPERT_GATE_UP: _expert_gate_up, Op.EXPERT_DOWN: _expert_down, Op.FFN_OUT: _ffn_out, Op.LM_HEAD: _lm_head,
    Op.ARGMAX: _argmax,
}


# ============================================================================================== the stage


@register_stage
class MegakernelInterpStage(Stage):
    """Stage "megakernel-interp": every decode step runs the megakernel program in the CPU interpreter (the
    randomised-interleaving checker; the native parallel executor is stage "megakernel-cpu").

    Options (``Decoder(..., stage="megakernel-interp", **options)``): ``policy`` ("critical_path" or
    "round_robin"), ``num_sms`` (queues to schedule for), ``seed`` (step ``i`` uses interleaving seed
    ``seed·1000003 + i``), ``tiling`` (a :class:`~kimik3.megakernel.step.Tiling`), ``check`` (run the hazard
    checker on the program once, at construction) and ``poison`` (NaN-fill scratch buffers before each step).
    Deterministic: every element is computed by one instruction in a fixed order whatever the interleaving."""

    name = "megakernel-interp"
    support = StageSupport(dtypes=(torch.float32, torch.bfloat16, torch.float16, torch.float64), max_batch=64,
                           devices=("cpu",), kept_experts=("mxfp4",))

    def __init__(self, model: KimiForCausalLM, batch_size: int, max_seq_len: int, policy: str = "critical_path",
                 num_sms: int = 8, seed: int = 0, tiling: Tiling | None = None, check: bool = True,
                 poison: bool = True) -> None:
        super().__init__(model, batch_size, max_seq_len)
        if policy not in POLICIES:
            raise ValueError(f"unknown policy {policy!r}; known: {', '.join(POLICIES)}")
        # the program carries the routed experts as the model holds them (dense, or the MXFP4 bytes as they are)
        self.program = build_program(model.config, batch_size, num_sms, policy, max_seq_len, tiling,
                                     act_dtype=model.dtype, expert_format=model.expert_storage)
        if check:
            bad = check_program(self.program)
            if bad:
                raise ValueError("megakernel program failed the hazard check:\n" + format_violations(bad))
        self.interpreter = CPUInterpreter(encode := self.program.tensor(), model)
        self.encoded = encode
        self.naive = NaiveStage(model, batch_size, max_seq_len)
        self.seed, self.poison = seed, poison
        self.steps = 0

    def reset(self) -> None:
        self.naive.reset()
        self.interpreter.bind_state(self.naive.state)

    @torch.no_grad()
    def prefill(self, input_ids: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        logits = self.naive.prefill(input_ids, lengths)  # token by token through the reference path
        self.interpreter.bind_state(self.naive.state)
        return logits

    def snapshot(self) -> DecodeState:
        """A copy of the decode state (e.g. right after prefill), for :meth:`restore`."""
        return copy.deepcopy(self.naive.state)

    def restore(self, state: DecodeState, seed: int | None = None) -> None:
        """Continue from a copy of ``state``, optionally under another interleaving seed (step counter reset) —
        to replay the same decode steps under different interleavings. Counters keep growing: they never reset."""
        self.naive.state = copy.deepcopy(state)
        self.interpreter.bind_state(self.naive.state)
        if seed is not None:
            self.seed, self.steps = seed, 0

    @torch.no_grad()
    def step(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        logits = self.interpreter.run_step(ids, positions, seed=self.seed * 1000003 + self.steps,
                                           poison_scratch=self.poison)
        self.steps += 1
        return logits.clone()
