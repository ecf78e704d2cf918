"""Megakernel programs that carry the routed experts as MXFP4 (host side): build, encode, hazard-check, interpret.

Expectation source: stage ``naive`` on the same MXFP4-holding model (``model.quantize_experts()``), whose experts
are dequantised one at a time by ``QuantizedExperts.expert`` (value x scale in fp32, cast once) — the numbers the
interpreter's expert opcodes must reproduce from the code / scale boxes they are handed. Teacher-forced on naive's
greedy tokens; per step within TOL["fp32_stage"] (fp32) or TOL["bf16_stage"] (bf16), the same greedy tokens (fp32),
scratch poisoned (NaN) before every step; micro at batch 1 and 3, on our packer's bytes and on valid MXFP4 bytes it
would never write (random codes, scales moved by one). Sensitivity: the quantised model's logits differ from the dense
model's by far more than the tolerance, so a path that read the dense weights (or the wrong scales) could not pass.

Host contract: the uint8 buffers and operand lists of ``kernels/contracts/isa.py`` (MXFP4_OPERANDS), the header word
H_EXPERT_FORMAT through encode -> decode, the hazard checker on MXFP4 programs and on planted violations of an MXFP4
operand, the GPU stage's static shapes / variant names / device contract, and clear errors for bad input.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from kimik3.kernels.contracts import isa

import kimik3
import kimik3.megakernel.interp_ranks  # noqa: F401  (registers stage "megakernel-interp")
from kimik3.megakernel import EXPERT_FORMATS, build_program, build_step, decode_program, encode_program
from kimik3.megakernel.gpu import check_device_contract
from kimik3.megakernel.hazards import check_program
from kimik3.megakernel.instructions import Kind, Mode, Op, Program
from kimik3.megakernel.interpreter import CPUInterpreter
from kimik3.megakernel.kernel_shapes import static_shapes, variant_name
from kimik3.model.config import get_preset
from kimik3.model.modeling import KimiForCausalLM
from kimik3.validation.metric import TOL, rel_error

pytestmark = pytest.mark.usefixtures("one_thread")  # small tensors: see tests/conftest.py

STEPS = 5
NUM_SMS = 4


def _mxfp4_model(dtype: torch.dtype = torch.float32, odd: bool = False) -> KimiForCausalLM:
    """micro holding its experts as MXFP4; ``odd``: every code a random byte (negative zeros, blocks whose largest
    code is not 6) and every scale moved by -1..+1 from our packer's: valid MXFP4 the packer would never write."""
    model = kimik3.from_preset("micro", seed=0, dtype=dtype).quantize_experts()
    if odd:
        g = torch.Generator().manual_seed(11)
        for name, t in model.named_buffers():
            if name.endswith("_packed"):
                t.copy_(torch.randint(0, 256, t.shape, generator=g, dtype=torch.int64).to(torch.uint8))
            elif name.endswith("_scale"):
                t.copy_((t.long() + torch.randint(-1, 2, t.shape, generator=g)).to(torch.uint8))
    return model


def _with_operand(p: Program, i: int, j: int, **changes) -> Program:
    """A copy of ``p`` with operand ``j`` of instruction ``i`` changed (mode / box)."""
    ins = list(p.instructions)
    ops = list(ins[i].operands)
    ops[j] = dataclasses.replace(ops[j], **changes)
    ins[i] = dataclasses.replace(ins[i], operands=tuple(ops))
    return dataclasses.replace(p, instructions=ins, queues=[list(q) for q in p.queues])


def _first(p: Program, op: Op) -> int:
    return next(i for i, x in enumerate(p.instructions) if x.op == op)


# ------------------------------------------------------------------------------------------------ the interpreter


