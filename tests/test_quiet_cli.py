"""Quiet command lines: compiler/autotune output (Python-level and from child processes) goes to a log file,
progress still reaches the terminal."""

from __future__ import annotations

import subprocess
import sys

from kimik3.util.clilog import compiler_output_to


def test_compiler_output_goes_to_the_log_and_progress_to_the_terminal(tmp_path, capfd):
    log = tmp_path / "logs" / "bench.log"
    with compiler_output_to(log) as terminal:
        sys.stderr.write("AUTOTUNE mm(64x64, 64x64)\n")  # how Inductor reports autotuning
        subprocess.run([sys.executable, "-c", "import sys; sys.stderr.write('g++ warning: from a child\\n')"],
                       check=True)
        terminal.write("bench: 3/10\n")
    print("the table")
    sys.stderr.write("after the block\n")
    out, err = capfd.readouterr()
    text = log.read_text()
    assert "AUTOTUNE mm" in text and "g++ warning: from a child" in text
    assert "AUTOTUNE" not in out + err and "g++" not in out + err
    assert "bench: 3/10" in err and "the table" in out and "after the block" in err
