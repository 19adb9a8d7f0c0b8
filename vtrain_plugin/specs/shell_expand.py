"""Bash's expansion of the words of a script read by :mod:`vtrain_plugin.specs.shell_words`, without
running anything (used by :mod:`vtrain_plugin.specs.launch_script`).

``$NAME``, ``${NAME}``, ``${NAME:-default}`` (and ``-``, ``=``, ``+`` forms), ``${ARRAY[@]}`` and
``$(( integer arithmetic ))`` are expanded from the variables the script set before; unquoted
expansions are split into words on whitespace, ``"${ARRAY[@]}"`` gives one word per element. What
cannot be known without running the script (command substitutions, variables the script does not
set) stays as its own text. Each variable remembers the blocks (``if`` branches, loops) that set it,
so the reader can tell which blocks a command depends on.
"""

from __future__ import annotations

import ast
import operator
import re
from collections.abc import Callable, Sequence

from vtrain_plugin.specs.shell_words import Part, Word

_EXPANSION = re.compile(r"\\[$`\"\\]|\$\{[^}]*\}|\$\(\(.*?\)\)|\$\([^)]*\)|`[^`]*`|\$[A-Za-z_][A-Za-z0-9_]*|\$.")


class Unknown(str):
    """The text of an expansion whose value is not known without running the script; kept as one word."""


def _concat(left: str | None, right: str) -> str:
    """``left + right``, unknown if either part is."""
    text = (left or "") + right
    return Unknown(text) if isinstance(left, Unknown) or isinstance(right, Unknown) else text


def _joined(values: Sequence[str]) -> str:
    text = " ".join(values)
    return Unknown(text) if any(isinstance(v, Unknown) for v in values) else text


class Environment:
    """The variables of a script as it is read. Each variable also remembers the blocks (``if``
    branches, loops: ids given by the reader) whose assignments its value depends on."""

    def __init__(self) -> None:
        self.values: dict[str, list[str]] = {}
        self.blocks: dict[str, frozenset[int]] = {}
        self._read: set[int] = set()  # blocks behind the variables the current expansion read

    def assign(self, name: str, append: bool, value: Word, elements: list[Word] | None, *,
               block: int | None) -> None:
        """``name=value``, ``name+=value`` or ``name=( elements )``, inside ``block`` (None: outside any)."""
        self._read = set() if block is None else {block}
        if elements is not None:
            new = [f for word in elements for f in self._fields(word, split=True)]
        else:
            new = self._fields(value, split=False)[:1] or [""]
        if append and name in self.values:
            old = self.values[name]
            new = old + new if elements is not None else old[:-1] + [(old[-1] if old else "") + new[0]]
            self._read |= self.blocks.get(name, frozenset())
        self.values[name] = new
        self.blocks[name] = frozenset(self._read)

    def expand_command(self, words: Sequence[Word]) -> tuple[list[str], frozenset[int]]:
        """The words of a command after expansion, and the blocks behind the variables it read."""
        self._read = set()
        expanded = [f for word in words for f in self._fields(word, split=True)]
        return expanded, frozenset(self._read)

    def _fields(self, word: Word, *, split: bool) -> list[str]:
        """Bash's expansion of one word: unquoted expansions are split on whitespace when ``split``
        (never in an assignment), and ``"${ARRAY[@]}"`` gives one word per element."""
        fields: list[str] = []
        current: str | None = None

        def flush() -> None:
            nonlocal current
            if current is not None:
                fields.append(current)
            current = None

        for part in word.parts:
            if not part.expansion:
                current = _concat(current, part.text)
                continue
            pieces = self._expand_part(part)
            if not split:
                current = _concat(current, _joined(pieces))
            elif part.quoted:
                for k, piece in enumerate(pieces):
                    if k:
                        flush()
                    current = _concat(current, piece)
            else:
                for k, piece in enumerate(pieces):
                    if k or piece[:1].isspace():
                        flush()
                    for t, token in enumerate([piece] if isinstance(piece, Unknown) else piece.split()):
                        if t:
                            flush()
                        current = _concat(current, token)
                    if piece[-1:].isspace():
                        flush()
        flush()
        return fields

    def _expand_part(self, part: Part) -> list[str]:
        """The values a part expands to: one string, or the elements of ``${ARRAY[@]}``."""
        if not part.quoted:
            return self._expansion(part.text)
        values = [""]
        position = 0
        for match in _EXPANSION.finditer(part.text):
            values[-1] = _concat(values[-1], part.text[position:match.start()])
            token = match.group()
            if token.startswith("\\"):
                values[-1] = _concat(values[-1], token[1:])
            else:
                expanded = self._expansion(token)
                values[-1] = _concat(values[-1], expanded[0] if expanded else "")
                values.extend(expanded[1:])
            position = match.end()
        values[-1] = _concat(values[-1], part.text[position:])
        return values

    def _expansion(self, token: str) -> list[str]:
        if token.startswith("$((") and token.endswith("))"):
            value = _arithmetic(token, self._scalar)
            return [Unknown(token) if value is None else value]
        if token.startswith(("$(", "`")):
            return [Unknown(token)]  # a command substitution: never run
        inner = token[2:-1] if token.startswith("${") else token[1:]
        match = re.fullmatch(r"([A-Za-z_][A-Za-z0-9_]*|[0-9]+)(\[[@*]\])?(?:(:?[-=+])(.*))?", inner, re.S)
        if match is None:
            return [Unknown(token)]
        name, index, op, default = match.groups()
        value = self._lookup(name)
        if op is not None:
            unset = value is None or (op.startswith(":") and value in ([], [""]))
            if op.endswith("+"):
                return [] if unset else [self._expand_default(default)]
            if unset:
                return [self._expand_default(default)]
        if value is None:
            return [Unknown(token)]
        if index == "[*]":
            return [_joined(value)]
        return value if index else value[:1]

    def _expand_default(self, text: str) -> str:
        return " ".join(self._expand_part(Part(text.strip('"'), quoted=True, expansion=True)))

    def _lookup(self, name: str) -> list[str] | None:
        self._read |= self.blocks.get(name, frozenset())
        return self.values.get(name)

    def _scalar(self, name: str) -> str | None:
        value = self._lookup(name)
        return value[0] if value else None


_OPERATORS: dict[type, Callable[..., int]] = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
                                    ast.Div: operator.floordiv, ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod,
                                    ast.USub: operator.neg, ast.UAdd: operator.pos}


def _arithmetic(token: str, scalar: Callable[[str], str | None]) -> str | None:
    """Bash integer arithmetic ``$(( ... ))`` over + - * / %, with variables; None if not that."""
    expression = token[3:-2].strip()
    names = re.sub(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)\}?", r"\1", expression)
    substituted = re.sub(r"[A-Za-z_][A-Za-z0-9_]*", lambda m: scalar(m.group()) or "x", names)
    if len(substituted) > 200 or not re.fullmatch(r"[0-9+\-*/%() \t]*", substituted):
        return None
    try:
        return str(_evaluate(ast.parse(substituted.replace("/", "//"), mode="eval").body))
    except (SyntaxError, ZeroDivisionError, KeyError, ValueError):
        return None


def _evaluate(node: ast.AST) -> int:
    if isinstance(node, ast.Constant) and isinstance(node.value, int):
        return node.value
    if isinstance(node, ast.BinOp):
        return _OPERATORS[type(node.op)](_evaluate(node.left), _evaluate(node.right))
    if isinstance(node, ast.UnaryOp):
        return _OPERATORS[type(node.op)](_evaluate(node.operand))
    raise ValueError(f"not integer arithmetic: {ast.dump(node)}")
