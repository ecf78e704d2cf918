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
    (["validate", "--threads", "0"], "--threads: must be a positive integer"),
    (["export", "--preset", "micro", "--out", "x", "--seed", str(2**70)], "--seed: must be in 0..9223372036854775807"),
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
