"""Every command that README.md and examples/README.md document runs as written, after the README's quick start.

The commands are those of the files' code blocks. A shell block (an indented
block, or a fence whose info string is a shell: ``sh``, ``bash``,
``console``...) holds one command per line, backslash continuations joined,
``#`` comment lines dropped; where its lines are prompted with ``$ `` it is a
terminal session, and its prompted lines are one command run in one shell
(the output lines between them are not compared: they are examples). A
``python`` block is one program. Blocks of data (``toml``, ``json``...) hold
no command; a block of any other language fails the test until it is said
which it is.

Each command runs in bash (``-e -o pipefail``) with a hard timeout, killed
with everything it started, in a directory of its own that stands for a
checkout after the quick start: ``examples/`` is this tree's,
``.venv-daemon/bin`` and ``.venv/bin`` hold this environment's ``python``,
``hbmd`` and ``hbmctl`` (first on ``PATH`` too), and ``HOME`` is that
directory, so that ``~/.hbmd`` is the run directory of a host-backend daemon
that the test starts there as the quick start does (no ``--budget``: half of
the RAM, which no example may fill) and ``HBMD_RUN_DIR`` names. Commands run
two at a time, each with its own daemon and one torch thread. A command that cannot run here is
left out by :data:`NOT_RUN`, with its reason, and reported as skipped; a
command neither run nor left out cannot exist, and an entry of
:data:`NOT_RUN` that no file documents any more fails, so the list stays
true.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from hbmd.daemon.main import EXIT_INVARIANT_VIOLATED
from hbmd.testing.spawn import DaemonProcess

pytestmark = [pytest.mark.ipc, pytest.mark.torch]  # the documented examples and snippet are torch engines

ROOT = Path(__file__).resolve().parents[1]
DOCUMENTS = ("README.md", "examples/README.md")
COMMAND_TIMEOUT_S = 150
AT_ONCE = 2
"""Commands run at once: CI's cores. They are CPU-bound (Python and torch starting in every engine process)."""

SHELLS = {"", "sh", "bash", "shell", "console", "shell-session", "zsh"}
PROGRAMS = {"python": "python", "py": "python", "python3": "python"}
DATA = {"toml", "json", "yaml", "yml", "text", "txt", "ini"}

GPU_NODE = "needs a GPU (--device cuda); the GPU tier runs the modes in tests/test_example_engine.py"
NOT_RUN = {
    ("README.md", (
        "python3 -m venv .venv-daemon && .venv-daemon/bin/pip install -q . && "
        ".venv-daemon/bin/hbmd --backend auto --run-dir ~/.hbmd"
    )): (
        "the quick start's install (pip, from the network) and its daemon in the foreground: the test stands in for "
        "both, this environment for .venv-daemon and a daemon it starts with --backend host --run-dir ~/.hbmd"
    ),
    ("README.md", (
        "python3 -m venv .venv && .venv/bin/pip install -q torch==2.13.0 -e '.[torch,test]' && "
        ".venv/bin/python -m pytest -q"
    )): "installs torch and the test extras (pip, from the network), then runs the whole suite, this test included",
    ("README.md", "pip install /path/to/hbmd # a checkout or its wheel, in vLLM's environment: registers the plugin"):
        "pip, in vLLM's environment",
    ("README.md", "hbmd --device 0 --budget 90% & # or the hbmd@0 systemd unit"): "needs a GPU",
    ("README.md", "HBMD_VLLM=1 vllm serve MODEL --load-format hbmd # without HBMD_VLLM=1 the plugin does nothing"):
        "needs vLLM and a GPU",
    ("examples/README.md",
     "python examples/engine.py crash-resume --start-daemon --device cuda --config gpu --kv-share 1"): GPU_NODE,
    ("examples/README.md",
     "python examples/engine.py restart --start-daemon --device cuda --config gpu-large --kv-blocks 1024"): GPU_NODE,
    ("examples/README.md",
     "python examples/engine.py share-weights --start-daemon --device cuda --config gpu-large"): GPU_NODE,
    ("examples/README.md",
     "python examples/engine.py two-engines --start-daemon --device cuda --kv-share 0.5"): GPU_NODE,
    ("examples/README.md", (
        "python examples/engine.py two-engines --start-daemon --device cuda --daemon-config examples/tenants.toml "
        "--kv-share 1"
    )): GPU_NODE,
}
"""(file, command with its whitespace collapsed): why it does not run here."""


@dataclasses.dataclass(frozen=True)
class Block:
    """A code block of a document: the line its code starts on (1-based), its info string's first word, its lines."""

    path: str
    line: int
    language: str
    lines: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class Command:
    """One documented command: ``shell`` (a bash script) or ``python`` (a program), and where it is documented."""

    path: str
    line: int
    kind: str
    text: str

    @property
    def key(self) -> tuple[str, str]:
        return self.path, " ".join(self.text.replace("\\\n", " ").split())

    @property
    def id(self) -> str:
        return f"{self.path}:{self.line}"


