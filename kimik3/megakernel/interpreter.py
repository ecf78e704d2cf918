"""Run the megakernel's int32 program on the CPU with torch, under random interleavings of the SM queues.

It checks the *program* — instruction decomposition, operand declarations, waits — against the reference model
with nothing else in the way: it decodes the int32 tensor, gives every SM a cursor into its queue and, at each
tick, runs to completion the head instruction of a random SM whose waits are met (``counter[c] ≥ step·total[c] +
target``), then adds to its counter. Only the declared waits constrain the order, so a missing wait shows up as a
wrong answer under some seed; instructions see only their declared boxes, buffers are poisoned each step, and a
deadlock raises :class:`DeadlockError` with a per-SM dump. MXFP4 expert opcodes dequantise exactly the boxes they
are handed. Stage ``"megakernel-interp"`` (:mod:`kimik3.megakernel.interp_ranks`, with the rank programs of a
deployment) puts this behind :class:`kimik3.Decoder`. Its honesty aids:
docs/architecture.md#appendix-design-notes-by-room.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import torch
import torch.nn.functional as F

from kimik3.kernels.contracts.peers import counter_bases, counter_words, wait_met
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
    Mode,
    Op,
    Program,
    decode_program,
    stage_descriptor,
)
from kimik3.megakernel.layout import bind_weight, missing_weight, model_weights, state_views, weight_view
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
from kimik3.validation.metric import poison

__all__ = ["CPUInterpreter", "DeadlockError"]


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
                t = bind_weight(spec, weight_view(weights[spec.name]))
            elif spec.kind == Kind.STATE:
                continue  # bound to a DecodeState by bind_state
            else:
                t = torch.zeros(spec.shape, dtype=spec.dtype)
            if tuple(t.shape) != spec.shape or t.dtype != spec.dtype:
                raise ValueError(f"buffer {spec.name}: program declares {list(spec.shape)} {spec.dtype}, "
                                 f"model gives {list(t.shape)} {t.dtype}")
            self.tensors[spec.name] = t
        self._scratch = [self.tensors[s.name] for s in p.buffers if s.kind in (Kind.ACT, Kind.OUTPUT, Kind.MAILBOX)]
        # operands read before the waits that are NOT static weights (only a broken program has any): snapshotted
        self._stale_prefetch = [[k for k, o in enumerate(ins.operands)
                                 if o.prefetch and p.buffers[o.buf].kind != Kind.WEIGHT] for ins in p.instructions]
        # counter memory, in words: one per local counter, one per source rank for a cross-rank one
        self.sources = [c.sources for c in p.counters]
        self.cbase = counter_bases(self.sources)
        self.counters = [0] * sum(counter_words(n) for n in self.sources)
        # the interpreters of every rank, by rank (a rank program's pushes and signals reach them): set by
        # kimik3.megakernel.interp_ranks; a program of one rank is its own only peer
        self.peers: list[CPUInterpreter] = [self]
        self.push_ops = [[k for k, o in enumerate(ins.operands) if o.mode & Mode.PUSH] for ins in p.instructions]
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
        if self.program.world > 1:
            raise ValueError(f"{self.program}: a rank program runs with its peers "
                             "(kimik3.megakernel.interp_ranks.run_ranks_step)")
        self.begin_step(ids, positions, poison_scratch)
        rng = random.Random(seed)
        while self.remaining:
            ready = self.ready()
            if not ready:
                raise self._deadlock(self.steps_done, self.head, self.base)
            self.run_head(ready[rng.randrange(len(ready))] if len(ready) > 1 else ready[0])
        return self.end_step()

    def begin_step(self, ids: torch.Tensor, positions: torch.Tensor, poison_scratch: bool = True) -> None:
        """Start a step: inputs written, scratch poisoned, every SM at the head of its queue (its stage copied)."""
        if self.views is None:
            raise RuntimeError("bind_state() first: the program's state buffers point nowhere")
        p = self.program
        self.tensors["ids"][:, 0, 0] = ids
        self.tensors["pos"][:, 0, 0] = positions
        if poison_scratch:
            for t in self._scratch:
                t.fill_(True) if t.dtype == torch.bool else poison(t)  # (bool has no NaN: "everyone uses it")
        self.base = [self.steps_done * c.total for c in p.counters]
        self.head = [0] * len(p.queues)
        self.snap: dict[int, dict[int, torch.Tensor]] = {}
        # the shared-memory stage buffers of every SM, poison until something is copied in (0xFF: NaN in bf16/fp32)
        self.stages = torch.full((len(p.queues), STAGE_BUFFERS, STAGE_BYTES), 0xFF, dtype=torch.uint8)
        self.staged_copies = 0
        self.ticks = []
        self.remaining = sum(len(q) for q in p.queues)
        for sm in range(len(p.queues)):
            self._arrive(sm)

    def _arrive(self, sm: int) -> None:
        """An SM reaches its next instruction: prefetch (a view for weights, a snapshot otherwise) and stage copies,
        all before the waits."""
        q, k = self.program.queues[sm], self.head[sm]
        if k < len(q):
            v = q[k]
            for j in self._stale_prefetch[v]:
                self.snap.setdefault(v, {})[j] = self.views[v][j].clone()
            # the device's stage copies as this instruction starts: its own stage at a queue head, then the
            # next instruction's (copied now, consumed after this instruction ends)
            for src, slot in ((self._own_src[v] if k == 0 else None, k), (self._next_src[v], k + 1)):
                if src is not None:
                    self.stages[sm, slot % STAGE_BUFFERS, : src.numel()] = src
                    self.staged_copies += 1

    def ready(self) -> list[int]:
        """The SMs whose head instruction's waits are met."""
        p, out = self.program, []
        words, cbase, sources, base, head = self.counters, self.cbase, self.sources, self.base, self.head
        for sm, q in enumerate(p.queues):
            if head[sm] < len(q):
                for c, t in p.instructions[q[head[sm]]].waits:
                    need = base[c] + t
                    if (words[cbase[c]] < need) if not sources[c] else not wait_met(words, cbase[c], sources[c], need):
                        break
                else:
                    out.append(sm)
        return out

    def run_head(self, sm: int) -> None:
        """Run SM ``sm``'s head instruction to completion: its body, its pushes to the peers, then its signal."""
        p = self.program
        v = p.queues[sm][self.head[sm]]
        ins = p.instructions[v]
        views = self.views[v]
        if v in self.snap:
            views = list(views)
            for k, t in self.snap.pop(v).items():
                views[k] = t
        if ins.stage[0] != -1:
            views = self._staged_views(v, views, self.stages[sm, self.head[sm] % STAGE_BUFFERS])
        _OPS[ins.op](self, ins, views)
        lo, hi = ins.peers
        for k in self.push_ops[v]:  # the box lands on every rank of the peer range (already written on this one)
            name, box = p.buffers[ins.operands[k].buf].name, ins.operands[k].slices()
            for r in range(lo, hi):
                if r != p.rank:
                    self.peers[r].tensors[name][box].copy_(views[k])
        if ins.signal >= 0:
            c = ins.signal
            if self.sources[c]:  # a cross-rank counter: this rank's word of it, on every rank of the range
                for r in range(lo, hi):
                    self.peers[r].counters[self.cbase[c] + p.rank] += ins.amount
            else:
                self.counters[self.cbase[c]] += ins.amount
        self.ticks.append(v)
        self.head[sm] += 1
        self.remaining -= 1
        self._arrive(sm)

    def end_step(self) -> torch.Tensor:
        """Check every counter word reached this step's total and return the logits buffer [B, V]."""
        p, step = self.program, self.steps_done
        for c, ctr in enumerate(p.counters):
            for k in range(counter_words(ctr.sources)):
                got = self.counters[self.cbase[c] + k]
                if got != (step + 1) * ctr.total:
                    src = f" (word of source rank {k})" if ctr.sources else ""
                    raise AssertionError(f"counter {ctr.name}{src} ended step {step} at {got}, expected "
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
            waits = [{"counter": c, "name": p.counters[c].name, "needs": base[c] + t,
                      "value": min(self.counters[self.cbase[c] + k] for k in range(counter_words(self.sources[c]))),
                      "satisfied": wait_met(self.counters, self.cbase[c], self.sources[c], base[c] + t)}
                     for c, t in ins.waits]
            dump.append({"sm": sm, "position": head[sm], "length": len(q), "instruction": v, "label": ins.label(),
                         "waits": waits})
            ws = "; ".join(f"counter {w['counter']} '{w['name']}' needs {w['needs']}, is {w['value']}"
                           + ("" if w["satisfied"] else " (BLOCKED)") for w in waits)
            lines.append(f"  SM {sm}: at {head[sm]}/{len(q)} waiting on #{v} {ins.label()}: {ws}")
        lines.append("  counters: " + ", ".join(
            f"{c.name}=" + (str(self.counters[self.cbase[i]:self.cbase[i] + c.sources]) if c.sources
                            else str(self.counters[self.cbase[i]])) for i, c in enumerate(p.counters)))
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
    out = v[2]  # stream[:, j] cols [B, 1, n], or across ranks this rank's partial row of the mailbox [B, 1, n]
    out.copy_((out.reshape(a.shape) + a if ins.args[0] else a).reshape(out.shape))  # a block boundary starts anew


def _router(it: CPUInterpreter, ins: Instruction, v: list[torch.Tensor]) -> None:
    """model.route from the logits on (sigmoid scores, biased choice, (grouped) top-k, renormalised weights); then
    compact the distinct chosen experts (ascending, as the naive loop visits them) into slots."""
    w, idx = route_from_logits(v[0][:, 0, :], v[1].reshape(-1), it.cfg)
    write_slots(idx, w, v[2], v[3], v[4], *(ins.args[:2] if ins.args[1] > ins.args[0] else ()))


def write_slots(idx: torch.Tensor, w: torch.Tensor, sel: torch.Tensor, mw: torch.Tensor, use: torch.Tensor,
                lo: int = 0, hi: int | None = None) -> None:
    """ROUTER's outputs from the chosen experts ``idx`` [B, k] and their weights ``w``: the distinct experts in
    ascending id into the slots ``sel`` [1, 1, Dmax] (-1 past the last), each token's weight per slot ``mw`` and its use
    flag ``use`` [B, 1, Dmax] (0 where unused). ``[lo, hi)``: a rank's experts (ROUTER args 0, 1), the others left
    to their ranks; a slot then holds the expert's index among the rank's (``e - lo``: the rank holds only them)."""
    uniq = idx.unique()
    if hi is not None:
        uniq = uniq[(uniq >= lo) & (uniq < hi)]
    n = uniq.numel()
    match = idx[:, :, None] == uniq[None, None, :]  # [B, k, n]
    sel.fill_(-1)
    sel[0, 0, :n] = uniq - lo
    mw.zero_()
    mw[:, 0, :n] = (w[:, :, None] * match).sum(1)
    use.zero_()
    use[:, 0, :n] = match.any(1)


def _expert_rows(it: CPUInterpreter, ins: Instruction, v: list[torch.Tensor], j: int, e: int) -> torch.Tensor:
    """Expert ``e``'s weight rows of operand ``j`` as the opcode reads them: the dense view, or for an MXFP4
    program the codes of operand ``j`` and the scales of the operand paired with it dequantised (value × scale in
    fp32, cast once to the activation dtype: what QuantizedExperts.expert gives the naive path)."""
    e = e - ins.operands[j].box[0]  # the box's first expert (codes and scales alike)
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
        w2 = v[4][sel[:n] - ins.operands[4].box[0]]
    else:  # (no expert chosen: an empty stack, the einsum sums nothing)
        w2 = torch.stack([_expert_rows(it, ins, v, 4, int(e)) for e in sel[:n]]) if n else \
            h.new_zeros(0, v[4].shape[1], h.shape[2])
    y = torch.einsum("bsi,sri->bsr", h, w2)  # every chosen expert's w2 rows, in the activation dtype
    acc = (f32(y) * w[..., None]).sum(1)  # combine in fp32 with the router weights (0 where unused), cast once
    v[5].copy_(acc.to(v[5].dtype).reshape(v[5].shape))  # (across ranks: an fp32 partial row [B, 1, n] of the mailbox)


def _ffn_out(it: CPUInterpreter, ins: Instruction, v: list[torch.Tensor]) -> None:
    flags, k, out = ins.args[0], 0, None
    if flags & FFN_ROUTED:
        x = v[k][:, 0, :]  # (across ranks: MOE_COMBINE's normed latent, the rank's share of its columns)
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
    p = v[k]
    # the stream's column tile [B, 1, n] accumulates (so does a bare reference call without operands, as
    # kernels/verify makes); a rank's partial row [B, 1, n] is written, pushed for the all-reduce
    ops = getattr(ins, "operands", ())
    if len(ops) <= k or ops[k].reads:
        p[:, 0, :].copy_(p[:, 0, :] + out)
    else:
        p.copy_(out.reshape(p.shape))


def _lm_head(it: CPUInterpreter, ins: Instruction, v: list[torch.Tensor]) -> None:
    xn = rms_norm(v[0][:, 0, :], v[1].reshape(-1), it.cfg.rms_norm_eps)
    y = f32(F.linear(xn, v[2][0]))
    v[3][:, 0, :].copy_(y)
    best = y.argmax(-1)  # first maximum: ties resolve to the lowest vocabulary id, like torch.argmax
    v[4].copy_(y.gather(1, best[:, None])[:, 0].reshape(v[4].shape))  # [B, 1, 1], a row of a mailbox too
    v[5].copy_((best + ins.args[2]).reshape(v[5].shape))


def _argmax(it: CPUInterpreter, ins: Instruction, v: list[torch.Tensor]) -> None:
    tile = v[0][:, 0, :].argmax(-1)  # the lowest tile among equal maxima = the lowest id
    v[2][:, 0, 0] = v[1][:, 0, :].gather(1, tile[:, None])[:, 0]


def _rank_sum(parts: torch.Tensor) -> torch.Tensor:
    """Every rank's partial [sources, ...] summed in fp32 in rank order: the same order, so the same bits, on every
    rank (torch's .sum may reorder)."""
    s = f32(parts[0])
    for r in range(1, parts.shape[0]):
        s = s + f32(parts[r])
    return s


def _allreduce_mix(it: CPUInterpreter, ins: Instruction, v: list[torch.Tensor]) -> None:
    """Every rank's partial of these rows [b, sources, H], summed in rank order in fp32 (the same order on every
    rank, so every rank's stream stays identical), into the block's partial sum; then the AttnRes mix."""
    s = _rank_sum(v[0].transpose(0, 1))
    entry = v[2][:, 0, :]
    entry.copy_(f32(entry) + s if ins.operands[2].reads else s)
    cands = [v[1][:, j, :] for j in range(ins.args[1] - 1)] + [entry]
    v[5][:, 0, :].copy_(attn_res_mix(cands, v[3].reshape(-1), v[4].reshape(1, -1), it.cfg.rms_norm_eps))


def _moe_combine(it: CPUInterpreter, ins: Instruction, v: list[torch.Tensor]) -> None:
    """Every rank's fp32 latent partial of these rows [b, sources, Dl], summed in rank order, cast once to the
    activation dtype and (args 0) latent-normed: the combined expert sum of the single-GPU step, on every rank."""
    x = _rank_sum(v[0].transpose(0, 1)).to(it.dtype)
    if ins.args[0]:
        x = rms_norm(x, v[1].reshape(-1), it.cfg.rms_norm_eps)
    v[-1][:, 0, :].copy_(x)


def _argmax_all(it: CPUInterpreter, ins: Instruction, v: list[torch.Tensor]) -> None:
    """The per-tile bests of every vocabulary shard [B, sources, tiles], rank-major (= ascending vocabulary id, so
    the first maximum is still the lowest id) -> the next token."""
    B = v[0].shape[0]
    vals, idx = v[0].reshape(B, -1), v[1].reshape(B, -1)
    tile = vals.argmax(-1)
    v[2][:, 0, 0] = idx.gather(1, tile[:, None])[:, 0]


_OPS: dict[Op, Callable[[CPUInterpreter, Instruction, list[torch.Tensor]], None]] = {
    Op.EMBED: _embed, Op.ATTN_RES_MIX: _attn_res_mix, Op.NORM_PROJ: _norm_proj, Op.MLP_GATE_UP: _mlp_gate_up,
    Op.KDA_STEP: _kda_step, Op.MLA_Q: _mla_q, Op.MLA_KV_APPEND: _mla_kv_append, Op.MLA_PARTIAL: _mla_partial,
    Op.MLA_REDUCE: _mla_reduce, Op.O_PROJ_RESIDUAL: _o_proj_residual, Op.ROUTER: _router,
    Op.EXPERT_GATE_UP: _expert_gate_up, Op.EXPERT_DOWN: _expert_down, Op.FFN_OUT: _ffn_out, Op.LM_HEAD: _lm_head,
    Op.ARGMAX: _argmax, Op.ALLREDUCE_MIX: _allreduce_mix, Op.ARGMAX_ALL: _argmax_all, Op.MOE_COMBINE: _moe_combine,
}
