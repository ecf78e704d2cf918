"""The probe kernels (kernels/probes/) that measure the performance model's constants, checked without a GPU.

Each probe compiles for sm_90a within its budget, and its PTX shows what its figure depends on: the bandwidth
variants issue exactly their number of independent 16-byte loads per loop iteration before any is used, the chase's
loads each take their address from the load before, the signal probe releases and acquires at gpu scope. The part a
CPU can run executes on the host (CuTe DSL host execution, in a subprocess: a device-only instruction aborts): which
chunks each thread of the stream reads and their sum, the chase over a chain from the runner's builder. The runner
(scripts/devcheck/probes.py): its document checker on synthetic documents (and the performance model's reader on
the same), its dry run without and with a prebuilt probe. Planted violations show each PTX and document check
fails. Design: docs/architecture.md, appendix "kernels/probes: measuring the model's constants".
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from kimik3.kernels.toolchain.targets import PROBE_TARGETS, probe_variants

ROOT = Path(__file__).resolve().parents[1]
PROBES_SCRIPT = ROOT / "scripts" / "devcheck" / "probes.py"


def _runner() -> Any:
    """scripts/devcheck/probes.py, loaded by path (a script of the repository, not part of the library)."""
    if "devcheck_probes_under_test" not in sys.modules:
        spec = importlib.util.spec_from_file_location("devcheck_probes_under_test", PROBES_SCRIPT)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = mod
        spec.loader.exec_module(mod)
    return sys.modules["devcheck_probes_under_test"]


def _cases_ci() -> list[dict]:
    """The CI cases: host executions (``check: host``) and the PTX checks of each probe (``check: ptx``)."""
    cases = [{"probe": "bandwidth", "check": "host", "words": w, "threads": t, "loads": n}
             for w, t, n in ((4 * 1000, 96, 4), (4 * 1536, 64, 4), (4 * 37, 64, 4))]  # a tail; exact; one partial step
    # the chase from node ``start`` (word start x stride): a whole cycle back to the start; past a wrap-around
    cases += [{"probe": "latency", "check": "host", "chain_words": 64 * 48, "stride": 64, "start": p, "steps": s,
               "unroll": 8} for p, s in ((0, 48), (5, 48 * 3 + 8))]
    cases += [{"probe": p, "check": "ptx"} for p in ("bandwidth", "latency", "signal")]
    return cases


# ---------------------------------------------------------------------------------------------- host execution
def _host_main(path: str) -> int:
    """``python tests/test_probes.py CASES.json``: each host case, one JSON line per case on stdout."""
    global cutlass, cute, Int32  # the DSL resolves the drivers' annotations in this module's globals
    import cutlass
    import cutlass.cute as cute
    from cutlass import Int32
    from cutlass.cute.runtime import from_dlpack
    from kimik3.kernels.probes import bandwidth, latency

    @cute.jit
    def stream_all(mBuf: cute.Tensor, mOut: cute.Tensor, T: Int32, LOADS: cutlass.Constexpr):
        for g in cutlass.range(T):
            mOut[g] = bandwidth.stream_sum(mBuf, g, T, LOADS)

    @cute.jit
    def chase_once(mChain: cute.Tensor, mOut: cute.Tensor, start: Int32, steps: Int32, UNROLL: cutlass.Constexpr):
        mOut[0] = latency.chase(mChain, start, steps, UNROLL)

    for case in json.loads(Path(path).read_text()):
        if case["probe"] == "bandwidth":
            buf = torch.randint(-2**31, 2**31 - 1, (case["words"],), dtype=torch.int32,
                                generator=torch.Generator().manual_seed(case["words"]))
            out = torch.zeros(case["threads"], dtype=torch.int32)
            stream_all(from_dlpack(buf, assumed_align=16), from_dlpack(out, assumed_align=16), case["threads"],
                       case["loads"])
            res = {"buf": buf.tolist(), "sums": out.tolist()}
        else:
            chain, _ = _runner().build_chain(case["chain_words"], case["stride"], seed=1)
            out = torch.zeros(1, dtype=torch.int32)
            chase_once(from_dlpack(chain, assumed_align=16), from_dlpack(out, assumed_align=16),
                       case["start"] * case["stride"], case["steps"], case["unroll"])
            res = {"end": int(out[0])}
        print(json.dumps({"case": case, **res}), flush=True)
    return 0


@pytest.fixture(scope="module")
def host_results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    cases = [c for c in _cases_ci() if c["check"] == "host"]
    path = tmp_path_factory.mktemp("probes") / "cases.json"
    path.write_text(json.dumps(cases))
    r = subprocess.run([sys.executable, str(Path(__file__)), str(path)], capture_output=True, text=True, timeout=600,
                       cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    lines = [json.loads(ln) for ln in r.stdout.splitlines() if ln.startswith("{")]
    assert r.returncode == 0 and len(lines) == len(cases), (
        f"host execution exited {r.returncode} after {len(lines)}/{len(cases)} cases (a negative code is a signal: "
        f"a device-only instruction reached on the host aborts)\n{r.stderr[-3000:]}")
    return {_name(x["case"]): x for x in lines}


def _name(c: dict) -> str:
    return "-".join(f"{v}" for k, v in c.items() if k != "check")


def _stream_model(buf: torch.Tensor, T: int, loads: int) -> list[int]:
    """Thread g's chunks, as the probe's docstring states them: in step s, s T LOADS + u T + g for u < LOADS."""
    chunks = buf.view(-1, 4).to(torch.int64).sum(1)
    owner = [(c % (T * loads)) % T for c in range(len(chunks))]
    sums = [0] * T
    for c, g in enumerate(owner):
        sums[g] += int(chunks[c])
    return [(s + 2**31) % 2**32 - 2**31 for s in sums]


@pytest.mark.host
@pytest.mark.parametrize("name", [_name(c) for c in _cases_ci() if c["check"] == "host"])
def test_host_execution(name: str, host_results: dict[str, dict]) -> None:
    r = host_results[name]
    case = r["case"]
    if case["probe"] == "bandwidth":
        buf = torch.tensor(r["buf"], dtype=torch.int32)
        total = int(buf.to(torch.int64).sum())
        assert (sum(r["sums"]) - total) % 2**32 == 0, "the threads' chunks do not cover the buffer exactly once"
        assert r["sums"] == _stream_model(buf, case["threads"], case["loads"]), "a thread read other chunks"
    else:
        chain, order = _runner().build_chain(case["chain_words"], case["stride"], seed=1)
        idx = case["start"] * case["stride"]
        for _ in range(case["steps"]):
            idx = int(chain[idx])
        p = int((order == case["start"] * case["stride"]).nonzero()[0, 0])
        assert r["end"] == idx == int(order[(p + case["steps"]) % len(order)])


def test_chain_is_one_cycle_over_every_node() -> None:
    build = _runner().build_chain
    chain, order = build(64 * 1000, 64, seed=3)
    nodes = set(range(0, 64 * 1000, 64))
    assert set(order.tolist()) == nodes and len(order) == len(nodes)
    idx, seen = 0, []
    for _ in range(len(nodes)):
        seen.append(idx)
        idx = int(chain[idx])
    assert idx == 0 and set(seen) == nodes, "the chain is not one cycle through every node"
    assert (chain[[i for i in range(64 * 1000) if i % 64]] == -1).all()
    gaps = (torch.roll(order, -1) - order).abs()
    assert (gaps > 64).float().mean() > 0.9, "consecutive hops should land far apart"
    with pytest.raises(ValueError, match="2 nodes"):
        build(64, 64)


# ---------------------------------------------------------------------------------------------- compile + PTX
def _build(name: str) -> Any:
    pytest.importorskip("cutlass")
    from kimik3.kernels.toolchain import build as B
    from kimik3.kernels.toolchain.registry import get_variant

    v = get_variant(name)
    res = B.build(v, "sm_90a")
    ptx = res.ptx
    assert B.ptx_target(ptx) == "sm_90a" and len(res.kernels) == 1, [k["name"] for k in res.kernels]
    assert res.resources["spill_stores"] == res.resources["spill_loads"] == res.resources["stack"] == 0
    assert ".local" not in ptx and B.check_budget(res, v.budget) == [], B.check_budget(res, v.budget)
    missing = [f for f in v.ptx_features if f not in ptx]
    assert not missing, f"{name}: PTX lacks {missing}"
    return res


_INSTR = re.compile(r"^\s*(@!?%\w+\s+)?([a-z][\w.:]*)\s*(.*?);\s*$")
_REG = re.compile(r"%[a-z]+\d+")


def _body(ptx: str, opcode: str) -> list[tuple[str, list[str], list[str]]]:
    """The innermost loop (a label and the first later branch back to it) holding ``opcode``, as (opcode, defined
    registers, used registers) per instruction."""
    lines = ptx.splitlines()
    labels = {m.group(1): i for i, ln in enumerate(lines) if (m := re.match(r"^(\$\w+):", ln.strip()))}
    best = None
    for j, ln in enumerate(lines):
        m = re.search(r"\bbra(?:\.uni)?\s+(\$\w+);", ln)
        if m and m.group(1) in labels and labels[m.group(1)] < j:
            i = labels[m.group(1)]
            if any(opcode in x for x in lines[i:j]) and (best is None or j - i < best[1] - best[0]):
                best = (i, j)
    assert best is not None, f"no loop holds {opcode}"
    out = []
    for ln in lines[best[0] + 1:best[1] + 1]:
        m = _INSTR.match(ln)
        if not m or ln.strip().startswith("//"):
            continue
        op, args = m.group(2), m.group(3)
        regs = _REG.findall(args)
        stores = op.startswith(("st.", "red.", "bra", "bar."))
        if op.startswith("ld.") and "{" in args:  # vector load: {d0, ..}, [addr]
            dst = _REG.findall(args.split("}")[0])
            out.append((op, dst, _REG.findall(args.split("}")[1])))
        elif stores or not regs:
            out.append((op, [], regs))
        else:
            out.append((op, regs[:1], regs[1:]))
    return out


def loads_before_first_use(body: list[tuple[str, list[str], list[str]]], opcode: str) -> tuple[int, int]:
    """(loads of ``opcode`` issued before any instruction reads a register one of them wrote, all in the body)."""
    loaded: set[str] = set()
    before = None
    n = 0
    for op, dst, src in body:
        if loaded & set(src) and before is None:
            before = n
        if op.startswith(opcode):
            n += 1
            loaded |= set(dst)
    return (n if before is None else before), n


def dependent_chain(body: list[tuple[str, list[str], list[str]]], opcode: str) -> list[bool]:
    """For each load of ``opcode`` after the first in the body: whether its address is computed from the
    previous such load's value (def-use through the body's instructions)."""
    defs: dict[str, list[str]] = {}
    prev: set[str] = set()
    out = []
    for op, dst, src in body:
        if op.startswith(opcode):
            if prev:
                todo, seen = list(src), set()
                while todo:
                    r = todo.pop()
                    if r not in seen:
                        seen.add(r)
                        todo += defs.get(r, [])
                out.append(bool(seen & prev))
            prev = set(dst)
            for d in dst:
                defs[d] = []  # a load's value is where a chain of addresses starts
            continue
        for d in dst:
            defs[d] = list(src)
    return out


BANDWIDTH = probe_variants("probe.bandwidth")  # every variant of the sweep


def _check_bandwidth(name: str) -> None:
    from kimik3.kernels.toolchain.registry import get_variant

    loads = get_variant(name).shapes["loads"]
    body = _body(_build(name).ptx, "ld.global.nc.v4")
    assert loads_before_first_use(body, "ld.global.nc.v4") == (loads, loads), (
        f"{name}: {loads} independent 16-byte loads per iteration expected before the first use")


def _check_latency() -> None:
    from kimik3.kernels.toolchain.registry import get_variant

    v = get_variant("probe.latency/chase")
    ptx = _build(v.name).ptx
    deps = dependent_chain(_body(ptx, "ld.global.b32"), "ld.global.b32")
    assert len(deps) == v.shapes["unroll"] - 1 and all(deps), f"chase loads per iteration: dependent {deps}"
    loads = v.shapes["loads"]  # the streamers beside the chase keep theirs in flight
    assert loads_before_first_use(_body(ptx, "ld.global.nc.v4"), "ld.global.nc.v4") == (loads, loads)


def _signal_scopes(ptx: str) -> list[str]:
    """What is wrong with the signal probe's release / acquire instructions (empty: gpu scope, a spinning wait)."""
    bad = []
    rel = re.findall(r"\b(?:red|atom)\.[\w.]+", ptx)
    loads = [x for x in re.findall(r"\bld\.[\w.:]+", ptx) if not x.startswith(("ld.param", "ld.shared"))]
    if not rel or not all(r.startswith("red.release.gpu.global.add") for r in rel):
        bad.append(f"signal: release adds {rel}")
    if not loads or not all(x.startswith("ld.acquire.gpu.global") for x in loads):
        bad.append(f"wait: every global load must be an acquire at gpu scope, got {loads}")
    if re.search(r"\b(atom|red|ld|st)\.[\w.]*\b(cta|sys|cluster)\b", ptx):
        bad.append("a memory operation at a scope other than gpu")
    if "nanosleep" in ptx:
        bad.append("nanosleep back-off in the ping-pong")
    return bad


