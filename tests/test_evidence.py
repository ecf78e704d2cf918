"""The evidence room (kimik3/evidence): units derived from the code cover every device and stage file, the results
file merges runs, every dossier has its sections and never an empty Unproven where something is unproven, and — on
a scratch copy of the repository — a planted unit without a test and a deleted planted-bug row fail ``--strict``,
while a change to one opcode family touches that unit alone and selects exactly its checks."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from kimik3.kernels.contracts.isa import Op
from kimik3.kernels.toolchain.source import OPS, kernel_source_hash

from kimik3.evidence import results as R
from kimik3.evidence.coverage import covering_tests, mutants
from kimik3.evidence.dossier import SECTIONS, dossier, status
from kimik3.evidence.units import ROOT, discover, dispatch_table, files_hash, unowned


@pytest.fixture(scope="module")
def units():
    return discover()


def test_units_come_from_the_code_and_own_every_device_and_stage_file(units):
    assert unowned(units) == []
    by = {u.name: u for u in units}
    # every opcode the VM dispatches belongs to exactly one family
    fam_ops = [op for u in units if u.kind == "opcode family" for op in u.opcodes]
    assert sorted(fam_ops) == sorted(dispatch_table()) and set(fam_ops) == {o.name for o in Op if o != Op.NOP}
    assert {u.op for u in units if u.kind == "fused kernel"} == {k for k, m in OPS.items() if m.startswith("fused.")}
    from kimik3 import stages

    assert {n for n in list(stages.STAGES) + list(stages._LAZY_STAGES)} == {
        u.name.split("/", 1)[1] for u in units if u.kind == "stage"} - {"interface"}
    gemv = by["fused/gemv"]
    assert gemv.hash == files_hash(gemv.files) and gemv.hash != by["fused/kda"].hash
    # a unit left out: its files are reported
    assert unowned([u for u in units if u.name != "megakernel/kda"]) == ["kernels/megakernel/kda.py"]


def test_results_file_merges_runs_and_refuses_a_malformed_one(tmp_path, monkeypatch):
    path = tmp_path / "runs" / "test-results.json"
    a = R.Recorder(path)
    a.add("tests/test_a.py::test_x", "call", "passed", 0.5)
    a.add("tests/test_a.py::test_y", "setup", "failed", 0.1)
    a.write()
    b = R.Recorder(path)
    b.add("tests/test_b.py::test_z", "call", "skipped", 0.0)
    b.write()
    data = R.read_results(path)
    assert {k: v["outcome"] for k, v in data["tests"].items()} == {
        "tests/test_a.py::test_x": "passed", "tests/test_a.py::test_y": "error", "tests/test_b.py::test_z": "skipped"}
    assert len(data["runs"]) == 2 and all("unit_hashes" in r for r in data["runs"].values())
    path.write_text("{not json")
    with pytest.raises(ValueError, match="test-results.json: not a readable results file"):
        R.read_results(path)


def test_every_dossier_has_its_sections_and_says_what_is_unproven(units):
    by = {u.name: u for u in units}
    empty = {"schema": 1, "runs": {}, "tests": {}}
    for name in ("fused/moe", "megakernel/moe", "stage/megakernel-cpu", "contract/isa"):
        d = dossier(by[name], units, empty)
        assert all(s in d for s in SECTIONS), name
        assert d["Unproven"] and status(d) in ("not recorded", "untested"), (name, d["Unproven"])
    d = dossier(by["megakernel/moe"], units, empty)
    assert set(d["Contract"]["opcodes"]) == {"EXPERT_GATE_UP", "EXPERT_DOWN"}
    assert d["Scope"]["prebuilt_hash"] == kernel_source_hash("megakernel") and d["Launch"]["threads"] == 384
    assert any("never run on a GPU" in x for x in d["Unproven"])
    assert d["Validation"]["mutants"] and all(m["test"].startswith("tests/") for m in d["Validation"]["mutants"])
    # a passing recorded run on the current source: only the GPU remains unproven
    tests = {f"{t}::test_ok": {"outcome": "passed", "duration_s": 0.1, "run": "r"}
             for t in covering_tests(by["megakernel/moe"])}
    ran = {"schema": 1, "tests": tests, "runs": {"r": {"commit": "c", "date": "d", "unit_hashes": {
        "megakernel/moe": by["megakernel/moe"].hash}}}}
    assert status(dossier(by["megakernel/moe"], units, ran)) == "CPU-proven, GPU-unproven"
    ran["runs"]["r"]["unit_hashes"]["megakernel/moe"] = "an older source"
    assert status(dossier(by["megakernel/moe"], units, ran)) == "stale"
    assert len(mutants()) > 60


# ------------------------------------------------------------------------------------------ a scratch repository
CHILD = textwrap.dedent("""
    import contextlib, importlib.machinery, io, json, sys
    # the editable install maps kimik3 onto the checkout: the scratch copy is imported instead
    sys.meta_path[:] = [f for f in sys.meta_path if "__editable__" not in getattr(f, "__module__", "")]
    sys.path.insert(0, sys.argv[1])
    import kimik3
    assert kimik3.__file__.startswith(sys.argv[1]), kimik3.__file__
    from kimik3.__main__ import main
    out = []
    for argv in json.loads(sys.argv[2]):
        buf, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(err):
            rc = main(argv)
        out.append({"argv": argv, "rc": rc, "out": buf.getvalue(), "err": err.getvalue()})
    print(json.dumps(out))
