"""The repository stands on its own: nothing it ships reaches outside its root, and every section it cites exists.

Why a test: CI used to lay a copy of the project's external reference folder beside the clone, so a test or a
notebook reading from there passed in CI and failed for anyone who cloned the repository alone. And a `§` number
in a comment is only useful if the document it points at is in the repository and has that section.

Two checks over every text file of the code, test, script, tool, notebook (``.ipynb`` included) and doc folders:

* **no outside path**: no parent-folder escape (``../``, ``".."``, ``Path(__file__)`` climbed past the root via
  ``parents[N]``, ``.parent`` chains or nested ``os.path.dirname``), no absolute ``/work/`` path, no environment
  variable that used to locate the external folder, no ``shared/spec|golden|guides|tools|hooks`` path;
* **citations resolve**: every ``§N`` / ``§N.M`` (also ``§A, §B``, ``§A/§B`` and ``§A–B`` runs) names a ``§``
  heading of ``docs/architecture.md``, or of ``docs/cute-dsl-notes.md`` when the run follows the word "guide";
  every ``pitfall N`` is item N of the numbered list under ``§9`` (``§8`` of the notes for "guide pitfall N");
  every ``docs/<name>.md`` mentioned exists, and a ``#fragment`` after it is one of its headings.

This file is the one file not scanned: it has to spell out the patterns it looks for. The checker functions are
exercised on planted bad references below, so a checker that finds nothing cannot pass silently.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SELF = Path(__file__).resolve()
SCANNED_DIRS = ("kimik3", "kernels", "tests", "scripts", "tools", "notebooks", "docs")
SCANNED_FILES = ("README.md",)
TEXT_SUFFIXES = {".py", ".ipynb", ".md", ".sh", ".txt", ".json", ".toml", ".yml", ".yaml", ".cfg", ".ini", ".rst"}
SKIP_DIRS = {"__pycache__", ".ipynb_checkpoints", ".pytest_cache", ".ruff_cache"}

ARCH_DOC = "docs/architecture.md"
GUIDE_DOC = "docs/cute-dsl-notes.md"
PITFALL_SECTION = {ARCH_DOC: "9", GUIDE_DOC: "8"}  # the numbered list that "pitfall N" indexes

# The folder name is split so that this pattern is not itself a hit when the string appears in a scanned file.
_ENV_VAR = "KIMIK3" + "_SHARED"
_FIXED_PATTERNS = [
    (re.compile(re.escape(_ENV_VAR)), "environment variable locating a folder outside the repository"),
    (re.compile(r"(?<![\w.])\.\./"), "parent-folder escape '../'"),
    # '..' joined into a path (a membership test such as `".." in parts` is a guard, not an escape)
    (re.compile(r"""(?:/\s*|Path\(\s*|join\([^)]*,\s*)(["'])\.\.\1"""), "parent-folder path component '..'"),
    (re.compile(r"(?<![\w.-])/work/"), "absolute path '/work/'"),
    (re.compile(r"\bshared/(?:spec|golden|guides|tools|hooks)\b"), "path into the external 'shared/' folder"),
]
# Deliberate escapes: hostile inputs that the code under test must refuse. (file, exact text) -> why.
ALLOWED_ESCAPES = {
    ("tests/test_bad_inputs.py", '"../outside.safetensors"'): "a checkpoint index pointing outside its folder, which "
                                                              "the reader must refuse",
    ("tests/test_fuzz_inputs.py", '"../outside.safetensors"'): "a shard name the fuzzed index may hold, which the "
                                                               "reader must refuse",
}
_FILE_ANCHOR = r"Path\(\s*__file__\s*\)(?:\.resolve\(\s*\)|\.absolute\(\s*\))?"
_PARENTS_INDEX = re.compile(_FILE_ANCHOR + r"\.parents\[\s*(\d+)\s*\]")
_PARENT_CHAIN = re.compile(_FILE_ANCHOR + r"((?:\.parent\b)+)")
_DIRNAME_CHAIN = re.compile(r"((?:os\.path\.dirname\(\s*)+)(?:os\.path\.(?:abspath|realpath)\(\s*)?__file__")

