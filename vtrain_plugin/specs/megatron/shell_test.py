"""Whether the condition of a launch script's ``if`` holds, when that is known without running the
script (used by :mod:`vtrain_plugin.specs.megatron.launch_script`).

A condition is decided when it is made of ``[ ... ]``, ``[[ ... ]]``, ``test``, ``true`` and ``false``
joined by ``&&``, ``||`` and ``!``, testing strings and integers (``=``, ``==``, ``!=``, ``-n``, ``-z``,
``-eq`` ... ``-ge``) whose words the script sets outside undecided blocks: ``USE_FP8=1; if [ "$USE_FP8" =
1 ]`` runs its branch. Anything else (files, patterns, commands, values from ``$(...)``) is undecided.
"""

from __future__ import annotations

from collections.abc import Sequence

from vtrain_plugin.specs.megatron.shell_expand import Environment, Text
from vtrain_plugin.specs.megatron.shell_words import Statement, Word

_INTEGER_TESTS = {"-eq": int.__eq__, "-ne": int.__ne__, "-lt": int.__lt__, "-le": int.__le__,
                  "-gt": int.__gt__, "-ge": int.__ge__}


def condition_holds(env: Environment, commands: Sequence[tuple[Statement, list[Word]]]) -> bool | None:
    """Whether the condition ``commands`` (each statement with its words, keywords removed) holds
    with the variables of ``env``; None when that is not known without running the script."""
    result: bool | None = False
    joiner = ";"
    for statement, words in commands:
        value = None if statement.redirected else _command(env, words)
        if joiner == "&&":
            result = False if result is False or value is False else None if None in (result, value) else True
        elif joiner == "||":
            result = True if result is True or value is True else None if None in (result, value) else False
        elif joiner in (";", "\n"):
            result = value
        else:
            return None  # a pipe or a background job
        joiner = statement.separator
    return result


def _command(env: Environment, words: list[Word]) -> bool | None:
    literals = [w.literal() for w in words]
    if literals[:1] == ["!"]:
        value = _command(env, words[1:])
        return None if value is None else not value
    if literals in (["true"], [":"]):
        return True
    if literals == ["false"]:
        return False
    if literals[:1] == ["[["] and literals[-1:] == ["]]"]:
        args, read = env.expand_command(words[1:-1], split=False)
        if _pattern(words[1:-1], args):
            return None
    elif (literals[:1] == ["["] and literals[-1:] == ["]"]) or literals[:1] == ["test"]:
        args, read = env.expand_command(words[1:-1] if literals[0] == "[" else words[1:])
    else:
        return None
    if read or any(arg.unknown for arg in args):
        return None  # a value set inside an undecided block, or not known
    return _test(list(args))


def _pattern(words: list[Word], args: list[Text]) -> bool:
    """Whether a ``[[ ... == right ]]`` compares with a pattern (unquoted ``*``, ``?`` or ``[``)."""
    if len(args) != 3 or args[1] not in ("=", "==", "!="):
        return False
    return any(c in args[2] for c in "*?[") and any(not part.quoted for part in words[2].parts)


def _test(args: list[str]) -> bool | None:
    """bash's ``test`` of its arguments, by their count; None where it tests files or is not that."""
    if args[:1] == ["!"] and len(args) in (2, 4):
        value = _test(args[1:])
        return None if value is None else not value
    if len(args) == 0:
        return False
    if len(args) == 1:
        return args[0] != ""
    if len(args) == 2:
        return {"-n": args[1] != "", "-z": args[1] == ""}.get(args[0])
    if len(args) == 3:
        left, op, right = args
        if op in ("=", "=="):
            return left == right
        if op == "!=":
            return left != right
        if op in _INTEGER_TESTS and all(_is_integer(a) for a in (left, right)):
            return _INTEGER_TESTS[op](int(left), int(right))
        if left == "!" and op not in _INTEGER_TESTS:
            value = _test(args[1:])
            return None if value is None else not value
    return None


def _is_integer(text: str) -> bool:
    return text.strip().lstrip("+-").isdigit()