@pytest.mark.parametrize("B, odd", [(1, False), (3, False), (3, True)])
def test_interpreter_matches_naive_on_an_mxfp4_model(B: int, odd: bool) -> None:
    model = _mxfp4_model(odd=odd)
    dense = kimik3.from_preset("micro", seed=0)
    lengths = [5, 3, 4][:B]
    ids = torch.randint(0, model.config.vocab_size, (B, max(lengths)), generator=torch.Generator().manual_seed(B))
    ref = kimik3.Decoder(model, "naive", batch_size=B, max_seq_len=16)
    dec = kimik3.Decoder(model, "megakernel-interp", batch_size=B, max_seq_len=16, num_sms=NUM_SMS, seed=B,
                         poison=True, check=True)
    prog = dec.stage.program
    assert prog.expert_format == "mxfp4" and {b.dtype for b in prog.buffers if b.name.endswith(
        ("experts.w1_packed", "experts.w2_scale"))} == {torch.uint8}
    assert not any(b.name.endswith(("experts.w1", "experts.w3", "experts.w2")) for b in prog.buffers)
    want = ref.prefill(ids, lengths)
    dec.prefill(ids, lengths)
    quant_gap = rel_error(kimik3.Decoder(dense, "naive", batch_size=B, max_seq_len=16).prefill(ids, lengths), want)
    assert quant_gap > 100 * TOL["fp32_stage"], "the quantised experts must matter for this test to mean anything"
    for s in range(STEPS):
        tok = want.argmax(-1)
        want = ref.step(tok)
        got = dec.step(tok)
        e = rel_error(got, want)
        assert e <= TOL["fp32_stage"], f"B={B} step {s}: e={e:.2e}"
        assert torch.equal(got.argmax(-1), want.argmax(-1)), f"B={B} step {s}: greedy tokens differ"
        assert torch.equal(dec.stage.interpreter.tensors["next_token"][:, 0, 0], want.argmax(-1))


def test_interpreter_bf16_mxfp4_model_within_stage_tolerance() -> None:
    """bf16: the dequantised weights are cast to the activation dtype (exact for E2M1 x 2^k) before the dense math."""
    model = _mxfp4_model(torch.bfloat16)
    ids = torch.randint(0, model.config.vocab_size, (2, 4), generator=torch.Generator().manual_seed(9))
    ref = kimik3.Decoder(model, "naive", batch_size=2, max_seq_len=12)
    dec = kimik3.Decoder(model, "megakernel-interp", batch_size=2, max_seq_len=12, num_sms=3, policy="round_robin")
    want = ref.prefill(ids, [4, 2])
    dec.prefill(ids, [4, 2])
    for s in range(3):
        tok = want.argmax(-1)
        want, got = ref.step(tok), dec.step(tok)
        assert rel_error(got, want) <= TOL["bf16_stage"], f"step {s}"


def test_interpreter_refuses_a_program_of_the_other_format() -> None:
    model = _mxfp4_model()
    dense_prog = build_program(model.config, 1, 2, max_seq_len=8, act_dtype=torch.float32)
    with pytest.raises(ValueError, match="carries the routed experts as dense, but the model holds them mxfp4"):
        CPUInterpreter(dense_prog, model)
    mx_prog = build_program(model.config, 1, 2, max_seq_len=8, act_dtype=torch.float32, expert_format="mxfp4")
    with pytest.raises(ValueError, match="as mxfp4, but the model holds them dense"):
        CPUInterpreter(mx_prog, kimik3.from_preset("micro", seed=0))


def test_interpreter_reads_only_the_declared_scales() -> None:
    """A scales box one row short: the checker reports it, and the interpreter (handed only the declared boxes)
    cannot dequantise the codes it reads."""
    model = _mxfp4_model()
    p = build_program(model.config, 2, 3, max_seq_len=8, act_dtype=torch.float32, expert_format="mxfp4")
    i = _first(p, Op.EXPERT_GATE_UP)
    b = p.instructions[i].operands[6].box
    bad = _with_operand(p, i, 6, box=(*b[:3], b[3] - 1, *b[4:]))
    assert any(v.kind == "mxfp4" and v.instr == i for v in check_program(bad))
    dec = kimik3.Decoder(model, "naive", batch_size=2, max_seq_len=8)
    dec.prefill(torch.tensor([[3, 4], [5, 6]]), [2, 2])
    it = CPUInterpreter(bad, model)
    it.bind_state(dec.stage.state)
    with pytest.raises(ValueError, match="MXFP4 scale shape"):
        it.run_step(torch.tensor([1, 2]), torch.tensor([2, 2]))


