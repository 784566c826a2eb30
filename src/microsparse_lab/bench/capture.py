"""Reading gradients captured by ``microsparse train --capture-gradients DIR``.

The format (written by ``microsparse_lab.training.capture``):

- ``DIR/grad-rank{rank}-step{step:06d}.pt``: ``torch.save`` of one float32 1-D tensor, that
  rank's fresh local gradient at that step, parameters concatenated in order;
- ``DIR/layout.json``: ``names``, ``shapes``, ``offsets`` and ``numel`` of that vector (other
  keys, such as ``task``, ``model``, ``world_size``, ``steps``, are kept as ``metadata``).

Example:
    >>> capture = load_capture("runs/bench/capture")      # doctest: +SKIP
    >>> capture.layout.numel, capture.ranks, capture.steps  # doctest: +SKIP
    (215370, [0, 1, 2, 3], 200)
    >>> capture.gradient(rank=0, step=0).shape             # doctest: +SKIP
    torch.Size([215370])
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from microsparse.layout import Layout

_FILE = re.compile(r"grad-rank(\d+)-step(\d{6,})\.pt")


class CaptureError(ValueError):
    """A capture directory that is missing, empty or inconsistent."""


@dataclass(frozen=True)
class CapturedGradients:
    """Index of a capture directory; gradients are loaded on demand."""

    directory: Path
    layout: Layout
    files: dict[int, list[Path]]
    """Rank → its gradient files for steps 0, 1, …, ``steps − 1``."""
    metadata: dict[str, Any] = field(default_factory=dict)

    @property
    def ranks(self) -> list[int]:
        return sorted(self.files)

    @property
    def steps(self) -> int:
        """Steps captured on every rank."""
        return min(len(paths) for paths in self.files.values())

    def gradient(self, rank: int, step: int) -> torch.Tensor:
        """Rank ``rank``'s flat float32 gradient at ``step``."""
        path = self.files[rank][step]
        vector = torch.load(path, map_location="cpu", weights_only=True)
        if not isinstance(vector, torch.Tensor) or vector.shape != (self.layout.numel,):
            shape = tuple(vector.shape) if isinstance(vector, torch.Tensor) else type(vector)
            raise CaptureError(
                f"{path}: expected a 1-D tensor of {self.layout.numel} entries "
                f"(layout.json's numel), got {shape}"
            )
        return vector.float()

    def mean_gradient(self, step: int) -> torch.Tensor:
        """The average of every captured rank's gradient at ``step``."""
        total = self.gradient(self.ranks[0], step).double()
        for rank in self.ranks[1:]:
            total += self.gradient(rank, step)
        return total.div_(len(self.ranks)).float()


def load_capture(directory: str | Path) -> CapturedGradients:
    """Index ``directory``; raise :class:`CaptureError` naming what is wrong and the fix."""
    directory = Path(directory)
    hint = "capture with: microsparse train --capture-gradients DIR --capture-steps N"
    if not directory.is_dir():
        raise CaptureError(f"{directory}: no such directory ({hint})")
    layout_path = directory / "layout.json"
    try:
        description = json.loads(layout_path.read_text())
    except FileNotFoundError:
        raise CaptureError(f"{layout_path} is missing ({hint})") from None
    except json.JSONDecodeError as error:
        raise CaptureError(f"{layout_path}: not valid JSON ({error})") from None
    layout = _layout(description, layout_path)

    found: dict[int, dict[int, Path]] = {}
    for path in directory.iterdir():
        match = _FILE.fullmatch(path.name)
        if match:
            found.setdefault(int(match[1]), {})[int(match[2])] = path
    if not found:
        raise CaptureError(f"{directory}: no grad-rank*-step*.pt files ({hint})")
    files = {}
    for rank, by_step in found.items():
        steps = sorted(by_step)
        if steps != list(range(len(steps))):
            missing = sorted(set(range(steps[-1] + 1)) - set(steps))
            raise CaptureError(f"{directory}: rank {rank} lacks steps {missing[:5]}")
        files[rank] = [by_step[step] for step in steps]
    keys = ("names", "shapes", "offsets", "numel")
    metadata = {key: value for key, value in description.items() if key not in keys}
    return CapturedGradients(directory, layout, files, metadata)


def _layout(description: dict[str, Any], path: Path) -> Layout:
    try:
        names = tuple(str(name) for name in description["names"])
        shapes = tuple(torch.Size(shape) for shape in description["shapes"])
    except (KeyError, TypeError) as error:
        raise CaptureError(f"{path}: needs 'names' and 'shapes' lists ({error})") from None
    if len(names) != len(shapes):
        raise CaptureError(f"{path}: {len(names)} names but {len(shapes)} shapes")
    layout = Layout.of(
        [(name, torch.empty(shape, device="meta")) for name, shape in zip(names, shapes)]
    )
    for key in ("offsets", "numel"):
        stated = description.get(key)
        actual = list(layout.offsets) if key == "offsets" else layout.numel
        if stated is not None and stated != actual:
            raise CaptureError(f"{path}: '{key}' disagrees with the shapes ({stated} vs {actual})")
    return layout
