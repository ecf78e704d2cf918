"""A tiny, safe arithmetic language for the design files: ``"4 if bt <= 2 else 2"``, ``"cdiv(kvl, NT) * nope"``.

Why: a design (``data/perf/designs/*.json``) must be *data* — per-opcode loads in flight, loop trip counts — yet
those numbers depend on the instruction (its rows, heads, batch rows). Expressions over named symbols keep them
data without ``eval``: only numbers, names, + - * / // %, comparisons, ``and``/``or``/``not``, ``a if c else b``
and the functions below are accepted; anything else is a ``ValueError`` naming the expression.
"""

from __future__ import annotations

import ast
import math
from collections.abc import Mapping
from functools import lru_cache
from typing import Any

__all__ = ["evaluate", "amount", "check", "constant", "MAX_EXPR"]

_FUNCS = {"min": min, "max": max, "ceil": math.ceil, "floor": math.floor, "cdiv": lambda a, b: -(-a // b)}
_BIN = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b,
        ast.Div: lambda a, b: a / b, ast.FloorDiv: lambda a, b: a // b, ast.Mod: lambda a, b: a % b}
_CMP = {ast.Lt: lambda a, b: a < b, ast.LtE: lambda a, b: a <= b, ast.Gt: lambda a, b: a > b,
        ast.GtE: lambda a, b: a >= b, ast.Eq: lambda a, b: a == b, ast.NotEq: lambda a, b: a != b}


MAX_EXPR = 1000  # characters: the longest design expression is a few hundred; a bound keeps parsing cheap


def _shown(text: str) -> str:
    """The expression as a message quotes it: whole when short, its start otherwise."""
    return repr(text) if len(text) <= 120 else f"{text[:100]!r}... ({len(text)} characters)"


@lru_cache(maxsize=4096)
def _parse(text: str) -> ast.Expression:
    if len(text) > MAX_EXPR:
        raise ValueError(f"design expression {_shown(text)} is longer than {MAX_EXPR} characters")
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError as e:
        raise ValueError(f"design expression {_shown(text)} is not valid: {e.msg}") from None
    except (RecursionError, MemoryError):
        raise ValueError(f"design expression {_shown(text)} is nested too deeply") from None
    for node in ast.walk(tree):
        ok = isinstance(node, (ast.Expression, ast.Constant, ast.Name, ast.Load, ast.BinOp, ast.UnaryOp, ast.USub,
                               ast.UAdd, ast.Not, ast.Compare, ast.BoolOp, ast.And, ast.Or, ast.IfExp, ast.Call,
                               *_BIN, *_CMP))
        if isinstance(node, ast.Constant) and not isinstance(node.value, (int, float, bool)):
            ok = False
        if isinstance(node, ast.Call) and not (isinstance(node.func, ast.Name) and node.func.id in _FUNCS
                                               and not node.keywords):
            ok = False
        if not ok:
            raise ValueError(f"design expression {_shown(text)}: {type(node).__name__} is not allowed")
    return tree


def _eval(node: ast.AST, env: Mapping[str, Any], text: str) -> Any:
    if isinstance(node, ast.Expression):
        return _eval(node.body, env, text)
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.Name):
        if node.id in env:
            return env[node.id]
        raise ValueError(f"design expression {_shown(text)}: unknown name {node.id!r} "
                         f"(known: {', '.join(sorted(env))})")
    if isinstance(node, ast.BinOp):
        return _BIN[type(node.op)](_eval(node.left, env, text), _eval(node.right, env, text))
    if isinstance(node, ast.UnaryOp):
        v = _eval(node.operand, env, text)
        return -v if isinstance(node.op, ast.USub) else (+v if isinstance(node.op, ast.UAdd) else not v)
    if isinstance(node, ast.Compare):
        left = _eval(node.left, env, text)
        for op, right_node in zip(node.ops, node.comparators):
            right = _eval(right_node, env, text)
            if not _CMP[type(op)](left, right):
                return False
            left = right
        return True
    if isinstance(node, ast.BoolOp):
        vals = (_eval(v, env, text) for v in node.values)
        return all(vals) if isinstance(node.op, ast.And) else any(vals)
    if isinstance(node, ast.IfExp):
        return _eval(node.body if _eval(node.test, env, text) else node.orelse, env, text)
    if isinstance(node, ast.Call):
        return _FUNCS[node.func.id](*(_eval(a, env, text) for a in node.args))
    raise ValueError(f"design expression {text!r}: {type(node).__name__} is not allowed")  # pragma: no cover


def evaluate(expr: str | int | float, env: Mapping[str, Any]) -> float:
    """The value of a design entry: a number as is, a string evaluated over ``env``."""
    if isinstance(expr, bool):
        return float(expr)
    if isinstance(expr, (int, float)):
        return float(expr)
    if not isinstance(expr, str):
        raise ValueError(f"design entry must be a number or an expression string, got {expr!r}")
    try:
        v = _eval(_parse(expr), env, expr)
        if isinstance(v, bool):
            raise ValueError(f"design expression {_shown(expr)} is a condition (true or false), not a number")
        v = float(v)
    except (ArithmeticError, TypeError, RecursionError, MemoryError) as e:  # 1/0, min(), max(1), 9**999 as float
        raise ValueError(f"design expression {_shown(expr)}: {type(e).__name__}: {e}") from None
    if not math.isfinite(v):
        raise ValueError(f"design expression {_shown(expr)} evaluates to {v}, not a finite number")
    return float(v)


def amount(expr: str | int | float, env: Mapping[str, Any]) -> float:
    """:func:`evaluate` of a count or a size (bytes, trips): a negative value is a design error, not zero."""
    v = evaluate(expr, env)
    if v < 0:
        raise ValueError(f"design expression {_shown(str(expr))} is {v:g} here; a count or size must be >= 0")
    return v


def constant(expr: str | int | float) -> float | None:
    """The value of an entry that names no symbol (a number, or an expression of numbers alone); None otherwise."""
    try:
        return evaluate(expr, {})
    except ValueError as e:
        if "unknown name" in str(e):
            return None
        raise


def check(expr: str | int | float) -> None:
    """Parse without evaluating (load-time validation of a design file)."""
    if isinstance(expr, str):
        _parse(expr)
    elif not isinstance(expr, (int, float)):
        raise ValueError(f"design entry must be a number or an expression string, got {expr!r}")
