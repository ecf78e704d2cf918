"""The units a reviewer judges, derived from the code (docs/architecture.md §13): each fused kernel and probe (the
kernel registry's ops), the megakernel's VM and each opcode family (the VM's dispatch), each stage (the stage
registry), the native CPU executor, and each contract module (``kernels/contracts/``, the scope gates).

A unit's files and source hash come from the code; the hash is the prebuilt manifest's scheme (each file's name then
its bytes, sha256) over the unit's own files, so an edit to one opcode family leaves the others' evidence fresh.
:func:`owners` answers which units a file belongs to; :func:`unowned` lists device and stage files of none.
"""

from __future__ import annotations

import ast
import hashlib
import importlib
from dataclasses import dataclass, field
from pathlib import Path

from kimik3.kernels.toolchain import source as ksrc

__all__ = ["ROOT", "Unit", "discover", "owners", "unowned", "files_hash", "device_files", "stage_files",
           "dispatch_table"]

ROOT = Path(__file__).resolve().parents[2]
_KERNELS = ROOT / "kernels"
DEVICE_ROOMS = ("fused", "megakernel", "probes", "common", "contracts")
# the VM's own files: the kernel, the helpers every opcode inlines, the operand views, the tensor-core step
VM_FILES = ("vm.py", "device_fns.py", "operands.py", "mma.py")


@dataclass(frozen=True)
class Unit:
    """One reviewable unit: ``name`` (``fused/gemv``, ``megakernel/mla``, ``stage/fused``, ...), its ``kind``,
    ``files`` (repository-relative), the kernel op whose prebuilt hash covers it (``op``), the opcodes it
    implements, its scope gate (a key of :data:`kimik3.scope.gates.GATES`) and the reference it reproduces."""

    name: str
    kind: str
    files: tuple[str, ...]
    about: str = ""
    op: str | None = None
    opcodes: tuple[str, ...] = ()
    gate: str | None = None
    reference: tuple[str, ...] = field(default=())

    @property
    def hash(self) -> str:
        return files_hash(self.files)

    def lines(self) -> int:
        return sum(len((ROOT / f).read_text(errors="replace").splitlines()) for f in self.files)


def files_hash(files: tuple[str, ...] | list[str]) -> str:
    """sha256 over ``files`` (repository-relative), each preceded by its name: the scheme of
    :func:`kimik3.kernels.toolchain.source.kernel_source_hash`."""
    h = hashlib.sha256()
    for rel in files:
        h.update(rel.encode() + b"\0")
        p = ROOT / rel
        h.update(p.read_bytes() if p.is_file() else b"<missing>")
    return h.hexdigest()


def _rel(p: Path) -> str:
    return p.resolve().relative_to(ROOT).as_posix()


def _doc_line(path: Path) -> str:
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    return " ".join(doc.split("\n\n")[0].split())


def dispatch_table() -> dict[str, str]:
    """Opcode name -> the device function the VM's ``_dispatch`` calls for it (read from kernels/megakernel/vm.py)."""
    tree = ast.parse((_KERNELS / "megakernel" / "vm.py").read_text())
    fn = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "_dispatch")
    out: dict[str, str] = {}
    for node in ast.walk(fn):
        if isinstance(node, ast.If) and isinstance(node.test, ast.Compare) and \
                isinstance(node.test.comparators[0], ast.Name) and node.test.comparators[0].id.startswith("OP_"):
            call = next((c for s in node.body for c in ast.walk(s) if isinstance(c, ast.Call)
                         and isinstance(c.func, ast.Name)), None)
            if call is not None:
                out[node.test.comparators[0].id[3:]] = call.func.id
    return out


def _defined_in(module_file: Path) -> set[str]:
    return {n.name for n in ast.parse(module_file.read_text()).body if isinstance(n, ast.FunctionDef)}


def _kernel_units() -> list[Unit]:
    out = []
    for op, mod in ksrc.OPS.items():
        room = mod.split(".")[0]
        if room not in ("fused", "probes"):
            continue
        path = ksrc.module_path(op)
        ref = _KERNELS / "reference" / path.name
        kind = "fused kernel" if room == "fused" else "probe kernel"
        out.append(Unit(f"{room.rstrip('s') if room == 'probes' else room}/{path.stem}", kind, (_rel(path),),
                        _doc_line(path), op=op, gate="fused" if room == "fused" else None,
                        reference=(_rel(ref),) if ref.is_file() else ()))
    return out


