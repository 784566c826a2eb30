"""What in a run directory is microsparse's, so that nothing of a user's is deleted or overwritten.

A run writes only these names in its directory ``OUT``: :data:`RUN_FILES` and the checkpoint
folders :data:`CHECKPOINT_DIRS`, which hold only :data:`CHECKPOINT_FILES`. The first run in
``OUT`` claims it with a marker file, :data:`MARKER`; a directory without one is the user's,
and a run refuses to start where one of the run files already exists there (it would write
over it). A checkpoint folder is known by what it holds: anything else in it is refused, in a
claimed directory too, because every checkpoint replaces the whole folder.

Which earlier runs a new one may replace is the caller's choice (:func:`refusal`, used by
``microsparse train`` before any worker starts); :func:`claim` and
:func:`foreign_in_checkpoint` guard the writes themselves.
"""

from __future__ import annotations

import re
from pathlib import Path

MARKER = ".microsparse-run"
RUN_FILES = ("metrics.jsonl", "epochs.jsonl", "summary.json", "error.log")
CHECKPOINT_DIRS = ("checkpoint", "checkpoint.new", "checkpoint.old")
# DCP's files, for a model sharded by FSDP2: its index and each rank's data.
CHECKPOINT_FILES = re.compile(r"meta\.json|shared\.pt|rank\d+\.pt|\.metadata|__\d+_\d+\.distcp")
_MARKER_TEXT = "This directory holds a microsparse training run; microsparse writes into it.\n"


class ForeignFileError(RuntimeError):
    """A run would write over or delete a file that microsparse did not write; names it."""


def foreign_file(out: str | Path) -> Path | None:
    """The first file in ``out`` that a run would write over or delete but that microsparse
    did not write, or None.

    Example:
        >>> foreign_file("/nonexistent") is None
        True
    """
    out = Path(out)
    claimed = (out / MARKER).is_file()
    for name in RUN_FILES:
        path = out / name
        if not claimed and (path.exists() or path.is_symlink()):
            return path
    for name in CHECKPOINT_DIRS:  # known by what they hold, marker or not
        path = out / name
        if path.exists() or path.is_symlink():
            foreign = foreign_in_checkpoint(path)
            if foreign is not None:
                return foreign
    return None


def foreign_in_checkpoint(directory: Path) -> Path | None:
    """The first entry of checkpoint folder ``directory`` that is not a checkpoint file
    (``directory`` itself if it is not a plain folder), or None."""
    if directory.is_symlink() or not directory.is_dir():
        return directory
    for entry in sorted(directory.iterdir()):
        if entry.is_symlink() or not entry.is_file() or not CHECKPOINT_FILES.fullmatch(entry.name):
            return entry
    return None


def describe_foreign(path: Path, out: str | Path, option: str) -> str:
    """Why ``path`` is in the way of a run in ``out``, and what to do (``option``: the
    command line's name for ``out``)."""
    out = Path(out)
    if path.parent != out:
        return (
            f"{path} was not written by microsparse, and {path.parent} is a checkpoint folder, "
            f"which every checkpoint replaces: move {path.name} elsewhere, or choose another "
            f"{option} directory"
        )
    if path.name in CHECKPOINT_DIRS:
        return (
            f"{path} is not a folder of checkpoint files, and a run there would replace it: "
            f"move it elsewhere, or choose another {option} directory"
        )
    return (
        f"{path} was not written by microsparse ({out} has no {MARKER} marker) and a run "
        f"there would write over it: move it elsewhere, or choose another {option} directory"
    )


def refusal(out: str | Path, option: str, resuming: bool, overwrite: bool) -> str | None:
    """Why a run may not start in ``out``, naming the path and the option that fixes it, or
    None if it may.

    A user's file in the way is always refused. An earlier run is replaced only with
    ``overwrite``, if it finished (``summary.json``) or has a checkpoint to continue from;
    ``resuming`` continues a checkpoint instead, and starts afresh over an unfinished run
    without one (as every restart before the first checkpoint does).
    """
    out = Path(out)
    if not out.is_dir():
        return None  # created by the run (or refused by mkdir, naming the error)
    foreign = foreign_file(out)
    if foreign is not None:
        return describe_foreign(foreign, out, option)
    checkpoint = next((out / name for name in CHECKPOINT_DIRS if (out / name / "meta.json")
                       .is_file()), None)  # fmt: skip
    if overwrite or (resuming and checkpoint is not None):
        return None
    summary = out / "summary.json"
    if summary.is_file():
        what = "and no checkpoint to continue from" if resuming else f"({summary})"
        return (
            f"{out} holds a finished run {what}: add --overwrite to replace it, or choose "
            f"another {option} directory"
        )
    if checkpoint is not None:
        return (
            f"{out} holds an unfinished run with a checkpoint ({checkpoint}): continue it with "
            f"--resume {out}, or add --overwrite to start afresh there"
        )
    return None


def earlier_run(out: str | Path) -> Path | None:
    """A file of an earlier run in ``out`` (which a new run there replaces), or None."""
    paths = (Path(out, name) for name in (*RUN_FILES, *CHECKPOINT_DIRS))
    return next((path for path in paths if path.exists()), None)


def claim(out: str | Path) -> None:
    """Create ``out`` if needed and mark it as a run's; ForeignFileError if a file that a run
    writes is there but not microsparse's."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    foreign = foreign_file(out)
    if foreign is not None:
        raise ForeignFileError(describe_foreign(foreign, out, "--out"))
    marker = out / MARKER
    if not marker.is_file():
        marker.write_text(_MARKER_TEXT, encoding="utf-8")
