"""``microsparse compare``: the same task and seed once per sparsifier, then one report.

Each run is an ordinary ``microsparse train`` (the same entry point, in this process), into
``OUT/<sparsifier>``; options after ``--`` go to every run unchanged. A sparsifier may carry
its own options as ``name(key=value,...)`` (those ``train`` offers: ``selection``,
``threshold_rule``, ``partitioning``, ``index_message``, ``wire``), its run then labelled so.

Example:
    $ microsparse compare --sparsifiers dense,topk,micro --workers 4 --out runs/cmp -- --epochs 2
    $ microsparse compare --budget 0.002 --out runs/cmp-bytes   # at equal bytes, not entries
    $ microsparse compare --sparsifiers 'topk,topk(wire=fixed),micro(wire=plain)'
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path

from microsparse.sparsifiers import available_sparsifiers, create_sparsifier
from microsparse_lab import arguments
from microsparse_lab.cli import train as train_command
from microsparse_lab.cli.report import add_target, fail, write
from microsparse_lab.methods.names import parse_variant, split_labels
from microsparse_lab.reports import RunError, load_runs
from microsparse_lab.training.config import SPARSIFIER_OPTIONS

PAPER_SPARSIFIERS = ("dense", "topk", "cltk", "hard_threshold", "sage", "deft", "micro")
"""The sparsifiers of the paper's comparison, in the order tables and legends show them."""

_COMPARE_SETS = {
    "--sparsifier": "--sparsifiers",
    "--out": "--out",
    "--task": "--task",
    "--workers": "--workers",
    "--density": "--density",
    "--budget": "--budget",
    "--seed": "--seed",
}
"""Train options that compare sets itself, and the compare option to use instead."""


def add_parser(commands: argparse._SubParsersAction) -> None:
    """Add ``microsparse compare`` to the command parsers."""
    compare = arguments.command(commands, "compare", _compare)
    add = compare.add_argument
    add(
        "--task",
        default=None,
        help="training task, passed to `microsparse train --task` (default: train's default)",
    )
    add(
        "--sparsifiers",
        default=",".join(PAPER_SPARSIFIERS),
        help="comma-separated names, each with its own options as name(key=value,...) if it "
        "needs them (e.g. topk(wire=fixed)), or 'all' (default: %(default)s)",
    )
    add("--workers", type=arguments.positive_int, default=4, help="(default: %(default)s)")
    add(
        "--density",
        type=arguments.density,
        default=None,
        help="every run sends this fraction of the gradient's entries: the paper's comparison, "
        "at equal entries (default: 0.001)",
    )
    add(
        "--budget",
        type=arguments.budget,
        default=None,
        help="instead of --density: every run sends this fraction of dense's bytes, at equal "
        "bytes; each sparsifier's density follows from what an entry costs on its wire",
    )
    add("--seed", type=int, default=1, help="(default: %(default)s)")
    add("--out", default=None, help="output directory (default runs/compare-TASK-TIMESTAMP)")
    add_target(compare)
    add(
        "--skip-done",
        action="store_true",
        help="keep runs in OUT that already have a summary.json instead of training them again",
    )
    add("--progress", action="store_true", help="show each run's progress bar")
    add("--no-plots", action="store_true", help="only the table")
    add("train_args", nargs="*", metavar="-- TRAIN_OPTION", help="passed to every run")


