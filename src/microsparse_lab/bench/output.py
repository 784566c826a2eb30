"""What every benchmark writes: a JSON record, a Markdown table, PNG plots, and the machine."""

from __future__ import annotations

import json
import math
import os
import platform
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from microsparse_lab.training.log import json_safe


def machine() -> dict[str, Any]:
    """The machine a benchmark ran on, and how busy it was when the benchmark started."""
    info: dict[str, Any] = {
        "cpus": os.cpu_count(),
        "cpu_model": cpu_model(),
        "memory_gib": _memory_gib(),
        "load_average": [round(x, 2) for x in os.getloadavg()],
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }
    return info


def describe_machine(info: dict[str, Any]) -> str:
    """One line: CPU model, cores, memory, torch threads, load average, GPU."""
    load = ", ".join(f"{x:g}" for x in info["load_average"])
    gpu = f"; GPU {info['cuda']}" if info.get("cuda") else "; no GPU"
    threads = f"{info['torch_threads']} thread" + ("s" if info["torch_threads"] != 1 else "")
    return (
        f"{info['cpu_model']}, {info['cpus']} cores, {info['memory_gib']:.0f} GiB RAM, "
        f"torch {info['torch']} with {threads}; "
        f"load average {load} at start{gpu}"
    )


def cpu_model() -> str:
    """The CPU's model name, as /proc/cpuinfo gives it."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _memory_gib() -> float:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError):
        return math.nan


def write_json(path: Path, payload: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(json_safe(payload), indent=1) + "\n")


def write_results(
    name: str,
    result: dict[str, Any],
    out: str | Path,
    markdown: Callable[[dict[str, Any]], str],
    plot: Callable[[dict[str, Any], Path], list[Path]] | None,
) -> list[Path]:
    """Write ``NAME.json``, ``NAME.md`` and (given ``plot``) its PNGs into ``out``."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / f"{name}.json", result)
    (out / f"{name}.md").write_text(markdown(result) + "\n")
    written = [out / f"{name}.json", out / f"{name}.md"]
    if plot is not None:
        written += plot(result, out)
    return written


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A GitHub Markdown table; floats are written as they are given (format them first).

    Example:
        >>> print(markdown_table(["n", "ms"], [[1, "0.5"], [4, "0.2"]]))
        | n | ms |
        |---|---|
        | 1 | 0.5 |
        | 4 | 0.2 |
    """
    lines = ["| " + " | ".join(map(str, headers)) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(map(str, row)) + " |" for row in rows]
    return "\n".join(lines)


def significant(value: float, digits: int = 3) -> str:
    """``value`` with ``digits`` significant digits, without exponent for everyday sizes.

    Example:
        >>> significant(0.0012345), significant(123456.0), significant(float("nan"))
        ('0.00123', '123456', '–')
    """
    if value is None or not math.isfinite(value):
        return "–"
    if value == 0:
        return "0"
    magnitude = math.floor(math.log10(abs(value)))
    decimals = max(0, digits - 1 - magnitude)
    return f"{value:.{decimals}f}"

