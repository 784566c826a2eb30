"""``microsparse report``: the results table and plots of saved runs, from their files alone."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from microsparse_lab import arguments
from microsparse_lab.reports import (
    Run,
    RunError,
    load_runs,
    results_table,
    seeds,
    tensorboard,
    to_markdown,
    write_report,
    write_tensorboard,
)


def add_parser(commands: argparse._SubParsersAction) -> None:
    """Add ``microsparse report`` to the command parsers."""
    report = arguments.command(commands, "report", _report)
    add = report.add_argument
    add("run_dirs", nargs="+", metavar="RUN_DIR", help="run directories, or their parents")
    add(
        "--out",
        default=None,
        help="where to write the table and plots (default: RUN_DIR when only one is given)",
    )
    add_target(report)
    add("--no-plots", action="store_true", help="only the table")
    add(
        "--seeds",
        action="store_true",
        help="RUN_DIR is a study over seeds, STUDY/VARIANT/seed-S: write quality.md (each "
        "variant's gap to dense, seed by seed) and quality.png (metric against epochs)",
    )
    add(
        "--at",
        type=_epochs,
        default=(5, 10),
        metavar="EPOCHS",
        help="with --seeds: comma-separated epochs to compare at (default: 5,10)",
    )
    add(
        "--variants",
        default=None,
        metavar="NAMES",
        help="with --seeds: only these comma-separated variants (dense is always kept)",
    )
    add(
        "--window",
        type=_epochs,
        default=None,
        metavar="FIRST,LAST",
        help="with --seeds: also compare the mean over these epochs (e.g. 16,20)",
    )
    add(
        "--metric",
        default=None,
        metavar="NAME",
        help="with --seeds: compare this per-epoch record instead of the task's metric, e.g. "
        "train_loss (gaps in nats)",
    )
    add(
        "--tensorboard",
        metavar="LOGDIR",
        default=None,
        help="also write TensorBoard event files, one subdirectory per run (needs tensorboard)",
    )


def add_target(parser: argparse.ArgumentParser) -> None:
    """``--target``, of the table of ``report`` and of ``compare``."""
    parser.add_argument(
        "--target",
        type=arguments.number,
        default=None,
        help="metric value for 'time to target' (default: 95%% of the dense run's final "
        "metric, 105%% when lower is better; without a dense run, of the best run's)",
    )


def _epochs(text: str) -> tuple[int, ...]:
    return tuple(arguments.positive_int(part) for part in text.split(","))


def _report(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """results table and plots from saved run directories

    Read the metrics.jsonl, epochs.jsonl and summary.json of each RUN_DIR (or of each subdirectory
    that has them, e.g. a `microsparse compare` output) and write results.md, results.csv and PNG
    plots. The quality metric and whether higher is better are read from the runs."""
    if args.seeds:
        return _report_seeds(args, parser)
    if args.metric is not None:
        return fail(parser, "argument --metric: only with --seeds")
    if args.out is None and len(args.run_dirs) > 1:
        return fail(parser, "argument --out: required when more than one RUN_DIR is given")
    if args.tensorboard and not tensorboard.tensorboard_available():
        return fail(parser, f"argument --tensorboard: {tensorboard.MISSING}")
    try:
        runs = load_runs(args.run_dirs)
        write(runs, Path(args.out or args.run_dirs[0]), args.target, not args.no_plots)
        if args.tensorboard:
            write_tensorboard(runs, args.tensorboard)
            print(f"wrote TensorBoard events; view: tensorboard --logdir {args.tensorboard}")
    except (RunError, ModuleNotFoundError) as error:
        return fail(parser, str(error))
    return 0


def _report_seeds(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    if len(args.run_dirs) != 1:
        return fail(parser, "argument --seeds: give one study directory")
    if args.window is not None and (len(args.window) != 2 or args.window[0] > args.window[1]):
        return fail(parser, "argument --window: expected FIRST,LAST with FIRST <= LAST")
    try:
        variants = seeds.load_study(args.run_dirs[0], args.metric)
        if args.variants is not None:
            wanted = {"dense", *args.variants.split(",")}
            unknown = wanted - {v.name for v in variants} - {"dense"}
            if unknown:
                return fail(parser, f"argument --variants: no runs of {', '.join(sorted(unknown))}")
            variants = [v for v in variants if v.name in wanted]
        table = seeds.gap_table(variants, args.at, args.window)
        out = Path(args.out or args.run_dirs[0])
        out.mkdir(parents=True, exist_ok=True)
        (out / "quality.md").write_text(table + "\n", encoding="utf-8")
        written = [out / "quality.md"]
        if not args.no_plots:
            written.append(seeds.plot_study(variants, out / "quality.png"))
    except (RunError, ModuleNotFoundError) as error:
        return fail(parser, str(error))
    print(table)
    print(f"wrote {', '.join(str(path) for path in written)}")
    return 0


def write(runs: list[Run], out: Path, target: float | None, plots: bool) -> None:
    """Write the report of ``runs`` into ``out`` and print the table and the files' names."""
    print(to_markdown(results_table(runs, target)))
    written = write_report(runs, out, target, plots)
    print(f"wrote {', '.join(str(path) for path in written)}")


def fail(parser: argparse.ArgumentParser, message: str) -> int:
    """Print one error line naming the command; return the usage-error exit code, 2."""
    print(f"{parser.prog}: error: {message}", file=sys.stderr)
    return 2
