"""The device check's constants phase: the probe kernels (``kernels/probes/``) run on the GPU, and the document of
measured constants the performance model reads (``kimik3/perfmodel/measured.py``).

:func:`run_probes` loads each probe's prebuilt artefact through ``kernels/toolchain/loader.py``, runs it with
repeats (median, [min, max]) and returns the document; a measurement that would start after ``budget_s`` is listed
under ``skipped``, and a figure is reported only when it was measured and its own checks passed (the streamed sum,
the chase's end node, the ping-pong's rounds). ``dry=True`` (a CPU machine): every probe artefact checked against
the manifest at the current source hash and loaded, the plan returned, no numbers. :func:`build_chain` and
:func:`check_document` are what ``tests/test_probes.py`` exercises on the CPU. Design: docs/architecture.md,
appendix "kernels/probes: measuring the model's constants".
"""

from __future__ import annotations

import json
import math
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from kimik3.kernels.toolchain.registry import get_variant
from kimik3.kernels.toolchain.targets import PROBE_TARGETS, probe_variants

from kimik3.perf.provenance import commit_info, utc_now

__all__ = ["run_probes", "build_chain", "check_document", "plan", "HARDWARE", "SOURCE", "CONSTANTS", "SWEEP"]

REPO = Path(__file__).resolve().parents[2]
HARDWARE = "h200"
SOURCE = "scripts/device_check.py phase constants"
SWEEP = "bandwidth_vs_bytes_in_flight_per_sm"
# name -> unit of every constant the document may carry (the units kimik3/perfmodel/measured.py expects)
CONSTANTS = {"hbm_read_efficiency": "fraction of hbm_peak_Bps", "hbm_latency_ns": "ns", "hbm_loaded_latency_ns": "ns",
             "signal_acquire_ns": "ns", "kernel_boundary_ns": "ns"}
LOAD_BYTES = 16  # per load of the bandwidth probe (ld.global.nc.v4)
CHAIN_STRIDE_WORDS = 64  # pointer-chase nodes 256 B apart: every hop a different line and DRAM burst
CHASE_STEPS = 2048  # hops per chase launch (the elapsed time covers between steps - 1 and steps of them)
SIGNAL_WARM, SIGNAL_ROUNDS, MAX_SPINS = 64, 4096, 1 << 22
BOUNDARY_KERNELS = 200  # tiny kernels per CUDA graph replay
REPEATS = {"bandwidth": 5, "latency": 7, "signal": 5, "boundary": 7}
# seconds a measurement needs at most on an H200 (load, allocation, checks and repeats): it starts only if that fits
ESTIMATE_S = {"setup": 2.0, "bandwidth": 0.6, "hbm_latency_ns": 0.6, "hbm_loaded_latency_ns": 1.2,
              "signal_acquire_ns": 0.8, "kernel_boundary_ns": 0.6}
COVERAGE_TRIES = 3  # loaded latency: launches with more stream passes until the stream covers the chase


def plan() -> list[dict[str, Any]]:
    """The measurements in the order they run, each with its kernel(s) and the seconds it is allowed to start with."""
    bw = probe_variants("probe.bandwidth")
    items = [{"name": "setup", "what": "every probe kernel verified and loaded", "kernels": list(PROBE_TARGETS),
              "estimate_s": ESTIMATE_S["setup"]}]
    items += [{"name": f"bandwidth {n.partition('/')[2]}", "kernels": [n], "sweep": SWEEP,
               "bytes_in_flight_per_sm": _in_flight(get_variant(n).shapes), "estimate_s": ESTIMATE_S["bandwidth"]}
              for n in bw]
    items.append({"name": "hbm_read_efficiency", "from": "the bandwidth sweep's best point", "estimate_s": 0.0})
    for name in ("hbm_latency_ns", "hbm_loaded_latency_ns"):
        items.append({"name": name, "kernels": probe_variants("probe.latency"), "estimate_s": ESTIMATE_S[name]})
    items.append({"name": "signal_acquire_ns", "kernels": probe_variants("probe.signal"),
                  "estimate_s": ESTIMATE_S["signal_acquire_ns"]})
    items.append({"name": "kernel_boundary_ns", "kernels": [], "what": "torch tiny kernels replayed from a CUDA graph",
                  "estimate_s": ESTIMATE_S["kernel_boundary_ns"]})
    return items


def _in_flight(s: dict[str, Any]) -> int:
    """Bytes in flight per SM of a bandwidth or streaming variant's static shapes."""
    return s["threads"] * s["loads"] * LOAD_BYTES * s["ctas_per_sm"]