_NUM = r"\d+(?:\.\d+)*"
_CITE = re.compile(
    r"(?:(?P<guide>\bguide\s+)|(?P<spec>\bspec(?:'s)?\s+))?"  # whose § it is
    r"§\s?(?P<first>" + _NUM + r")"
    r"(?P<rest>(?:\s*(?:,|/|and)\s*§\s?" + _NUM + r"|[–-]§?" + _NUM + r")*)")  # "§A, §B", "§A/§B", "§A–B"
_PITFALL = re.compile(r"(?P<guide>\bguide\s+)?\bpitfalls?\s+(?P<n>\d+)\b")
_DOC_LINK = re.compile(r"\b(docs/[\w./-]+?\.md)(?:#([\w-]+))?")
_MD_LINK = re.compile(r"\]\(\s*(?![a-z][a-z0-9+.-]*:)([^)\s#]*)(?:#([\w-]+))?\s*\)")  # relative markdown links
_SECTION_HEADING = re.compile(r"^#{1,6}\s+§(" + _NUM + r")\b")
_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")


@dataclass(frozen=True)
class Problem:
    where: str  # "path:line" (for notebooks "path [cell i] line j")
    what: str

    def __str__(self) -> str:
        return f"{self.where}: {self.what}"


# ---------------------------------------------------------------------------------------------- reading files

def scanned_files(root: Path = ROOT) -> list[Path]:
    """Every text file of the scanned folders (and top-level files), except this test."""
    out: list[Path] = [root / f for f in SCANNED_FILES if (root / f).is_file()]
    for d in SCANNED_DIRS:
        base = root / d
        if not base.is_dir():
            continue
        for p in sorted(base.rglob("*")):
            if p.is_file() and p.suffix in TEXT_SUFFIXES and not SKIP_DIRS.intersection(p.relative_to(root).parts):
                if p.resolve() != SELF:
                    out.append(p)
    return out


def text_lines(path: Path, root: Path = ROOT) -> list[tuple[str, str]]:
    """(location, line) pairs. Notebooks are read cell by cell, so a hit names the cell a person would edit."""
    rel = path.relative_to(root).as_posix()
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".ipynb":
        try:
            cells = json.loads(text).get("cells", [])
        except json.JSONDecodeError as e:
            raise ValueError(f"{rel} is not valid notebook JSON: {e}") from None
        out = []
        for i, cell in enumerate(cells):
            src = cell.get("source", "")
            src = "".join(src) if isinstance(src, list) else src
            out += [(f"{rel} [cell {i}] line {j}", line) for j, line in enumerate(src.splitlines(), 1)]
        return out
    return [(f"{rel}:{j}", line) for j, line in enumerate(text.splitlines(), 1)]


# ---------------------------------------------------------------------------------------------- outside paths

def outside_references(path: Path, root: Path = ROOT) -> list[Problem]:
    """Every reference in ``path`` to a location outside ``root``."""
    # How many folders lie between the root and this file: Path(__file__).parents[depth] is the root itself.
    depth = len(path.resolve().relative_to(root.resolve()).parts) - 1
    problems = []
    rel = path.relative_to(root).as_posix()
    allowed = [text for (f, text) in ALLOWED_ESCAPES if f == rel]
    for where, line in text_lines(path, root):
        for text in allowed:
            line = line.replace(text, "")
        for pat, what in _FIXED_PATTERNS:
            if pat.search(line):
                problems.append(Problem(where, f"{what}: {line.strip()[:160]}"))
        climbs = [int(m.group(1)) for m in _PARENTS_INDEX.finditer(line)]
        climbs += [m.group(1).count(".parent") - 1 for m in _PARENT_CHAIN.finditer(line)]
        climbs += [m.group(1).count("dirname") - 1 for m in _DIRNAME_CHAIN.finditer(line)]
        for c in climbs:  # c: the index into Path(__file__).parents that the expression ends at
            if c > depth:
                problems.append(Problem(where, f"__file__ climbed {c + 1} folders from a file {depth} below the "
                                        f"repository root: {line.strip()[:160]}"))
    return problems


