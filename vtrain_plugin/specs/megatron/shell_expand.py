"""Bash's expansion of the words of a script read by :mod:`vtrain_plugin.specs.megatron.shell_words`, without
running anything (used by :mod:`vtrain_plugin.specs.megatron.launch_script`).

``$NAME``, ``${NAME}``, ``${NAME:-default}`` (and the ``-``, ``=``, ``:=``, ``+`` forms, quotes inside the
default as bash reads them), ``${ARRAY[@]}`` and ``$(( integer arithmetic ))`` are expanded from the
variables the script set before; unquoted expansions are split into words on whitespace,
``"${ARRAY[@]}"`` gives one word per element.

A variable the script does not set is unset, as when bash runs the script in an empty environment
(``$SLURM_NNODES``, ``$PWD``, ``$HOME``), unless the reader is given it: it expands to nothing, so
``"${PWD}/x"`` is ``/x`` and an unquoted ``$UNSET`` alone drops its word. The script's arguments are
not given either: ``${1:-default}`` gives its default and ``"$@"`` nothing, but a bare ``$1`` (a path
the script is run with, in Megatron-LM's examples) stays as its own text, as does what cannot be
known without running the script (command substitutions ``$(...)``, arithmetic on such values): kept
as one word, never split. Each variable remembers the blocks (``if`` branches, loops) that set it, so
the reader can tell which blocks a command depends on.
"""

from __future__ import annotations

import ast
import operator
import re
from collections.abc import Callable, Iterator, Mapping, Sequence

from vtrain_plugin.specs.megatron.shell_words import Part, Word


class Text(str):
    """Expanded text with spans that word splitting keeps whole: text bash quoted inside a
    ``${NAME:-"default"}``, and ``unknown`` spans, expansions kept as their own text (these stay
    unknown when the text is stored in a variable)."""

    spans: tuple[tuple[int, int, bool], ...]  # (start, end, unknown)

    def __new__(cls, text: str = "", spans: tuple[tuple[int, int, bool], ...] = ()) -> Text:
        self = super().__new__(cls, text)
        self.spans = spans
        return self

    @property
    def unknown(self) -> bool:
        return any(unknown for _, _, unknown in self.spans)

    def stored(self) -> Text:
        """The text as a variable holds it: quoting is gone, unknown spans stay."""
        return Text(self, tuple(s for s in self.spans if s[2]))


def _unknown(token: str) -> Text:
    """An expansion not known without running the script: its own text, never split."""
    return Text(token, ((0, len(token), True),))


def _protected(text: str) -> Text:
    """Quoted text: word splitting leaves it whole."""
    return Text(text, ((0, len(text), False), *getattr(text, "spans", ())))


def _quote_end(text: str, i: int) -> int:
    """The index of the double quote that closes the one at ``text[i]`` (the length if none)."""
    j = i + 1
    while j < len(text) and text[j] != '"':
        if text[j] == "\\":
            j += 2
        elif text[j] == "$" and j + 1 < len(text):
            j = _token_end(text, j)
        else:
            j += 1
    return min(j, len(text))


def _cat(*pieces: str) -> Text:
    """The pieces joined, their spans moved along."""
    spans: list[tuple[int, int, bool]] = []
    offset = 0
    for piece in pieces:
        spans.extend((start + offset, end + offset, unknown)
                     for start, end, unknown in getattr(piece, "spans", ()))
        offset += len(piece)
    return Text("".join(pieces), tuple(spans))


def _joined(values: Sequence[str]) -> Text:
    return _cat(*(piece for k, value in enumerate(values) for piece in ((" ", value) if k else (value,))))


def _split(text: Text) -> tuple[list[Text], bool, bool]:
    """Bash's word splitting of an unquoted expansion on whitespace outside the kept spans: the
    fields, and whether the text starts and ends with a split (it joins no neighbouring text there)."""
    inside = [False] * len(text)
    for start, end, _ in text.spans:
        inside[start:end] = [True] * (end - start)
    breaks = [i for i, c in enumerate(text) if c in " \t\n" and not inside[i]]
    fields: list[Text] = []
    start = 0
    for i in [*breaks, len(text)]:
        if i > start:
            fields.append(Text(text[start:i], tuple((max(s, start) - start, min(e, i) - start, u)
                                                    for s, e, u in text.spans if s < i and e > start)))
        start = i + 1
    return fields, bool(breaks) and breaks[0] == 0, bool(breaks) and breaks[-1] == len(text) - 1