def _check_signal() -> None:
    ptx = _build("probe.signal/pingpong").ptx
    assert _signal_scopes(ptx) == []
    assert any(op.startswith("ld.acquire.gpu") for op, _, _ in _body(ptx, "ld.acquire.gpu")), "the wait must spin"


@pytest.mark.parametrize("case", [c for c in _cases_ci() if c["check"] == "ptx"], ids=lambda c: c["probe"])
def test_probe_ptx(case: dict) -> None:
    """Each probe compiles within its budget and its PTX does what its figure depends on."""
    if case["probe"] == "bandwidth":
        for name in BANDWIDTH:
            _check_bandwidth(name)
    elif case["probe"] == "latency":
        _check_latency()
    else:
        _check_signal()


def test_ptx_checks_catch_planted_violations() -> None:
    """A use between the stream's loads, a chase load whose address does not come from the previous load, a
    relaxed wait or a cta-scope signal: each is caught on the real PTX."""
    body = _body(_build(BANDWIDTH[-1]).ptx, "ld.global.nc.v4")
    first = next(i for i, (op, _, _) in enumerate(body) if op.startswith("ld.global.nc.v4"))
    planted = body[:first + 1] + [("add.s32", ["%r9999"], body[first][1][:1])] + body[first + 1:]
    assert loads_before_first_use(planted, "ld.global.nc.v4")[0] == 1
    body = _body(_build("probe.latency/chase").ptx, "ld.global.b32")
    i = [k for k, (op, _, _) in enumerate(body) if op.startswith("ld.global.b32")][1]
    planted = body[:i] + [(body[i][0], body[i][1], ["%rd9999"])] + body[i + 1:]
    assert not all(dependent_chain(planted, "ld.global.b32"))
    ptx = _build("probe.signal/pingpong").ptx
    assert _signal_scopes(ptx.replace("ld.acquire.gpu", "ld.relaxed.gpu"))
    assert _signal_scopes(ptx.replace("red.release.gpu", "red.release.cta"))
    spin = ptx.rindex("ld.acquire.gpu")  # one spin load relaxed, the others kept
    assert _signal_scopes(ptx[:spin] + "ld.relaxed.gpu" + ptx[spin + len("ld.acquire.gpu"):])


