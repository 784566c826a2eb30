"""Tiny files in the real datasets' formats (CIFAR pickles, WikiText tokens, MovieLens CSV),
written by the tests themselves: no dataset file is ever committed."""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np


def write_cifar(directory: Path, classes: int = 10, per_file: int = 8, seed: int = 0) -> Path:
    """CIFAR-10 (``data_batch_1..5``, ``test_batch``) or CIFAR-100 (``train``, ``test``)."""
    rng = np.random.default_rng(seed)
    directory.mkdir(parents=True, exist_ok=True)
    if classes == 10:
        names, key = [*(f"data_batch_{i}" for i in range(1, 6)), "test_batch"], b"labels"
    else:
        names, key = ["train", "test"], b"fine_labels"
    for name in names:
        batch = {
            b"data": rng.integers(0, 256, (per_file, 3072), dtype=np.uint8),
            key: rng.integers(0, classes, per_file).tolist(),
            b"batch_label": name.encode(),
        }
        with open(directory / name, "wb") as file:
            pickle.dump(batch, file)
    return directory


WIKITEXT = {
    "wiki.train.tokens": " = Valkyria = \n\n the cat sat on the mat . \n the dog sat . \n",
    "wiki.valid.tokens": " the cat ran . \n",
    "wiki.test.tokens": " a bird sat . \n",
}


def write_wikitext(directory: Path, repeat: int = 1) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    for name, text in WIKITEXT.items():
        (directory / name).write_text(text * repeat, encoding="utf-8")
    return directory


def write_ratings(directory: Path, users: int = 6, items: int = 120, per_user: int = 5) -> Path:
    """MovieLens-20M's ratings.csv: every user rates ``per_user`` items at increasing times."""
    rng = np.random.default_rng(0)
    directory.mkdir(parents=True, exist_ok=True)
    lines = ["userId,movieId,rating,timestamp"]
    for user in range(1, users + 1):
        for order, item in enumerate(rng.choice(items, per_user, replace=False)):
            lines.append(f"{user},{10 * item + 1},{rng.integers(1, 6)}.0,{1000 * user + order}")
    (directory / "ratings.csv").write_text("\n".join(lines) + "\n")
    return directory