def _tokens(text: str) -> Iterator[tuple[str, str]]:
    """``(literal, token)`` pairs of double-quoted text: the literal text before each escape or ``$``
    expansion (nested braces and parentheses balanced); the last token is ""."""
    position = i = 0
    while i < len(text):
        c = text[i]
        if c == "\\" and i + 1 < len(text):
            yield text[position:i], text[i:i + 2]
            i = position = i + 2
        elif c == "$" and i + 1 < len(text) and (text[i + 1] in "{(" or text[i + 1].isalnum()
                                                  or text[i + 1] in "_@*#?$!-"):
            end = _token_end(text, i)
            yield text[position:i], text[i:end]
            i = position = end
        elif c == "`":
            close = text.find("`", i + 1)
            end = len(text) if close < 0 else close + 1
            yield text[position:i], text[i:end]
            i = position = end
        else:
            i += 1
    yield text[position:], ""


def _token_end(text: str, i: int) -> int:
    """The end of the ``$`` expansion starting at ``text[i]``."""
    opening = text[i + 1]
    if opening in "{(":
        closing = "}" if opening == "{" else ")"
        depth, quote = 0, None
        for j in range(i + 1, len(text)):
            c = text[j]
            if quote:
                quote = None if c == quote else quote
            elif c in "'\"" and opening == "{":
                quote = c
            elif c == opening:
                depth += 1
            elif c == closing:
                depth -= 1
                if depth == 0:
                    return j + 1
        return len(text)
    if opening.isalpha() or opening == "_":
        match = re.compile(r"[A-Za-z0-9_]*").match(text, i + 1)
        return match.end() if match else i + 2
    return i + 2


_PARAMETER = re.compile(r"([A-Za-z_][A-Za-z0-9_]*|[0-9]+|[@*#?$!-])(\[[@*]\])?(?:(:?[-=+?])(.*))?", re.S)
_POSITIONAL = re.compile(r"[1-9][0-9]*")


