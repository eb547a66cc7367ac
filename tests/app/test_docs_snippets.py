"""Every code block in README.md and docs/*.md runs as written.

Conventions (also in docs/contributing.md), by the fence's info string, its first word the
language and the rest flags:

- ```python        README.md: run in the fast tier (keep it cheap: a second or two of work);
                    docs/*.md: run in the slow tier (each block starts torch, ~4 s).
- ```sh            run in the slow tier: a CLI command starts torch and often ranks.
- ```python slow / ```sh slow   slow tier (several ranks, or more than ~10 s).
- ```python cuda / ```sh cuda   only where torch sees a GPU (also marked `cuda`); the only
                                  blocks that see it (below).
- ```python slow nproc=N         run under `torchrun --standalone --nproc-per-node N` (gloo ranks).
- ```sh slow repo                run at the repository root (maintainer commands with paths
                                  relative to it; they must not change tracked files).
- ```sh install-only            checked for syntax only (`bash -n`): install commands that
                                  create virtual environments and pip install.
- ```sh slow tested-by=FILE      checked for syntax only: FILE (a test module) runs the same
                                  commands with its own assertions, so the suite does not pay for
                                  them twice; every script path and `fusedzero` subcommand of the
                                  block must appear in FILE. On a python block: FILE reads the
                                  block from its page (which it must name) and runs it, or checks
                                  it equals a copy that runs.
- ```text, ```console, a bare ``` and any other language: output or prose, never run.

Each block runs as a subprocess in its file's temporary folder: the blocks of one Markdown file
share one folder and run in the order they appear, so a block may use what an earlier block of
the same file and tier wrote (a checkpoint, a config.json); run alone (`-k`), such a block fails.
python blocks run as a file under this interpreter (`python block.py`; a single-process one in a
fork of the test process, which has torch and fusedzero imported already), sh blocks under
`bash -euo pipefail`, with this
interpreter's folder (the repository's virtual environment) first on PATH. A block without the
`cuda` flag runs with `CUDA_VISIBLE_DEVICES=""`: the examples say what a CPU machine does (2 gloo
ranks for `fusedzero train --nproc 2`), and on a GPU machine `--device auto` would take the GPUs
and refuse `--nproc` beyond them. (So where torch sees a GPU, python blocks are not forked: a
fork inherits this process's CUDA state, which the variable cannot hide.) A failure names the
file and line of the block and shows the block, its exit status and the end of its output.

README.md blocks that fail today are listed in README_XFAIL below, keyed by (file, first line
of the block), each with why: they are reported as xfail and not run (some would pip install
or train for minutes). The list only shrinks: `test_xfail_list_is_current` fails when an entry
no longer names a block, so a rewrite of the README empties it.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from _cli_server import CliServer
from _helpers import run_forked

REPO = Path(__file__).resolve().parents[2]
DOC_FILES = [
    "README.md",
    *sorted(p.relative_to(REPO).as_posix() for p in (REPO / "docs").glob("*.md")),
]
RUN_LANGS = {"python", "sh"}
FLAGS = {"slow", "cuda", "install-only", "repo"}
FAST_TIMEOUT_S, SLOW_TIMEOUT_S = 300, 900
CUDA_SEEN = torch.cuda.is_available()

# README.md blocks that do not run as written today (an error, or past the time limit), keyed by
# (file, the block's first line), each with why. Empty: every block runs. Keep it that way.
README_XFAIL: dict[tuple[str, str], str] = {}


@dataclasses.dataclass(frozen=True)
class Block:
    """One fenced code block of a Markdown file."""

    file: str  # relative to the repository
    line: int  # 1-based line of the opening fence
    lang: str  # the info string's first word ("" for a bare fence)
    flags: frozenset[str]  # the info string's other words
    code: str

    @property
    def first_line(self) -> str:
        return next((x for x in self.code.splitlines() if x.strip()), "")

    @property
    def where(self) -> str:
        return f"{self.file}:{self.line}"


def extract_blocks(text: str, file: str) -> list[Block]:
    """The fenced blocks of `text` (``` fences, indented ones in lists too: their indent is
    removed from the code). An unclosed fence raises, naming its line."""
    blocks = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        stripped = lines[i].lstrip()
        if not stripped.startswith("```"):
            i += 1
            continue
        indent = len(lines[i]) - len(stripped)
        fence = stripped[: len(stripped) - len(stripped.lstrip("`"))]
        words = stripped[len(fence) :].split()
        start = i
        body = []
        i += 1
        while i < len(lines) and lines[i].strip() != fence:
            line = lines[i]
            body.append(line[indent:] if indent == 0 or line[:indent].isspace() else line.lstrip())
            i += 1
        if i == len(lines):
            raise ValueError(
                f"{file}:{start + 1}: the fence {fence}{' '.join(words)} is never closed"
            )
        blocks.append(
            Block(
                file,
                start + 1,
                words[0] if words else "",
                frozenset(words[1:]),
                "\n".join(body) + "\n",
            )
        )
        i += 1
    return blocks


def _all_blocks() -> list[Block]:
    return [b for f in DOC_FILES for b in extract_blocks((REPO / f).read_text(), f)]


def _marks(b: Block) -> list[pytest.MarkDecorator]:
    marks = []
    # The fast tier runs README.md's cheap python blocks only: a python block starts torch (about
    # 4 s of a 60 s tier); docs/ pages' blocks run in the slow tier.
    if (
        "slow" in b.flags
        or (b.lang == "sh" and "install-only" not in b.flags)
        or (b.lang == "python" and b.file != "README.md")
    ):
        marks += [pytest.mark.slow, pytest.mark.timeout(SLOW_TIMEOUT_S + 60)]
    else:
        marks.append(pytest.mark.timeout(FAST_TIMEOUT_S + 60))
    if "cuda" in b.flags:
        marks += [
            pytest.mark.cuda,
            pytest.mark.skipif(not CUDA_SEEN, reason="a ```cuda block needs a GPU"),
        ]
    why = README_XFAIL.get((b.file, b.first_line))
    if why is not None:
        marks.append(pytest.mark.xfail(reason=f"fails today: {why}", run=False))
    return marks


def _params() -> list:
    return [
        pytest.param(b, id=b.where, marks=_marks(b)) for b in _all_blocks() if b.lang in RUN_LANGS
    ]


def _env(block: Block, cli: Path | None = None) -> dict[str, str]:
    """The environment `block` runs in: this one, the venv first on PATH (after `cli`, the
    folder of the CLI server's `fusedzero`, where given), and the GPU hidden unless the block is
    flagged `cuda`."""
    env = dict(os.environ)
    first = [str(cli)] if cli is not None else []
    env["PATH"] = os.pathsep.join([*first, str(Path(sys.executable).parent), env.get("PATH", "")])
    env.setdefault("PYTHONWARNINGS", "ignore")
    if "cuda" not in block.flags:
        env["CUDA_VISIBLE_DEVICES"] = ""
    return env


# Markdown file -> the folder its blocks run in (one per file and pytest session).
_WORK: dict[str, Path] = {}


@pytest.fixture(scope="session")
def cli_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[[], Path]]:
    """The folder of the CLI server's `fusedzero` (tests/app/_cli_server.py), started at the
    first sh block that needs it, stopped at the end of the session."""
    servers: list[CliServer] = []

    def folder() -> Path:
        if not servers:
            servers.append(
                CliServer(
                    tmp_path_factory.mktemp("cli"), env={**os.environ, "CUDA_VISIBLE_DEVICES": ""}
                )
            )
        return servers[0].folder

    yield folder
    for s in servers:
        s.close()