FENCE = re.compile(r"^(?P<indent> *)(?P<fence>`{3,}|~{3,})\s*(?P<info>.*)$")
LIST_ITEM = re.compile(r"^(?P<marker> *(?:[-*+]|\d+[.)]) +)\S")


def code_blocks(path: str) -> list[Block]:
    """The fenced and indented code blocks of the Markdown file ``path`` (relative to the repository).

    Indented blocks are found as CommonMark finds them where lists are
    simple: four spaces past the enclosing list item's content, after a
    blank line.
    """
    lines = (ROOT / path).read_text().splitlines()
    blocks: list[Block] = []
    content_indent = 0  # where the current list item's text starts; 0 outside a list
    previous_blank = True
    i = 0
    while i < len(lines):
        line = lines[i]
        indent = len(line) - len(line.lstrip(" "))
        fence = FENCE.match(line)
        if fence and indent < content_indent + 4:
            close = fence["fence"][0] * len(fence["fence"])
            start = i
            body = []
            i += 1
            while i < len(lines) and not lines[i].strip().startswith(close):
                body.append(lines[i].removeprefix(fence["indent"]))
                i += 1
            blocks.append(Block(path, start + 2, (fence["info"].split() or [""])[0].lower(), tuple(body)))
            previous_blank = False
            i += 1
            continue
        if line.strip() and previous_blank and indent >= content_indent + 4:
            start = i
            body = []
            while i < len(lines) and (not lines[i].strip() or lines[i].startswith(" " * (content_indent + 4))):
                body.append(lines[i][content_indent + 4:])
                i += 1
            while body and not body[-1].strip():
                body.pop()
            blocks.append(Block(path, start + 1, "", tuple(body)))
            previous_blank = True
            continue
        if line.strip():
            item = LIST_ITEM.match(line)
            if item:
                content_indent = len(item["marker"])
            elif previous_blank and indent < content_indent:
                content_indent = 0
        previous_blank = not line.strip()
        i += 1
    return blocks


def commands_of(block: Block) -> list[Command]:
    """The commands a block documents: see the module's docstring."""
    if block.language in PROGRAMS:
        return [Command(block.path, block.line, PROGRAMS[block.language], "\n".join(block.lines) + "\n")]
    if block.language in DATA:
        return []
    if block.language not in SHELLS:
        raise ValueError(f"{block.path}:{block.line}: a ```{block.language} block: add its language to SHELLS, "
                         "PROGRAMS or DATA in tests/test_docs.py")
    logical: list[tuple[int, str]] = []
    pending: list[str] = []
    for offset, line in enumerate(block.lines):
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if not pending:
            first = block.line + offset
        pending.append(line.strip())
        if not line.rstrip().endswith("\\"):
            logical.append((first, "\n".join(pending)))
            pending = []
    if any(text.startswith("$ ") for _, text in logical):
        session = [text.removeprefix("$ ") for _, text in logical if text.startswith("$ ")]
        return [Command(block.path, logical[0][0], "shell", "\n".join(session) + "\n")]
    return [Command(block.path, line, "shell", text) for line, text in logical]


def documented_commands() -> list[Command]:
    return [command for path in DOCUMENTS for block in code_blocks(path) for command in commands_of(block)]


COMMANDS = documented_commands()


@dataclasses.dataclass(frozen=True)
class Outcome:
    """How a documented command ended: its exit status and output, and what the daemon it ran against said."""

    returncode: int
    output: str
    daemon_log: str
    daemon_status: int


def checkout_after_quick_start(home: Path) -> Path:
    """``home`` made to stand for the checkout a reader has after the quick start; the environments' bin folder."""
    (home / "examples").symlink_to(ROOT / "examples", target_is_directory=True)
    bin_dir = home / ".venv-daemon" / "bin"
    bin_dir.mkdir(parents=True)
    wrappers = {"python": "", "python3": "", "hbmd": "-m hbmd.daemon ", "hbmctl": "-m hbmd.client.ctl "}
    for name, module in wrappers.items():
        wrapper = bin_dir / name
        wrapper.write_text(f'#!/bin/sh\nexec {sys.executable} {module}"$@"\n')
        wrapper.chmod(0o755)
    (home / ".venv").symlink_to(home / ".venv-daemon", target_is_directory=True)
    return bin_dir