def _hbm_peak_Bps() -> float:
    data = json.loads((REPO / "data" / "perf" / "constants.json").read_text())
    return float(data["constants"]["hbm_peak_Bps"]["value"])


def build_chain(chain_words: int, stride_words: int = CHAIN_STRIDE_WORDS, seed: int = 0
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(chain, order)``: an int32 chain of ``chain_words`` words whose nodes sit at multiples of ``stride_words``,
    ``chain[node] = next node`` (word indices) along one cycle through every node in a random order, -1 elsewhere;
    ``order`` (int64) the nodes in visiting order, so ``k`` hops from ``order[p]`` end at ``order[(p + k) % n]``."""
    if stride_words < 1 or chain_words < 2 * stride_words or chain_words >= 2**31:
        raise ValueError(f"build_chain: need 1 <= stride_words and 2 nodes at least in fewer than 2^31 words; got "
                         f"chain_words={chain_words}, stride_words={stride_words}")
    n = chain_words // stride_words
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed)) * stride_words
    chain = torch.full((chain_words,), -1, dtype=torch.int32)
    chain[order] = torch.roll(order, -1).to(torch.int32)
    return chain, order


def _stat(samples: list[float], unit: str, method: str) -> dict[str, Any]:
    return {"value": float(statistics.median(samples)), "unit": unit, "method": method, "samples": len(samples),
            "spread": [float(min(samples)), float(max(samples))]}


def check_document(doc: dict[str, Any]) -> list[str]:
    """Problems of a document :func:`run_probes` returns (empty when it keeps the contract the performance model
    reads): the keys and their types, each constant's unit, a positive value inside its [min, max] spread, a read
    efficiency at most 1, the sweep's points."""
    bad = []
    for key in ("hardware", "date", "source", "device"):
        if not doc.get("dry_run") and not (isinstance(doc.get(key), str) and doc[key]):
            bad.append(f"{key} must be a non-empty string, got {doc.get(key)!r}")
    if "commit" not in doc or not (doc["commit"] is None or isinstance(doc["commit"], str) and doc["commit"]):
        bad.append(f"commit must be a sha or null, got {doc.get('commit')!r}")
    consts, sweeps = doc.get("constants"), doc.get("sweeps")
    if not isinstance(consts, dict) or not isinstance(sweeps, dict):
        return bad + ["constants and sweeps must be objects"]
    if doc.get("dry_run") and (consts or sweeps):
        bad.append("a dry run measures nothing: constants and sweeps must be empty")
    for name, e in consts.items():
        if name not in CONSTANTS:
            bad.append(f"constants.{name}: unknown (known: {', '.join(CONSTANTS)})")
            continue
        if not isinstance(e, dict) or set(e) != {"value", "unit", "method", "samples", "spread"}:
            bad.append(f"constants.{name}: needs exactly value, unit, method, samples, spread; got {e!r}")
            continue
        v, s = e["value"], e["spread"]
        fin = [isinstance(x, float) and math.isfinite(x) and x > 0 for x in (v, *(s if isinstance(s, list) else []))]
        if not (isinstance(s, list) and len(s) == 2 and all(fin) and s[0] <= v <= s[1]):
            bad.append(f"constants.{name}: value {v!r} must be finite, positive and inside its spread {s!r}")
        elif name == "hbm_read_efficiency" and s[1] > 1:
            bad.append(f"constants.{name}: above the datasheet peak (spread {s!r})")
        if e["unit"] != CONSTANTS[name]:
            bad.append(f"constants.{name}.unit must be {CONSTANTS[name]!r}, got {e['unit']!r}")
        if not (isinstance(e["samples"], int) and not isinstance(e["samples"], bool) and e["samples"] >= 1):
            bad.append(f"constants.{name}.samples must be a positive integer, got {e['samples']!r}")
        if not (isinstance(e["method"], str) and e["method"].strip()):
            bad.append(f"constants.{name}.method must say how it was measured")
    if set(sweeps) - {SWEEP}:
        bad.append(f"sweeps: unknown {sorted(set(sweeps) - {SWEEP})} (known: {SWEEP})")
    pts = sweeps.get(SWEEP, [])
    if not isinstance(pts, list):
        return bad + [f"sweeps.{SWEEP} must be a list"]
    xs = [p.get("bytes_in_flight_per_sm") for p in pts if isinstance(p, dict)]
    for i, p in enumerate(pts):
        ok = isinstance(p, dict) and set(p) == {"bytes_in_flight_per_sm", "Bps"} and isinstance(p["Bps"], float) \
            and math.isfinite(p["Bps"]) and p["Bps"] > 0 and isinstance(p["bytes_in_flight_per_sm"], int) \
            and not isinstance(p["bytes_in_flight_per_sm"], bool) and p["bytes_in_flight_per_sm"] > 0
        if not ok:
            bad.append(f"sweeps.{SWEEP}[{i}] must be {{bytes_in_flight_per_sm: positive int, Bps: positive float}}, "
                       f"got {p!r}")
    if len(set(xs)) != len(xs):
        bad.append(f"sweeps.{SWEEP}: a bytes_in_flight_per_sm value appears twice")
    return bad


# ---------------------------------------------------------------------------------------------- the dry run
# (tensors, scalars) each probe is called with below (TVM-FFI: the stream is the current torch stream)
CALL_ARITY = {"probe.bandwidth": (3, 1), "probe.latency": (5, 4), "probe.signal": (2, 3)}


def _signature_problem(name: str, fn: Any) -> str | None:
    """Call ``fn`` with CPU placeholders in the runner's arity: a TVM-FFI function refuses them for the device only
    when the count is right (the GPU-less check that the runner's calls match the compiled signature)."""
    tensors, scalars = CALL_ARITY[name.partition("/")[0]]
    try:
        fn(*[torch.zeros(1, dtype=torch.int32)] * tensors, *[1] * scalars)
    except (ValueError, TypeError) as e:
        return None if "expected device_type=cuda" in str(e) else f"{type(e).__name__}: {e}"[:1000]
    return "accepted CPU tensors (not a CUDA kernel?)"


def _verify(prebuilt: Path | None, arch: str | None) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Each probe artefact: verified (source hash, arch, shapes, file sha256) and loaded; the loaded functions."""
    from kimik3.kernels.toolchain import prebuilt as pb
    from kimik3.kernels.toolchain.loader import load_prebuilt_fn

    rows, fns = [], {}
    manifest: dict[str, Any] = {}
    if prebuilt is not None:
        try:
            manifest = pb.read_manifest(prebuilt)
        except ValueError as e:
            return [{"name": n, "status": f"missing: {e}"} for n in PROBE_TARGETS], fns
    for name in PROBE_TARGETS:
        if prebuilt is None or name not in manifest.get("kernels", {}):
            rows.append({"name": name, "status": "missing: " + ("no prebuilt directory" if prebuilt is None else
                                                                f"not in {prebuilt / pb.MANIFEST}")})
            continue
        try:
            fn = load_prebuilt_fn(prebuilt, manifest, name, arch, get_variant(name).shapes)
        except (ValueError, ImportError, OSError, RuntimeError) as e:
            rows.append({"name": name, "status": f"error: {type(e).__name__}: {e}"[:1000]})
            continue
        if fn is None:
            rows.append({"name": name, "status": "error: exported as a cubin only (the runner calls TVM-FFI .so)"})
            continue
        bad = _signature_problem(name, fn) if arch is not None else None  # (on a GPU the calls themselves say so)
        if bad:
            rows.append({"name": name, "status": f"error: the runner's call does not fit: {bad}"})
            continue
        fns[name] = fn
        rows.append({"name": name, "status": "ok"})
    return rows, fns


# ---------------------------------------------------------------------------------------------- the measurements
class _Run:
    """One GPU run's state: the loaded kernels, the shared buffers, what was measured and skipped, the clock."""

    def __init__(self, fns: dict[str, Any], budget_s: float, *, device: str = "cuda", sm_count: int | None = None,
                 shapes: dict[str, dict[str, Any]] | None = None) -> None:
        self.fns, self.deadline, self.device = fns, time.monotonic() + budget_s, device
        self.shapes = shapes or {n: get_variant(n).shapes for n in PROBE_TARGETS}
        self.constants: dict[str, dict[str, Any]] = {}
        self.sweep: list[dict[str, Any]] = []
        self.skipped: list[dict[str, str]] = []
        self.problems: list[str] = []
        self.notes: dict[str, Any] = {}
        self.sm_count = sm_count or torch.cuda.get_device_properties(0).multi_processor_count
        self.buf: torch.Tensor | None = None
        self.buf_sum = 0
        self.best_Bps: float | None = None
        self.chain: torch.Tensor | None = None  # the chase's chain on the device, its visiting order, hops so far
        self.order = torch.zeros(0, dtype=torch.int64)
        self.pos = 0

    def attempt(self, name: str, estimate_s: float, needs: list[str], fn: Callable[[], None]) -> None:
        """``fn()`` if its kernels loaded and ``estimate_s`` fits in what is left of the budget; else skipped."""
        left = self.deadline - time.monotonic()
        missing = [n for n in needs if n not in self.fns]
        if missing:
            self.skipped.append({"name": name, "reason": f"kernel(s) not loaded: {', '.join(missing)}"})
        elif left < estimate_s:
            self.skipped.append({"name": name, "reason": f"budget: {max(0.0, left):.2f} s left, needs ~{estimate_s} s"})
        else:
            try:
                fn()
            except Exception as e:  # one failed probe must not cost the others
                self.skipped.append({"name": name, "reason": f"error: {type(e).__name__}: {e}"[:1000]})

    def sync(self) -> None:
        if self.device == "cuda":
            torch.cuda.synchronize()

    def stream_buffer(self, words: int) -> torch.Tensor:
        if self.buf is None or self.buf.numel() != words:
            g = torch.Generator(device=self.device).manual_seed(0)
            self.buf = torch.randint(-2**31, 2**31 - 1, (words,), dtype=torch.int32, device=self.device, generator=g)
            self.buf_sum = int(self.buf.sum(dtype=torch.int64).item())
        return self.buf

    # -- bandwidth
    def bandwidth(self, name: str) -> None:
        s = self.shapes[name]
        grid = self.sm_count * s["ctas_per_sm"]
        if grid > s["max_ctas"]:
            raise ValueError(f"{self.sm_count} SMs x {s['ctas_per_sm']} CTAs exceed the {s['max_ctas']} stamp rows")
        buf = self.stream_buffer(s["words"])
        sums = torch.zeros(s["max_ctas"], dtype=torch.int32, device=self.device)
        stamps = torch.zeros(s["max_ctas"], s["stamp_words"], dtype=torch.int64, device=self.device)
        fn, samples = self.fns[name], []
        for r in range(REPEATS["bandwidth"] + 1):  # the first launch warms up and is checked, not timed
            sums.zero_()
            stamps.zero_()
            fn(buf, sums, stamps, grid)
            self.sync()
            got = int(sums[:grid].to(torch.int64).sum().item())
            if not _same_int32(got, self.buf_sum):
                raise RuntimeError(f"{name}: the CTAs' sums {got} do not add up to the buffer's {self.buf_sum} "
                                   "(mod 2^32): the probe did not read every chunk once")
            st = stamps[:grid].cpu()
            span_ns = int(st[:, 1].max() - st[:, 0].min())
            if r:
                samples.append(buf.numel() * 4 / (span_ns * 1e-9))
        per_sm = torch.bincount(st[:, 2]).tolist()
        self.notes.setdefault("bandwidth_ctas_per_sm", {})[name] = sorted({c for c in per_sm if c})
        bps = float(statistics.median(samples))
        self.sweep.append({"bytes_in_flight_per_sm": _in_flight(s), "Bps": bps})
        if self.best_Bps is None or bps > self.best_Bps:
            self.best_Bps = bps
            self.notes["bandwidth_best"] = {"kernel": name, "samples": samples, "bytes": buf.numel() * 4}

    def efficiency(self) -> None:
        best = self.notes.get("bandwidth_best")
        if best is None:
            self.skipped.append({"name": "hbm_read_efficiency", "reason": "no point of the bandwidth sweep measured"})
            return
        peak = _hbm_peak_Bps()
        e = _stat([x / peak for x in best["samples"]], CONSTANTS["hbm_read_efficiency"],
                  f"best point of the bandwidth sweep ({best['kernel']}: {_mib(best['bytes'])} of int32 read once per "
                  "launch by "
                  f"{self.sm_count} SMs x ctas_per_sm persistent CTAs through ld.global.nc.v4, bytes / span of the "
                  f"CTAs' globaltimer stamps), median over launches / hbm_peak_Bps of data/perf/constants.json")
        if e["spread"][1] > 1:
            self.problems.append(f"hbm_read_efficiency: {e['spread']} above the datasheet peak: not reported")
            return
        self.constants["hbm_read_efficiency"] = e

    # -- latency
    def latency(self, loaded: bool) -> None:
        (name,) = probe_variants("probe.latency")
        s = self.shapes[name]
        if self.chain is None:
            chain, self.order = build_chain(s["chain_words"], CHAIN_STRIDE_WORDS)
            self.chain = chain.to(self.device)
            # evict the copied chain from L2: every hop of a chase must miss
            torch.empty(4 * s["chain_words"], dtype=torch.int32, device=self.device).fill_(1)
        if CHASE_STEPS % s["unroll"]:
            raise ValueError(f"CHASE_STEPS {CHASE_STEPS} must be a multiple of the chase's unroll {s['unroll']}")
        buf = self.stream_buffer(s["words"])
        out = torch.zeros(s["out_words"], dtype=torch.int64, device=self.device)
        sums = torch.zeros(s["max_ctas"], dtype=torch.int32, device=self.device)
        stamps = torch.zeros(s["max_ctas"], s["stamp_words"], dtype=torch.int64, device=self.device)
        grid = self.sm_count * s["ctas_per_sm"] if loaded else 1  # the chaser and sm_count x ctas_per_sm - 1 streamers
        if grid > s["max_ctas"]:
            raise ValueError(f"grid {grid} exceeds the {s['max_ctas']} stamp rows")
        passes = 1
        if loaded:
            pass_s = buf.numel() * 4 / (self.best_Bps or _hbm_peak_Bps() / 4)
            unloaded = self.constants.get("hbm_latency_ns", {}).get("value", 1000.0)
            passes = max(1, math.ceil(3 * CHASE_STEPS * unloaded * 1e-9 / pass_s))
        fn, samples, n = self.fns[name], [], len(self.order)
        reps = REPEATS["latency"] + 1
        r = tries = 0
        while r < reps:
            start = int(self.order[self.pos % n])
            sums.zero_()
            stamps.zero_()
            fn(self.chain, buf, out, sums, stamps, start, CHASE_STEPS, passes, grid)
            self.sync()
            want = int(self.order[(self.pos + CHASE_STEPS) % n])
            self.pos += CHASE_STEPS
            o, st = out.cpu(), stamps[:grid].cpu()
            if int(o[1]) != want:
                raise RuntimeError(f"{name}: the chase ended on word {int(o[1])}, not {want}: it did not follow the "
                                   f"chain for {CHASE_STEPS} hops")
            if loaded:
                got = int(sums[1:grid].to(torch.int64).sum().item())
                if not _same_int32(got, passes * self.buf_sum):
                    raise RuntimeError(f"{name}: the streamers' sums do not add up to {passes} passes over the buffer")
                t0, t1 = int(st[0, 0]), int(st[0, 1])
                if int(st[1:, 0].max()) > t0 + (t1 - t0) // 20 or int(st[1:, 1].min()) < t1:
                    tries += 1
                    if tries >= COVERAGE_TRIES:
                        raise RuntimeError(f"{name}: the stream did not cover the chase after {tries} tries "
                                           f"(passes up to {passes})")
                    passes *= 2
                    continue
            if r:
                samples.append(int(o[0]) / CHASE_STEPS)
            r += 1
        key = "hbm_loaded_latency_ns" if loaded else "hbm_latency_ns"
        how = (f"while {grid - 1} CTAs stream {_mib(buf.numel() * 4)} {passes} time(s) at "
               f"{_in_flight(s) // 1024} KiB in flight per SM (their globaltimer stamps cover the chase)"
               if loaded else "alone on the GPU")
        self.constants[key] = _stat(samples, "ns", (
            f"pointer chase ({name}): one thread, {CHASE_STEPS} dependent int32 loads per launch over a "
            f"{_mib(s['chain_words'] * 4)} random cycle of nodes {CHAIN_STRIDE_WORDS * 4} B apart, {how}; "
            "globaltimer ns / hops, median over launches"))
        if loaded:
            self.notes["loaded_latency_passes"] = passes

    # -- signal
    def signal(self) -> None:
        (name,) = probe_variants("probe.signal")
        s = self.shapes[name]
        ctr = torch.zeros(2, dtype=torch.int32, device=self.device)
        out = torch.zeros(2, s["out_words"], dtype=torch.int64, device=self.device)
        fn, samples = self.fns[name], []
        for r in range(REPEATS["signal"] + 1):
            ctr.zero_()
            out.zero_()
            fn(ctr, out, SIGNAL_WARM, SIGNAL_ROUNDS, MAX_SPINS)
            self.sync()
            o = out.cpu()
            if not (int(o[0, 4]) == int(o[1, 4]) == 1 and int(o[0, 3]) == SIGNAL_WARM + SIGNAL_ROUNDS):
                raise RuntimeError(f"{name}: a wait gave up after {MAX_SPINS} spins (rows {o.tolist()})")
            if int(o[0, 2]) == int(o[1, 2]):
                raise RuntimeError(f"{name}: both CTAs ran on SM {int(o[0, 2])}")
            if r:
                samples.append((int(o[0, 1]) - int(o[0, 0])) / SIGNAL_ROUNDS / 2)
        self.constants["signal_acquire_ns"] = _stat(samples, "ns", (
            f"ping-pong ({name}) between two CTAs on different SMs through two int32 counters: red.release.gpu add, "
            f"spin on ld.acquire.gpu (the megakernel's signal and wait, without its nanosleep back-off), "
            f"{SIGNAL_ROUNDS} rounds after {SIGNAL_WARM}; globaltimer ns per round / 2, median over launches"))

    # -- kernel boundary
    def boundary(self) -> None:
        x = torch.zeros(1, device=self.device)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                x.add_(1)
        torch.cuda.current_stream().wait_stream(side)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(BOUNDARY_KERNELS):
                x.add_(1)
        samples = []
        for r in range(REPEATS["boundary"] + 1):
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            g.replay()
            e1.record()
            e1.synchronize()
            if r:
                samples.append(e0.elapsed_time(e1) * 1e6 / BOUNDARY_KERNELS)
        self.constants["kernel_boundary_ns"] = _stat(samples, "ns", (
            f"{BOUNDARY_KERNELS} dependent one-element torch kernels (x.add_(1)) replayed from one CUDA graph, CUDA "
            "event time per replay / kernels, median over replays"))

    def measure(self) -> None:
        """Every measurement of :func:`plan`, in its order, each only if its kernels loaded and its time fits."""
        for name in probe_variants("probe.bandwidth"):
            self.attempt(f"bandwidth {name.partition('/')[2]}", ESTIMATE_S["bandwidth"], [name],
                         lambda n=name: self.bandwidth(n))
        self.efficiency()
        lat = probe_variants("probe.latency")
        self.attempt("hbm_latency_ns", ESTIMATE_S["hbm_latency_ns"], lat, lambda: self.latency(False))
        self.attempt("hbm_loaded_latency_ns", ESTIMATE_S["hbm_loaded_latency_ns"], lat, lambda: self.latency(True))
        self.attempt("signal_acquire_ns", ESTIMATE_S["signal_acquire_ns"], probe_variants("probe.signal"),
                     self.signal)
        self.attempt("kernel_boundary_ns", ESTIMATE_S["kernel_boundary_ns"], [], self.boundary)

    def results(self) -> dict[str, Any]:
        """The document's measured part: constants, the sweep (ascending), what was skipped and why, problems."""
        sweep = sorted(self.sweep, key=lambda p: p["bytes_in_flight_per_sm"])
        return {"constants": self.constants, "sweeps": {SWEEP: sweep} if sweep else {}, "skipped": self.skipped,
                "problems": self.problems, "notes": self.notes}


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:g} MiB"