def _compare(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """train once per sparsifier (same task and seed), then tabulate and plot

    Run `microsparse train` once per sparsifier with the same task, seed, workers and density (or
    byte budget, --budget), each into OUT/SPARSIFIER, then write OUT/results.md, OUT/results.csv
    and PNG plots (as `microsparse report OUT` does). Options after `--` are passed to every
    `microsparse train`, e.g. `-- --epochs 2 --max-steps 50`."""
    if args.density is not None and args.budget is not None:
        return fail(parser, "argument --budget: give --density or --budget, not both")
    sparsifiers = _parse_sparsifiers(args.sparsifiers)
    if isinstance(sparsifiers, str):
        return fail(parser, f"argument --sparsifiers: {sparsifiers}")
    owned = sorted({arg.split("=")[0] for arg in args.train_args} & set(_COMPARE_SETS))
    if owned:
        option = _COMPARE_SETS[owned[0]]
        return fail(parser, f"{owned[0]} after --: compare sets it per run; use compare's {option}")
    task_options, problem = _task_options(args.task)
    if problem:
        return fail(parser, f"argument --task: {problem}")
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out = Path(args.out or f"runs/compare-{args.task or 'default'}-{stamp}")
    commands = {
        label: [
            "train",
            *task_options,
            *("--sparsifier", name, *flags, "--workers", str(args.workers)),
            *_amount(args),
            *("--seed", str(args.seed)),
            *("--out", str(out / label)),
            *([] if args.progress else ["--no-progress"]),
            *args.train_args,
        ]
        for label, (name, flags) in sparsifiers.items()
    }
    # Bad pass-through options fail here, once, before any run starts.
    for argv in commands.values():
        try:
            _train_command().parse_args(argv)
        except SystemExit as exit:
            return int(exit.code or 0) or 2
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        return fail(parser, f"argument --out: cannot create directory {str(out)!r}: {error}")
    record = {"task": args.task, "runs": list(sparsifiers), "commands": commands, "failed": {}}
    for name, argv in commands.items():
        if args.skip_done and (out / name / "summary.json").exists():
            print(f"== {name}: kept the finished run in {out / name}", flush=True)
            continue
        print(f"== {name}: microsparse {' '.join(argv)}", flush=True)
        started = time.perf_counter()
        code = _run(_main, argv)
        print(f"== {name}: exit {code} after {time.perf_counter() - started:.0f} s", flush=True)
        if code != 0:
            record["failed"][name] = code
        (out / "compare.json").write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    finished = [name for name in sparsifiers if (out / name / "summary.json").exists()]
    if not finished:
        return fail(parser, f"no run finished; see the errors above and {out}/*/error.log")
    try:
        write(load_runs([out / name for name in finished]), out, args.target, not args.no_plots)
    except (RunError, ModuleNotFoundError) as error:
        return fail(parser, str(error))
    return 1 if record["failed"] else 0


def _amount(args: argparse.Namespace) -> list[str]:
    """``--budget B`` where one is asked for, else ``--density D`` (0.001 by default)."""
    if args.budget is not None:
        return ["--budget", repr(args.budget)]
    return ["--density", repr(0.001 if args.density is None else args.density)]


def _run(main: Callable[[list[str]], int], argv: list[str]) -> int:
    try:
        return main(argv)
    except SystemExit as exit:  # a usage error found after parsing, e.g. batch too large
        return int(exit.code) if isinstance(exit.code, int) else 1


def _parse_sparsifiers(text: str) -> dict[str, tuple[str, list[str]]] | str:
    """Each run's label and its sparsifier with train's flags for the options it names
    (every registered sparsifier for 'all'), else an error message.

    Example:
        >>> _parse_sparsifiers("topk,topk(wire=fixed)")
        {'topk': ('topk', []), 'topk(wire=fixed)': ('topk', ['--wire', 'fixed'])}
    """
    known = available_sparsifiers()
    if text.strip() == "all":
        names = [name for name in PAPER_SPARSIFIERS if name in known]
        return {name: (name, []) for name in [*names, *(n for n in known if n not in names)]}
    try:
        runs = split_labels(text, once=False)
    except ValueError:
        return "no sparsifier named" if not text.strip(",").strip() else f"cannot read {text!r}"
    if len(set(runs)) < len(runs):
        return "a sparsifier is named twice"
    chosen: dict[str, tuple[str, list[str]]] = {}
    for label in runs:
        try:
            variant = parse_variant(label)
        except ValueError as error:
            return str(error)
        if variant.name not in known:
            return f"unknown {variant.name!r}; choose from {', '.join(known)}"
        other = sorted(set(variant.options) - set(SPARSIFIER_OPTIONS))
        if other:
            return (f"{label!r}: a run's options are train's {', '.join(SPARSIFIER_OPTIONS)}; "
                    f"give {', '.join(other)} after -- for every run")  # fmt: skip
        try:  # options that cannot work together fail here, before any run starts
            create_sparsifier(variant.name, 0.5, **variant.options)
        except (TypeError, ValueError) as error:
            return f"{label}: {error}"
        flags = [part for key, value in variant.options.items()
                 for part in (f"--{key.replace('_', '-')}", str(value))]  # fmt: skip
        chosen[label] = (variant.name, flags)
    return chosen or "no sparsifier named"


def _task_options(task: str | None) -> tuple[list[str], str | None]:
    """``["--task", task]`` if ``microsparse train`` takes ``--task``, and an error if not."""
    if task is None:
        return [], None
    train = _train_parser()
    action = train._option_string_actions.get("--task")
    if action is None:
        if task == "mnist":  # the only task before `--task` existed
            return [], None
        return [], "this `microsparse train` has no --task option; only mnist is available"
    if action.choices is not None and task not in action.choices:
        return [], f"invalid choice {task!r} (choose from {', '.join(action.choices)})"
    return ["--task", task], None


def _train_command() -> argparse.ArgumentParser:
    """``microsparse`` with its train command alone, as the command line builds it."""
    parser = argparse.ArgumentParser(prog="microsparse")
    train_command.add_parser(parser.add_subparsers(required=True))
    return parser


def _main(argv: list[str]) -> int:
    """``microsparse train ...`` in this process, as :func:`microsparse_lab.cli.main` runs it."""
    args = _train_command().parse_args(argv)
    return args.run(args, args.parser)


def _train_parser() -> argparse.ArgumentParser:
    for action in _train_command()._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action.choices["train"]
    raise RuntimeError("microsparse has no train command")
