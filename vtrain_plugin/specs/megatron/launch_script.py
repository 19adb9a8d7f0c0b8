"""The training command of a launch script: the Megatron-LM arguments, and the GPU count torchrun gives.

A launch script is read, never run. Its statements (:mod:`vtrain_plugin.specs.megatron.shell_words`) are
walked in order: assignments (``NAME=value``, ``NAME+=value``, arrays ``NAME=( ... )``, ``export``)
set variables, and the training command is the one that runs a ``.py`` file through ``torchrun``,
``python -m torch.distributed.run`` (or ``.launch``) or ``python``. Its words are expanded as bash
does (:mod:`vtrain_plugin.specs.megatron.shell_expand`), in an environment that holds only the variables the
caller gives: ``$SLURM_NNODES`` is unset unless given. What cannot be known without running the
script (command substitutions ``$(...)``, the script's arguments ``$1``...) stays as its own text, so
a flag that needs it reports that text.

An ``if`` branch whose condition is decided by the script's own settings
(:mod:`vtrain_plugin.specs.megatron.shell_test`: ``USE_FP8=1; if [ "$USE_FP8" = 1 ]``) runs or not as in bash.
Whether any other block (``if`` on files or commands, ``for``, ``while``, ``case``) runs is not known
without running the script: a training command inside one is refused; one that reads variables set
inside such blocks is read once for each way those blocks may run or not, and the caller checks that
every reading gives the same plan (a block that only adds logging flags is harmless; one that adds
``--fp8-format`` is not).
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path, PurePosixPath

from vtrain_plugin.core import checks as v
from vtrain_plugin.core.errors import ConfigError
from vtrain_plugin.specs.megatron.shell_expand import Environment
from vtrain_plugin.specs.megatron.shell_test import condition_holds
from vtrain_plugin.specs.megatron.shell_words import Statement, Word, assignment, read_statements

_OPENERS = {"if", "for", "while", "until", "case", "select"}
_BRANCHES = {"elif", "else"}
_CLOSERS = {"fi", "done", "esac"}
_KEYWORDS = _OPENERS | _BRANCHES | _CLOSERS | {"then", "do", "!", "{", "}", "exec", "time", "nohup"}
_DECLARATIONS = {"export", "declare", "typeset", "local", "readonly"}
MAX_BLOCKS = 6  # blocks a training command may depend on: each doubles the command lines to compare
_PYTHON = re.compile(r"^python[0-9.]*$")


@dataclass(frozen=True, slots=True, kw_only=True)
class LaunchCommand:
    """A training command: the Megatron-LM arguments and torchrun's node and process counts as written."""

    megatron_args: tuple[str, ...]
    script: str = ""  # the .py file the launcher runs ("": the words had no launcher)
    nnodes: str | None = None
    nproc_per_node: str | None = None
    line: int = 0  # where the command starts in its script (0: not from a script)
    blocks: tuple[int, ...] = ()  # lines of the blocks whose assignments the command reads

    def num_gpus(self, gpus: int | None) -> tuple[int, str | None]:
        """The GPU count, and a note when ``gpus`` (``--gpus``) overrides the script's: torchrun's
        ``--nnodes`` x ``--nproc-per-node`` as written, else ``gpus``. A ``--gpus`` other than the
        script's count is taken (a script is often written for one node and run on many) and noted; a
        count inside an elastic ``--nnodes MIN:MAX`` range is one the script allows."""
        if gpus is not None:
            v.positive_int("--gpus", gpus)
        if self.nnodes is None and self.nproc_per_node is None:
            if gpus is None:
                raise ConfigError("the GPU count is unknown: give --gpus N (or torchrun --nnodes and "
                                  "--nproc-per-node in the script)")
            return gpus, None
        nproc = "1" if self.nproc_per_node is None else self.nproc_per_node
        nnodes = "1" if self.nnodes is None else self.nnodes
        where = f"torchrun --nnodes {nnodes or '(empty)'} x --nproc-per-node {nproc or '(empty)'}"
        counts = [_count(n) for n in nnodes.split(":")]
        per_node = _count(nproc)
        if per_node is None or len(counts) > 2 or None in counts:
            if gpus is None:
                raise ConfigError(f"the GPU count is unknown: {where} is not a product of whole numbers; give --gpus N")
            return gpus, None
        low, high = counts[0], counts[-1]
        if per_node == 0 or low == 0:
            raise ConfigError(f"the GPU count must be positive: {where}")
        if low == high and gpus is None:
            return low * per_node, None
        if gpus is None:
            raise ConfigError(f"the GPU count is unknown: {where} is a range of nodes; give --gpus N")
        if gpus % per_node == 0 and low <= gpus // per_node <= high:
            return gpus, None
        nodes = f"{low} node{'s' if low > 1 else ''}" if low == high else f"{low} to {high} nodes"
        total = f" = {low * per_node}" if low == high else ""
        return gpus, f"--gpus {gpus} overrides the script's {nodes} x {per_node} GPUs{total}"