@pytest.mark.parametrize("block", _params())
def test_block_runs(
    block: Block,
    tmp_path: Path,
    tmp_path_factory: pytest.TempPathFactory,
    cli_server: Callable[[], Path],
) -> None:
    nproc = [f for f in block.flags if f.startswith("nproc=")]
    tested_by = [f for f in block.flags if f.startswith("tested-by=")]
    unknown = block.flags - FLAGS - set(nproc) - set(tested_by)
    assert not unknown, (
        f"{block.where}: unknown fence flags {sorted(unknown)}; use {FLAGS}, "
        "nproc=N or tested-by=FILE"
    )
    if tested_by:
        _check_tested_by(block, REPO / tested_by[0].split("=", 1)[1])
        return
    if block.lang == "python" and nproc:
        # A multi-rank example, as its page says to run it: torchrun, N local gloo ranks.
        script = tmp_path / "block.py"
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={int(nproc[0].split('=')[1])}",
            str(script),
        ]
    elif block.lang == "python":
        script = tmp_path / "block.py"
        cmd = [sys.executable, str(script)]
    elif "install-only" in block.flags:
        script = tmp_path / "block.sh"
        cmd = ["bash", "-n", str(script)]
    else:
        script = tmp_path / "block.sh"
        cmd = ["bash", "-euo", "pipefail", str(script)]
    script.write_text(block.code)
    work = _WORK.get(block.file)
    if "repo" in block.flags:
        work = REPO  # a maintainer's command, run at the repository root as its page says
    elif work is None:
        work = _WORK[block.file] = tmp_path_factory.mktemp(Path(block.file).stem)
    slow = "slow" in block.flags or block.lang == "sh"
    timeout = SLOW_TIMEOUT_S if slow else FAST_TIMEOUT_S
    try:
        if cmd == [sys.executable, str(script)] and hasattr(os, "fork") and not CUDA_SEEN:
            p = _run_python_forked(script, work, timeout, _env(block))
        else:
            # sh blocks' `fusedzero` is the CLI server's (not for a GPU: it hides it).
            cli = (
                cli_server() if cmd[:2] == ["bash", "-euo"] and "cuda" not in block.flags else None
            )
            p = subprocess.run(
                cmd,
                cwd=work,
                env=_env(block, cli),
                capture_output=True,
                text=True,
                timeout=timeout,
                check=False,
            )
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"{block.where}: the block ran past {e.timeout} s:\n{block.code}")
    if p.returncode != 0:
        pytest.fail(
            f"{block.where}: the ```{block.lang} block exited with {p.returncode}:\n"
            f"{block.code}\n--- stdout (end) ---\n{p.stdout[-2000:]}\n"
            f"--- stderr (end) ---\n{p.stderr[-3000:]}",
            pytrace=False,
        )


