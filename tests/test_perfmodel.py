"""The GPU performance model: hand-computed small cases, the committed scores, the CLI, the current design against
the compiled kernels."""

from __future__ import annotations

import copy
import json
import re

import numpy as np
import pandas as pd
import pytest
import torch
from kimik3.kernels.contracts.isa import COLLECTIVE_OPS, DEVICE_OPS

from kimik3.megakernel.instructions import BufferSpec, Counter, Instruction, Kind, Mode, Op, Operand, Program
from kimik3.model.config import get_preset
from kimik3.perfmodel import (
    CURRENT_DESIGN,
    PERF_DIR,
    compare_kernels,
    compare_opcodes,
    design_expert_formats,
    design_names,
    instruction_times,
    load_constants,
    load_design,
    predict,
    simulate_model,
    stream_ns,
)
from kimik3.perfmodel.expr import evaluate

C = load_constants()
V1 = load_design("v1")
CUR = load_design(CURRENT_DESIGN)


def _gemv_program(rows: int, hin: int, waits: bool = False) -> Program:
    """One NORM_PROJ instruction (B = 1) on one SM; with ``waits`` a producer EMBED on SM 1 before it."""
    from kimik3.model.config import get_preset

    cfg = get_preset("k3-shard")
    bufs = [BufferSpec("x", Kind.ACT, (1, 1, hin), torch.bfloat16),
            BufferSpec("g", Kind.WEIGHT, (1, 1, hin), torch.bfloat16),
            BufferSpec("w", Kind.WEIGHT, (1, rows, hin), torch.bfloat16),
            BufferSpec("y", Kind.ACT, (1, 1, rows), torch.bfloat16)]
    full = lambda b: (0, bufs[b].shape[0], 0, bufs[b].shape[1], 0, bufs[b].shape[2])  # noqa: E731
    gemv = Instruction(Op.NORM_PROJ, 0, (0, 0, 0, rows), (
        Operand(0, Mode.READ, full(0)), Operand(1, Mode.READ | Mode.PREFETCH, full(1)),
        Operand(2, Mode.READ | Mode.PREFETCH, full(2)), Operand(3, Mode.WRITE, full(3))),
        waits=((0, 1),) if waits else (), sm=1 if waits else 0, qpos=0)
    ins, queues, counters = [gemv], [[0]], []
    if waits:
        prod = Instruction(Op.EMBED, 0, (0, 0, 0, 1), (Operand(0, Mode.WRITE, full(0)),), signal=0, amount=1,
                           sm=0, qpos=0)
        ins, queues, counters = [prod, gemv], [[0], [1]], [Counter("x", 1)]
    p = Program(bufs, ins, queues, counters, 1, 4096, 1, "critical_path")
    n = len(ins)
    w = float(rows * hin * 2)
    p.costs = pd.DataFrame({"weight_bytes": [0.0] * (n - 1) + [w], "state_bytes": [0.0] * n,
                            "act_bytes": [0.0] * n, "flops": [0.0] * (n - 1) + [2.0 * rows * hin]})
    p.cfg = cfg
    return p


def test_stream_little_law_by_hand():
    lat, cap = 600.0, 32e9
    assert stream_ns(0, 1, lat, cap) == 0.0
    # everything in flight at once: one latency + transfer at the cap
    assert stream_ns(16384, 65536, lat, cap) == pytest.approx(600 + 16384 / 32e9 * 1e9)
    # 12 KiB in flight at 600 ns -> 20.5 GB/s < cap: the tail flows at in-flight / latency
    inflight = 12288
    want = 600 + inflight / cap * 1e9 + (10 * inflight) / (inflight / 600e-9) * 1e9
    assert stream_ns(11 * inflight, inflight, lat, cap) == pytest.approx(want)


