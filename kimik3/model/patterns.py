"""Module-name patterns read from a checkpoint (``quantization_config`` ``ignore`` / ``targets`` entries,
``re:`` + a regex) matched in time linear in the name: a hostile pattern such as ``(.*.*)*Z`` cannot make loading
backtrack without end, as Python's ``re`` would. Map: docs/architecture.md (map, model).

The syntax is the part of regular expressions such configs use: literals, ``.``, classes (``[a-z_]``, ``[^.]``),
escapes (``\\.``, ``\\d``, ``\\w``, ``\\s``), groups (``(...)``, ``(?:...)``), ``|``, ``*``, ``+``, ``?``, and ``^`` /
``$`` at the ends. Anything else (counted repeats, lookarounds, backreferences, flags) is refused by name, as is a
pattern over :data:`MAX_PATTERN` or nesting groups deeper than :data:`MAX_DEPTH`. Matching is ``re.match``'s:
anchored at the start, at the end only with ``$``.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["MAX_PATTERN", "Pattern", "compile_pattern"]

MAX_PATTERN = 512  # characters: real ignore entries are well under 200
MAX_DEPTH = 32  # nested groups: real patterns nest two or three; the parser recurses once per level
MAX_DFA = 4096  # memoised (state set, character) steps per pattern: the NFA simulated once per step, then looked up
_END = object()  # the test of a '$' state: passable only at the end of the name
_CLASSES = {"d": lambda c: c.isdigit(), "w": lambda c: c.isalnum() or c == "_", "s": lambda c: c.isspace()}


@dataclass
class _State:
    test: object = None  # a callable on one character; None: an epsilon state
    out: list[int] | None = None


class Pattern:
    """A compiled pattern: :meth:`match` is ``re.match(pattern, name) is not None``, in O(len(pattern) x len(name))."""

    def __init__(self, text: str) -> None:
        if not isinstance(text, str):
            raise ValueError(f"a module pattern must be a string, got {type(text).__name__}")
        if len(text) > MAX_PATTERN:
            raise ValueError(f"module pattern of {len(text)} characters (at most {MAX_PATTERN}): {text[:60]!r}...")
        self.text = text
        self._states: list[_State] = []
        self._pos = self._depth = 0
        self._src = text
        start, end = self._alternation()
        if self._pos != len(text):
            self._refuse(f"unbalanced ')' at position {self._pos}")
        self._start, self._accept = start, end

    # ------------------------------------------------------------------ parsing into a Thompson NFA
    def _refuse(self, why: str) -> None:
        raise ValueError(f"module pattern {self.text!r}: {why} (supported: literals, '.', [classes], \\d \\w \\s, "
                         "groups, '|', '*', '+', '?', '^' and '$' at the ends)")

    def _new(self, test: object = None) -> int:
        self._states.append(_State(test, []))
        return len(self._states) - 1

    def _link(self, a: int, b: int) -> None:
        self._states[a].out.append(b)

    def _peek(self) -> str | None:
        return self._src[self._pos] if self._pos < len(self._src) else None

    def _alternation(self) -> tuple[int, int]:
        branches = [self._sequence()]
        while self._peek() == "|":
            self._pos += 1
            branches.append(self._sequence())
        if len(branches) == 1:
            return branches[0]
        s, e = self._new(), self._new()
        for bs, be in branches:
            self._link(s, bs)
            self._link(be, e)
        return s, e

    def _sequence(self) -> tuple[int, int]:
        s = e = self._new()
        while self._peek() not in (None, "|", ")"):
            a, b = self._repeat()
            self._link(e, a)
            e = b
        return s, e

    def _repeat(self) -> tuple[int, int]:
        a, b = self._atom()
        op = self._peek()
        if op == "{":
            self._refuse("counted repeats {m,n} are not supported")
        if op not in ("*", "+", "?"):
            return a, b
        self._pos += 1
        if self._peek() in ("*", "+", "?"):
            self._refuse(f"a quantifier after {op!r} (lazy or possessive forms) is not supported")
        s, e = self._new(), self._new()
        self._link(s, a)
        self._link(b, e)
        if op in ("*", "?"):
            self._link(s, e)
        if op in ("*", "+"):
            self._link(b, a)
        return s, e

    def _atom(self) -> tuple[int, int]:
        c = self._src[self._pos]
        self._pos += 1
        if c == "(":
            if self._src.startswith("?:", self._pos):
                self._pos += 2
            elif self._peek() == "?":
                self._refuse("lookarounds, named groups and inline flags are not supported")
            if self._depth >= MAX_DEPTH:
                self._refuse(f"groups nested more than {MAX_DEPTH} deep")
            self._depth += 1
            inner = self._alternation()
            self._depth -= 1
            if self._peek() != ")":
                self._refuse("unclosed '('")
            self._pos += 1
            return inner
        if c in "*+?{":
            self._refuse(f"nothing to repeat before {c!r} at position {self._pos - 1}")
        if c == "^":  # a no-op where matching starts anyway: first in the pattern or in a top-level branch
            if not (self._depth == 0 and (self._pos == 1 or self._src[self._pos - 2] == "|")):
                self._refuse("'^' is supported only at the ends")
            s = self._new()
            return s, s
        if c == "$":  # the end of the name: last in a branch (before '|', ')' or the end of the pattern)
            if self._peek() not in (None, "|", ")"):
                self._refuse("'$' is supported only at the ends")
            s, e = self._new(_END), self._new()
            self._link(s, e)
            return s, e
        if c == "[":
            test = self._class()
        elif c == "\\":
            test = self._escape()
        elif c == ".":
            def test(ch: str) -> bool:
                return ch != "\n"
        else:
            def test(ch: str, lit: str = c) -> bool:
                return ch == lit
        s, e = self._new(test), self._new()
        self._link(s, e)
        return s, e

    def _escape(self) -> object:
        if self._pos >= len(self._src):
            self._refuse("a trailing backslash")
        c = self._src[self._pos]
        self._pos += 1
        if c in _CLASSES:
            return _CLASSES[c]
        if c.isalnum():
            self._refuse(f"the escape \\{c} is not supported")
        return lambda ch, lit=c: ch == lit

    def _class(self) -> object:
        negate = self._peek() == "^"
        if negate:
            self._pos += 1
        items: list[object] = []
        first = True
        while True:
            if self._pos >= len(self._src):
                self._refuse("unclosed '['")
            c = self._src[self._pos]
            if c == "]" and not first:
                self._pos += 1
                break
            first = False
            self._pos += 1
            if c == "\\":
                items.append(self._escape())
                continue
            if self._peek() == "-" and self._pos + 1 < len(self._src) and self._src[self._pos + 1] != "]":
                hi = self._src[self._pos + 1]
                self._pos += 2
                if hi < c:
                    self._refuse(f"the range {c}-{hi} is reversed")
                items.append(lambda ch, lo=c, up=hi: lo <= ch <= up)
            else:
                items.append(lambda ch, lit=c: ch == lit)
        return lambda ch: any(t(ch) for t in items) != negate

    # ------------------------------------------------------------------ simulation
    def _closure(self, states: set[int], at_end: bool) -> set[int]:
        stack, seen = list(states), set(states)
        while stack:
            s = stack.pop()
            test = self._states[s].test
            if test is None or (test is _END and at_end):
                for n in self._states[s].out:
                    if n not in seen:
                        seen.add(n)
                        stack.append(n)
        return seen

    def _step(self, cur: frozenset[int], ch: str, last: bool) -> frozenset[int]:
        """The state set after reading ``ch`` (``last``: it ends the name), memoised: a lazily built DFA, so a
        long list of names costs a dictionary lookup per character once the common steps are known."""
        key = (cur, ch, last)
        hit = self._dfa.get(key)
        if hit is None:
            nxt = {n for s in cur if self._states[s].test not in (None, _END) and self._states[s].test(ch)
                   for n in self._states[s].out}
            hit = frozenset(self._closure(nxt, last)) if nxt else frozenset()
            if len(self._dfa) < MAX_DFA:
                self._dfa[key] = hit
        return hit

    def match(self, name: str) -> bool:
        """Whether ``name`` starts with a match (``$`` matching only at its end)."""
        if not hasattr(self, "_dfa"):
            self._dfa: dict[tuple[frozenset[int], str, bool], frozenset[int]] = {}
            self._first = {end: frozenset(self._closure({self._start}, end)) for end in (False, True)}
        cur = self._first[not name]
        for i, ch in enumerate(name):
            if self._accept in cur:
                return True
            cur = self._step(cur, ch, i == len(name) - 1)
            if not cur:
                return False
        return self._accept in cur


def compile_pattern(text: str) -> Pattern:
    """:class:`Pattern` of ``text`` (the part after ``re:``); ``ValueError`` naming what is not supported."""
    return Pattern(text)