def _megakernel_units() -> list[Unit]:
    mk = _KERNELS / "megakernel"
    table = dispatch_table()
    fam_of: dict[str, list[str]] = {}
    for name in ksrc.OPCODE_MODULES:
        f = ksrc.module_path(name)
        if f.name in VM_FILES:
            continue
        defs = _defined_in(f)
        fam_of[f.name] = sorted(op for op, fn in table.items() if fn in defs)
    vm = Unit("megakernel/vm", "megakernel VM", tuple(_rel(mk / f) for f in VM_FILES), _doc_line(mk / "vm.py"),
              op="megakernel", gate="megakernel",
              reference=("kimik3/megakernel/interpreter.py", "kimik3/megakernel/hazards.py"))
    fams = [Unit(f"megakernel/{Path(f).stem}", "opcode family", (_rel(mk / f),), _doc_line(mk / f), op="megakernel",
                 opcodes=tuple(ops), gate="megakernel", reference=("kimik3/megakernel/interpreter.py",))
            for f, ops in sorted(fam_of.items())]
    return [vm, *fams]


def _common_units() -> list[Unit]:
    files = tuple(_rel(p) for p in sorted((_KERNELS / "common").glob("*.py")) if p.name != "__init__.py")
    return [Unit("kernels/common", "device helpers", files, "device helpers every kernel inlines (warp reductions, "
                 "fast exp, MXFP4 decode) and the trace-time host switch")]


def _contract_units() -> list[Unit]:
    out = [Unit(f"contract/{p.stem}", "contract", (_rel(p),), _doc_line(p))
           for p in sorted((_KERNELS / "contracts").glob("*.py")) if p.name != "__init__.py"]
    scope = tuple(_rel(p) for p in sorted((ROOT / "kimik3" / "scope").glob("*.py")))
    out.append(Unit("contract/scope", "contract", scope, "the fast paths' scope gates, as data"))
    return out


def _stage_units() -> list[Unit]:
    from kimik3 import stages as st

    out = [Unit("stage/interface", "stage", (_rel(ROOT / "kimik3/stages/base.py"),
                                             _rel(ROOT / "kimik3/stages/__init__.py")),
                "what every stage implements and the registry of stages by name")]
    for name in list(st.STAGES) + [n for n in st._LAZY_STAGES if n not in st.STAGES]:
        cls = st.get_stage(name)
        path = Path(importlib.import_module(cls.__module__).__file__)
        out.append(Unit(f"stage/{name}", "stage", (_rel(path),), " ".join((cls.__doc__ or "").split("\n\n")[0].split()),
                        gate=name if name in _gates() else None,
                        reference=("kimik3/stages/naive.py",) if name != "naive" else ("kimik3/model/modeling.py",)))
    return out


def _gates() -> dict:
    from kimik3.scope.gates import GATES

    return GATES


def _cpu_executor() -> Unit:
    files = ("kimik3/megakernel/cpu_executor.cpp", "kimik3/megakernel/cpu_simd.h", "kimik3/megakernel/cpu.py",
             "kimik3/megakernel/cpu_ranks.py", "kimik3/megakernel/peer_memory.py")
    return Unit("megakernel/cpu-executor", "CPU executor", files,
                "the megakernel's program run by native worker threads waiting on atomic counters (C++), a "
                "deployment's ranks as processes over a shared segment", gate="megakernel-cpu",
                reference=("kimik3/megakernel/interpreter.py",))


def discover() -> list[Unit]:
    """Every unit, derived from the code (names unique)."""
    units = [*_kernel_units(), *_megakernel_units(), *_common_units(), *_contract_units(), _cpu_executor(),
             *_stage_units()]
    names = [u.name for u in units]
    dup = {n for n in names if names.count(n) > 1}
    if dup:
        raise ValueError(f"units named twice: {sorted(dup)}")
    return units


def owners(path: str, units: list[Unit] | None = None) -> list[str]:
    """The names of the units ``path`` (repository-relative) belongs to."""
    return [u.name for u in (units or discover()) if path in u.files]


def device_files() -> list[str]:
    """The device code: every module of kernels/'s device rooms."""
    return [_rel(p) for room in DEVICE_ROOMS for p in sorted((_KERNELS / room).glob("*.py"))
            if p.name != "__init__.py"]


def stage_files() -> list[str]:
    """The stages' modules: kimik3/stages/ and the modules the lazily registered stages live in."""
    from kimik3 import stages as st

    files = {_rel(p) for p in (ROOT / "kimik3" / "stages").glob("*.py")}
    files |= {_rel(Path(importlib.import_module(m).__file__)) for m in st._LAZY_STAGES.values()}
    return sorted(files)


def unowned(units: list[Unit] | None = None) -> list[str]:
    """Device and stage files that belong to no unit (a test requires none)."""
    units = units or discover()
    owned = {f for u in units for f in u.files}
    return [f for f in device_files() + stage_files() if f not in owned]
