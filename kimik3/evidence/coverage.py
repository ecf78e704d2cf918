"""What covers each unit, read from the code (docs/architecture.md §13): a test module covers the units whose files
it imports — directly, or through the host-verification modules (``kernels/verify/``) and the tests' own helper
modules, which exist to drive device code — and the planted mutants of ``docs/planted-bugs.md`` name the module
they mutate (``fused.gemv.gemv_tile``, ``megakernel.moe``, ...), the CPU check that catches them and the test.

Static, so it needs no test run: a reviewer sees which checks stand behind a unit before running any.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from kimik3.evidence.units import ROOT, Unit
from kimik3.kernels.toolchain.source import OPS as _OPS

__all__ = ["Mutant", "test_modules", "covering_tests", "how_covered", "mutants", "mutant_ids_in_tests",
           "unit_of_module"]

TESTS = ROOT / "tests"
PLANTED = ROOT / "docs" / "planted-bugs.md"
# modules whose imports count as the importing test's own: host verification and the tests' helpers
_PASS_THROUGH = ("kimik3.kernels.verify.", "host_exec_runner", "device_check_script")


def _module_file(name: str) -> Path | None:
    """The repository file of an importable module name (``kimik3.kernels.fused.gemv``, ``host_exec_runner``)."""
    parts = name.split(".")
    if parts[:2] == ["kimik3", "kernels"]:
        base = ROOT / "kernels" / Path(*parts[2:]) if len(parts) > 2 else ROOT / "kernels"
    elif parts[0] == "kimik3":
        base = ROOT / Path(*parts)
    else:
        base = TESTS / Path(*parts)
    for cand in (base.with_suffix(".py"), base / "__init__.py"):
        if cand.is_file():
            return cand
    return None


@cache
def _imports(path: Path) -> frozenset[str]:
    """Module names ``path`` imports (``from a.b import c`` yields ``a.b`` and ``a.b.c``)."""
    out: set[str] = set()
    try:
        tree = ast.parse(path.read_text())
    except (OSError, SyntaxError):
        return frozenset()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            out.add(node.module)
            out |= {f"{node.module}.{a.name}" for a in node.names}
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) in (
                "import_module", "__import__") and node.args and isinstance(node.args[0], ast.Constant) \
                and isinstance(node.args[0].value, str):
            out.add(node.args[0].value)
    return frozenset(out)


@cache
def _reached(path: Path) -> frozenset[str]:
    """Repository files a module imports, following the pass-through modules (verification, test helpers)."""
    seen: set[Path] = set()
    todo, files = [path], set()
    while todo:
        p = todo.pop()
        if p in seen:
            continue
        seen.add(p)
        for name in _imports(p):
            f = _module_file(name)
            if f is None:
                continue
            files.add(f.resolve().relative_to(ROOT).as_posix())
            if name.startswith(_PASS_THROUGH) or f.parent == TESTS:
                todo.append(f)
    return frozenset(files)


# kernel variant names (kernels/toolchain/registry.py): megakernel/<preset>/b<B>..., fused/<family>/<preset>/b<B>...
_VARIANT = re.compile(r"^(megakernel|fused/[a-z_]+)(?:\.[a-z0-9_]+)?/[a-z0-9-]+/b\d+")
_DOTTED = re.compile(r"^(fused|megakernel|common|contracts|probes)\.([a-z_0-9]+)")


# a fused variant's family prefix -> its kernel op, where the two differ (the registry's "mla" family is mla_decode)
_FAMILY_OP = {"mla": "mla_decode"}


@cache
def _strings(path: Path) -> frozenset[str]:
    try:
        tree = ast.parse(path.read_text())
    except (OSError, SyntaxError):
        return frozenset()
    return frozenset(n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str))


@cache
def _named(path: Path) -> tuple[frozenset[str], frozenset[str]]:
    """(kernel ops a module names a variant or build target of, kernel files it names as a dotted module: the
    mutants' ``megakernel.moe``), following the pass-through modules."""
    ops, files = set(), set()
    mods = [path] + [ROOT / f for f in _reached(path) if f.startswith(("kernels/verify/", "tests/"))]
    for m in mods:
        for name in _imports(m):  # the exported target lists (kernels/toolchain/targets.py) name the ops they build
            if name.startswith("kimik3.kernels.toolchain.targets."):
                what = name.rsplit(".", 1)[1].lower()
                ops |= {op for op in _OPS if op.startswith("probe_")} if "probe" in what else set()
                ops |= {"megakernel"} if "megakernel" in what or "rank" in what else set()
                ops |= {op for op in _OPS if not op.startswith("probe_") and op != "megakernel"} \
                    if "fused" in what else set()
        for s in _strings(m):
            v = _VARIANT.match(s)
            if v:
                op = v.group(1).replace("fused/", "")
                ops.add(_FAMILY_OP.get(op, op))
            d = _DOTTED.match(s)
            if d and (ROOT / "kernels" / d.group(1) / f"{d.group(2)}.py").is_file():
                files.add(f"kernels/{d.group(1)}/{d.group(2)}.py")
    return frozenset(ops), frozenset(files)


def test_modules() -> list[Path]:
    return sorted(TESTS.glob("test_*.py"))


def how_covered(unit: Unit, test: Path) -> str | None:
    """How test module ``test`` reaches ``unit``: "imports" (one of its files, directly or through verification),
    "mutates" (names one of its modules as a mutant's target), "compiles" (builds a variant of the kernel op it is
    part of), "runs by name" (a stage named as the Decoder takes it), or None."""
    own = set(unit.files)
    if own & _reached(test):
        return "imports"
    if unit.kind == "contract" and any(own & _reached(ROOT / f) for f in _reached(test) if f.endswith(".py")):
        return "imports through the code it tests"  # a contract is read by the modules a test drives
    ops, files = _named(test)
    if own & files:
        return "mutates"
    if unit.op and unit.op in ops:
        return "compiles"
    if unit.kind == "stage" and unit.name.split("/", 1)[1] in _strings(test):
        return "runs by name"
    return None


def covering_tests(unit: Unit) -> dict[str, str]:
    """Test modules (``tests/test_x.py``) that reach ``unit``, each with how (:func:`how_covered`)."""
    out = {}
    for p in test_modules():
        how = how_covered(unit, p)
        if how:
            out[p.relative_to(ROOT).as_posix()] = how
    return out


@dataclass(frozen=True)
class Mutant:
    """A row of docs/planted-bugs.md: the bug class, the planted mutant, the check that catches it, the test (a
    node id, ``...[id]`` shorthand expanded to the row's test function) and the module it mutates."""

    bug: str
    mutant: str
    check: str
    test: str
    module: str | None


_MOD = re.compile(r"`((?:fused|megakernel|common|contracts|probes)\.[a-z_0-9]+)")


def mutants(text: str | None = None) -> list[Mutant]:
    """The planted-bug table's rows, in order."""
    text = PLANTED.read_text() if text is None else text
    rows, last = [], ""
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")] if line.startswith("|") else []
        if len(cells) < 4 or cells[0] in ("Bug class",) or set(cells[0]) <= set("-: "):
            continue
        test = cells[3]
        m = re.search(r"`(tests/[^`]+)`", test)
        if m:
            last = m.group(1).split("[")[0]
            test = m.group(1)
        else:
            short = re.search(r"`\.\.\.(\[[^]]+\])`", test)
            test = last + short.group(1) if short and last else test
        mod = _MOD.search(cells[1]) or _MOD.search(cells[2])
        rows.append(Mutant(cells[0], cells[1], cells[2], test, mod.group(1) if mod else None))
    return rows


def unit_of_module(dotted: str, units: list[Unit]) -> list[str]:
    """Units owning the kernel module ``dotted`` names (``megakernel.moe`` -> kernels/megakernel/moe.py)."""
    parts = dotted.split(".")
    for k in range(len(parts), 1, -1):
        rel = "kernels/" + "/".join(parts[:k]) + ".py"
        owners = [u.name for u in units if rel in u.files]
        if owners:
            return owners
    return []


def mutant_ids_in_tests() -> set[str]:
    """The mutant ids the host-execution tests parametrise over (keys of their mutant tables), so a row deleted from
    docs/planted-bugs.md is noticed."""
    ids: set[str] = set()
    for f in TESTS.glob("test_host_exec*.py"):
        tree = ast.parse(f.read_text())
        for node in tree.body:
            targets = [t.id for t in getattr(node, "targets", []) if isinstance(t, ast.Name)]
            target = getattr(node, "target", None)
            if isinstance(target, ast.Name):
                targets.append(target.id)
            value = getattr(node, "value", None)
            if any("MUTANT" in t for t in targets) and isinstance(value, ast.Dict):
                ids |= {k.value for k in value.keys if isinstance(k, ast.Constant) and isinstance(k.value, str)}
    return ids
