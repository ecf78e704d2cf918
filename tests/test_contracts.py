"""Every contract between the host and the device code is defined once.

* ``kernels/contracts/isa.py`` (the megakernel's instruction encoding) and ``kernels/contracts/meta.py`` (the fused
  kernels' layouts, eps values, parameter order) load on their own, in a fresh interpreter where torch and cutlass
  cannot be imported — what a consumer that needs only the contract gets;
* the host program encodes with those definitions (header, tables and rows read back at the contract's offsets);
* no other module of the package or the kernels assigns a contract constant or defines a metadata function again;
* the kernel source hash covers every project module a kernel imports (so editing a contract invalidates the
  prebuilt kernels built from it);
* the CPU interpreter computes routing, the KDA decay gate and the gated norm with the model's functions.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from kimik3.kernels.contracts import isa, meta
from kimik3.kernels.toolchain.source import OPS, hashed_modules, module_path

from kimik3.megakernel import instructions, interpreter
from kimik3.megakernel.scheduler import build_program
from kimik3.model import modeling as model
from kimik3.model.config import get_preset

REPO = Path(__file__).resolve().parents[1]

_STANDALONE = textwrap.dedent("""
    import importlib.abc, importlib.util, sys

    class Block(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in ("torch", "cutlass", "numpy", "kimik3"):
                raise ImportError(f"blocked: {name}")
            return None

    sys.meta_path.insert(0, Block())
    out = {}
    for name in ("isa", "meta"):
        spec = importlib.util.spec_from_file_location(f"contract_{name}", f"{sys.argv[1]}/kernels/contracts/{name}.py")
        mod = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = mod
        spec.loader.exec_module(mod)
        out[name] = mod
    isa, meta = out["isa"], out["meta"]
    loaded = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "cutlass", "numpy"))
    print(int(isa.Op.ROUTER), isa.MAGIC, isa.INSTR_WORDS, isa.W_OPS, isa.FFN_LATENT_NORM, isa.DTYPE_BF16)
    print(meta.mla_head_layout(96), meta.mla_default_splits(8, 96, 4096), meta.attn_res_threads(7168, 3),
          meta.kda_head_dim_ok(128), meta.RMS_EPS, meta.ARG_ORDER[("kda", "kda")][0])
    print("loaded:", loaded)