class Environment:
    """The variables of a script as it is read. Each variable also remembers the blocks (``if``
    branches, loops: ids given by the reader) whose assignments its value depends on."""

    def __init__(self, variables: Mapping[str, str] | None = None) -> None:
        self.values: dict[str, list[Text]] = {name: [Text(value)] for name, value in (variables or {}).items()}
        self.blocks: dict[str, frozenset[int]] = {}
        self._read: set[int] = set()  # blocks behind the variables the current expansion read

    def assign(self, name: str, append: bool, value: Word, elements: list[Word] | None, *,
               blocks: frozenset[int] = frozenset()) -> None:
        """``name=value``, ``name+=value`` or ``name=( elements )``, inside ``blocks`` (none: outside any)."""
        self._read = set(blocks)
        if elements is not None:
            new = [f.stored() for word in elements for f in self._fields(word, split=True)]
        else:
            new = [f.stored() for f in self._fields(value, split=False)[:1]] or [Text()]
        if append and name in self.values:
            old = self.values[name]
            new = old + new if elements is not None else old[:-1] + [_cat(old[-1] if old else "", new[0])]
            self._read |= self.blocks.get(name, frozenset())
        self.values[name] = new
        self.blocks[name] = frozenset(self._read)

    def expand_command(self, words: Sequence[Word], *, split: bool = True) -> tuple[list[Text], frozenset[int]]:
        """The words of a command after expansion (each word one field when not ``split``, as inside
        ``[[ ]]``), and the blocks behind the variables it read."""
        self._read = set()
        expanded = [f for word in words for f in self._fields(word, split=split)]
        return expanded, frozenset(self._read)

    def _fields(self, word: Word, *, split: bool) -> list[Text]:
        """Bash's expansion of one word: unquoted expansions are split on whitespace when ``split``
        (never in an assignment), and ``"${ARRAY[@]}"`` gives one word per element."""
        fields: list[Text] = []
        current: Text | None = None

        def flush() -> None:
            nonlocal current
            if current is not None:
                fields.append(current)
            current = None

        def add(text: str) -> None:
            nonlocal current
            current = _cat(current or "", text)

        for part in word.parts:
            if not part.expansion:
                add(part.text)
                continue
            pieces = self._expand_part(part)
            if not split:
                add(_joined(pieces))
            elif part.quoted:
                for k, piece in enumerate(pieces):
                    if k:
                        flush()
                    add(piece)
            else:
                for k, piece in enumerate(pieces):
                    if k:
                        flush()
                    words, leading, trailing = _split(piece)
                    if leading:
                        flush()
                    for t, field in enumerate(words):
                        if t:
                            flush()
                        add(field)
                    if trailing:
                        flush()
        if not split and current is None:
            current = Text()
        flush()
        return fields

    def _expand_part(self, part: Part) -> list[Text]:
        """The values a part expands to: one text, or the elements of ``${ARRAY[@]}`` (none for
        ``"${EMPTY[@]}"``, as bash)."""
        if not part.quoted:
            return self._expansion(part.text, quoted=False)
        values = [Text()]
        for literal, token in _tokens(part.text):
            values[-1] = _cat(values[-1], literal)
            if token.startswith("\\"):
                values[-1] = _cat(values[-1], token[1:] if token[1] in '$`"\\' else token)
            elif token:
                expanded = self._expansion(token, quoted=True)
                if not expanded and token == part.text:
                    return []
                values[-1] = _cat(values[-1], expanded[0] if expanded else "")
                values.extend(expanded[1:])
        return values

    def _expansion(self, token: str, *, quoted: bool) -> list[Text]:
        if token.startswith("$((") and token.endswith("))"):
            value = self._arithmetic(token[3:-2])
            return [_unknown(token) if value is None else Text(value)]
        if token.startswith(("$(", "`")):
            return [_unknown(token)]  # a command substitution: never run
        inner = token[2:-1] if token.startswith("${") else token[1:]
        match = _PARAMETER.fullmatch(inner)
        if match is None:
            return [_unknown(token)]
        name, index, op, default = match.groups()
        value = self._lookup(name)
        if op is not None:
            unset = value is None or (op.startswith(":") and value in ([], [""]))
            if op.endswith("+"):
                return [] if unset else [self._word(default, quoted=quoted)]
            if unset and op.endswith("?"):
                return [_unknown(token)]  # bash stops the script here
            if unset:
                text = self._word(default, quoted=quoted)
                if op.endswith("=") and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
                    self.values[name] = [text.stored()]
                    self.blocks[name] = frozenset(self._read)
                return [text]
        if value is None:
            if _POSITIONAL.fullmatch(name) or name in ("0", "$", "!", "?", "-"):
                return [_unknown(token)]  # the script's arguments, process ids: kept as text
            return [] if index or name in ("@", "*") else [Text("0" if name == "#" else "")]
        if index == "[*]":
            return [_joined(value)]
        return value if index else value[:1]

    def _word(self, text: str, *, quoted: bool) -> Text:
        """The word of a ``${NAME:-word}`` default as bash reads it: quotes removed, quoted text kept
        whole (word splitting leaves it alone), expansions expanded."""
        pieces: list[Text] = []
        i = 0
        while i < len(text):
            c = text[i]
            if c == '"':
                close = _quote_end(text, i)
                inner = _joined(self._expand_part(Part(text[i + 1:close], quoted=True, expansion=True)))
                pieces.append(inner if quoted else _protected(inner))
                i = close + 1
            elif c == "'" and not quoted:
                close = text.find("'", i + 1)
                close = len(text) if close < 0 else close
                pieces.append(_protected(text[i + 1:close]))
                i = close + 1
            elif c == "\\" and i + 1 < len(text):
                pieces.append(_protected(text[i + 1]))
                i += 2
            elif c == "$" or c == "`":
                token = next(_tokens(text[i:]))[1]
                pieces.append(_joined(self._expansion(token, quoted=quoted)) if token else Text(c))
                i += max(len(token), 1)
            else:
                pieces.append(Text(c))
                i += 1
        return _cat(*pieces)

    def _lookup(self, name: str) -> list[Text] | None:
        self._read |= self.blocks.get(name, frozenset())
        return self.values.get(name)

    def _arithmetic(self, expression: str) -> str | None:
        """Bash integer arithmetic ``$(( ... ))`` over + - * / %: ``$`` expansions first, then bare
        names (unset ones are 0, as in bash); None if not that."""
        expanded = _cat(*(piece for literal, token in _tokens(expression)
                          for piece in (literal, _joined(self._expansion(token, quoted=True)) if token else "")))
        if expanded.unknown:
            return None

        def name(match: re.Match[str]) -> str:
            value = self._lookup(match.group())
            return "0" if not value or value[0] == "" else value[0]

        substituted = re.sub(r"[A-Za-z_][A-Za-z0-9_]*", name, str(expanded)).strip()
        if len(substituted) > 200 or not re.fullmatch(r"[0-9+\-*/%() \t]*", substituted):
            return None
        try:
            return str(_evaluate(ast.parse(substituted.replace("/", "//"), mode="eval").body))
        except (SyntaxError, ZeroDivisionError, KeyError, ValueError):
            return None


_OPERATORS: dict[type, Callable[..., int]] = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
                                    ast.Div: operator.floordiv, ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod,
                                    ast.USub: operator.neg, ast.UAdd: operator.pos}


def _evaluate(node: ast.AST) -> int:
    if isinstance(node, ast.Constant) and isinstance(node.value, int):
        return node.value
    if isinstance(node, ast.BinOp):
        return _OPERATORS[type(node.op)](_evaluate(node.left), _evaluate(node.right))
    if isinstance(node, ast.UnaryOp):
        return _OPERATORS[type(node.op)](_evaluate(node.operand))
    raise ValueError(f"not integer arithmetic: {ast.dump(node)}")
