"""The ``microsparse`` command line: one module per command, each adding its own parser.

Example:
    $ microsparse train --workers 4 --density 0.001 --out runs/micro
    $ torchrun --nnodes 2 --nproc-per-node 8 ... -m microsparse_lab train --device cuda
"""

from __future__ import annotations

import argparse
import sys
from typing import NoReturn

from microsparse_lab.cli import bench, compare, report, simulate, train
from microsparse_lab.training.launch import leave_process, torchrun_env
from microsparse_lab.training.log import silence_stdout

COMMANDS = [train, compare, report, simulate, bench]
"""Modules with ``add_parser(commands)``; the parser they add sets ``run(args, parser)``."""


def main(argv: list[str] | None = None) -> int:
    """Run ``microsparse`` with ``argv`` (default ``sys.argv[1:]``); returns the exit code.

    Example:
        >>> main(["train", "--workers", "2", "--max-steps", "5"])  # doctest: +SKIP
        0
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    return args.run(args, args.parser)


def entry() -> NoReturn:
    """The ``microsparse`` program (and ``python -m microsparse_lab``): :func:`main`, then exit.

    Under torchrun this process was a rank and ran a gloo process group itself; it ends
    without the interpreter's teardown, which can abort a worker that had finished
    (:func:`~microsparse_lab.training.launch.leave_process`). When stdout's reader goes away
    (``| head``), it stops quietly as Unix tools do, with the exit code of SIGPIPE.
    """
    try:
        try:
            code = main()
        finally:  # --help's SystemExit too: flushed here, a closed pipe is caught below
            sys.stdout.flush()
    except BrokenPipeError:
        silence_stdout()  # for what is still buffered, at exit
        code = 141  # 128 + SIGPIPE: what a shell reports for a tool that SIGPIPE ended
    if torchrun_env() is not None:
        leave_process(code)
    sys.exit(code)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="microsparse", description="MiCRO gradient sparsification for data-parallel training."
    )
    commands = parser.add_subparsers(title="commands", required=True, metavar="COMMAND")
    for command in COMMANDS:
        command.add_parser(commands)
    return parser