""")


def _scratch(tmp_path: Path) -> Path:
    """A copy of the working tree (tracked and unignored files) as a git repository of one commit."""
    files = subprocess.run(["git", "-C", str(ROOT), "ls-files", "-co", "--exclude-standard", "-z"],
                           capture_output=True, check=True).stdout.decode().split("\0")
    dst = tmp_path / "repo"
    for f in filter(None, files):
        src = ROOT / f
        if src.is_file():
            (dst / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst / f)
    env = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t"}
    for cmd in (["init", "-q"], ["add", "-A"], ["commit", "-q", "-m", "scratch"]):
        subprocess.run(["git", "-C", str(dst), *cmd], check=True, env={**os.environ, **env})
    return dst


def _run(repo: Path, *argvs: list[str]) -> list[dict]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    r = subprocess.run([sys.executable, "-c", CHILD, str(repo), json.dumps(list(argvs))], cwd=repo, env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def _commit(repo: Path, message: str) -> None:
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@t"}
    subprocess.run(["git", "-C", str(repo), "commit", "-qam", message], check=True, env=env)


def test_scratch_repo_strict_gaps_and_a_bounded_review(tmp_path, units):
    repo = _scratch(tmp_path)
    # plant: a contract module no test reaches; a planted-bug row deleted; one opcode family edited
    (repo / "kernels/contracts/planted.py").write_text('"""A planted contract."""\n\nPLANTED = 1\n')
    doc = repo / "docs/planted-bugs.md"
    victim = next(m for m in mutants() if "[mk-fp4-row-scale]" in m.test)
    lines = doc.read_text().splitlines(keepends=True)
    doc.write_text("".join(ln for ln in lines if "`...[mk-fp4-row-scale]`" not in ln))
    assert victim and doc.read_text() != "".join(lines)
    subprocess.run(["git", "-C", str(repo), "add", "-A"], check=True)
    _commit(repo, "plant gaps")
    misc = repo / "kernels/megakernel/misc.py"
    misc.write_text(misc.read_text() + "\n# an edit to one opcode family\n")
    strict, scoped, wide = _run(
        repo, ["evidence", "--out", str(tmp_path / "ev"), "--strict"],
        ["evidence", "--since", "HEAD", "--scope", "megakernel/misc", "--dry-run"],
        ["evidence", "--since", "HEAD", "--scope", "megakernel/kda"])
    assert strict["rc"] == 1
    assert "strict: contract/planted: untested" in strict["err"], strict["err"][-2000:]
    assert "planted mutant 'mk-fp4-row-scale' is in the tests but has no row" in strict["out"] + strict["err"]
    index = (tmp_path / "ev" / "index.html").read_text()
    assert "contract__planted.html" in index and "untested" in index
    # the review: one unit touched, exactly its checks, nothing flagged; a narrower declared scope is flagged
    out = scoped["out"]
    assert scoped["rc"] == 0 and "1 unit(s) touched" in out and "megakernel/misc: kernels/megakernel/misc.py" in out
    expected = sorted(covering_tests(next(u for u in units if u.name == "megakernel/misc")))
    command = next(line for line in out.splitlines() if " -m pytest -q " in line)
    assert command.split(" -m pytest -q ")[1].split() == expected
    assert wide["rc"] == 1 and "FLAGGED: the change touches units outside its declared scope: megakernel/misc" in \
        wide["out"]
    # the declared scope from a commit trailer
    _commit(repo, "edit misc\n\nEvidence-Scope: megakernel/kda")
    (trailer,) = _run(repo, ["evidence", "--since", "HEAD~1"])
    assert trailer["rc"] == 1 and "declared scope: megakernel/kda" in trailer["out"]


def test_evidence_never_writes_into_someone_elses_folder(tmp_path, capsys):
    from kimik3.__main__ import main

    (tmp_path / "notes.txt").write_text("mine")
    assert main(["evidence", "--out", str(tmp_path)]) == 2
    assert "notes.txt" in capsys.readouterr().err or (tmp_path / "notes.txt").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]
