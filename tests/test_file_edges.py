"""Files the commands read and write, at the edges a hostile probe found: an output path that is a device node,
a FIFO, a folder or a dangling symlink is refused naming it (never replaced, never a traceback); an input that is a
FIFO is refused instead of blocking the reader forever; a malformed design names its file."""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Callable
from pathlib import Path

import pytest

from kimik3.util.files import atomic_write_text, check_output_file, check_writable, read_json_file


@pytest.fixture
def fifo(tmp_path: Path) -> Path:
    p = tmp_path / "pipe"
    os.mkfifo(p)
    return p


@pytest.fixture
def alarm():
    def fire(*_: object) -> None:
        raise TimeoutError("blocked: a FIFO was opened")

    old = signal.signal(signal.SIGALRM, fire)
    signal.alarm(20)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, old)


def test_output_paths_that_are_not_regular_files_are_refused(tmp_path: Path, fifo: Path, alarm: None) -> None:
    dangling = tmp_path / "link"
    dangling.symlink_to(tmp_path / "missing")
    for path, why in ((Path("/dev/null"), "a device node"), (fifo, "a FIFO"), (tmp_path, "a directory"),
                      (dangling, "does not exist")):
        for fn in (check_output_file, check_writable, lambda p: atomic_write_text(p, "x")):
            with pytest.raises(ValueError, match=why):
                fn(path)
    assert dangling.is_symlink() and not (tmp_path / "missing").exists()
    for bad in ("", "."):
        with pytest.raises(ValueError, match="names no file"):
            check_output_file(bad)
    target = tmp_path / "real.json"
    target.write_text("old")
    (tmp_path / "good-link").symlink_to(target)
    atomic_write_text(tmp_path / "good-link", "new")  # a link to a regular file: the link is replaced
    assert target.read_text() == "old" and (tmp_path / "good-link").read_text() == "new"


def test_a_fifo_is_never_opened_for_reading(fifo: Path, alarm: None) -> None:
    with pytest.raises(ValueError, match="is not a regular file"):
        read_json_file(fifo, "design")
    from kimik3.perfmodel.data import load_constants, load_design

    design = fifo.parent / "design.json"
    os.mkfifo(design)
    with pytest.raises(ValueError, match="not a regular file"):
        load_design(design)
    with pytest.raises(ValueError, match="not a regular file"):
        load_constants(fifo)


def test_predict_on_a_fifo_design_says_so(fifo: Path, alarm: None, capsys: pytest.CaptureFixture) -> None:
    from kimik3.__main__ import main

    design = fifo.parent / "d.json"
    os.mkfifo(design)
    assert main(["predict", "--stage", "fused", "--design", str(design)]) == 2
    assert "not a regular file" in capsys.readouterr().err


@pytest.mark.parametrize("mutate, why", [
    (lambda d: d["megakernel"].pop("opcodes"), "malformed .*opcodes"),
    (lambda d: d["megakernel"]["opcodes"]["NORM_PROJ"]["streams"][0].pop("loads"), "malformed .*loads"),
    (lambda d: d["megakernel"].update(opcodes=[1, 2]), "malformed"),
])
def test_a_malformed_design_names_its_file(tmp_path: Path, mutate: Callable[[dict], object], why: str) -> None:
    from kimik3.perfmodel.data import PERF_DIR, load_design

    d = json.loads((PERF_DIR / "designs" / "v2.json").read_text())
    mutate(d)
    p = tmp_path / "bad.json"
    p.write_text(json.dumps(d))
    with pytest.raises(ValueError, match=rf"design {p}: {why}"):
        load_design(p)