# ---------------------------------------------------------------------------------------------- citations

@dataclass(frozen=True)
class DocIndex:
    """What a cited document offers: its § section numbers, heading slugs and numbered pitfall items."""

    sections: frozenset[str]
    slugs: frozenset[str]
    pitfalls: frozenset[int]


def _slug(heading: str) -> str:
    """GitHub's heading anchor: lower case, punctuation dropped, spaces to hyphens."""
    s = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return s.replace(" ", "-")


def index_doc(path: Path, pitfall_section: str | None = None) -> DocIndex:
    sections, slugs, pitfalls = set(), set(), set()
    in_pitfalls, level = False, 0
    in_code = False
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.lstrip().startswith("```"):
            in_code = not in_code
            continue
        if in_code:
            continue
        h = _HEADING.match(line)
        if h:
            slugs.add(_slug(h.group(2)))
            s = _SECTION_HEADING.match(line)
            if s:
                sections.add(s.group(1))
            if in_pitfalls and len(h.group(1)) <= level:
                in_pitfalls = False
            if s and s.group(1) == pitfall_section:
                in_pitfalls, level = True, len(h.group(1))
            continue
        item = re.match(r"^(\d+)\.\s", line)
        if in_pitfalls and item:
            pitfalls.add(int(item.group(1)))
    return DocIndex(frozenset(sections), frozenset(slugs), frozenset(pitfalls))


def citations(line: str, default: str = ARCH_DOC) -> list[tuple[str, str]]:
    """(document, section number) for every § citation in one line: "guide §" cites the CuTe DSL notes, "spec §"
    the architecture notes, a bare § the architecture notes, or (inside one of the cited documents) itself."""
    out = []
    for m in _CITE.finditer(line):
        doc = GUIDE_DOC if m.group("guide") else ARCH_DOC if m.group("spec") else default
        out += [(doc, n) for n in [m.group("first"), *re.findall(_NUM, m.group("rest"))]]
    return out


def unresolved_citations(path: Path, docs: dict[str, DocIndex], root: Path = ROOT) -> list[Problem]:
    """Every §, pitfall or docs/ reference in ``path`` that names something the repository's docs do not have."""
    rel = path.relative_to(root).as_posix()
    default = rel if rel in PITFALL_SECTION else ARCH_DOC
    problems = []
    for where, line in text_lines(path, root):
        for doc, n in citations(line, default):
            if doc not in docs:
                problems.append(Problem(where, f"§{n} cites {doc}, which does not exist"))
            elif n not in docs[doc].sections:
                problems.append(Problem(where, f"§{n} is not a section heading of {doc}"))
        for m in _PITFALL.finditer(line):
            doc = GUIDE_DOC if m.group("guide") else default
            if doc not in docs or int(m.group("n")) not in docs[doc].pitfalls:
                problems.append(Problem(where, f"pitfall {m.group('n')} is not an item of the pitfall list "
                                        f"(§{PITFALL_SECTION[doc]}) of {doc}"))
        for m in _MD_LINK.finditer(line) if path.suffix in (".md", ".ipynb") else ():
            target = (path.parent / m.group(1)).resolve() if m.group(1) else path.resolve()
            if not target.is_relative_to(root.resolve()):
                problems.append(Problem(where, f"link {m.group(1)} leaves the repository"))
            elif not target.exists():
                problems.append(Problem(where, f"link {m.group(1)} does not exist"))
            elif m.group(2) and target.suffix == ".md" and m.group(2) not in index_doc(target).slugs:
                problems.append(Problem(where, f"link {m.group(1)}#{m.group(2)}: no such heading"))
        for m in _DOC_LINK.finditer(line):
            target, frag = m.group(1), m.group(2)
            if not (root / target).is_file():
                problems.append(Problem(where, f"{target} does not exist"))
            elif frag:
                idx = docs.get(target) or index_doc(root / target)
                if frag not in idx.slugs:
                    problems.append(Problem(where, f"{target} has no heading #{frag}"))
    return problems