""")


def test_contract_modules_load_without_torch_and_cutlass() -> None:
    r = subprocess.run([sys.executable, "-c", _STANDALONE, str(REPO)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.strip().splitlines()
    assert lines[0].split() == [str(int(isa.Op.ROUTER)), str(isa.MAGIC), str(isa.INSTR_WORDS), str(isa.W_OPS),
                                str(isa.FFN_LATENT_NORM), str(isa.DTYPE_BF16)]
    assert lines[1] == (f"{meta.mla_head_layout(96)} {meta.mla_default_splits(8, 96, 4096)} "
                        f"{meta.attn_res_threads(7168, 3)} True {meta.RMS_EPS} qkv")
    assert lines[2] == "loaded: []"


def test_blocked_imports_really_fail() -> None:
    """The blocker of the test above is effective: importing torch through it fails."""
    code = _STANDALONE.split("out = {}")[0] + "import torch\n"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "blocked: torch" in r.stderr


def test_host_encoding_uses_the_contract() -> None:
    assert instructions.Op is isa.Op and instructions.Mode is isa.Mode and instructions.Kind is isa.Kind
    p = build_program(get_preset("micro"), 2, 3, "round_robin", 64)
    t = p.tensor().tolist()
    assert t[isa.H_MAGIC] == isa.MAGIC and t[isa.H_VERSION] == isa.VERSION
    assert (t[isa.H_N], t[isa.H_S], t[isa.H_C], t[isa.H_NB]) == (len(p.instructions), p.num_sms, len(p.counters),
                                                                len(p.buffers))
    assert (t[isa.H_BATCH], t[isa.H_MAX_SEQ], t[isa.H_LAYERS]) == (2, 64, p.num_layers)
    assert isa.POLICIES[t[isa.H_POLICY]] == p.policy and t[isa.H_TOTAL] == len(t)
    for i, spec in enumerate(p.buffers):
        row = t[t[isa.H_OFF_BUF] + i * isa.BUFFER_WORDS:][: isa.BUFFER_WORDS]
        assert row[isa.BW_KIND] == spec.kind
        assert row[isa.BW_DTYPE] == isa.DTYPE_CODES[str(spec.dtype).removeprefix("torch.")]
        assert (row[isa.BW_D0], row[isa.BW_D1], row[isa.BW_D2]) == spec.shape
    for i, c in enumerate(p.counters):
        assert t[t[isa.H_OFF_CTR] + i * isa.COUNTER_WORDS + isa.CW_TOTAL] == c.total
    for i, ins in enumerate(p.instructions):
        row = t[t[isa.H_OFF_INS] + i * isa.INSTR_WORDS:][: isa.INSTR_WORDS]
        assert (row[isa.W_OP], row[isa.W_LAYER], row[isa.W_SIGNAL], row[isa.W_AMOUNT]) == (
            ins.op, ins.layer, ins.signal, ins.amount)
        assert tuple(row[isa.W_ARGS:isa.W_ARGS + 4]) == ins.args and row[isa.W_NWAITS] == len(ins.waits)
        assert row[isa.W_NOPS] == len(ins.operands)
        for j, o in enumerate(ins.operands):
            base = isa.W_OPS + j * isa.OPERAND_WORDS
            assert (row[base + isa.OW_BUF], row[base + isa.OW_MODE]) == (o.buf, o.mode)
            assert tuple(row[base + isa.OW_BOX + f] for f in (isa.B0, isa.B1, isa.R0, isa.R1, isa.C0, isa.C1)) == \
                o.box


# names whose value is part of a contract: assigning a literal to one anywhere but its defining module is a copy
# (scheduler.POLICIES is another thing: the policies the scheduler offers, not the encoding's policy codes)
_ISA_NAMES = {n for n in vars(isa) if n.isupper() and not n.startswith("_")} - {"POLICIES"} | {"MODE_PREFETCH"}
_META_NAMES = {"SUPPORTED_ARCHS", "ARCHS", "RMS_EPS", "GEMV_RMS_EPS", "NORM_EPS", "QK_EPS", "EPS", "SITU_BETA",
               "SITU_BETA_LIN", "SITU_BETAS", "LM_ROWS_PER_WARP", "LM_ROWS_PER_CTA", "KEEP_MAX_CANDIDATES",
               "CHUNK_BUDGET", "ARG_ORDER", "_ORDER", "_MOE_ORDER", "MOE_ORDER", "HEADS_ORDER", "THREADS",
               "KDA_THREADS"}
_META_FUNCS = {"head_layout", "default_splits", "mla_head_layout", "mla_default_splits", "attn_res_threads",
               "kda_head_dim_ok", "kda_layout", "head_routing"}


def _literal(node: ast.AST) -> bool:
    if isinstance(node, ast.Constant):
        return not isinstance(node.value, str)
    if isinstance(node, ast.UnaryOp):
        return _literal(node.operand)
    if isinstance(node, (ast.Tuple, ast.List, ast.Dict)):
        return True
    return False


def test_no_second_definition() -> None:
    copies = []
    files = sorted((REPO / "kimik3").rglob("*.py")) + sorted((REPO / "kernels").glob("*.py"))
    for path in files:
        rel = path.relative_to(REPO).as_posix()
        tree = ast.parse(path.read_text())
        for node in tree.body:
            if isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                names = [e.id for t in targets for e in (t.elts if isinstance(t, ast.Tuple) else [t])
                         if isinstance(e, ast.Name)]
                value = node.value
                values = value.elts if isinstance(value, ast.Tuple) and len(value.elts) == len(names) else \
                    [value] * len(names)
                for n, v in zip(names, values):
                    if v is not None and _literal(v) and (
                            (n in _ISA_NAMES and rel != "kernels/contracts/isa.py")
                            or (n in _META_NAMES and rel != "kernels/contracts/meta.py")):
                        copies.append(f"{rel}:{node.lineno} assigns {n}")
            elif isinstance(node, ast.FunctionDef) and node.name in _META_FUNCS and rel != "kernels/contracts/meta.py":
                copies.append(f"{rel}:{node.lineno} defines {node.name}()")
    assert not copies, ("contract values defined outside kernels/contracts/isa.py / kernels/contracts/meta.py:\n"
                        + "\n".join(copies))


def _local_imports(name: str) -> set[str]:
    """Kernel modules (named from ``kernels/``, e.g. ``common.device``) that module ``name`` imports."""
    out = set()
    for node in ast.walk(ast.parse(module_path(name).read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("kimik3.kernels."):
            sub = node.module.removeprefix("kimik3.kernels.")
            for a in node.names:  # `from kimik3.kernels.common import device` names a module
                out.add(f"{sub}.{a.name}" if module_path(f"{sub}.{a.name}").is_file() else sub)
    return out - {"toolchain.source"}  # the hashing code itself, not compiled code


def test_source_hash_covers_every_imported_module() -> None:
    kernels = [op for op, mod in OPS.items() if "SOURCE_HASH = kernel_source_hash" in module_path(mod).read_text()]
    assert {"gemv", "router", "kda", "mla_decode", "moe", "attn_res", "megakernel"} <= set(kernels)
    for k in kernels:
        hashed = set(hashed_modules(k))
        todo, seen = [OPS[k]], set()
        while todo:
            m = todo.pop()
            if m in seen:
                continue
            seen.add(m)
            todo.extend(_local_imports(m))
        assert seen <= hashed, f"kernels/{OPS[k]} compiles code from {sorted(seen - hashed)}, which its hash misses"


@pytest.mark.parametrize("fn", ["route_from_logits", "router_logits", "kda_decay", "kda_gated_norm",
                                "kda_short_conv"])
def test_interpreter_uses_the_model_functions(fn: str) -> None:
    assert getattr(interpreter, fn) is getattr(model, fn)


def test_route_is_route_from_logits() -> None:
    """model.route is its two halves (what the interpreter's NORM_PROJ + ROUTER compute), bit for bit."""
    cfg = get_preset("micro").replace(n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2)
    g = torch.Generator().manual_seed(0)
    x, w, b = torch.randn(5, 32, generator=g), torch.randn(16, 32, generator=g), torch.randn(16, generator=g) * 0.1
    wa, ia = model.route(x, w, b, cfg)
    wb, ib = model.route_from_logits(model.router_logits(x, w), b, cfg)
    assert torch.equal(ia, ib) and torch.equal(wa, wb)