# ------------------------------------------------------------------------------------------------ the program


@pytest.mark.parametrize("preset, B", [("micro", 1), ("micro", 3), ("tiny", 3)])
@pytest.mark.parametrize("policy", ["critical_path", "round_robin"])
def test_mxfp4_program_declares_the_contract_and_checks_clean(preset: str, B: int, policy: str) -> None:
    cfg = get_preset(preset)
    E, Dl, Ie = cfg.n_routed_experts, cfg.moe_latent_size, cfg.moe_intermediate_size
    p = build_program(cfg, B, 8, policy, max_seq_len=16, expert_format="mxfp4")
    assert check_program(p) == []
    names = {b.name: b for b in p.buffers}
    for layer in (i for i in range(cfg.num_hidden_layers) if cfg.ffn(i) == "moe"):
        mp = f"model.layers.{layer}.block_sparse_moe.experts."
        for w, rows, cols in (("w1", Ie, Dl), ("w3", Ie, Dl), ("w2", Dl, Ie)):
            assert (names[mp + w + "_packed"].shape, names[mp + w + "_scale"].shape) == (
                (E, rows, cols // 2), (E, rows, cols // 32))
            assert {names[mp + w + s].dtype for s in ("_packed", "_scale")} == {torch.uint8}
            assert {names[mp + w + s].kind for s in ("_packed", "_scale")} == {Kind.WEIGHT}
            assert mp + w not in names
    for ins in p.instructions:
        if ins.op not in isa.MXFP4_OPERANDS:
            continue
        assert len(ins.operands) == {Op.EXPERT_GATE_UP: 8, Op.EXPERT_DOWN: 7}[ins.op]
        for j, js in isa.MXFP4_OPERANDS[ins.op]:
            c, s = ins.operands[j], ins.operands[js]
            cb, sb = p.buffers[c.buf], p.buffers[s.buf]
            assert cb.name.endswith("_packed") and sb.name == cb.name.removesuffix("_packed") + "_scale"
            assert c.mode == s.mode == Mode.READ | Mode.PREFETCH
            assert c.box == (0, E, *c.box[2:4], 0, cb.shape[2]) and s.box == (0, E, *c.box[2:4], 0, sb.shape[2])
        assert ins.stage == (-1, 0, 0), "uint8 expert boxes span all experts: never staged"
    dense = build_program(cfg, B, 8, policy, max_seq_len=16)
    assert [x.op for x in dense.instructions] == [x.op for x in p.instructions]
    mx_cost = p.costs.groupby("op")["weight_bytes"].sum()
    dense_cost = dense.costs.groupby("op")["weight_bytes"].sum()
    for op in ("EXPERT_GATE_UP", "EXPERT_DOWN"):  # MXFP4: 4.25 bits per weight against bf16's 16
        assert mx_cost[op] / dense_cost[op] == pytest.approx(4.25 / 16, rel=1e-6)


def test_planted_mxfp4_operand_violations_are_reported() -> None:
    p = build_program("micro", 3, 4, max_seq_len=16, expert_format="mxfp4")
    g, d = _first(p, Op.EXPERT_GATE_UP), _first(p, Op.EXPERT_DOWN)

    def kinds(q: Program, i: int) -> set[str]:
        return {v.kind for v in check_program(q) if v.instr == i}

    b = p.instructions[g].operands[7].box
    assert "mxfp4" in kinds(_with_operand(p, g, 7, box=(b[0], b[1] - 1, *b[2:])), g)  # w3 scales: an expert short
    b = p.instructions[d].operands[6].box
    assert "mxfp4" in kinds(_with_operand(p, d, 6, box=(*b[:2], b[2] + 1, *b[3:])), d)  # w2 scales: a row short
    assert "static-write" in kinds(_with_operand(p, g, 6, mode=Mode.WRITE), g)  # scales written
    moe_h = p.instructions[g].operands[5].buf  # scales pointed at an activation: not uint8 weights
    assert "mxfp4" in kinds(_with_operand(p, g, 6, buf=moe_h, mode=Mode.READ,
                                          box=p.instructions[g].operands[5].box), g)
    short = dataclasses.replace(p.instructions[d], operands=p.instructions[d].operands[:6])  # scales dropped
    q = dataclasses.replace(p, instructions=[short if k == d else x for k, x in enumerate(p.instructions)])
    assert "mxfp4" in kinds(q, d)
    assert check_program(dataclasses.replace(p, expert_format="dense")) == [], \
        "the pair rule applies to MXFP4 programs only"


def test_encode_decode_round_trip_keeps_the_format() -> None:
    p = build_program("micro", 2, 4, max_seq_len=16, expert_format="mxfp4")
    t = encode_program(p)
    assert t[isa.H_EXPERT_FORMAT] == EXPERT_FORMATS.index("mxfp4") == 1
    q = decode_program(t)
    assert q == p and q.expert_format == "mxfp4"
    assert [(b.name, b.dtype, b.shape) for b in q.buffers] == [(b.name, b.dtype, b.shape) for b in p.buffers]
    for b in q.buffers:
        row = t[t[isa.H_OFF_BUF] + q.buffer_id(b.name) * isa.BUFFER_WORDS:][: isa.BUFFER_WORDS]
        assert row[isa.BW_DTYPE] == isa.DTYPE_CODES[str(b.dtype).removeprefix("torch.")]
    assert any(b.dtype == torch.uint8 for b in q.buffers) and isa.DTYPE_CODES["uint8"] == 7
    dense = encode_program(build_program("micro", 2, 4, max_seq_len=16))
    assert dense[isa.H_EXPERT_FORMAT] == 0 and decode_program(dense).expert_format == "dense"
    bad = t.clone()
    bad[isa.H_EXPERT_FORMAT] = len(EXPERT_FORMATS)
    with pytest.raises(ValueError, match="expert format"):
        decode_program(bad)
    assert q != dataclasses.replace(q, expert_format="dense")


def test_bad_input_is_refused_clearly() -> None:
    cfg = get_preset("micro")
    odd = dataclasses.replace(cfg, moe_latent_size=48, moe_intermediate_size=40)
    with pytest.raises(ValueError, match=r"multiples of 32.*moe_latent_size \(Dl\) = 48.*moe_intermediate_size "
                                         r"\(Ie\) = 40"):
        build_program(odd, 1, 2, max_seq_len=8, expert_format="mxfp4")
    build_step(odd, 1, max_seq_len=8)  # dense experts take any width
    for call in (lambda: build_program(cfg, 1, 2, max_seq_len=8, expert_format="fp4"),
                 lambda: build_step(cfg, 1, max_seq_len=8, expert_format="bf16"),
                 lambda: static_shapes(cfg, 1, expert_format="nvfp4"),
                 lambda: variant_name(cfg, 1, "int4"),
                 lambda: dataclasses.replace(build_program(cfg, 1, 2, max_seq_len=8), expert_format="MXFP4")):
        with pytest.raises(ValueError, match="unknown expert_format"):
            call()


# ------------------------------------------------------------------------------------------------ the GPU stage (host)


def test_gpu_static_shapes_variant_names_and_device_contract() -> None:
    assert static_shapes("tiny", 1)["fp4"] is False and static_shapes("tiny", 1, expert_format="mxfp4")["fp4"] is True
    assert variant_name("tiny", 8) == "megakernel/tiny/b8"
    assert variant_name(get_preset("tiny"), 8, "mxfp4") == "megakernel/tiny/b8-mxfp4"
    for preset, B in (("micro", 1), ("tiny", 8)):
        cfg = get_preset(preset)
        p = build_program(cfg, B, 132, max_seq_len=64, expert_format="mxfp4")
        assert check_device_contract(p, cfg, B, static_shapes(cfg, B, expert_format="mxfp4")) == []
        assert check_device_contract(p, cfg, B) == []  # the default shapes follow the program's format
        problems = check_device_contract(p, cfg, B, static_shapes(cfg, B))
        assert any("kernel is compiled for dense" in m for m in problems), problems
        dense = build_program(cfg, B, 132, max_seq_len=64)
        assert any("program carries dense routed experts" in m
                   for m in check_device_contract(dense, cfg, B, static_shapes(cfg, B, expert_format="mxfp4")))
    cfg = get_preset("micro")
    p = build_program(cfg, 1, 8, max_seq_len=16, expert_format="mxfp4")
    g = _first(p, Op.EXPERT_GATE_UP)
    k = p.instructions[g].operands[6].buf  # the w1 scales declared bf16: a dtype the device code does not read
    bufs = list(p.buffers)
    bufs[k] = dataclasses.replace(bufs[k], dtype=torch.bfloat16)
    problems = check_device_contract(dataclasses.replace(p, buffers=bufs), cfg, 1)
    assert any(f"#{g}" in m and f"operand 6 ({bufs[k].name}) is torch.bfloat16, device code reads torch.uint8" in m
               for m in problems), problems


def test_megakernel_cpu_with_an_mxfp4_model_needs_experts_mxfp4() -> None:
    """The native executor reads dense expert operands; an MXFP4-holding model is refused unless its held bytes
    stream through the executor's MXFP4 table (experts="mxfp4"), before anything is compiled."""
    from kimik3.megakernel.cpu import CPUMegakernel

    model = _mxfp4_model()
    with pytest.raises(ValueError, match="experts='mxfp4'"):
        CPUMegakernel(model, 1, 8, num_workers=1)
    mx_prog = build_program(model.config, 1, 1, max_seq_len=8, act_dtype=torch.float32, expert_format="mxfp4")
    with pytest.raises(ValueError, match="dense expert operands"):
        CPUMegakernel(model, 1, 8, program=mx_prog, experts="mxfp4")


def _have_cxx() -> bool:
    from kimik3.megakernel import cpu

    try:
        cpu.find_compiler()
    except ValueError:
        return False
    return True


@pytest.mark.skipif(not _have_cxx(), reason="no C++ compiler on this machine (the stage refuses, tested)")
def test_megakernel_cpu_streams_the_held_mxfp4_bytes() -> None:
    """megakernel-cpu on an MXFP4-holding model (experts="mxfp4"): the executor streams the model's own codes and
    scales (no dense copy, no re-quantisation) and matches naive on the same model."""
    import kimik3.megakernel.cpu  # noqa: F401  (registers stage "megakernel-cpu")

    model = _mxfp4_model()
    B, lengths = 3, [5, 3, 4]
    ids = torch.randint(0, model.config.vocab_size, (B, 5), generator=torch.Generator().manual_seed(1))
    ref = kimik3.Decoder(model, "naive", batch_size=B, max_seq_len=16)
    dec = kimik3.Decoder(model, "megakernel-cpu", batch_size=B, max_seq_len=16, num_sms=2, experts="mxfp4",
                         poison=True)
    held = dict(model.named_buffers())
    for name, (codes, scales) in dec.stage.runner._mx.items():
        assert codes.data_ptr() == held[name + "_packed"].data_ptr()
        assert scales.data_ptr() == held[name + "_scale"].data_ptr()
    want = ref.prefill(ids, lengths)
    dec.prefill(ids, lengths)
    for s in range(3):
        tok = want.argmax(-1)
        want, got = ref.step(tok), dec.step(tok)
        assert rel_error(got, want) <= TOL["fp32_stage"], f"step {s}"
        assert torch.equal(got.argmax(-1), want.argmax(-1))