def _count(text: str) -> int | None:
    return int(text) if re.fullmatch(r"[0-9]{1,9}", text) else None


def launch_command(words: Sequence[str], *, line: int = 0) -> LaunchCommand:
    """Split a command line into its launcher (torchrun, python) and the script's arguments; words
    without a launcher are all Megatron-LM arguments."""
    words = list(words)
    start = next((i for i in range(len(words)) if _launcher(words, i)), None)
    if start is None:
        return LaunchCommand(megatron_args=tuple(words), line=line)
    script = next(i for i in range(start, len(words)) if words[i].endswith(".py"))
    options = _torchrun_options(words[start:script])
    return LaunchCommand(megatron_args=tuple(words[script + 1:]), script=words[script],
                         nnodes=options.get("nnodes"), nproc_per_node=options.get("nproc_per_node"), line=line)


def read_launch_script(text: str, env: Mapping[str, str] | None = None) -> tuple[LaunchCommand, ...]:
    """The training command of a bash launch script (see the module doc) run with the environment
    variables ``env`` (none by default): one command, or, when the command reads variables that
    ``if``/``for``/``while``/``case`` blocks set, one for each way those blocks may run or not that
    gives a different command line."""
    statements = read_statements(text)
    command, blocks = _training_command(statements, frozenset(), env)
    if len(blocks) > MAX_BLOCKS:
        raise ConfigError(f"line {command.line}: the training command depends on {len(blocks)} if/for/while/case "
                          f"blocks (lines {', '.join(map(str, command.blocks))}); vtrain reads at most {MAX_BLOCKS}")
    ids = sorted(blocks)
    variants: dict[tuple, LaunchCommand] = {}
    for mask in range(2 ** len(ids)):
        skip = frozenset(block for k, block in enumerate(ids) if mask >> k & 1)
        variant = _training_command(statements, skip, env)[0] if skip else command
        variants.setdefault((variant.megatron_args, variant.nnodes, variant.nproc_per_node),
                            replace(variant, blocks=command.blocks))
    return tuple(variants.values())


def read_command_line(text: str) -> LaunchCommand:
    """A command line as one string (``--megatron-args``): Megatron-LM arguments, with or without a
    launcher in front; line continuations and quotes as bash reads them, no variables set. Without a
    launcher, lines are joined (flags pasted over several lines)."""
    commands = [(line, words) for line, words, _ in _commands(read_statements(text), frozenset(), {}, None)]
    launches = [launch_command(words, line=line) for line, words in commands if _has_launcher(words)]
    if len(launches) > 1:
        raise ConfigError(f"expected one command line, got {len(launches)} training commands")
    if launches:
        return launches[0]
    return launch_command([word for _, words in commands for word in words])


def _training_command(statements: list[Statement], skip: frozenset[int], env: Mapping[str, str] | None
                      ) -> tuple[LaunchCommand, frozenset[int]]:
    """The training command when the blocks in ``skip`` do not run, and the blocks it depends on."""
    lines: dict[int, int] = {}
    found = [(launch_command(words, line=line), blocks)
             for line, words, blocks in _commands(statements, skip, lines, env) if _has_launcher(words)]
    if not found:
        raise ConfigError("no training command found: expected torchrun, python -m torch.distributed.run "
                          "or python running a .py script (such as pretrain_gpt.py)")
    pretrain = [f for f in found if PurePosixPath(f[0].script).name.startswith("pretrain")]
    candidates = pretrain or found
    if len(candidates) > 1:
        raise ConfigError(f"{len(candidates)} training commands found (lines "
                          f"{', '.join(str(c.line) for c, _ in candidates)}); keep one")
    command, blocks = candidates[0]
    return replace(command, blocks=tuple(sorted({lines[b] for b in blocks}))), blocks


@dataclass(frozen=True, slots=True)
class _Block:
    """An open block: its id, whether it runs (None: not known without running the script), and
    whether it is an ``if`` branch (loops and ``case`` are never decided)."""

    id: int
    runs: bool | None
    branch: bool


def _and(left: bool | None, right: bool | None) -> bool | None:
    return False if False in (left, right) else None if None in (left, right) else True


