"""The documentation as a user copies it: every Python block and every README command runs.

Python blocks (README.md, docs/*.md) are parsed by Sybil and run in order, one namespace per
document. In the Markdown source:

- ``<!-- invisible-code-block: python ... -->`` is code the rendered page does not show: the
  setup a reader is told about (a tiny model, data) and checks after a snippet;
- the blocks between ``<!-- torchrun: start -->`` and ``<!-- torchrun: end -->``, visible and
  invisible, are one script run on 2 gloo ranks under
  ``torchrun --standalone --nproc-per-node 2``; each block keeps its line of the document, so a
  traceback's line numbers are the document's;
- ``<!-- torchrun: end twice -->`` runs that script twice in one folder (a restart);
- ``<!-- skip: next "why" -->`` marks a fragment that cannot run as written, with the reason.

The command lines of the ``sh`` blocks of README.md and docs/CLI.md run in a scratch folder,
made small by appended flags (``--max-steps 2 --no-progress``, 2 workers); each line that needs
what CI lacks is in ``SKIPPED`` with the reason, and a new line is neither run nor skipped until
it is listed.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from sybil import Document, Example, Region, Sybil
from sybil.evaluators.python import PythonEvaluator
from sybil.example import NotEvaluated
from sybil.parsers.markdown import PythonCodeBlockParser, SkipParser
from sybil.parsers.markdown.lexers import DirectiveInHTMLCommentLexer

ROOT = Path(__file__).parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BIN = Path(sys.executable).parent
TIMEOUT = 300  # seconds for one script or command: one that hangs fails, not the suite


def _run(command: list[str], cwd: Path) -> str | None:
    """Run ``command`` in ``cwd`` with one torch thread; a message on failure, else None."""
    # This checkout's package, whatever is installed; one thread, as torchrun would set.
    path = os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1"}
    # A session of its own, so that a timeout ends every process it started, not only the first.
    process = subprocess.Popen(command, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, start_new_session=True, env=env)  # fmt: skip
    try:
        _, stderr = process.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        _, stderr = process.communicate()
        return f"{shlex.join(command)} ran past {TIMEOUT} s:\n{stderr[-4000:]}"
    if process.returncode != 0:
        # torchrun's own report of a failure says nothing the ranks' tracebacks do not.
        ranks = "\n".join(line for line in stderr.splitlines() if line.startswith("[rank"))
        shown = (ranks or stderr)[-6000:]
        return f"{shlex.join(command)} exited with {process.returncode}:\n{shown}"
    return None


# --- Python blocks ------------------------------------------------------------------------


TEARDOWN = """
import os as _os, sys as _sys
_sys.stdout.flush(), _sys.stderr.flush()
_os._exit(0)
"""
"""What every region's script ends with, once its own last line has run: on gloo (torch 2.13)
the interpreter's teardown can still abort ("terminate called without an active exception",
more often on a busy machine; docs/FSDP.md), which is not what a block tests."""


class TorchrunRegions:
    """A Sybil parser and evaluator: the Python blocks between ``<!-- torchrun: start -->`` and
    ``<!-- torchrun: end -->`` run as one script on 2 gloo ranks; the ``end`` example fails with
    the ranks' stderr unless torchrun exits with 0."""

    def __init__(self) -> None:
        self.lexer = DirectiveInHTMLCommentLexer("torchrun", arguments="start|end|end twice")
        self.blocks: dict[str, list[tuple[int, str]]] = {}

    def __call__(self, document: Document) -> list[Region]:
        return [Region(lexed.start, lexed.end, lexed.lexemes["arguments"], self.evaluate)
                for lexed in self.lexer(document)]  # fmt: skip

    def evaluate(self, example: Example) -> str | None:
        document = example.document
        if example.parsed == "start":
            self.blocks[document.path] = []
            document.push_evaluator(self.collect)
            return None
        document.pop_evaluator(self.collect)
        blocks = self.blocks.pop(document.path, [])
        if not blocks:
            return "no Python block was collected since <!-- torchrun: start -->: run them all"
        script = example.namespace["tmp_path"] / f"{Path(document.path).name}-{example.line}.py"
        lines: list[str] = []
        for line, source in blocks:
            lines += [""] * (line - len(lines)) + source.splitlines()
        script.write_text("\n".join(lines) + "\n" + TEARDOWN)
        torchrun = [str(BIN / "torchrun"), "--standalone", "--nproc-per-node", "2", str(script)]
        # "end twice": a script that resumes from what its first run saved.
        for _ in range(2 if example.parsed == "end twice" else 1):
            if failure := _run(torchrun, cwd=script.parent):
                return failure
        return None

    def collect(self, example: Example) -> None:
        if not isinstance(example.region.evaluator, PythonEvaluator):
            raise NotEvaluated()  # directives (a skip, this region's end) evaluate themselves
        source = example.parsed
        self.blocks[example.document.path].append((example.line + source.line_offset, source))


