"""Implicit-feedback recommendation data: MovieLens ratings, leave-one-out, sampled negatives.

Every rating counts as an interaction (NCF's protocol). Each user's latest interaction (by
timestamp; a tie goes to the later row) is held out for testing and ranked against 99 items
the user never interacted with; the rest are training positives, each paired with fresh
negatives every epoch.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from microsparse_lab.training.data.common import DataFormatError, find_files, package_file

ML100K_FILE = ("dataset_example", "ml-100k", "ml-100k.inter")  # inside the installed recbole
ML20M_FORMAT = (
    "MovieLens-20M ratings.csv: comma-separated with the header userId,movieId,rating,timestamp"
)


@dataclass(frozen=True)
class RatingsData:
    """Training interactions and the leave-one-out test of every user."""

    users: int
    items: int
    train_users: torch.Tensor  # (N,) user id of every training positive
    train_items: torch.Tensor  # (N,) its item id
    seen: torch.Tensor  # sorted user * items + item of every training positive
    test_users: torch.Tensor  # (U,) every user with a held-out interaction
    test_items: torch.Tensor  # (U, 1 + negatives): the held-out item, then sampled negatives


def movielens_100k(eval_negatives: int = 99, seed: int = 0) -> RatingsData:
    """MovieLens-100K as shipped in ``recbole``: 943 users, 1,682 items, 100,000 ratings.

    Example:
        >>> data = movielens_100k()  # doctest: +SKIP
        >>> data.users, data.items, tuple(data.test_items.shape)  # doctest: +SKIP
        (943, 1682, (943, 100))
    """
    # recbole's own dependency pins are unusable, and only its data file is read (never imported).
    path = package_file("recbole", *ML100K_FILE, install="--no-deps recbole")
    expected = "user_id:token\titem_id:token\trating:float\ttimestamp:float"
    table = _read_table(path, "\t", expected, "MovieLens-100K in RecBole's atomic format")
    return leave_one_out(table[:, 0], table[:, 1], table[:, 3], eval_negatives, seed)


def movielens_20m(data_dir: str | Path, eval_negatives: int = 99, seed: int = 0) -> RatingsData:
    """MovieLens-20M's ``ratings.csv`` from ``data_dir`` (or its ``ml-20m`` folder).

    Example:
        >>> data = movielens_20m("data/ml-20m")  # doctest: +SKIP
        >>> data.users, data.items  # doctest: +SKIP
        (138493, 26744)
    """
    (path,) = find_files(data_dir, ["ratings.csv"], ML20M_FORMAT, ("ml-20m",))
    table = _read_table(path, ",", "userId,movieId,rating,timestamp", ML20M_FORMAT)
    return leave_one_out(table[:, 0], table[:, 1], table[:, 3], eval_negatives, seed)


def leave_one_out(
    user_ids: np.ndarray,
    item_ids: np.ndarray,
    timestamps: np.ndarray,
    eval_negatives: int = 99,
    seed: int = 0,
) -> RatingsData:
    """Hold out each user's latest interaction; sample ``eval_negatives`` unseen items for it.

    Users and items are renumbered 0.. in order of their original ids. A user whose only
    interaction is held out keeps no training positive.

    Example:
        >>> data = leave_one_out(np.array([7, 7, 9, 9]), np.array([1, 2, 1, 3]),
        ...                      np.array([5, 4, 1, 2]), eval_negatives=1)
        >>> data.train_items.tolist(), data.test_items[:, 0].tolist()
        ([1, 0], [0, 2])
    """
    _, users = np.unique(user_ids, return_inverse=True)
    item_values, items = np.unique(item_ids, return_inverse=True)
    user_count, item_count = int(users.max()) + 1, len(item_values)
    all_keys = np.unique(users.astype(np.int64) * item_count + items)
    if np.bincount(all_keys // item_count).max() >= item_count:
        raise DataFormatError("a user interacted with every item: no negative item to sample")
    # Latest per user: sort by (user, timestamp, row); the last row of each user is its test.
    order = np.lexsort((np.arange(len(users)), timestamps, users))
    last = np.ones(len(order), dtype=bool)
    last[:-1] = users[order][1:] != users[order][:-1]
    test, train = order[last], np.sort(order[~last])
    rng = np.random.default_rng(seed)
    negatives = sample_unseen(
        np.repeat(users[test], eval_negatives), item_count, all_keys, rng
    ).reshape(-1, eval_negatives)
    return RatingsData(
        users=user_count,
        items=item_count,
        train_users=torch.from_numpy(users[train].astype(np.int64)),
        train_items=torch.from_numpy(items[train].astype(np.int64)),
        seen=torch.from_numpy(np.unique(users[train].astype(np.int64) * item_count + items[train])),
        test_users=torch.from_numpy(users[test].astype(np.int64)),
        test_items=torch.from_numpy(np.column_stack([items[test], negatives]).astype(np.int64)),
    )


def sample_unseen(
    users: np.ndarray, item_count: int, seen: np.ndarray, rng: np.random.Generator
) -> np.ndarray:
    """One uniformly drawn item per entry of ``users`` that the user has not interacted with.

    ``seen`` is the sorted array of ``user * item_count + item`` of known interactions; every
    user must have an unseen item. Collisions are redrawn until none is left (draws are
    independent, so an item can repeat, as in NCF's protocol).

    Example:
        >>> seen = np.array([0 * 3 + 0, 0 * 3 + 1])  # user 0 saw items 0 and 1
        >>> sample_unseen(np.zeros(4, dtype=int), 3, seen, np.random.default_rng(0)).tolist()
        [2, 2, 2, 2]
    """
    items = rng.integers(0, item_count, len(users))
    redraw = np.arange(len(users))
    while len(redraw):
        keys = users[redraw].astype(np.int64) * item_count + items[redraw]
        position = np.minimum(np.searchsorted(seen, keys), len(seen) - 1)
        redraw = redraw[seen[position] == keys] if len(seen) else redraw[:0]
        items[redraw] = rng.integers(0, item_count, len(redraw))
    return items


def training_instances(
    data: RatingsData, negatives: int, batches: torch.Tensor, seed: int, epoch: int, rank: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(users, items, labels) shaped like ``batches``, indices into one epoch's instances.

    Instance ``j`` of an epoch is training positive ``j mod N``: labelled 1 if ``j < N``,
    otherwise paired with an unseen item (label 0) drawn from a generator seeded by
    (seed, epoch, rank); so an epoch holds ``(1 + negatives) · N`` instances and is the same
    whenever it is replayed.
    """
    count = len(data.train_users)
    flat = batches.reshape(-1)
    positive = flat % count
    users = data.train_users[positive]
    items = data.train_items[positive].clone()
    is_negative = flat >= count
    rng = np.random.default_rng([seed, epoch, rank, 7])
    drawn = sample_unseen(users[is_negative].numpy(), data.items, data.seen.numpy(), rng)
    items[is_negative] = torch.from_numpy(drawn)
    labels = (~is_negative).float()
    return users.view_as(batches), items.view_as(batches), labels.view_as(batches)


def _read_table(path: Path, delimiter: str, header: str, what: str) -> np.ndarray:
    with open(path, encoding="utf-8") as file:
        first = file.readline().strip()
        if first.replace(" ", "") != header.replace(" ", ""):
            raise DataFormatError(f"{path}: header {first!r}; expected {what}")
        try:
            table = np.loadtxt(file, delimiter=delimiter, dtype=np.float64, ndmin=2)
        except ValueError as error:
            raise DataFormatError(f"{path}: {error}; expected {what}") from None
    if table.shape[1] != 4 or len(table) == 0:
        raise DataFormatError(f"{path}: {table.shape[1]} columns; expected {what}")
    return table
