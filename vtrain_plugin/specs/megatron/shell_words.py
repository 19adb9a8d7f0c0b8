"""Read a bash script into statements of words, without running it (the lexer of
:mod:`vtrain_plugin.specs.megatron.launch_script`).

``shlex`` drops the quoting that bash's expansion depends on (``$ARGS`` is split into words,
``"$ARGS"`` is not), so words are kept as parts: literal text, quoted or not, and ``$`` expansions
with the quoting they appeared in. Covered: comments, line continuations, single and double quotes,
backslash escapes, ``$NAME``, ``${...}``, ``$(...)``, ``$((...))`` and backquotes (kept whole, for the
expander), array assignments ``NAME=( ... )``, statement separators (newline ``;`` ``&&`` ``||`` ``|``
``&``), redirections (dropped with their target) and here-documents (skipped).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from vtrain_plugin.core.errors import ConfigError

SEPARATORS = ("&&", "||", ";;", "|&", ";", "|", "&", "\n")
REDIRECTIONS = ("<<-", "<<<", "<<", ">>", "&>>", "&>", ">&", "<&", ">|", "<>", ">", "<")
_NAME_ASSIGN = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)(\+?=)")


@dataclass(frozen=True, slots=True)
class Part:
    text: str
    quoted: bool  # inside single or double quotes, or escaped: never split into words
    expansion: bool  # a ``$...`` or backquoted expansion, kept whole


@dataclass(slots=True)
class Word:
    parts: list[Part] = field(default_factory=list)

    def literal(self) -> str | None:
        """The text of a word without expansions (quotes removed), else None."""
        if any(p.expansion for p in self.parts):
            return None
        return "".join(p.text for p in self.parts)


@dataclass(slots=True)
class Statement:
    line: int
    words: list[Word] = field(default_factory=list)
    arrays: dict[int, list[Word]] = field(default_factory=dict)  # word index of ``NAME=`` -> elements
    separator: str = ""  # the operator that ends it (``&&``, ``||``, ``;``, newline...; "" at the end)
    redirected: bool = False  # a redirection was dropped from it


class _Lexer:
    def __init__(self, text: str) -> None:
        self.text = text
        self.i = 0
        self.line = 1
        self.statements: list[Statement] = []
        self.heredocs: list[tuple[str, bool]] = []

    def error(self, message: str) -> ConfigError:
        return ConfigError(f"line {self.line}: {message}")

    def run(self) -> list[Statement]:
        statement = Statement(self.line)
        word: Word | None = None
        array: list[Word] | None = None
        while self.i < len(self.text):
            c = self.text[self.i]
            if self.text.startswith("\\\n", self.i):
                self.i += 2
                self.line += 1
                continue
            if c in " \t\r" or (c == "\n" and array is not None):
                self._end(word, statement, array)
                word = None
                self._newline(c)
                continue
            if c == "#" and word is None:
                end = self.text.find("\n", self.i)
                self.i = len(self.text) if end < 0 else end
                continue
            if array is not None and c == ")":
                self._end(word, statement, array)
                word, array = None, None
                self.i += 1
                continue
            if c == "(" and word is not None and array is None and _NAME_ASSIGN.match(word.literal() or "") \
                    and (word.literal() or "").endswith("="):
                statement.words.append(word)
                array = statement.arrays.setdefault(len(statement.words) - 1, [])
                word = None
                self.i += 1
                continue
            op = self._operator()
            if op is not None:
                if op in REDIRECTIONS and word is not None and (word.literal() or "x").isdigit():
                    word = None  # a file descriptor number: 2>&1
                self._end(word, statement, array)
                word = None
                if op in REDIRECTIONS:
                    self.i += len(op)
                    self._redirection(op)
                    statement.redirected = True
                    continue
                if statement.words:
                    statement.separator = op
                    self.statements.append(statement)
                self._newline(op)
                statement = Statement(self.line)
                continue
            if word is None:
                word = Word()
                if not statement.words:
                    statement.line = self.line
            word.parts.append(self._part())
        self._end(word, statement, array)
        if statement.words:
            self.statements.append(statement)
        return self.statements

    @staticmethod
    def _end(word: Word | None, statement: Statement, array: list[Word] | None) -> None:
        if word is not None:
            (array if array is not None else statement.words).append(word)

    def _newline(self, text: str) -> None:
        self.i += len(text)
        if text == "\n":
            self.line += 1
            while self.heredocs:
                self._skip_heredoc(*self.heredocs.pop(0))

    def _operator(self) -> str | None:
        """The operator at the cursor (not consumed); a parenthesis outside an array ends a statement."""
        for op in (*REDIRECTIONS, *SEPARATORS, "(", ")"):
            if self.text.startswith(op, self.i):
                return op
        return None

    def _redirection(self, op: str) -> None:
        """Drop the redirection's target word; remember a here-document's delimiter."""
        while self.i < len(self.text) and self.text[self.i] in " \t":
            self.i += 1
        target = Word()
        while self.i < len(self.text) and self.text[self.i] not in " \t\n;&|<>()":
            target.parts.append(self._part())
        if op in ("<<", "<<-"):
            self.heredocs.append(("".join(p.text for p in target.parts), op == "<<-"))

    def _skip_heredoc(self, delimiter: str, strip_tabs: bool) -> None:
        while self.i < len(self.text):
            end = self.text.find("\n", self.i)
            end = len(self.text) if end < 0 else end
            body = self.text[self.i:end]
            self.i = end + 1
            self.line += 1
            if (body.lstrip("\t") if strip_tabs else body) == delimiter:
                return

    def _part(self) -> Part:
        c = self.text[self.i]
        if c == "'":
            end = self.text.find("'", self.i + 1)
            if end < 0:
                raise self.error("unterminated single quote")
            text = self.text[self.i + 1:end]
            self.line += text.count("\n")
            self.i = end + 1
            return Part(text, quoted=True, expansion=False)
        if c == '"':
            return self._double_quoted()
        if c == "\\":
            self.i += 2
            return Part(self.text[self.i - 1:self.i], quoted=True, expansion=False)
        if c in "$`":
            return Part(self._expansion(), quoted=False, expansion=True)
        start = self.i
        while self.i < len(self.text) and self.text[self.i] not in " \t\r\n;&|<>()'\"\\$`":
            self.i += 1
        return Part(self.text[start:self.i], quoted=False, expansion=False)

    def _double_quoted(self) -> Part:
        """A double-quoted string as one part; its expansions are resolved by the expander."""
        self.i += 1
        out: list[str] = []
        while True:
            if self.i >= len(self.text):
                raise self.error("unterminated double quote")
            c = self.text[self.i]
            if c == '"':
                self.i += 1
                return Part("".join(out), quoted=True, expansion=True)
            if c == "\\" and self.i + 1 < len(self.text) and self.text[self.i + 1] in '$`"\\\n':
                if self.text[self.i + 1] == "\n":
                    self.line += 1
                else:
                    out.append("\\" + self.text[self.i + 1])
                self.i += 2
            elif c in "$`":
                out.append(self._expansion())
            else:
                self.line += c == "\n"
                out.append(c)
                self.i += 1

    def _expansion(self) -> str:
        """The source text of one expansion: ``$NAME``, ``${...}``, ``$(...)``, ``$((...))``, backquotes."""
        start = self.i
        if self.text[self.i] == "`":
            end = self.text.find("`", self.i + 1)
            if end < 0:
                raise self.error("unterminated backquote")
            self.i = end + 1
            return self.text[start:self.i]
        self.i += 1
        nxt = self.text[self.i:self.i + 1]
        if nxt in ("{", "("):
            self._balanced(nxt, "}" if nxt == "{" else ")")
        elif nxt.isalpha() or nxt == "_":
            while self.i < len(self.text) and (self.text[self.i].isalnum() or self.text[self.i] == "_"):
                self.i += 1
        elif nxt and nxt in "0123456789@*#?$!-":
            self.i += 1
        return self.text[start:self.i]

    def _balanced(self, opening: str, closing: str) -> None:
        depth = 0
        quote = None
        while self.i < len(self.text):
            c = self.text[self.i]
            self.line += c == "\n"
            self.i += 1
            if quote:
                quote = None if c == quote else quote
            elif c in "'\"":
                quote = c
            elif c == opening:
                depth += 1
            elif c == closing:
                depth -= 1
                if depth == 0:
                    return
        raise self.error(f"unterminated $ {opening}...{closing}")


def read_statements(text: str) -> list[Statement]:
    """The statements of a bash script, each a list of words with their parts (see the module doc)."""
    return _Lexer(text).run()


def assignment(word: Word) -> tuple[str, bool, Word] | None:
    """``(name, append, value)`` when ``word`` is ``NAME=value`` or ``NAME+=value``, else None."""
    if not word.parts or word.parts[0].quoted or word.parts[0].expansion:
        return None
    match = _NAME_ASSIGN.match(word.parts[0].text)
    if match is None:
        return None
    rest = word.parts[0].text[match.end():]
    value = Word(([Part(rest, quoted=False, expansion=False)] if rest else []) + word.parts[1:])
    return match.group(1), match.group(2) == "+=", value