DOCS_SYBIL = Sybil(parsers=[PythonCodeBlockParser(), SkipParser(), TorchrunRegions()])
EXAMPLES = [example for path in DOCS for example in DOCS_SYBIL.parse(path)]


@pytest.mark.parametrize("example", EXAMPLES,
                         ids=[f"{Path(e.path).name}:{e.line}" for e in EXAMPLES])  # fmt: skip
def test_python_block(example: Example, tmp_path: Path) -> None:
    """Runs in document order: a block may use what the blocks before it defined."""
    example.namespace["tmp_path"] = tmp_path
    example.evaluate()


def test_every_python_block_is_collected_and_every_skip_says_why() -> None:
    fences = 0
    for path in DOCS:
        text = path.read_text()
        fences += len(re.findall(r"^```python$", text, re.MULTILINE))
        assert not re.findall(r"^```(py|python3|pycon)$", text, re.MULTILINE), path
        for reason in re.findall(r"<!-- skip: next(.*?)-->", text):
            assert re.fullmatch(r' "[^"]+" ', reason), f"{path.name}: a skip without a reason"
    visible = [e for e in EXAMPLES if "invisible-code-block" not in e.document.text[e.start:e.end]
               and isinstance(e.region.evaluator, PythonEvaluator)]  # fmt: skip
    assert len(visible) == fences  # no block escapes Sybil


# --- README's and the CLI page's command lines ---------------------------------------------

SKIPPED = {
    "make demo": "sets up a fresh .venv from the package index, then trains 155 steps",
    "make test": "is this test suite",
    "microsparse train --task cifar10 --model resnet18 --data-dir ~/data/cifar-10-batches-py":
        "needs CIFAR-10 downloaded into ~/data",
    "torchrun --nnodes 2 --nproc-per-node 8 ... -m microsparse_lab train --sparsifier micro":
        "needs a cluster of 2 machines",
}  # fmt: skip
SMALL = {  # appended flags that make a command small
    "train": ["--workers", "2", "--max-steps", "2", "--no-progress"],
    "compare": ["--workers", "2", "--", "--max-steps", "2", "--no-progress"],
    "simulate": ["--quick", "--sparsifiers", "micro", "--no-plots", "--quiet"],
    "overhead": ["--sizes", "100000", "--partitions", "1,4", "--repeats", "2",
                 "--loopback-ranks", "2", "--no-plots", "--quiet"],
}  # fmt: skip


COMMANDS = [ROOT / "README.md", ROOT / "docs" / "CLI.md"]
"""Documents whose ``sh`` lines are run, in this order (a line may use an earlier one's output)."""


def readme_commands() -> list[str]:
    """The lines of the ``sh`` blocks of :data:`COMMANDS`, without their comments."""
    fence = re.compile(r"^```sh\n(.*?)^```$", re.S | re.M)
    blocks = [block for path in COMMANDS for block in fence.findall(path.read_text())]
    lines = [line.split("#")[0].strip() for block in blocks for line in block.splitlines()]
    return [line for line in lines if line]


def _readme_command(line: str) -> list[str]:
    words = shlex.split(line)
    if words[0] != "microsparse":
        raise AssertionError(f"{line!r} is neither run nor in SKIPPED with a reason")
    command = [str(BIN / "microsparse"), *words[1:]]
    return command + SMALL.get(words[2] if words[1] == "bench" else words[1], [])


@pytest.fixture(scope="module")
def scratch(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("readme")


@pytest.mark.parametrize("line", readme_commands())
def test_readme_command(line: str, scratch: Path) -> None:
    if line in SKIPPED:
        pytest.skip(SKIPPED[line])
    if "--seeds runs/quality/mnist" in line:  # a study of one seed, from `compare`'s runs
        study = scratch / "runs" / "quality" / "mnist"
        if not (scratch / "runs" / "cmp").exists():
            pytest.skip("needs the runs of `microsparse compare` above")
        for variant in ("dense", "micro"):
            shutil.copytree(scratch / "runs" / "cmp" / variant, study / variant / "seed-1",
                            dirs_exist_ok=True)  # fmt: skip
    failure = _run(_readme_command(line), cwd=scratch)
    assert failure is None, failure
