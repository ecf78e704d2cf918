"""Every command checks its arguments before any work, with one shared set of types (``kimik3/util/args.py``):
nonsense the second probe found accepted (or only refused after setup, or with a traceback) is refused at parse
time with exit status 2 and one line naming the argument."""

from __future__ import annotations

import pytest

from kimik3.__main__ import main


@pytest.mark.parametrize("argv, says", [
    (["kernels", "list", "--batch", "0"], "--batch: must be positive integers"),
    (["kernels", "list", "--batch", ""], "--batch: must name at least one"),
    (["kernels", "list", "--preset", "bogus"], "unknown preset 'bogus'"),
    (["run-notebooks", "--only", ","], "--only: must name at least one"),
    (["bench", "--compile-mode", "bogus"], "--compile-mode: invalid choice"),
    (["bench", "--steps", "1000000000"], "--steps: must be in 1..100000"),
    (["bench", "--batch", "1,,2"], "--batch: has an empty item"),
    (["bench", "--out", "/dev/null"], "is a device node"),
    (["export", "--preset", "micro", "--out", ""], "--out: must name a folder"),
    (["validate", "--dtypes", "float64"], "unknown dtype(s) 'float64'"),
    (["validate", "--dtypes", "int8"], "unknown dtype(s) 'int8'"),
    (["validate", "--batch-sizes", "0"], "must be positive integers"),
    (["validate", "--batch-sizes", "-1"], "must be positive integers"),
    (["validate", "--seeds", str(2**64)], "--seeds: must be in 0..9223372036854775807"),
    (["validate", "--threads", "0"], "--threads: must be in 1..1024"),
    (["bogus"], "unknown command 'bogus'"),
    (["predict", "--preset", "kimi-k3", "--stage", "megakernel"], "more than the 141 GB of one h200"),
    (["predict", "--stage", "megakernel", "--batch", "1000000000"], "--batch: must be in 1..4096"),
    (["kernels", "build", "--arch", "sm_90a", "--out", ""], "--out: must name a folder"),
    (["validate", "--drift-tokens", "1000000000"], "--drift-tokens: must be in 0..100000"),
    (["export", "--preset", "micro", "--out", "x", "--seed", str(2**70)], "--seed: must be in 0..9223372036854775807"),
    (["evidence", "--out", "/dev/null"], "exists and is not a directory"),
    (["evidence", "--scope", ","], "--scope: must name at least one"),
    (["evidence", "--since", "no-such-revision"], "--since 'no-such-revision' is not a revision"),
    (["evidence", "--since", "HEAD", "--scope", "megakernel/nosuch"], "declared scope names no unit"),
    (["evidence", "--since", "HEAD", "--run", "--dry-run"], "not allowed with argument"),
])
def test_nonsense_is_refused_before_any_work(argv: list[str], says: str, capsys: pytest.CaptureFixture) -> None:
    try:
        code = main(argv)
    except SystemExit as e:  # argparse's own refusal
        code = e.code
    assert code == 2
    assert says in capsys.readouterr().err


def test_hardware_checks_its_output_before_measuring(capsys: pytest.CaptureFixture) -> None:
    from kimik3.perf.hardware import _main

    with pytest.raises(SystemExit) as e:
        _main(["--out", "/dev/null"])
    assert e.value.code == 2 and "is a device node" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        _main(["--threads", "0"])


def test_a_refusal_quoting_a_file_escapes_its_terminal_sequences(tmp_path, capsys: pytest.CaptureFixture) -> None:
    evil = tmp_path / "design\x1b]0;owned\x07\x1b[2J.json"
    evil.write_text("{not json")
    assert main(["predict", "--stage", "fused", "--design", str(evil)]) == 2
    err = capsys.readouterr().err
    assert "\x1b" not in err and "\x07" not in err
    assert "design\\x1b]0;owned\\x07\\x1b[2J.json" in err


def test_hardware_refuses_a_million_threads(capsys: pytest.CaptureFixture) -> None:
    from kimik3.perf.hardware import _main

    with pytest.raises(SystemExit) as e:
        _main(["--quick", "--threads", "1000000"])
    assert e.value.code == 2 and "--threads: must be in 1..1024" in capsys.readouterr().err


def _someone_elses(folder) -> dict:
    folder.mkdir()
    files = {"summary.json": '{"mine": true}', "manifest.json": '{"mine": true}', "notes.txt": "my notes"}
    for name, text in files.items():
        (folder / name).write_text(text)
    return files


@pytest.mark.parametrize("argv", [
    ["validate", "--quick", "--presets", "micro", "--no-ep", "--no-hazards", "--out", "{out}"],
    ["kernels", "build", "--arch", "sm_90a", "--preset", "micro", "--batch", "1", "--family", "router",
     "--out", "{out}"],
    ["export", "--preset", "micro", "--out", "{out}"],
])
def test_a_folder_of_someone_elses_files_is_refused_as_out(tmp_path, capsys: pytest.CaptureFixture,
                                                           argv: list[str]) -> None:
    out = tmp_path / "mine"
    files = _someone_elses(out)
    assert main([a.format(out=out) for a in argv]) == 2
    assert "is not empty and does not hold" in capsys.readouterr().err
    assert {f.name: f.read_text() for f in out.iterdir()} == files


@pytest.mark.parametrize("argv", [
    ["export", "--preset", "micro", "--out", "{out}"],
    ["run-notebooks", "--only", "01", "--out", "{out}"],
    ["validate", "--quick", "--out", "{out}"],
    ["kernels", "build", "--arch", "sm_90a", "--out", "{out}"],
])
def test_a_dangling_symlink_as_out_is_refused(tmp_path, capsys: pytest.CaptureFixture, argv: list[str]) -> None:
    out = tmp_path / "link"
    out.symlink_to(tmp_path / "nowhere" / "x")
    try:
        code = main([a.format(out=out) for a in argv])
    except SystemExit as e:
        code = e.code
    assert code == 2 and "which does not exist" in capsys.readouterr().err
    assert not (tmp_path / "nowhere").exists()


@pytest.mark.parametrize("argv", [["export", "--preset", "micro", "--out", "{out}"],
                                  ["validate", "--quick", "--out", "{out}"],
                                  ["bench", "--preset", "micro", "--out", "{out}/b.json"]])
def test_an_out_name_too_long_for_the_file_system_is_refused(tmp_path, capsys: pytest.CaptureFixture,
                                                            argv: list[str]) -> None:
    out = tmp_path / ("o" * 300)
    try:
        code = main([a.format(out=out) for a in argv])
    except SystemExit as e:
        code = e.code
    err = capsys.readouterr().err
    assert code == 2 and "File name too long" in err and "Traceback" not in err
