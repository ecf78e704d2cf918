"""Files the commands read and write, at the edges a hostile probe found: an output path that is a device node,
a FIFO, a folder or a dangling symlink is refused naming it (never replaced, never a traceback); an input that is a
FIFO is refused instead of blocking the reader forever; a malformed design names its file."""

from __future__ import annotations

import json
import os
import re
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


def _stream(d: dict) -> dict:
    return d["megakernel"]["opcodes"]["NORM_PROJ"]["streams"][0]


@pytest.mark.parametrize("mutate, why", [
    (lambda d: d["megakernel"].pop("opcodes"), r"megakernel: missing 'opcodes'"),
    (lambda d: _stream(d).pop("loads"), r"megakernel.opcodes.NORM_PROJ.streams\[0\]: missing 'loads'"),
    (lambda d: d["megakernel"].update(opcodes=[1, 2]), r"megakernel.opcodes: must be an object"),
    (lambda d: d["megakernel"].pop("threads"), r"megakernel: missing 'threads'"),
    (lambda d: d["megakernel"].update(threads={"value": 0}), r"megakernel.threads: must be an integer in 1..1024"),
    (lambda d: d["megakernel"].update(threads={"value": None}), r"megakernel.threads: must be an integer"),
    (lambda d: d["megakernel"].update(ctas_per_sm={"value": 0}), r"megakernel.ctas_per_sm: must be an integer"),
    (lambda d: d["megakernel"].update(stage_bytes={"value": 1e308}), r"megakernel.stage_bytes: must be an integer"),
    (lambda d: d["megakernel"].update(registers={"value": "many"}), r"megakernel.registers: must be an integer"),
    (lambda d: d["megakernel"].update(shared_bytes={"value": {"1": -5}}), r"megakernel.shared_bytes\[1\]"),
    (lambda d: d["megakernel"]["opcodes"].update(WARP_DRIVE={}),
     r"megakernel.opcodes: unknown opcode\(s\) 'WARP_DRIVE'"),
    (lambda d: _stream(d).update(threads=0), r"streams\[0\].threads: must be > 0"),
    (lambda d: _stream(d).update(bytes="-4096"), r"streams\[0\].bytes: must be >= 0"),
    (lambda d: _stream(d).update(bytes="1 < 2"), r"streams\[0\].bytes: .*a condition"),
    (lambda d: _stream(d).update(bytes="1/0"), r"streams\[0\].bytes: .*ZeroDivisionError"),
    (lambda d: _stream(d).update(bytes="min()"), r"streams\[0\].bytes: .*TypeError"),
    (lambda d: _stream(d).update(bytes="(" * 5000 + "1" + ")" * 5000),
     r"streams\[0\].bytes: .* \(10001 characters\) is longer than 1000 characters"),
    (lambda d: _stream(d).update(bytes="-" * 998 + "1"), r"streams\[0\].bytes: .*RecursionError"),
    (lambda d: _stream(d).update(bytes="*".join(["9" * 300] * 3)), r"streams\[0\].bytes: .*OverflowError"),
    (lambda d: d["megakernel"]["opcodes"]["NORM_PROJ"].update(issue_per_fma=0), r"issue_per_fma: must be > 0"),
    (lambda d: d.update(name="\x1b[31mEVIL"), r"name: must be a short plain name"),
    (lambda d: d["fused"]["families"]["gemv"]["kernels"][0].update(threads="0"), r"kernels\[0\].threads: must be"),
])
def test_a_malformed_design_names_its_file_and_field(tmp_path: Path, mutate: Callable[[dict], object],
                                                     why: str) -> None:
    from kimik3.perfmodel.data import PERF_DIR, load_design

    d = json.loads((PERF_DIR / "designs" / "v2.json").read_text())
    mutate(d)
    p = tmp_path / "bad.json"
    p.write_text(json.dumps(d))
    with pytest.raises(ValueError, match=rf"design {p}: ([\w.]+\.)?{why}") as err:
        load_design(p)
    assert len(str(err.value)) < 600


@pytest.mark.parametrize("stage, mutate, why", [
    ("megakernel", lambda d: _stream(d).update(bytes="weight_bytes / (rows - rows)"),
     r"opcode NORM_PROJ .*ZeroDivisionError"),
    ("megakernel", lambda d: _stream(d).update(threads="NT - NT"), r"opcode NORM_PROJ .*keeps 0 bytes in flight"),
    ("megakernel", lambda d: _stream(d).update(bytes="-weight_bytes"),
     r"opcode NORM_PROJ .*is -[\d.e+]+ here; a count"),
    ("fused", lambda d: d["fused"]["families"]["gemv"]["kernels"][0].update(threads="B - B"),
     r"fused family gemv kernel gemv .*must all be > 0"),
])
def test_a_design_that_fails_for_one_instruction_names_it(tmp_path: Path, capsys: pytest.CaptureFixture,
                                                          stage: str, mutate: Callable[[dict], object],
                                                          why: str) -> None:
    from kimik3.__main__ import main
    from kimik3.perfmodel.data import PERF_DIR

    d = json.loads((PERF_DIR / "designs" / "v2.json").read_text())
    mutate(d)
    p = tmp_path / "bad.json"
    p.write_text(json.dumps(d))
    assert main(["predict", "--stage", stage, "--design", str(p)]) == 2
    err = capsys.readouterr().err
    assert re.search(rf"predict: design v2: {why}", err), err
    assert "Traceback" not in err