# ---------------------------------------------------------------------------------------------- registry + targets
def test_probe_targets_span_the_sweep_and_exceed_l2() -> None:
    from kimik3.kernels.toolchain import registry as R

    assert [v.name for v in R.all_probe_variants()] == list(PROBE_TARGETS)
    assert all(R.get_variant(n).name == n for n in PROBE_TARGETS) and not set(R.PROBES) & set(R.FAMILIES)
    in_flight = sorted(_runner()._in_flight(R.get_variant(n).shapes) for n in probe_variants("probe.bandwidth"))
    assert 4 <= len(in_flight) <= 6 and in_flight[0] <= 8 * 1024 and in_flight[-1] >= 64 * 1024
    assert len(set(in_flight)) == len(in_flight)
    hw = json.loads((ROOT / "data" / "hardware.json").read_text())["hardware"]["h200"]
    lat = R.get_variant("probe.latency/chase").shapes
    assert lat["chain_words"] * 4 > 2 * hw["l2_MB"] * 1e6 and lat["words"] * 4 > 2 * hw["l2_MB"] * 1e6
    assert R.get_variant("probe.signal/pingpong").shapes["pad_bytes"] > hw["smem_per_sm_KB"] * 1024 / 2
    with pytest.raises(ValueError, match="unknown probe kernel"):
        R.get_variant("probe.bandwidth/t1-l1-c1")
    with pytest.raises(ValueError, match="no probe targets"):
        probe_variants("probe.nope")


