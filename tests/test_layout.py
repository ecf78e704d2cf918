"""The folders are the map: one concern per room, no import circles, no oversized module, and the device code's
source hashes cover the device rooms and nothing else (docs/architecture.md, map).

* no import circle among the modules of ``kimik3/`` and ``kernels/``, counting imports inside functions and under
  ``TYPE_CHECKING`` (a lazy import hides a circle, it does not remove it);
* no module of the library or the kernels over 800 lines; ``kimik3/`` holds at its top only the public API, the CLI,
  the ``Decoder`` and the bench command;
* every file of the device rooms is hashed into some kernel, no file of the reference or verification rooms is, and
  editing a verification file or a test input changes no kernel's hash while editing a device file does;
* every module opens with a docstring of at most 12 lines, and no code carries status notes.
"""

from __future__ import annotations

import ast
import re
import shutil
from collections import defaultdict
from pathlib import Path

import pytest
from kimik3.kernels.toolchain import source

REPO = Path(__file__).resolve().parents[1]
MAX_LINES = 800
TOP_LEVEL = {"__init__.py", "__main__.py", "_kernel_package.py", "_version.py", "decoder.py", "bench.py"}
DEVICE_ROOMS = ("contracts", "common", "fused", "megakernel", "probes")


def _modules() -> dict[str, Path]:
    out = {}
    for p in [*REPO.glob("kimik3/**/*.py"), *REPO.glob("kernels/**/*.py")]:
        rel = p.relative_to(REPO).with_suffix("").parts
        parts = ["kimik3", "kernels", *rel[1:]] if rel[0] == "kernels" else list(rel)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = p
    return out