def load_docs(root: Path = ROOT) -> dict[str, DocIndex]:
    return {d: index_doc(root / d, PITFALL_SECTION.get(d)) for d in (ARCH_DOC, GUIDE_DOC) if (root / d).is_file()}


def all_problems(root: Path = ROOT) -> list[Problem]:
    docs = load_docs(root)
    out: list[Problem] = []
    for p in scanned_files(root):
        out += outside_references(p, root) + unresolved_citations(p, docs, root)
    return out


# ---------------------------------------------------------------------------------------------- the checks

def test_documents_exist_and_number_their_sections():
    docs = load_docs()
    assert set(docs) == {ARCH_DOC, GUIDE_DOC}
    assert (ROOT / "docs" / "validation.md").is_file()
    # the sections the code leans on hardest, and the full pitfall list
    assert {"0", "1.1", "2.2", "2.3", "3.2", "4.4", "5.3", "5.5", "8.2"} <= docs[ARCH_DOC].sections
    assert docs[ARCH_DOC].pitfalls == frozenset(range(1, 20))


def test_golden_fixture_is_in_the_repository():
    fixture = ROOT / "tests" / "fixtures" / "k3-release-tiny"
    for name in ("config.json", "model.safetensors", "expected.safetensors", "README.md"):
        assert (fixture / name).is_file(), f"{name} missing from {fixture}"


def test_no_file_reaches_outside_the_repository():
    problems = [p for p in scanned_files() for p in outside_references(p)]
    assert not problems, "references outside the repository root:\n" + "\n".join(map(str, problems))


def test_every_citation_resolves():
    docs = load_docs()
    problems = [q for p in scanned_files() for q in unresolved_citations(p, docs)]
    assert not problems, "citations without a target in docs/:\n" + "\n".join(map(str, problems))


# ---------------------------------------------------------------------------------------------- planted errors

@pytest.fixture()
def fake_repo(tmp_path: Path) -> Path:
    """A minimal repository: one cited document, one clean source file."""
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "architecture.md").write_text(
        "# Notes\n\n## §1 Top\n\n### §1.1 Layers\n\n## §9 Pitfalls\n\n1. one\n2. two\n\n"
        "## §10 After\n\n3. not a pitfall\n",
        encoding="utf-8")
    (tmp_path / "docs" / "cute-dsl-notes.md").write_text("# Guide\n\n## §2 GEMV\n\n## §8 Pitfalls\n\n1. arch\n",
                                                        encoding="utf-8")
    (tmp_path / "kimik3").mkdir()
    (tmp_path / "kimik3" / "ok.py").write_text(
        '"""Layer map (§1.1, §1 and pitfall 2; guide §2, guide pitfall 1), see docs/architecture.md#1-top."""\n'
        "from pathlib import Path\nROOT = Path(__file__).resolve().parents[1]\nUP = Path(__file__).parent.parent\n"
        "SAFE = '..' not in Path('a/b').parts\n",
        encoding="utf-8")
    return tmp_path


def test_checker_passes_a_clean_tree(fake_repo: Path):
    assert all_problems(fake_repo) == []