def run_after_quick_start(command: Command) -> Outcome:
    """Run ``command`` where a reader would, beside the quick start's daemon, within :data:`COMMAND_TIMEOUT_S`; it,
    all it started and the daemon are stopped after."""
    # Short and under /tmp: ~/.hbmd holds the daemon's sockets, whose paths must fit in 108 bytes.
    home = Path(tempfile.mkdtemp(prefix="hbmd-docs-", dir="/tmp"))
    try:
        bin_dir = checkout_after_quick_start(home)
        run_dir = home / ".hbmd"
        # The quick start's daemon (no --budget: half of the RAM), checking its invariants as the conftest's do, and
        # locking host memory in its own directory: two commands run at once, each beside its own.
        daemon = DaemonProcess(run_dir, "--backend", "host", "--log-level", "debug", "--check-invariants",
                               "--device-lock-dir", str(home), log_path=home / "hbmd.log").start()
        try:
            env = {key: value for key, value in os.environ.items() if not key.startswith(("HBMD_", "XDG_"))}
            env.update(HOME=str(home), HBMD_RUN_DIR=str(run_dir), PATH=f"{bin_dir}{os.pathsep}{env.get('PATH', '')}")
            # One torch thread each: two commands at once, each torch spinning a thread per core, took 138 s of CPU
            # and 88 s here against 64 s and 53 s (2 cores, 2026-12-05).
            env.setdefault("OMP_NUM_THREADS", "1")
            argv = (["bash", "-e", "-o", "pipefail", "-c", command.text] if command.kind == "shell"
                    else [str(bin_dir / "python"), "-c", command.text])
            proc = subprocess.Popen(argv, cwd=home, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    text=True, start_new_session=True)
            try:
                output, _ = proc.communicate(timeout=COMMAND_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                output, _ = proc.communicate()
                output += f"\n[killed: ran past {COMMAND_TIMEOUT_S}s]"
            finally:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)  # whatever it left behind: a daemon, an engine
        finally:
            daemon_status = daemon.stop()
        return Outcome(proc.returncode, output, daemon.log(), daemon_status)
    finally:
        shutil.rmtree(home, ignore_errors=True)


def test_the_documents_have_the_commands_a_reader_needs():
    """The quick start and every mode of the example engine are among the commands run: a document that parsed to
    nothing would pass vacuously."""
    run = [c for c in COMMANDS if c.key not in NOT_RUN]
    assert any(c.kind == "python" for c in run)
    assert any("hbmctl status" in c.text for c in run if c.path == "README.md")
    usage = subprocess.run([sys.executable, str(ROOT / "examples" / "engine.py"), "--help"], capture_output=True,
                           text=True, timeout=60, check=True).stdout
    modes = set(re.search(r"\{([a-z,-]+)\}", usage)[1].split(","))
    assert modes == {m for c in run for m in re.findall(r"engine\.py (\S+)", c.text)}


README_MOST_LINES = 600
"""How long the README may grow: what a reader takes in before deciding; the rest goes to ARCHITECTURE.md, SECURITY.md,
deploy/README.md and bench/README.md."""


def test_the_readme_is_short_and_its_quick_start_two_commands_that_say_where_the_second_terminal_finds_the_daemon():
    """The snippets, hbmctl and the examples run in the quick start's second terminal, where they found the daemon only
    if the reader knew to set HBMD_RUN_DIR there (they failed naming /run/hbmd)."""
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= README_MOST_LINES
    start = lines.index("## Quick start")
    end = next(i for i in range(start + 1, len(lines)) if lines[i].startswith("## "))
    assert len([c for c in COMMANDS if c.path == "README.md" and start < c.line <= end]) == 2
    assert "`export HBMD_RUN_DIR=~/.hbmd` in that second terminal" in "\n".join(lines[start:end])


def test_every_command_left_out_is_still_documented():
    documented = {c.key for c in COMMANDS}
    stale = [key for key in NOT_RUN if key not in documented]
    assert not stale, f"NOT_RUN lists commands no document has any more (remove them, or fix their text): {stale}"


@pytest.fixture(scope="module")
def outcomes(request) -> dict[Command, Outcome]:
    """Every selected command that runs here, run :data:`AT_ONCE` at a time, each in its own checkout beside its own
    daemon: what each did."""
    selected = [item.callspec.params["command"] for item in request.session.items
                if item.originalname == "test_the_documented_command_runs_as_written"]
    runnable = [command for command in selected if command.key not in NOT_RUN]
    with concurrent.futures.ThreadPoolExecutor(AT_ONCE) as pool:
        return dict(zip(runnable, pool.map(run_after_quick_start, runnable)))


@pytest.mark.parametrize("command", COMMANDS, ids=[c.id for c in COMMANDS])
@pytest.mark.system
def test_the_documented_command_runs_as_written(command, request):
    if command.key in NOT_RUN:
        pytest.skip(f"{command.id}: {NOT_RUN[command.key]}")
    outcome = request.getfixturevalue("outcomes")[command]
    assert outcome.returncode == 0, (
        f"{command.id} exited with {outcome.returncode}:\n{command.text}\n{outcome.output[-4000:]}"
    )
    # A daemon that exited on its own with this status, or said so, found an invariant broken: a bug.
    assert outcome.daemon_status != EXIT_INVARIANT_VIOLATED, outcome.daemon_log[-4000:]
    assert "an invariant does not hold" not in outcome.daemon_log, outcome.daemon_log[-4000:]