# ---------------------------------------------------------------------------------------------- the runner
def _document() -> dict[str, Any]:
    r = _runner()
    e = {"value": 0.9, "unit": "fraction of hbm_peak_Bps", "method": "synthetic", "samples": 5, "spread": [0.85, 0.92]}
    ns = {"value": 700.0, "unit": "ns", "method": "synthetic", "samples": 7, "spread": [650.0, 800.0]}
    return {"hardware": "h200", "date": "2025-01-01T00:00:00+00:00", "commit": "0" * 40, "device": "NVIDIA H200",
            "source": r.SOURCE, "constants": {"hbm_read_efficiency": e, **{k: dict(ns) for k in r.CONSTANTS
                                                                             if k != "hbm_read_efficiency"}},
            "sweeps": {r.SWEEP: [{"bytes_in_flight_per_sm": 4096, "Bps": 1.0e12},
                                 {"bytes_in_flight_per_sm": 65536, "Bps": 4.3e12}]}, "skipped": []}


def _plant(doc: dict[str, Any], how: str) -> dict[str, Any]:
    d = json.loads(json.dumps(doc))
    if how == "outside-spread":
        d["constants"]["hbm_latency_ns"]["value"] = 900.0
    elif how == "above-peak":
        d["constants"]["hbm_read_efficiency"].update(value=1.05, spread=[1.0, 1.1])
    elif how == "unknown-name":
        d["constants"]["l2_latency_ns"] = d["constants"]["hbm_latency_ns"]
    elif how == "unit":
        d["constants"]["signal_acquire_ns"]["unit"] = "us"
    elif how == "duplicate-point":
        d["sweeps"][_runner().SWEEP][1]["bytes_in_flight_per_sm"] = 4096
    elif how == "samples":
        d["constants"]["kernel_boundary_ns"]["samples"] = 0
    elif how == "no-device":
        d["device"] = None
    return d


