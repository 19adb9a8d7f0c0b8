"""Every example of README.md and docs/*.md runs, and every output they show is what the code prints.

Fenced blocks by info string: ``bash`` and ``python`` are run (bash from the repository root with
``vtrain`` as this checkout's CLI under ``set -e -o pipefail``, python as the ``__main__`` module of a
scratch folder; each ``vtrain`` and the python a process forked from the tests' zygote, where
torch and megatron-core are imported once: tests/support/zygote.py); ``console`` is a
transcript, ``$ vtrain ...`` lines followed by what the command printed (stdout and stderr as a
terminal shows them), each command run and its output compared with the one shown (``$ cd DIR``
moves the transcript's later commands, as in a shell). Blocks tagged
``gpu`` need a CUDA device: without one their ``vtrain`` commands are only parsed by the CLI's own
parser. ``python sketch`` needs the user's own training script and is skipped; ``bash setup`` (the
``make`` targets that install) is not run, its targets must exist. A bare or ``text`` fence holding
a command is an error, so no example escapes the test.

The transcripts of all pages run in one process (one import of torch and megatron-core, one trace
cache: the slow examples would otherwise pay both each) in a scratch folder where ``examples/`` and
``tests/`` are the repository's, each transcript with a calibration folder of its own (one that
calibrates does not move the next one's estimates). What the comparison
tolerates: ``...`` alone on a line stands for any number of lines (rows left out of a long table),
``...`` within a line for any text (a path of this machine); trailing blanks. Nothing else: numbers,
table shapes and messages must be the printed ones, so a shown output that drifts from the code fails.
"""

from __future__ import annotations

import difflib
import json
import os
import re
import shlex
import shutil
import socketserver
import subprocess
import sys
import threading
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
FENCE = re.compile(r"^```([^\n`]*)\n(.*?)^```$", re.M | re.S)
RUNNABLE = {"bash", "python"}
SHARED = ("examples", "tests")  # what transcripts name by relative path, seen from their scratch folder


def _blocks():
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        for m in FENCE.finditer(text):
            info = m.group(1).split()
            line = text.count("\n", 0, m.start()) + 1
            yield page.relative_to(REPO).as_posix(), line, info, m.group(2)


def _examples():
    for page, line, info, code in _blocks():
        if info and info[0] in RUNNABLE:
            yield pytest.param(info[0], info[1:], code, id=f"{page}:{line}")


def _transcript(code: str) -> list[tuple[str, list[str]]]:
    """A console block as (command, lines it printed) steps; a command may go on over lines ending in \\."""
    steps: list[tuple[str, list[str]]] = []
    lines = iter(code.splitlines())
    for line in lines:
        if line.startswith("$ "):
            command = line[2:]
            while command.endswith("\\"):
                command = command[:-1] + next(lines).strip()
            steps.append((command, []))
        else:
            assert steps, f"a console block starts with a '$ ' command, not {line!r}"
            steps[-1][1].append(line)
    return steps


def _transcripts():
    for page, line, info, code in _blocks():
        if info and info[0] == "console":
            yield f"{page}:{line}", info[1:], _transcript(code)


def _argv(command: str) -> list[str]:
    """The words of a transcript's command: ``vtrain ...`` or ``cd DIR``."""
    words = shlex.split(command, comments=True)
    assert words and (words[0] == "vtrain" or words[0] == "cd" and len(words) == 2), \
        f"a transcript runs vtrain commands (and cd) only, not {command!r}"
    return words


def _has_cuda() -> bool:
    """A CUDA device is present; torch (seconds to import) is asked only where a driver is."""
    if not (shutil.which("nvidia-smi") or Path("/dev/nvidia0").exists()):
        return False
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def _parses(code: str) -> None:
    """Each ``vtrain`` command of ``code`` is one the CLI's parser accepts."""
    from vtrain_plugin.cli import build_parser

    for line in code.replace("\\\n", " ").splitlines():
        line = line.removeprefix("$ ")
        if line.startswith("vtrain "):
            try:
                build_parser().parse_args(_argv(line)[1:])
            except SystemExit as exc:
                pytest.fail(f"{line!r} does not parse (exit {exc.code})")


def _environment(tmp_path: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
            "VTRAIN_EXAMPLE_OUT": str(tmp_path)}


