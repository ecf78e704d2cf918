"""Workshop mode: every exercise's check passes the reference solution, catches each known wrong answer with a
reason, reports an unattempted stub as such, and is wired into its notebook's check cell."""

from __future__ import annotations

import re

import pytest

from kimik3.notebook import workshop
from kimik3.notebook.runner import CI, DEFAULTS, NOTEBOOK_DIR

NAMES = list(workshop.EXERCISES)


@pytest.mark.parametrize("name", NAMES)
def test_right_answer_passes_and_wrong_answers_are_caught(name):
    ex = workshop.EXERCISES[name]
    right = workshop.grade(name, ex.solution)
    assert right.ok, right.message
    assert ex.wrong_answers, f"{name}: no wrong answer to prove the check can fail"
    for wrong in ex.wrong_answers:
        res = workshop.grade(name, wrong)
        assert not res.ok and res.attempted and len(res.message) > 30, (wrong.__name__, res)

    def stub(*args):
        raise NotImplementedError

    todo = workshop.grade(name, stub)
    assert not todo.ok and not todo.attempted and "reveal" in todo.message

    def broken(*args):
        return 1 / 0

    assert "ZeroDivisionError" in workshop.grade(name, broken).message


def test_check_solutions_mode_reveal_and_bad_names(capsys):
    assert workshop.check("step_lower_bound", solutions=True).ok
    assert "RIGHT" in capsys.readouterr().out
    assert "return max(" in workshop.reveal("step_lower_bound")
    with pytest.raises(ValueError, match="unknown exercise"):
        workshop.check("no-such-exercise", solutions=True)


@pytest.mark.parametrize("prefix", ["01", "02", "03", "04", "05"])
def test_every_notebook_01_to_05_has_wired_exercises(prefix):
    exs = workshop.exercises(prefix)
    assert 1 <= len(exs) <= 3
    src = next(NOTEBOOK_DIR.glob(f"{prefix}_*.py"))
    text = src.read_text()
    assert re.search(r"^solutions = False", text, re.M), f"{src.name}: no `solutions` parameter"
    for ex in exs:
        assert re.search(rf"workshop\.check\(\s*\"{ex.name}\"[^)]*solutions=solutions", text), (src.name, ex.name)
    # make run and CI execute with the solutions, so an executed notebook shows every check passing
    assert DEFAULTS[src.stem]["solutions"] is True and CI[src.stem]["solutions"] is True