def test_single_gemv_instruction_by_hand():
    """NORM_PROJ, B = 1, 256 rows x 7168: fetch + 64 KiB stage + the rest streamed at 24 KiB in flight."""
    rows, hin = 256, 7168
    p = _gemv_program(rows, hin)
    t = instruction_times(p, V1, C, 4096).iloc[0]
    lat, l2, share = C.hbm_latency_ns, C.l2_latency_ns, C.sm_share_Bps
    nops = 4
    assert t["fetch_ns"] == pytest.approx(1 * lat + (3 + nops) * l2)
    staged_rows = 65536 // (hin * 2)  # 4 whole rows
    staged = staged_rows * hin * 2
    assert t["staged_bytes"] == staged
    assert t["stage_ns"] == pytest.approx(lat + staged / share * 1e9)
    rest = rows * hin * 2 - staged
    inflight = 384 * 4 * 16  # NT threads x 4 loads x 16 bytes (bt = 1)
    rate = min(inflight / (lat * 1e-9), share)
    hbm = lat + inflight / share * 1e9 + (rest - inflight) / rate * 1e9
    assert t["hbm_ns"] == pytest.approx(hbm)
    fma = rows * hin * 2.0 / (128 * C.sm_clock_Hz) * 1e9
    assert t["fma_ns"] == pytest.approx(fma)
    # rstd prologue: cdiv(B, NW) * cdiv(hin * 2 // 16, 32) L2 trips, a 5-shuffle warp sum each
    trips = 1 * -(-(hin * 2 // 16) // 32)
    serial = trips * (l2 + 5 * C.shuffle_latency_cycles * C.cycle_ns)
    assert t["serial_ns"] == pytest.approx(serial)
    assert t["body_ns"] == pytest.approx(max(hbm, fma, t["reread_ns"]) + serial + 5 * C.barrier_ns)
    assert t["signal_ns"] == pytest.approx(l2)
    tl = simulate_model(p, instruction_times(p, V1, C, 4096))
    # no waits: start after fetch, then the whole stage, then body + signal
    assert tl["start_ns"].iloc[0] == pytest.approx(t["fetch_ns"])
    assert tl["end_ns"].iloc[0] == pytest.approx(t["fetch_ns"] + t["stage_ns"] + t["body_ns"] + t["signal_ns"])


def test_one_wait_chain_by_hand():
    """Producer on SM 0, consumer on SM 1 waiting on its counter: the consumer's fetch + stage overlap the wait;
    it starts one wait round trip after the producer's signal."""
    p = _gemv_program(64, 7168, waits=True)
    times = instruction_times(p, V1, C, 4096)
    tl = simulate_model(p, times)
    prod, cons = times.iloc[0], times.iloc[1]
    prod_end = prod["fetch_ns"] + prod["stage_ns"] + prod["body_ns"] + prod["signal_ns"]
    assert tl["end_ns"].iloc[0] == pytest.approx(prod_end)
    ready = max(cons["fetch_ns"], prod_end)
    start = ready + cons["wait_rt_ns"]
    assert tl["start_ns"].iloc[1] == pytest.approx(start)
    begin = max(start, cons["fetch_ns"] + cons["stage_ns"])
    assert tl["end_ns"].iloc[1] == pytest.approx(begin + cons["body_ns"] + cons["signal_ns"])
    # a design that prefetches across instructions cannot be slower on the same program
    ahead = simulate_model(p, times, prefetch_ahead=True)
    assert ahead["end_ns"].max() <= tl["end_ns"].max() + 1e-9


def test_expressions_are_data_not_code():
    assert evaluate("4 if bt <= 2 else 2", {"bt": 4}) == 2
    assert evaluate("cdiv(kvl, NT) * nope", {"kvl": 512, "NT": 384, "nope": 128}) == 256
    for bad in ("__import__('os')", "x.y", "[1]", "open('f')", "lambda: 1"):
        with pytest.raises(ValueError):
            evaluate(bad, {"x": 1})
    with pytest.raises(ValueError, match="unknown name"):
        evaluate("nope * 2", {})


def test_constants_have_sources_and_no_design_is_missing_an_opcode():
    raw = json.loads((PERF_DIR / "constants.json").read_text())["constants"]
    for k, e in raw.items():
        assert e["source"] and "verified" in e, k
    assert C.achievable_Bps < C.hbm_peak_Bps  # the ceiling is the achievable bandwidth, not the datasheet
    expert_ops = {"EXPERT_GATE_UP", "EXPERT_DOWN"}
    for name in design_names():
        ops = set(load_design(name)["megakernel"]["opcodes"])
        base = {k for k in ops if "." not in k}
        device = {op.name for op in DEVICE_OPS}
        assert device <= base, name  # every opcode the device code runs
        for extra in base - device:  # a collective opcode: its device code is a rank kernel's (MKConfig.ranks)
            assert extra in {op.name for op in COLLECTIVE_OPS}, (name, extra)
            assert load_design(name)["megakernel"]["opcodes"][extra]["how"].startswith("source: kernels/megakernel/")
        if base - device:
            assert {op.name for op in COLLECTIVE_OPS} <= base, name  # a design that prices ranks prices them all
        fp4 = {k for k in ops if k.endswith(".mxfp4")}
        assert ops == base | fp4, name  # no other variant entries
        # a design that scores MXFP4 experts describes both expert opcodes for them, and only those
        want = {f"{op}.mxfp4" for op in expert_ops} if "mxfp4" in design_expert_formats(name) else set()
        assert fp4 == want, name


@pytest.mark.parametrize("design", ["v1", "v2", "v3", "v4"])
@pytest.mark.parametrize("stage", ["megakernel", "fused"])
def test_predict_both_stages_all_batches_match_committed_scores(stage, design):
    committed = json.loads((PERF_DIR / f"scores-{design}.json").read_text())
    assert committed["constants"] == "data/perf/constants.json" and committed["design"] == design
    fmts = design_expert_formats(design)
    assert {x.get("experts", "bf16") for x in committed["results"]} == set(fmts)
    for experts, b in [(f, b) for f in fmts for b in (1, 8, 64)]:
        r = predict("k3-shard", stage, b, design, experts=experts)
        assert set(r) >= {"predicted_ms", "roofline_ms", "fraction_of_roofline", "by_opcode"}
        assert 0 < r["fraction_of_roofline"] <= 1.0  # never faster than the achievable-bandwidth roofline
        want = next(x for x in committed["results"] if x["stage"] == stage and x["batch"] == b
                    and x.get("experts", "bf16") == experts)
        assert r["predicted_ms"] == pytest.approx(want["predicted_ms"], rel=1e-6), \
            f"data/perf/scores-{design}.json is stale: regenerate with kimik3.perfmodel.write_scores('{design}')"
        assert r["roofline_ms"] == pytest.approx(want["roofline_ms"], rel=1e-9)


def test_current_design_is_the_default_and_v1_keeps_its_record():
    """``predict`` without a design scores today's kernels; v1 (the kernels before the cross-instruction redesign)
    still gives its committed figure with the same constants."""
    assert CURRENT_DESIGN == CUR["name"] and CURRENT_DESIGN != "v1"
    assert predict("k3-shard", "megakernel", 1)["design"] == CURRENT_DESIGN
    v1 = json.loads((PERF_DIR / "scores-v1.json").read_text())["results"]
    want = next(x for x in v1 if x["stage"] == "megakernel" and x["batch"] == 1)
    assert predict("k3-shard", "megakernel", 1, "v1")["fraction_of_roofline"] == want["fraction_of_roofline"]


def test_a_design_carries_the_tiling_it_was_scored_on():
    """v1 was scored on a program whose MLA_PARTIAL took every head; today's program cuts the heads into tiles when
    the (sequence, split) tiles leave SMs free (batch 1). The model builds each design's own program."""
    from kimik3.perfmodel import design_tiling, model_program

    assert design_tiling(V1) == (("mla_partial_heads", "all"),) and design_tiling(CUR) == ()
    nh = get_preset("k3-shard").num_attention_heads

    def heads(prog):
        return {x.args[1] - x.args[0] for x in prog.instructions if x.op == Op.MLA_PARTIAL}

    assert heads(model_program("k3-shard", 1, tiling=design_tiling(V1))) == {nh}
    assert max(heads(model_program("k3-shard", 1))) < nh
    bad = copy.deepcopy(V1)
    bad["megakernel"]["tiling"] = {"value": {"no_such_tile": 3}}
    with pytest.raises(ValueError, match="unknown tiling field"):
        design_tiling(bad)
    bad["megakernel"]["tiling"] = {"value": {"kda_heads": 0}}
    with pytest.raises(ValueError, match="positive int"):
        design_tiling(bad)


def test_mxfp4_experts_are_scored_on_an_mxfp4_program():
    """The MXFP4 score runs the program that stores the routed experts as MXFP4 (its expert opcodes read the design's
    .mxfp4 entries) against the roofline of the same bytes; a design without MXFP4 entries refuses it."""
    from kimik3.perfmodel import megakernel_model, roofline_ms

    assert roofline_ms("k3-shard", 1, experts="mxfp4") < roofline_ms("k3-shard", 1)
    times, _ = megakernel_model("k3-shard", 1, CURRENT_DESIGN, C, experts="mxfp4")
    dense, _ = megakernel_model("k3-shard", 1, CURRENT_DESIGN, C)
    e = times["op"] == "EXPERT_GATE_UP"
    assert times.loc[e, "weight_bytes"].sum() < 0.3 * dense.loc[dense["op"] == "EXPERT_GATE_UP", "weight_bytes"].sum()
    r = predict("k3-shard", "megakernel", 1, experts="mxfp4")
    assert r["experts"] == "mxfp4" and 0 < r["fraction_of_roofline"] <= 1
    with pytest.raises(ValueError, match="MXFP4"):
        predict("k3-shard", "megakernel", 1, "v1", experts="mxfp4")
    with pytest.raises(ValueError, match="experts must be one of"):
        predict("k3-shard", "megakernel", 1, experts="fp3")


def test_scored_program_is_the_build_predict_scored():
    """A caller that wants the program predict scored (notebook 07's collectives) gets that very build: no second
    one (a k3-rank program takes tens of seconds to build)."""
    from kimik3.perfmodel import model_program, scored_program

    predict("k3-shard", "megakernel", 1, experts="mxfp4", ranges=False)
    before = model_program.cache_info()
    prog = scored_program("k3-shard", 1, experts="mxfp4")
    after = model_program.cache_info()
    assert after.misses == before.misses and after.hits == before.hits + 1
    assert prog.expert_format == "mxfp4" and scored_program("k3-shard", 1) is not prog  # bf16: another program


def test_compare_designs_side_by_side():
    from kimik3.perfmodel import compare_designs

    t = compare_designs("k3-shard", 1, ("v1", CURRENT_DESIGN))
    assert set(t.columns.get_level_values(0)) == {"v1", CURRENT_DESIGN}
    for name in ("v1", CURRENT_DESIGN):
        s = t.attrs["summary"][name]
        assert s["fraction_of_roofline"] == pytest.approx(predict("k3-shard", "megakernel", 1, name)
                                                          ["fraction_of_roofline"], abs=1e-4)
    with pytest.raises(ValueError):
        compare_designs("k3-shard", 1, ())


def test_a_better_design_scores_better_with_the_same_constants():
    """Design as data: doubling the loads in flight and prefetching ahead can only help."""
    from kimik3.perfmodel import megakernel_model

    d = copy.deepcopy(V1)
    d["name"] = "probe"
    d["megakernel"]["prefetch_ahead"] = {"value": True}
    with pytest.raises(ValueError, match="two stage buffers"):
        megakernel_model("k3-shard", 1, d, C)
    d["megakernel"]["stage_buffers"] = {"value": 2}
    for spec in d["megakernel"]["opcodes"].values():
        for s in spec.get("streams", []):
            s["loads"] = f"2 * ({s['loads']})"
    _, base = megakernel_model("k3-shard", 1, V1, C)
    _, better = megakernel_model("k3-shard", 1, d, C)
    assert better["end_ns"].max() < base["end_ns"].max()


def test_compare_with_synthetic_timings():
    from kimik3.megakernel.timeline import from_timings
    from kimik3.perfmodel import megakernel_model, model_program

    prog = model_program("k3-shard", 1)
    times, tl = megakernel_model("k3-shard", 1, "v1", C, program=prog)
    # a "measurement" where every MLA_PARTIAL takes twice the model and the rest exactly the model
    scale = np.where(tl["op"] == "MLA_PARTIAL", 2.0, 1.0)
    start = tl["start_ns"].to_numpy().astype(np.int64) + 10**9
    end = (start + (tl["end_ns"] - tl["start_ns"]).to_numpy() * scale).astype(np.int64)
    measured = from_timings(prog, np.stack([start, end, tl["sm"].to_numpy()], 1))
    cmp = compare_opcodes(times, tl, measured)
    assert cmp.loc["MLA_PARTIAL", "measured_over_model"] == pytest.approx(2.0, rel=1e-4)  # ns are integers
    assert cmp.loc["NORM_PROJ", "measured_over_model"] == pytest.approx(1.0, rel=1e-4)
    with pytest.raises(ValueError, match="not the same program"):
        compare_opcodes(times, tl, measured.iloc[:-1])
    from kimik3.perfmodel import opcode_report

    rep = opcode_report(prog, np.stack([start, end, tl["sm"].to_numpy()], 1), "k3-shard", design="v1")
    assert rep["by_opcode"]["MLA_PARTIAL"]["measured_over_model"] == pytest.approx(2.0, rel=1e-4)
    json.dumps(rep)
    from kimik3.perfmodel import fused_times

    ft = fused_times("k3-shard", 1, V1, C)
    k = compare_kernels(ft, {"kda": 30.0})
    assert k.loc["kda", "measured_over_model"] == pytest.approx(30.0 / (ft[ft.family == "kda"]["ns"].sum() / 1e3))
    with pytest.raises(ValueError):
        compare_kernels(ft, {"kda": float("nan")})


def test_predict_cli_json_and_bad_input(capsys):
    from kimik3.__main__ import main

    assert main(["predict", "--preset", "k3-shard", "--stage", "megakernel", "--batch", "1", "--design", "v1",
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["stage"] == "megakernel" and out["design"] == "v1" and out["label"].startswith("model")
    assert main(["predict", "--preset", "k3-shard", "--stage", "megakernel", "--batch", "8", "--experts", "mxfp4",
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["experts"] == "mxfp4" and out["design"] == CURRENT_DESIGN
    assert main(["predict", "--stage", "fused", "--batch", "1", "--design", "nope"]) == 2
    assert "unknown design" in capsys.readouterr().err
    with pytest.raises(ValueError, match="context"):
        predict("k3-shard", "fused", 1, "v1", context_len=10**6)


def _compiled(name: str) -> dict:
    pytest.importorskip("cutlass")
    from kimik3.kernels.toolchain import build as B
    from kimik3.kernels.toolchain import registry as R

    r = B.build(R.get_variant(name), "sm_90a")
    return {"kernels": {k["name"]: k for k in r.kernels}, "resources": r.resources, "ptx": r.ptx}


def _kernel(rep: dict, fn: str, suffix: str = "") -> dict:
    """The kernel of function ``fn`` (the DSL numbers an op's kernels by launch: moe align _0, gate/up _1, down _2,
    combine _3)."""
    hits = [k for n, k in rep["kernels"].items() if f"_{fn}_" in n and n.endswith(suffix)]
    assert len(hits) == 1, (fn, list(rep["kernels"]))
    return hits[0]


def test_current_design_matches_the_compiled_kernels_ci_subset():
    """The current design's numbers that come from the ptxas reports and the source constants, at k3-shard B = 8
    (megakernel, gemv.rmsnorm, moe bf16: kernels the compile tests build, loaded from the disk cache; every batch is
    slow). v1 described the kernels before the redesign: its compiled numbers were checked against that code and
    stay as its record."""
    from kimik3.kernels.contracts import isa
    from kimik3.kernels.contracts.addr import (
        LM_HEAD_MMA,
        gemv_batch_tile,
        gemv_group_passes,
        gemv_mma_unroll,
        gemv_unroll,
    )

    mk = _compiled("megakernel/k3-shard/b8")
    m = CUR["megakernel"]
    assert mk["resources"]["registers"] == m["registers"]["value"]["8"]
    assert mk["resources"]["shared_bytes"] == m["shared_bytes"]["value"]["8"]
    assert mk["resources"]["shared_bytes"] >= m["stage_bytes"]["value"] * m["stage_buffers"]["value"]
    from kimik3.kernels.megakernel.device_fns import NT

    assert NT == m["threads"]["value"] and isa.STAGE_BYTES == m["stage_bytes"]["value"]
    assert isa.STAGE_BUFFERS == m["stage_buffers"]["value"]
    # 16-byte weight loads in flight per lane: the CUDA-core path (batches 1 to 7), then the tensor-core path (two
    # weight chunks per k block; x normalised as loaded holds one block fewer; an item of several passes fewer still)
    for op, normed in (("NORM_PROJ", True), ("MLP_GATE_UP", True), ("O_PROJ_RESIDUAL", False), ("FFN_OUT", True),
                       ("LM_HEAD", True if LM_HEAD_MMA else None)):
        loads = m["opcodes"][op]["streams"][0]["loads"]
        for b in (1, 4):
            assert evaluate(loads, {"gbt": b, "mma": 0, "pg": 1, "pg2": 1}) == gemv_unroll("sm_90a", b), op
        mma = normed is not None and (op != "LM_HEAD" or LM_HEAD_MMA)
        sources = 2 if op in ("MLP_GATE_UP", "FFN_OUT") else 1
        for b in (8, 33, 64):
            env = {"gbt": gemv_batch_tile(b), "mma": 1, "pg": gemv_group_passes(b, 1), "pg2": gemv_group_passes(b, 2)}
            want = (2 * gemv_mma_unroll("sm_90a", normed, gemv_group_passes(b, sources)) if mma
                    else gemv_unroll("sm_90a", gemv_batch_tile(b)))
            assert evaluate(loads, env) == want, (op, b)
    # the dense experts on tensor cores: two weight rows x EXPERT_MMA_BLOCKS k blocks prefetched per lane and step
    from kimik3.kernels.contracts.addr import EXPERT_MMA_BLOCKS

    for op in ("EXPERT_GATE_UP", "EXPERT_DOWN"):
        assert evaluate(m["opcodes"][op]["streams"][0]["loads"], {"xm": 1}) == 2 * EXPERT_MMA_BLOCKS, op
    # prefetch_ahead with stage_wait = all: the own stage is waited one group behind the next one's copy
    assert m["prefetch_ahead"]["value"] and re.search(r"cp\.async\.wait_group\s+1;", mk["ptx"])
    g = _compiled("gemv.rmsnorm/k3-shard/b8")
    gemv = CUR["fused"]["families"]["gemv"]
    assert g["resources"]["registers"] == gemv["registers_by_variant"]["rmsnorm"]["8"]
    # loads in flight: one step issues `loads` 16-byte ld.global.nc.v4 (K = 7168)
    assert g["ptx"].count("ld.global.nc.v4") == evaluate(gemv["kernels"][0]["loads"], {"K": 7168})
    moe = _compiled("moe.bf16/k3-shard/b8")
    fam = {k["name"]: k for k in CUR["fused"]["families"]["moe"]["kernels"]}
    from kimik3.model.config import get_preset

    cfg = get_preset("k3-shard")
    env = {"fmt": 0, "L": cfg.moe_latent_size or cfg.hidden_size, "I": cfg.moe_intermediate_size}
    assert moe["ptx"].count("ld.global.nc.v4") == evaluate(fam["gate_up"]["loads"], env) + \
        evaluate(fam["down"]["loads"], env)
    assert _kernel(moe, "expert_gemv_kernel", "_2")["registers"] == fam["down"]["registers"]["8"]
    assert _kernel(moe, "moe_combine_kernel")["registers"] == fam["combine"]["registers"]["8"]


@pytest.mark.slow
@pytest.mark.parametrize("b", [1, 8, 64])
def test_current_design_matches_the_compiled_kernels_all_batches(b):
    mk = _compiled(f"megakernel/k3-shard/b{b}")
    assert mk["resources"]["registers"] == CUR["megakernel"]["registers"]["value"][str(b)]
    assert mk["resources"]["shared_bytes"] == CUR["megakernel"]["shared_bytes"]["value"][str(b)]
    fams = CUR["fused"]["families"]
    for var in ("rmsnorm", "plain", "residual", "f32out"):
        assert _compiled(f"gemv.{var}/k3-shard/b{b}")["resources"]["registers"] == \
            fams["gemv"]["registers_by_variant"][var][str(b)]
    kda = _compiled(f"kda/k3-shard/b{b}")
    assert kda["resources"]["registers"] == fams["kda"]["kernels"][0]["registers"][str(b)]
    mla = _compiled(f"mla/k3-shard/b{b}")
    assert _kernel(mla, "mla_split_kernel")["registers"] == fams["mla"]["kernels"][0]["registers"][str(b)]
    for fmt, key in (("bf16", "registers"), ("mxfp4", "registers_mxfp4")):
        moe = _compiled(f"moe.{fmt}/k3-shard/b{b}")
        ks = {k["name"]: k for k in fams["moe"]["kernels"]}
        assert _kernel(moe, "expert_gemv_kernel", "_2")["registers"] == ks["down"][key][str(b)]


def test_bench_model_columns():
    from kimik3.perfmodel import model_columns

    assert model_columns("micro", "naive", 1, 16) == {}
    mk = model_columns("micro", "megakernel", 2, 16)
    assert mk["model_ms"] >= mk["model_roofline_ms"] > 0
    assert model_columns("micro", "fused", 1, 16)["model_note"].startswith("not modelled")  # no fused path for micro


def test_device_hooks_on_cpu():
    from kimik3.perfmodel.device import fused_kernel_report, megakernel_opcode_report
    from kimik3.perfmodel.fused import fused_times

    ft = fused_times("k3-shard", 1, V1, C, 65, 72)
    launches = ft.groupby("launch", sort=False)["ns"].sum()
    name = next(n for n in launches.index if n.endswith("kda.step"))
    recs = [{"batch": 1, "launch": name, "family": "kda", "seconds": 3 * launches[name] / 1e9},
            {"batch": 1, "launch": "not.a.launch", "family": "x", "seconds": 1e-6}]
    rep = fused_kernel_report(recs, "k3-shard", 1, 65, 72)
    assert rep["by_family"]["kda"]["measured_over_model"] == pytest.approx(3.0)
    assert rep["by_launch"][1]["model_us"] is None
    with pytest.raises(ValueError, match="positive and finite"):
        fused_kernel_report([{**recs[0], "seconds": 0.0}], "k3-shard", 1, 65, 72)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA"):
            megakernel_opcode_report(None, 1, 8)