@pytest.mark.parametrize("line, expect", [
    ("x = Path(__file__).resolve().parents[2] / 'shared'", "climbed 3 folders"),
    ("x = Path(__file__).parent.parent.parent", "climbed 3 folders"),
    ("x = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))", "climbed 3 folders"),
    ("SPEC = '../" "shared/spec/kimi-k3-architecture.md'", "'../'"),  # split: a grep for the pattern finds real uses
    ("p = Path('data') / '..' / '..'", "component '..'"),
    ("p = os.path.join(here, '..', 'x')", "component '..'"),
    ("p = Path('..') / 'shared'", "component '..'"),
    ("p = '/work/shared/golden'", "absolute path"),
    ("os.environ.get('" + _ENV_VAR + "')", "environment variable"),
    ("# see shared/spec/validation.md", "external 'shared/'"),
    ("# decode step (§4.9)", "§4.9 is not a section heading of docs/architecture.md"),
    ("# runs (§1.1, §7)", "§7 is not a section heading"),
    ("# range §1–3", "§3 is not a section heading"),
    ("# range §1–§3", "§3 is not a section heading"),
    ("# tiling (guide §3.1)", "§3.1 is not a section heading of docs/cute-dsl-notes.md"),
    ("# beware (pitfall 3)", "pitfall 3 is not an item"),
    ("# beware (guide pitfall 2)", "pitfall 2 is not an item"),
    ("# see docs/nowhere.md", "docs/nowhere.md does not exist"),
    ("# see docs/architecture.md#9-nothing", "has no heading #9-nothing"),
])
def test_checker_catches_a_planted_reference(fake_repo: Path, line: str, expect: str):
    bad = fake_repo / "kimik3" / "bad.py"
    bad.write_text('"""A module."""\n' + line + "\n", encoding="utf-8")
    problems = all_problems(fake_repo)
    assert problems, f"planted {line!r} was not caught"
    assert all(p.where == "kimik3/bad.py:2" for p in problems), problems
    assert any(expect in p.what for p in problems), problems


@pytest.mark.parametrize("link, expect", [
    ("[up](../../outside.md)", "leaves the repository"),
    ("[gone](missing.md)", "does not exist"),
    ("[bad anchor](architecture.md#1-nowhere)", "no such heading"),
    ("[self](#1-nowhere)", "no such heading"),
])
def test_checker_follows_markdown_links(fake_repo: Path, link: str, expect: str):
    doc = fake_repo / "docs" / "extra.md"
    doc.write_text(f"# Extra\n\nSee [top](architecture.md#1-top), [web](https://example.org/x.md) and {link}.\n",
                   encoding="utf-8")
    problems = all_problems(fake_repo)
    assert problems and all(p.where == "docs/extra.md:3" for p in problems), problems
    assert any(expect in p.what for p in problems), problems


def test_checker_reads_notebook_cells(fake_repo: Path):
    nb = {"cells": [{"cell_type": "markdown", "source": ["# Title\n", "Numbers refer to shared/spec/x.md (§5).\n"]}],
          "metadata": {}, "nbformat": 4, "nbformat_minor": 5}
    (fake_repo / "notebooks").mkdir()
    (fake_repo / "notebooks" / "01_x.ipynb").write_text(json.dumps(nb), encoding="utf-8")
    problems = all_problems(fake_repo)
    assert {p.where for p in problems} == {"notebooks/01_x.ipynb [cell 0] line 2"}
    assert len(problems) == 2  # the outside path and the missing §5


def test_climb_limit_depends_on_the_file_depth(fake_repo: Path):
    (fake_repo / "tests").mkdir()
    (fake_repo / "tests" / "t.py").write_text("R = Path(__file__).resolve().parents[1]\n"
                                              "S = Path(__file__).resolve().parents[2]\n", encoding="utf-8")
    assert [p.where for p in all_problems(fake_repo)] == ["tests/t.py:2"]


def test_allowed_escape_is_exact(fake_repo: Path):
    (fake_repo / "tests").mkdir()
    (fake_repo / "tests" / "test_bad_inputs.py").write_text(
        'BAD = {"x": "../outside.safetensors"}\nWORSE = "../' 'shared/golden"\n', encoding="utf-8")
    problems = all_problems(fake_repo)
    assert problems and {p.where for p in problems} == {"tests/test_bad_inputs.py:2"}, problems