# ``vtrain`` and ``python -m`` of the examples: hands its argv, working directory, environment and
# stdin to the test process (cli_socket) and prints what the command printed, exiting with its status.
_CLIENT = """
import json, os, socket, sys
request = {"module": sys.argv[1], "argv": sys.argv[2:], "cwd": os.getcwd(), "env": dict(os.environ),
           "input": sys.stdin.read()}
with socket.socket(socket.AF_UNIX) as s:
    s.connect(os.environ["VTRAIN_TEST_CLI_SOCKET"])
    s.sendall(json.dumps(request).encode() + b"\\n")
    answer = json.loads(s.makefile("rb").readline())
sys.stdout.write(answer["stdout"])
sys.stderr.write(answer["stderr"])
sys.exit(answer["returncode"])
"""


@pytest.fixture(scope="module")
def cli_socket(python_m, tmp_path_factory):
    """A socket on which an example's commands are run as ``python -m MODULE ARGS`` by conftest's
    ``python_m``: each a process of its own, forked from the zygote that imported torch and
    megatron-core once (a fresh interpreter would pay those imports per command). Yields the client
    script to run in their place, with the environment variable it connects by."""
    folder = tmp_path_factory.mktemp("cli")
    lock = threading.Lock()

    class Handler(socketserver.StreamRequestHandler):
        def handle(self):
            request = json.loads(self.rfile.readline())
            with lock:
                proc = python_m(request["module"], *request["argv"], cwd=request["cwd"], env=request["env"],
                                input=request["input"])
            answer = {"returncode": proc.returncode, "stdout": proc.stdout, "stderr": proc.stderr}
            self.wfile.write(json.dumps(answer).encode() + b"\n")

    server = socketserver.UnixStreamServer(str(folder / "socket"), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    client = folder / "client.py"
    client.write_text(_CLIENT, encoding="utf-8")
    yield client, {"VTRAIN_TEST_CLI_SOCKET": str(folder / "socket")}
    server.shutdown()
    server.server_close()
    thread.join()


@pytest.mark.parametrize("language, tags, code", list(_examples()))
def test_example_runs(language: str, tags: list[str], code: str, tmp_path: Path, request) -> None:
    if "sketch" in tags:
        pytest.skip("a sketch: needs the user's own training script")
    if "setup" in tags:
        targets = re.findall(r"^make ([a-z-]+)", code, re.M)
        makefile = (REPO / "Makefile").read_text(encoding="utf-8")
        assert targets and all(re.search(rf"^{t}:", makefile, re.M) for t in targets), targets
        return
    if "gpu" in tags and not _has_cuda():
        _parses(code)
        pytest.skip("needs a CUDA device: its commands parsed only")
    client, connect = request.getfixturevalue("cli_socket")
    # the commands run as separate processes forked from the zygote (see cli_socket), in the start-up
    # environment of the zygote (PYTHONPATH as the tests have it): the repository's packages imported
    env = {**os.environ, **connect, "VTRAIN_EXAMPLE_OUT": str(tmp_path)}
    if language == "bash":
        script = (f'set -e -o pipefail\nvtrain() {{ "{sys.executable}" -I -S "{client}" vtrain_plugin.cli "$@"; }}\n'
                  f'python() {{ PYTHONPATH="{_environment(tmp_path)["PYTHONPATH"]}" "{sys.executable}" "$@"; }}\n{code}')
        cmd = ["bash", "-c", script]
    else:  # as a module run from its folder: what a script's top-level code sees alike (``__name__``, sys.path[0])
        (tmp_path / "example.py").write_text(code, encoding="utf-8")
        cmd = [sys.executable, "-I", "-S", str(client), "example"]
    proc = subprocess.run(cmd, cwd=REPO if language == "bash" else tmp_path, env=env, capture_output=True, text=True,
                          timeout=600, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, f"exit {proc.returncode}\n--- stdout\n{proc.stdout[-3000:]}\n--- stderr\n{proc.stderr[-3000:]}"


# Runs the transcripts it reads as JSON on stdin (lists of commands) through the CLI's main(), in
# this one process, each from this folder with a calibration folder of its own, and writes
# [exit code, output] per command to the file named by its argument.
_RUNNER = """
import contextlib, io, json, logging, os, sys
from vtrain_plugin.cli import main
base, results = os.getcwd(), []
for number, transcript in enumerate(json.load(sys.stdin)):
    os.chdir(base)
    os.environ["VTRAIN_CALIBRATION_DIR"] = os.path.join(base, "calibrations", str(number))
    results.append([])
    for words in transcript:
        out = io.StringIO()
        logging.root.handlers.clear()  # main() binds its log handler to the stderr of the command
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            try:
                code = os.chdir(words[1]) or 0 if words[0] == "cd" else main(words[1:])
            except SystemExit as exc:
                code = exc.code
        results[-1].append([code, out.getvalue()])
with open(sys.argv[1], "w", encoding="utf-8") as f:
    json.dump(results, f)
"""


@pytest.fixture(scope="module")
def printed(tmp_path_factory) -> dict[str, list[tuple[int, str]]]:
    """What each command of every transcript printed, by transcript id."""
    folder = tmp_path_factory.mktemp("transcripts")
    for name in SHARED:
        (folder / name).symlink_to(REPO / name)
    runnable = [(ident, steps) for ident, tags, steps in _transcripts() if "gpu" not in tags]
    transcripts = [[_argv(command) for command, _ in steps] for _, steps in runnable]
    proc = subprocess.run([sys.executable, "-c", _RUNNER, str(folder / "results.json")], input=json.dumps(transcripts),
                          cwd=folder, env=_environment(folder), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads((folder / "results.json").read_text(encoding="utf-8"))
    return {ident: [tuple(step) for step in steps] for (ident, _), steps in zip(runnable, results, strict=True)}


def _pattern(shown: list[str]) -> re.Pattern:
    parts = [r"(?:[^\n]*\n)*?" if line.strip() == "..." else
             ".*?".join(map(re.escape, line.rstrip().split("..."))) + r"[ \t]*\n" for line in shown]
    return re.compile("".join(parts))


def _matches(shown: list[str], output: str) -> bool:
    actual = "".join(line.rstrip() + "\n" for line in output.splitlines())
    return _pattern(shown).fullmatch(actual) is not None


@pytest.mark.parametrize("ident, tags, steps", [pytest.param(*t, id=t[0]) for t in _transcripts()])
def test_transcript_prints_what_it_shows(ident: str, tags: list[str], steps, request) -> None:
    if "gpu" in tags and not _has_cuda():
        _parses("\n".join(command for command, _ in steps))
        pytest.skip("needs a CUDA device: its commands parsed only")
    for (command, shown), (code, output) in zip(steps, request.getfixturevalue("printed")[ident]):
        refused = bool(shown) and shown[-1].startswith("vtrain: error: ")
        assert code == (2 if refused else 0), f"$ {command}: exit {code}\n{output[-3000:]}"
        diff = "\n".join(difflib.unified_diff(shown, output.splitlines(), "shown", "printed", lineterm=""))
        assert _matches(shown, output), f"$ {command}: the output shown differs from the one printed\n{diff}"


def test_pattern_tolerates_only_ellipses_and_trailing_blanks() -> None:
    shown = ["a 1.0 at .../x.json", "...", "total 3  "]
    assert _matches(shown, "a 1.0 at /tmp/q/x.json\nrow\nrow\ntotal 3\n")
    assert _matches(shown, "a 1.0 at /x.json\ntotal 3")
    assert not _matches(shown, "a 1.1 at /tmp/x.json\ntotal 3\n")
    assert not _matches(shown, "a 1.0 at /tmp/x.json\ntotal 3\nmore\n")


def test_every_example_is_tagged() -> None:
    """A bare or ``text`` fence holding a command or Python would be an example nobody runs: tag it
    bash or python (run) or console (a transcript, run and compared)."""
    untagged = [f"{page}:{line}" for page, line, info, code in _blocks()
                if (not info or info[0] == "text") and re.match(r"\s*(\$ )?(vtrain |python |import |from \w+ import|make )", code)]
    assert not untagged, f"untagged examples (use ```bash, ```python or ```console): {untagged}"


def test_pages() -> None:
    """The manual's shape: README within 300 lines, at least five pages of docs, each linked from it."""
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    assert len(readme.splitlines()) <= 300
    pages = sorted(p.name for p in (REPO / "docs").glob("*.md"))
    assert len(pages) >= 5
    assert [p for p in pages if f"docs/{p}" not in readme] == []