def import_graph(mods: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the project modules it imports anywhere in its file. ``from pkg import sub`` is an edge to the
    submodule; ``from pkg import name`` (not a module) an edge to the package."""
    edges: dict[str, set[str]] = defaultdict(set)
    for name, path in mods.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                edges[name].update(a.name for a in node.names if a.name in mods)
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                for a in node.names:
                    sub = f"{node.module}.{a.name}"
                    target = sub if sub in mods else node.module
                    if target in mods:
                        edges[name].add(target)
        edges[name].discard(name)
    return edges


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out = []
    for root in list(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            for w in it:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(edges.get(w, ())))))
                    break
                if w in on:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        out.append(sorted(comp))
    return out


def test_no_import_circles() -> None:
    found = circles(import_graph(_modules()))
    assert not found, "import circles (lazy imports included):\n" + "\n".join(" <-> ".join(c) for c in found)


def test_circle_finder_finds_a_planted_circle() -> None:
    edges = import_graph(_modules())
    edges["kimik3.model.config"].add("kimik3.stages.naive")  # config -> naive -> ... -> config
    assert any("kimik3.model.config" in c and "kimik3.stages.naive" in c for c in circles(edges))


def test_no_module_over_800_lines() -> None:
    sizes = {str(p.relative_to(REPO)): len(p.read_text().splitlines()) for p in _modules().values()}
    big = {path: n for path, n in sizes.items() if n > MAX_LINES}
    assert not big, f"modules over {MAX_LINES} lines: {big}"


def test_top_level_holds_only_the_api() -> None:
    top = {p.name for p in (REPO / "kimik3").glob("*.py")}
    assert top == TOP_LEVEL, f"kimik3/ top: unexpected {sorted(top - TOP_LEVEL)}, missing {sorted(TOP_LEVEL - top)}"


def test_every_device_file_is_hashed_and_no_verification_file_is() -> None:
    hashed = {m for op in source.OPS for m in source.hashed_modules(op)}
    device = {".".join(p.relative_to(REPO / "kernels").with_suffix("").parts)
              for room in DEVICE_ROOMS for p in (REPO / "kernels" / room).glob("*.py") if p.name != "__init__.py"}
    assert device - hashed == set(), f"device files no kernel hash covers: {sorted(device - hashed)}"
    assert not {m for m in hashed if m.split(".")[0] in source.UNHASHED_ROOMS}
    assert all(source.module_path(m).is_file() for m in hashed)


@pytest.fixture
def kernel_copy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A copy of kernels/ that source hashing reads instead of the real one."""
    copy = tmp_path / "kernels"
    shutil.copytree(REPO / "kernels", copy, ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.setattr(source, "KERNEL_DIR", copy)
    return copy


def _hashes() -> dict[str, str]:
    return {op: source.kernel_source_hash(op) for op in source.OPS}


@pytest.mark.parametrize("rel", ["verify/host_exec.py", "verify/addr_replay.py", "verify/ptx_lint.py",
                                 "reference/common.py", "toolchain/registry.py", "toolchain/prebuilt.py"])
def test_editing_verification_or_test_input_changes_no_hash(kernel_copy: Path, rel: str) -> None:
    before = _hashes()
    path = kernel_copy / rel
    path.write_text(path.read_text() + "\n# an edit\n")
    assert _hashes() == before, f"editing kernels/{rel} changed a kernel's source hash"


@pytest.mark.parametrize(("rel", "changed"), [
    ("megakernel/gemv.py", {"megakernel"}),
    ("megakernel/vm.py", {"megakernel"}),
    ("contracts/isa.py", {"megakernel"}),
    ("fused/gemv.py", {"gemv", "router"}),  # router launches the GEMV kernel
    ("contracts/meta.py", {"gemv", "router", "kda", "mla_decode", "moe", "attn_res", "megakernel", "probe_bandwidth",
                           "probe_latency", "probe_signal"}),
    ("common/device.py", set(source.OPS)),
    ("toolchain/dsl.py", set(source.OPS)),
])
def test_editing_a_device_file_changes_its_kernels_hashes(kernel_copy: Path, rel: str, changed: set[str]) -> None:
    before = _hashes()
    path = kernel_copy / rel
    path.write_text(path.read_text() + "\n# an edit\n")
    after = _hashes()
    assert {op for op in before if before[op] != after[op]} == changed


def test_every_opcode_documents_what_it_does_and_its_limits() -> None:
    """Each opcode's notes live in its own device function's docstring; notebook 05 tabulates them from there."""
    from kimik3.kernels.contracts.isa import DEVICE_OPS

    from kimik3.notebook.kernel_report import opcode_notes

    notes = opcode_notes()
    missing = [op.name for op in DEVICE_OPS if op.name not in notes.index]
    assert not missing, f"opcodes without an op_* docstring opening with their name: {missing}"
    empty = [name for name, row in notes.iterrows() if not row["device code"] or not row["known limits"]]
    assert not empty, f"opcode docstrings without a description or a 'Known limits:' part: {empty}"


MAX_DOCSTRING_LINES = 12
# status notes belong in the issue tracker and the closing notes, not in the code
STATUS_WORDS = re.compile(r"\b([Ff]or now|[Ff]irst version|[Ii]ssue #?\d+|TODO|FIXME|XXX)\b")


def test_every_module_opens_with_a_short_docstring() -> None:
    long, missing = {}, []
    for name, p in _modules().items():
        doc = ast.get_docstring(ast.parse(p.read_text()), clean=False)
        if doc is None:
            if p.name != "__init__.py" or p.read_text().strip():
                missing.append(name)
        elif len(doc.splitlines()) > MAX_DOCSTRING_LINES:
            long[name] = len(doc.splitlines())
    assert not missing, f"modules without a docstring: {missing}"
    assert not long, f"module docstrings over {MAX_DOCSTRING_LINES} lines (design prose goes to docs/): {long}"


def test_no_status_notes_in_the_code() -> None:
    hits = [f"{p.relative_to(REPO)}:{i}: {line.strip()}" for p in _modules().values()
            for i, line in enumerate(p.read_text().splitlines(), 1) if STATUS_WORDS.search(line)]
    assert not hits, "status notes in the code:\n" + "\n".join(hits[:20])


def test_the_docstring_rule_refuses_a_long_docstring(tmp_path: Path) -> None:
    p = tmp_path / "m.py"
    p.write_text('"""' + "\n".join(f"line {i}" for i in range(MAX_DOCSTRING_LINES + 1)) + '"""\n')
    assert len(ast.get_docstring(ast.parse(p.read_text()), clean=False).splitlines()) > MAX_DOCSTRING_LINES
    assert STATUS_WORDS.search("# for now the tail is scalar")


def test_every_package_is_in_the_installed_distribution():
    """`make setup` installs in editable mode, where a package missing from pyproject's list still imports; a plain
    install would leave it out. Every folder with an ``__init__.py`` under kimik3/ and kernels/ must be listed."""
    text = (REPO / "pyproject.toml").read_text()
    listed = set(re.findall(r'"([^"]+)"', re.search(r"^packages = \[(.*?)\]", text, re.S | re.M).group(1)))
    found = {".".join((base, *init.parent.relative_to(REPO / folder).parts))
             for folder, base in (("kimik3", "kimik3"), ("kernels", "kimik3.kernels"))
             for init in (REPO / folder).rglob("__init__.py")}
    assert found - listed == set(), f"packages missing from pyproject.toml's packages: {found - listed}"
    assert listed - found == set(), f"listed packages with no __init__.py: {listed - found}"