def _same_int32(a: int, b: int) -> bool:
    return (a - b) % 2**32 == 0


def run_probes(prebuilt: Path | None, *, dry: bool, budget_s: float) -> dict[str, Any]:
    """Measure the performance model's constants with the prebuilt probe kernels in ``prebuilt`` (see the module
    docstring); ``budget_s``: seconds after which no new measurement starts."""
    if budget_s <= 0:
        raise ValueError(f"budget_s must be positive, got {budget_s}")
    commit = commit_info(prebuilt)[0]
    head = {"hardware": HARDWARE, "date": utc_now(), "commit": commit, "source": SOURCE}
    if dry:
        rows, _ = _verify(prebuilt, "sm_90a")
        problems = [f"{r['name']}: {r['status']}" for r in rows if r["status"] != "ok"]
        return {"dry_run": True, **head, "device": None, "constants": {}, "sweeps": {}, "planned": plan(),
                "artefacts": rows, "problems": problems, "skipped": []}
    if not torch.cuda.is_available():
        raise RuntimeError("run_probes: no CUDA device (dry=True checks the artefacts on a CPU machine)")
    t0 = time.monotonic()
    rows, fns = _verify(prebuilt, None)
    run = _Run(fns, budget_s - (time.monotonic() - t0))
    run.measure()
    return {**head, "device": torch.cuda.get_device_name(), **run.results(), "artefacts": rows,
            "seconds": round(time.monotonic() - t0, 3)}