PLANTS = ("outside-spread", "above-peak", "unknown-name", "unit", "duplicate-point", "samples", "no-device")


def test_document_check_accepts_the_contract() -> None:
    assert _runner().check_document(_document()) == []


@pytest.mark.parametrize("how", PLANTS)
def test_document_check_catches_a_planted_violation(how: str) -> None:
    assert _runner().check_document(_plant(_document(), how)), how


def test_the_performance_model_reads_the_document(tmp_path: Path) -> None:
    measured = pytest.importorskip("kimik3.perfmodel.measured", reason="the performance model's reader")
    path = tmp_path / "constants-h200.json"
    path.write_text(json.dumps(_document()))
    m = measured.load_measured(path, "h200")
    assert set(m.constants) == set(_runner().CONSTANTS) and len(m.sweep) == 2
    path.write_text(json.dumps(_plant(_document(), "above-peak")))
    with pytest.raises(ValueError):
        measured.load_measured(path, "h200")


# The probes' launch contract (arguments, outputs, stamps) emulated on the CPU, with known figures: the runner's
# bookkeeping, its checks and its budget on the document they produce. SMs, stream buffer and chain are small.
SM = 132
LAT_NS, LOADED_NS, ROUND_NS = 600, 900, 1400


def _emulated(plant: str = "") -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    from kimik3.kernels.toolchain.registry import get_variant

    shapes = {n: dict(get_variant(n).shapes) for n in PROBE_TARGETS}
    for sh in shapes.values():
        sh.update({"words": 2**20} if "words" in sh else {})
        sh.update({"chain_words": 64 * 4096} if "chain_words" in sh else {})

    def wrap(x: int) -> int:
        return (x + 2**31) % 2**32 - 2**31

    def bandwidth(name: str) -> Any:
        sh = shapes[name]
        bps = min(_runner()._in_flight(sh) * SM / 500e-9, 4.3e12)

        def fn(buf: torch.Tensor, sums: torch.Tensor, stamps: torch.Tensor, grid: int) -> None:
            sums[0] = wrap(int(buf.to(torch.int64).sum()) + (plant == "bandwidth-sum" and name == BANDWIDTH[0]))
            stamps[:grid, 0] = 1000
            stamps[:grid, 1] = 1000 + round(buf.numel() * 4 / bps * 1e9)
            stamps[:grid, 2] = torch.arange(grid) % SM
        return fn, bps

    first: list[int] = []

    def chase(chain, buf, out, sums, stamps, start, steps, passes, grid) -> None:  # noqa: ANN001
        idx = start
        for _ in range(steps - (plant == "chase-short")):
            idx = int(chain[idx])
        out[1] = idx
        out[0] = steps * (LAT_NS if grid == 1 else LOADED_NS)
        stamps[0] = torch.tensor([1000, 1000 + int(out[0]), 5])
        if grid > 1:  # the first passes asked for do not cover the chase; twice as many do
            if not first:
                first.append(passes)
            sums[1] = wrap(passes * int(buf.to(torch.int64).sum()))
            end = 1000 + int(out[0]) + (1 if passes >= 2 * first[0] else -int(out[0]) // 2)
            stamps[1:grid] = torch.tensor([990, end, 7])

    def signal(ctr, out, warm, rounds, max_spins) -> None:  # noqa: ANN001
        for cta, sm in ((0, 3), (1, 3 if plant == "signal-same-sm" else 8)):
            out[cta] = torch.tensor([5000, 5000 + rounds * ROUND_NS, sm, warm + rounds, 1])

    fns: dict[str, Any] = {}
    rates = {}
    for n in PROBE_TARGETS:
        if n.startswith("probe.bandwidth/"):
            fns[n], rates[n] = bandwidth(n)
    fns["probe.latency/chase"], fns["probe.signal/pingpong"] = chase, signal
    return fns, {"shapes": shapes, "rates": rates, "first_passes": first}


def _emulated_run(plant: str = "", budget_s: float = 60.0) -> tuple[dict[str, Any], dict[str, Any]]:
    r = _runner()
    fns, info = _emulated(plant)
    run = r._Run(fns, budget_s, device="cpu", sm_count=SM, shapes=info["shapes"])
    run.measure()
    doc = {"hardware": r.HARDWARE, "date": "2025-01-01T00:00:00+00:00", "commit": "0" * 40, "device": "emulated",
           "source": r.SOURCE, **run.results()}
    return doc, info


def test_runner_on_emulated_probes_reports_what_they_measured() -> None:
    import inspect

    fns, _ = _emulated("")
    arity = {n.partition("/")[0]: len(inspect.signature(f).parameters) for n, f in fns.items()}
    assert arity == {k: sum(v) for k, v in _runner().CALL_ARITY.items()}, "the emulators take the runner's calls"
    doc, info = _emulated_run()
    assert _runner().check_document(doc) == [], _runner().check_document(doc)
    c = doc["constants"]
    assert c["hbm_latency_ns"]["value"] == LAT_NS and c["hbm_loaded_latency_ns"]["value"] == LOADED_NS
    assert c["signal_acquire_ns"]["value"] == ROUND_NS / 2
    assert doc["notes"]["loaded_latency_passes"] == 2 * info["first_passes"][0], "passes grow until the stream covers"
    pts = doc["sweeps"][_runner().SWEEP]
    assert len(pts) == len(BANDWIDTH) and [p["bytes_in_flight_per_sm"] for p in pts] == sorted(
        _runner()._in_flight(info["shapes"][n]) for n in BANDWIDTH)
    for p, n in zip(pts, sorted(BANDWIDTH, key=lambda n: _runner()._in_flight(info["shapes"][n]))):
        assert p["Bps"] == pytest.approx(info["rates"][n], rel=1e-3)
    peak = json.loads((ROOT / "data" / "perf" / "constants.json").read_text())["constants"]["hbm_peak_Bps"]["value"]
    assert c["hbm_read_efficiency"]["value"] == pytest.approx(max(info["rates"].values()) / peak, rel=1e-3)
    # no CUDA here: the one measurement that needs it fails, is listed with its reason and reports nothing
    assert "kernel_boundary_ns" not in c and [s["name"] for s in doc["skipped"]] == ["kernel_boundary_ns"]


@pytest.mark.parametrize(("plant", "lost"), [("bandwidth-sum", f"bandwidth {BANDWIDTH[0].partition('/')[2]}"),
                                            ("chase-short", "hbm_latency_ns"),
                                            ("signal-same-sm", "signal_acquire_ns")])
def test_runner_refuses_a_figure_whose_check_failed(plant: str, lost: str) -> None:
    doc, _ = _emulated_run(plant)
    skipped = {s["name"]: s["reason"] for s in doc["skipped"]}
    assert lost in skipped and skipped[lost].startswith("error"), skipped
    assert lost not in doc["constants"] and _runner().check_document(doc) == []
    if plant == "bandwidth-sum":
        assert len(doc["sweeps"][_runner().SWEEP]) == len(BANDWIDTH) - 1


def test_runner_starts_nothing_past_its_budget() -> None:
    doc, _ = _emulated_run(budget_s=0.05)
    assert doc["constants"] == {} and doc["sweeps"] == {}
    reasons = [s["reason"] for s in doc["skipped"]]
    assert len(reasons) == len(_runner().plan()) - 1 and all(
        r.startswith("budget") or r.startswith("no point") for r in reasons), reasons


def test_dry_run_without_prebuilt_plans_and_measures_nothing() -> None:
    r = _runner()
    doc = r.run_probes(None, dry=True, budget_s=15.0)
    assert doc["dry_run"] is True and doc["constants"] == {} and doc["sweeps"] == {}
    assert r.check_document(doc) == []
    assert {a["name"] for a in doc["artefacts"]} == set(PROBE_TARGETS)
    assert all(a["status"].startswith("missing") for a in doc["artefacts"]) and len(doc["problems"]) == len(
        doc["artefacts"])
    assert 0 < sum(p["estimate_s"] for p in doc["planned"]) <= 15.0
    names = {p["name"] for p in doc["planned"]}
    assert set(r.CONSTANTS) <= names
    with pytest.raises(ValueError, match="budget_s"):
        r.run_probes(None, dry=True, budget_s=0)


def test_dry_run_verifies_and_loads_a_prebuilt_probe(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """One probe exported (compile + link), then the dry run: that one verified, loaded and called in the runner's
    arity (refused for the CPU tensors only), the others missing; a stale source hash refused, a wrong arity too."""
    pytest.importorskip("tvm_ffi")
    from kimik3.kernels.toolchain import prebuilt as pb

    pb.build_prebuilt("sm_90a", tmp_path, ["probe.signal/pingpong"], fmt="tvm-ffi", log=None)
    doc = _runner().run_probes(tmp_path, dry=True, budget_s=15.0)
    status = {a["name"]: a["status"] for a in doc["artefacts"]}
    assert status.pop("probe.signal/pingpong") == "ok" and all(s.startswith("missing") for s in status.values())
    m = json.loads((tmp_path / "manifest.json").read_text())
    m["kernels"]["probe.signal/pingpong"]["source_hash"] = "0" * 64
    (tmp_path / "manifest.json").write_text(json.dumps(m))
    stale = tmp_path.parent / "stale"
    stale.mkdir()
    for f in tmp_path.iterdir():
        (stale / f.name).write_bytes(f.read_bytes())
    doc = _runner().run_probes(stale, dry=True, budget_s=15.0)
    assert "stale" in {a["name"]: a["status"] for a in doc["artefacts"]}["probe.signal/pingpong"]
    monkeypatch.setitem(_runner().CALL_ARITY, "probe.signal", (2, 2))  # a call one scalar short
    doc = _runner().run_probes(tmp_path, dry=True, budget_s=15.0)
    assert "does not fit" in {a["name"]: a["status"] for a in doc["artefacts"]}["probe.signal/pingpong"]


if __name__ == "__main__":
    raise SystemExit(_host_main(sys.argv[1]))


def test_the_runners_document_is_what_the_performance_model_reads(tmp_path: Path) -> None:
    """One contract, two sides: a document the probe runner accepts is one kimik3.perfmodel loads and scores with,
    naming the constants it measured."""
    from kimik3.perfmodel.measured import load_measured

    doc = _document()
    assert _runner().check_document(doc) == []
    path = tmp_path / "constants-h200.json"
    path.write_text(json.dumps(doc))
    m = load_measured(path)
    assert set(m.constants) == set(doc["constants"]) and len(m.sweep) == len(
        doc["sweeps"]["bandwidth_vs_bytes_in_flight_per_sm"])
    from kimik3.perfmodel.measured import measured_constants

    # the latency under load is the one the model's Little's law uses: it lands on hbm_latency_ns
    measured = set(measured_constants(path).measured)
    assert measured >= set(doc["constants"]) - {"hbm_loaded_latency_ns"} and "hbm_latency_ns" in measured