def _commands(statements: list[Statement], skip: frozenset[int], block_lines: dict[int, int],
              variables: Mapping[str, str] | None) -> Iterator[tuple[int, list[str], frozenset[int]]]:
    """Walk a script's statements: run its assignments, skip the blocks in ``skip`` and the ``if``
    branches whose condition is known to fail (blocks are numbered in order: each if/elif/else branch,
    loop and case; ``block_lines`` gets their lines), and yield each other command expanded, with its
    line and the undecided blocks behind the variables it read. ``variables``: the environment."""
    env = Environment(variables)
    stack: list[_Block] = []
    chains: list[bool | None] = []  # per open if: whether every branch so far is known not to run
    condition: list[tuple[Statement, list[Word]]] | None = None  # the if/elif condition being read
    for statement in statements:
        words = list(statement.words)
        indices = list(range(len(words)))
        if condition is not None and words[0].literal() != "then":
            condition.append((statement, words))
            continue
        while words and words[0].literal() in _KEYWORDS:
            keyword = words.pop(0).literal()
            indices.pop(0)
            if keyword == "then" and condition is not None:
                stack[-1] = _branch(env, stack, chains, condition)
                condition = None
            if keyword in _CLOSERS or (keyword in _BRANCHES and stack):
                stack = stack[:-1]
            if keyword == "fi" and chains:
                chains.pop()
            if keyword in _OPENERS or keyword in _BRANCHES:
                block_lines[len(block_lines) + 1] = statement.line
                stack.append(_Block(len(block_lines), None, keyword in ("if", "elif", "else")))
                if keyword == "if":
                    chains.append(True)
                if keyword in ("if", "elif"):
                    condition = [(statement, words)] if words else []
                    break
                if keyword == "else" and chains:
                    stack[-1] = _Block(stack[-1].id, chains[-1] if _decidable(stack) else None, True)
        if condition is not None or any(b.id in skip or b.runs is False for b in stack):
            continue
        undecided = frozenset(b.id for b in stack if b.runs is None)
        if words and words[0].literal() in _DECLARATIONS:
            keep = [k for k, w in enumerate(words) if k > 0 and not (w.literal() or "").startswith("-")]
            words, indices = [words[k] for k in keep], [indices[k] for k in keep]
        count = 0
        for word, index in zip(words, indices):
            parsed = assignment(word)
            if parsed is None:
                break
            count += 1
            env.assign(*parsed, statement.arrays.get(index), blocks=undecided)
        if count < len(words):
            expanded, blocks = env.expand_command(words[count:])
            if undecided and _has_launcher(expanded):
                raise ConfigError(f"line {statement.line}: the training command is inside an if/for/while/case "
                                  f"block (line {block_lines[max(undecided)]}) that vtrain cannot decide without "
                                  f"running the script; write the command outside the block")
            yield statement.line, expanded, blocks


def _decidable(stack: list[_Block]) -> bool:
    """Whether the innermost branch's condition may be decided: no loop or case around it."""
    return all(b.branch for b in stack)


def _branch(env: Environment, stack: list[_Block], chains: list[bool | None],
            condition: list[tuple[Statement, list[Word]]]) -> _Block:
    """The innermost if/elif branch once its condition is read: it runs when every earlier branch of
    its ``if`` is known not to run and its condition holds; the ``if`` remembers whether this one
    is known not to run."""
    holds = condition_holds(env, condition) if condition and _decidable(stack) else None
    earlier = chains[-1] if chains else None
    chains[-1:] = [_and(earlier, None if holds is None else not holds)]
    return _Block(stack[-1].id, _and(earlier, holds), True)


def _has_launcher(words: Sequence[str]) -> bool:
    return any(_launcher(words, i) for i in range(len(words)))


def _launcher(words: Sequence[str], i: int) -> bool:
    """Whether words[i] starts a launcher that runs a ``.py`` script later on the line."""
    name = PurePosixPath(words[i]).name
    if name != "torchrun" and not _PYTHON.match(name):
        return False
    return any(w.endswith(".py") for w in words[i + 1:])


def _torchrun_options(words: Sequence[str]) -> dict[str, str]:
    """``--nnodes`` and ``--nproc-per-node`` (either spelling, ``--opt value`` or ``--opt=value``); ""
    when the value is missing (``--nnodes $SLURM_NNODES`` with the variable unset)."""
    options: dict[str, str] = {}
    for i, word in enumerate(words):
        name, eq, value = word.partition("=")
        key = name.lstrip("-").replace("-", "_")
        if key in ("nnodes", "nproc_per_node") and name.startswith("--"):
            if eq:
                options[key] = value
            else:
                following = words[i + 1] if i + 1 < len(words) else ""
                options[key] = "" if following.startswith("-") else following
    return options


MAX_SCRIPT_BYTES = 1 << 20  # a launch script is a page of shell, not a megabyte


def read_launch_file(path: Path, env: Mapping[str, str] | None = None) -> tuple[LaunchCommand, ...]:
    """The training command of the launch script at ``path`` (at most 1 MiB of UTF-8 text) run with
    the environment variables ``env``."""
    try:
        with path.open("rb") as f:
            data = f.read(MAX_SCRIPT_BYTES + 1)
    except OSError as exc:
        raise ConfigError(f"cannot read: {exc.strerror or exc}") from None
    if len(data) > MAX_SCRIPT_BYTES:
        raise ConfigError(f"a launch script must be at most {MAX_SCRIPT_BYTES} bytes")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"not UTF-8 text (byte {exc.start})") from None
    return read_launch_script(text, env)