def _run_python_forked(
    script: Path, cwd: Path, timeout: float, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """`python script` in cwd, as a fork of this process: the same interpreter with torch and
    fusedzero already imported (a fresh one spends seconds importing them), run as __main__
    with its own stdout and stderr; the block cannot touch this process's state."""

    def body() -> None:
        import runpy
        import warnings

        warnings.simplefilter("ignore")
        os.chdir(cwd)
        sys.argv = [str(script)]
        sys.path.insert(0, str(script.parent))
        runpy.run_path(str(script), run_name="__main__")

    return run_forked(body, script.parent, timeout, env)


def _check_tested_by(block: Block, test_file: Path) -> None:
    """A block another test runs: its syntax, and that the test names what the block runs (an
    sh block's scripts and `fusedzero` subcommands; a python block's page, whose copy the test
    reads)."""
    assert test_file.is_file() and test_file.name.startswith("test_"), (
        f"{block.where}: tested-by names {test_file}, which is no test module"
    )
    text = test_file.read_text()
    if block.lang == "python":
        compile(block.code, block.where, "exec")
        page = Path(block.file).name
        assert page in text, f"{block.where}: {test_file.name} does not read {page}"
        return
    assert block.lang == "sh", f"{block.where}: tested-by is for sh and python blocks"
    p = subprocess.run(["bash", "-n"], input=block.code, capture_output=True, text=True)
    assert p.returncode == 0, f"{block.where}: {p.stderr}"
    words = block.code.split()
    wanted = {w for w in words if "/" in w and w.endswith((".sh", ".py"))}
    wanted |= {b for a, b in zip(words, words[1:]) if a == "fusedzero"}
    missing = sorted(w for w in wanted if w not in text)
    assert not missing, f"{block.where}: {test_file.name} does not run {missing}"


def test_xfail_list_is_current() -> None:
    """Every README_XFAIL entry names a block that exists: a rewritten README empties it."""
    keys = {(b.file, b.first_line) for b in _all_blocks()}
    stale = [k for k in README_XFAIL if k not in keys]
    assert not stale, f"README_XFAIL entries that match no block (remove them): {stale}"


def test_extract_blocks_reads_fences_flags_and_indents() -> None:
    text = (
        "intro\n```python\nprint(1)\n```\n- item\n\n  ```sh slow\n  echo a\n    echo b\n"
        "  ```\n```\noutput\n```\n````text\n```\n````\n"
    )
    got = extract_blocks(text, "x.md")
    assert [(b.line, b.lang, sorted(b.flags), b.code) for b in got] == [
        (2, "python", [], "print(1)\n"),
        (7, "sh", ["slow"], "echo a\n  echo b\n"),
        (11, "", [], "output\n"),
        (14, "text", [], "```\n"),
    ]
    assert got[1].first_line == "echo a" and got[1].where == "x.md:7"
    with pytest.raises(ValueError, match=r"x.md:1: the fence ```sh is never closed"):
        extract_blocks("```sh\necho\n", "x.md")
    # A block at the margin keeps its own indentation.
    got = extract_blocks("```python\nfor i in range(2):\n    print(i)\n```\n", "y.md")
    assert got[0].code == "for i in range(2):\n    print(i)\n"


def test_a_failing_block_names_its_file_line_and_code(
    tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    bad = Block("docs/x.md", 7, "sh", frozenset({"install-only"}), "if then fi\n")
    with pytest.raises(pytest.fail.Exception) as e:
        test_block_runs(bad, tmp_path, tmp_path_factory, lambda: tmp_path)
    msg = str(e.value)
    assert msg.startswith("docs/x.md:7: the ```sh block exited with 2:\nif then fi\n"), msg
    assert "syntax error" in msg


def test_forked_python_block_reports_exit_output_and_errors(tmp_path: Path) -> None:
    script = tmp_path / "block.py"
    script.write_text("import os, sys\nprint('hi', os.getcwd())\nsys.exit(3)\n")
    p = _run_python_forked(script, tmp_path, 60)
    assert p.returncode == 3 and p.stdout == f"hi {tmp_path}\n"
    script.write_text("import sys\nprint('to err', file=sys.stderr)\nraise KeyError('k')\n")
    p = _run_python_forked(script, tmp_path, 60)
    assert p.returncode == 1 and "to err" in p.stderr and "KeyError: 'k'" in p.stderr
    # After this process ran OpenMP with 2 threads, a fork used to hang in its first parallel
    # region (libgomp is not fork-safe); the child runs with one thread.
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        a = torch.randn(512, 512)
        (a @ a).sum()
        torch.randn(10**6).exp().sum()
        script.write_text(
            "import torch\na = torch.randn(512, 512)\n(a @ a).sum()\n"
            "torch.randn(10**6).exp().sum()\n"
        )
        assert _run_python_forked(script, tmp_path, 60).returncode == 0
    finally:
        torch.set_num_threads(threads)
    script.write_text("import time\ntime.sleep(60)\n")
    with pytest.raises(subprocess.TimeoutExpired):
        _run_python_forked(script, tmp_path, 0.5)


def test_blocks_see_the_gpu_only_with_the_cuda_flag(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a GPU machine `fusedzero train --nproc 2` in a block would take the GPU (one rank)
    and refuse 2: every block but a ```cuda one runs with the GPU hidden."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    plain = Block("docs/x.md", 1, "sh", frozenset({"slow"}), "fusedzero train --nproc 2\n")
    gpu = dataclasses.replace(plain, flags=frozenset({"slow", "cuda"}))
    assert _env(plain)["CUDA_VISIBLE_DEVICES"] == ""
    assert _env(gpu)["CUDA_VISIBLE_DEVICES"] == "0"
    assert _env(plain)["PATH"].split(os.pathsep)[0] == str(Path(sys.executable).parent)
