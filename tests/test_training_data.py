"""Datasets: the embedded defaults, the real-data loaders on tiny files in the real formats,
and the per-epoch sharding across ranks."""

from __future__ import annotations

import importlib.util
import pickle

import numpy as np
import pytest
import torch

from microsparse_lab.training.data import (
    DataFormatError,
    MissingDataError,
    load_cifar,
    load_mnist,
    shard_batches,
    stratified_split,
)
from microsparse_lab.training.data.images import cifar_data, random_crop_and_flip
from microsparse_lab.training.data.ratings import movielens_20m, movielens_100k, training_instances
from microsparse_lab.training.data.text import embedded_text, strip_wikitext, tokenize, wikitext
from tiny_datasets import write_cifar, write_ratings, write_wikitext


@pytest.fixture(scope="module")
def mnist():
    return load_mnist()


def test_mnist_has_4000_train_and_1000_test_images(mnist):
    train, test = mnist
    assert train.inputs.shape == (4000, 1, 28, 28)
    assert test.inputs.shape == (1000, 1, 28, 28)
    assert train.inputs.dtype == torch.float32
    assert train.labels.shape == (4000,) and test.labels.shape == (1000,)
    assert train.labels.dtype == torch.int64


def test_mnist_split_is_stratified(mnist):
    train, test = mnist
    assert torch.bincount(train.labels, minlength=10).tolist() == [400] * 10
    assert torch.bincount(test.labels, minlength=10).tolist() == [100] * 10


def test_mnist_is_standardised_with_training_statistics(mnist):
    train, test = mnist
    assert abs(train.inputs.mean().item()) < 1e-4
    assert abs(train.inputs.std().item() - 1) < 1e-3
    assert abs(test.inputs.mean().item()) < 0.1  # same transform, other images
    assert train.inputs.min().item() < -0.3 and train.inputs.max().item() > 2.0


def test_mnist_split_is_deterministic_for_a_seed(mnist):
    again = load_mnist(seed=0)
    other = load_mnist(seed=1)
    for part, same, different in zip(mnist, again, other, strict=True):
        assert torch.equal(part.inputs, same.inputs) and torch.equal(part.labels, same.labels)
        assert not torch.equal(part.inputs, different.inputs)


def test_stratified_split_is_a_partition():
    labels = np.repeat(np.arange(5), [30, 10, 20, 20, 20])
    train, test = stratified_split(labels, 0.8, seed=3)
    assert sorted(np.concatenate([train, test]).tolist()) == list(range(len(labels)))
    assert np.bincount(labels[test]).tolist() == [6, 2, 4, 4, 4]


def test_missing_mlxtend_names_the_extra_to_install(monkeypatch):
    real_find_spec = importlib.util.find_spec

    def find_spec(name, *args):
        return None if name == "mlxtend" else real_find_spec(name, *args)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    with pytest.raises(ModuleNotFoundError, match=r"pip install 'microsparse\[data\]'"):
        load_mnist()


@pytest.mark.parametrize(
    ("num_samples", "batch_size", "world_size"), [(4000, 32, 4), (100, 7, 3), (10, 5, 1)]
)
def test_shards_are_disjoint_equal_and_cover_the_epoch_minus_remainder(
    num_samples, batch_size, world_size
):
    shards = [
        shard_batches(num_samples, batch_size, rank, world_size, seed=5, epoch=2)
        for rank in range(world_size)
    ]
    steps = num_samples // (batch_size * world_size)
    assert all(shard.shape == (steps, batch_size) for shard in shards)
    everything = torch.cat([shard.flatten() for shard in shards])
    assert everything.unique().numel() == everything.numel() == steps * batch_size * world_size
    assert everything.min() >= 0 and everything.max() < num_samples


def test_shards_are_reproducible_and_reshuffled_every_epoch():
    first = shard_batches(4000, 32, rank=1, world_size=4, seed=5, epoch=0)
    assert torch.equal(first, shard_batches(4000, 32, rank=1, world_size=4, seed=5, epoch=0))
    assert not torch.equal(first, shard_batches(4000, 32, rank=1, world_size=4, seed=5, epoch=1))
    assert not torch.equal(first, shard_batches(4000, 32, rank=1, world_size=4, seed=6, epoch=0))


# ---- CIFAR python batches ------------------------------------------------------------------


@pytest.mark.parametrize("classes", [10, 100])
def test_cifar_loads_the_python_batches_as_uint8_images(classes, tmp_path):
    directory = write_cifar(tmp_path / "cifar", classes, per_file=4)
    train, test = load_cifar(directory, classes)
    train_files = 5 if classes == 10 else 1
    assert train.inputs.shape == (4 * train_files, 3, 32, 32) and train.inputs.dtype == torch.uint8
    assert test.inputs.shape == (4, 3, 32, 32) and test.labels.dtype == torch.int64
    name = "data_batch_1" if classes == 10 else "train"
    with open(directory / name, "rb") as file:
        first = pickle.load(file, encoding="bytes")
    # Channel-major rows: the first 1024 bytes are the red plane of the first image.
    assert train.inputs[0, 0].flatten().tolist() == first[b"data"][0, :1024].tolist()
    label_key = b"labels" if classes == 10 else b"fine_labels"
    assert train.labels[:4].tolist() == first[label_key]


def test_cifar_is_found_in_the_archive_folder(tmp_path):
    write_cifar(tmp_path / "cifar-10-batches-py", 10, per_file=2)
    train, _ = load_cifar(tmp_path, 10)
    assert len(train.labels) == 10


@pytest.mark.parametrize(("classes", "missing"), [(10, "data_batch_3"), (100, "test")])
def test_missing_cifar_file_is_named_with_the_expected_format(classes, missing, tmp_path):
    directory = write_cifar(tmp_path / "cifar", classes, per_file=2)
    (directory / missing).unlink()
    with pytest.raises(MissingDataError, match=f"missing {missing}; expected the CIFAR-{classes}"):
        load_cifar(directory, classes)


def test_cifar_file_in_another_format_is_refused(tmp_path):
    directory = write_cifar(tmp_path / "cifar", 10, per_file=2)
    with open(directory / "test_batch", "wb") as file:
        pickle.dump({b"data": np.zeros((2, 100), dtype=np.uint8), b"labels": [0, 1]}, file)
    with pytest.raises(DataFormatError, match="test_batch.*expected the CIFAR-10"):
        load_cifar(directory, 10)


def test_cifar_data_is_normalised_with_training_channel_statistics(tmp_path):
    data = cifar_data(write_cifar(tmp_path / "cifar", 10, per_file=16), 10)
    images = data.prepare(data.train.inputs)
    assert images.dtype == torch.float32
    assert images.mean(dim=(0, 2, 3)).abs().max() < 1e-4
    assert (images.std(dim=(0, 2, 3)) - 1).abs().max() < 1e-2
    assert data.augment and data.classes == 10 and data.channels == 3 and data.size == 32


def test_random_crop_and_flip_moves_whole_images():
    images = torch.arange(2 * 3 * 8 * 8, dtype=torch.float32).view(2, 3, 8, 8)
    torch.manual_seed(0)
    out = random_crop_and_flip(images, padding=2)
    assert out.shape == images.shape
    for original, crop in zip(images, out):
        # Every crop is a window of the zero-padded image, flipped or not.
        padded = torch.nn.functional.pad(original, (2, 2, 2, 2))
        windows = [
            padded[:, r : r + 8, c : c + 8].flip(-1) if flip else padded[:, r : r + 8, c : c + 8]
            for r in range(5)
            for c in range(5)
            for flip in (False, True)
        ]
        assert any(torch.equal(crop, window) for window in windows)


# ---- language modelling --------------------------------------------------------------------


def test_wikitext_reads_lines_with_eos_and_builds_the_training_vocabulary(tmp_path):
    data = wikitext(write_wikitext(tmp_path / "wt2"))
    words = [data.vocabulary[i] for i in data.train.tolist()]
    assert words[:4] == ["=", "Valkyria", "=", "<eos>"]
    assert words.count("<eos>") == 4  # one per line, blank lines included
    assert data.vocabulary[0] == "<unk>" and data.vocabulary[1] in ("<eos>", "sat", "the")
    valid = [data.vocabulary[i] for i in data.valid.tolist()]
    assert valid == ["the", "cat", "<unk>", ".", "<eos>"]  # "ran" is not a training word


def test_wikitext_vocabulary_cap_maps_rare_words_to_unk(tmp_path):
    data = wikitext(write_wikitext(tmp_path / "wt2"), vocab_size=3)
    assert data.vocab_size == 4 and data.vocabulary[0] == "<unk>"
    assert (data.train == 0).sum() > 0


def test_missing_wikitext_file_is_named_with_the_expected_format(tmp_path):
    directory = write_wikitext(tmp_path / "wt2")
    (directory / "wiki.valid.tokens").unlink()
    with pytest.raises(MissingDataError, match="missing wiki.valid.tokens; expected WikiText-2"):
        wikitext(directory)


def test_embedded_wikipedia_extract_is_plain_lowercase_text():
    data = embedded_text()
    assert data.vocab_size == 10_001 and data.vocabulary[0] == "<unk>"
    assert data.train.numel() > 400_000 and data.valid.numel() > 40_000
    assert data.train.dtype == torch.long and data.train.max() < data.vocab_size
    words = set(data.vocabulary)
    assert {"the", "<eos>", "anarchism", "."} <= words
    assert not any(mark in word for word in words for mark in ("[[", "{{", "|", "<ref"))
    assert (data.train == 0).float().mean() < 0.1  # few unknown words with 10,000 kept


def test_markup_is_stripped_and_text_tokenised():
    text = strip_wikitext("{{Infobox|a={{b}}}}'''Cats''' are [[Felidae|felids]].<ref>x</ref>")
    assert tokenize(text) == ["cats", "are", "felids", "."]


# ---- recommendation ------------------------------------------------------------------------


def test_movielens_20m_csv_holds_out_each_users_latest_rating(tmp_path):
    data = movielens_20m(write_ratings(tmp_path / "ml", users=6, items=120, per_user=5), 99)
    assert data.users == 6 and data.items <= 30
    assert len(data.train_users) == 6 * 4 and tuple(data.test_items.shape) == (6, 100)
    # write_ratings gives later ratings larger timestamps: the held-out item is the last one.
    table = np.loadtxt(tmp_path / "ml" / "ratings.csv", delimiter=",", skiprows=1)
    items = np.unique(table[:, 1])
    last = [np.searchsorted(items, table[table[:, 0] == u][-1, 1]) for u in range(1, 7)]
    assert data.test_items[:, 0].tolist() == last


def test_movielens_negatives_are_items_the_user_never_rated(tmp_path):
    data = movielens_20m(write_ratings(tmp_path / "ml", users=4, items=150, per_user=20), 99)
    for user, row in zip(data.test_users.tolist(), data.test_items.tolist()):
        rated = set(data.train_items[data.train_users == user].tolist()) | {row[0]}
        assert not rated & set(row[1:])


def test_missing_ratings_file_is_named_with_the_expected_format(tmp_path):
    with pytest.raises(MissingDataError, match="missing ratings.csv; expected MovieLens-20M"):
        movielens_20m(tmp_path)


def test_ratings_file_with_another_header_is_refused(tmp_path):
    (tmp_path / "ratings.csv").write_text("user,item\n1,2\n")
    with pytest.raises(DataFormatError, match="header 'user,item'; expected MovieLens-20M"):
        movielens_20m(tmp_path)


needs_recbole = pytest.mark.skipif(
    importlib.util.find_spec("recbole") is None,
    reason="MovieLens-100K ships in recbole: pip install --no-deps recbole",
)


@needs_recbole
def test_embedded_movielens_100k_has_every_user_in_the_test():
    data = movielens_100k()
    assert (data.users, data.items) == (943, 1682)
    assert len(data.train_users) + data.users == 100_000
    assert sorted(data.test_users.tolist()) == list(range(943))
    assert data.test_items.shape == (943, 100) and data.test_items.max() < 1682


def test_training_instances_pair_each_positive_with_unseen_negatives(tmp_path):
    data = movielens_20m(write_ratings(tmp_path, users=20, items=300, per_user=40))
    count = 5 * len(data.train_users)
    batches = shard_batches(count, 64, rank=1, world_size=2, seed=3, epoch=0)
    users, items, labels = training_instances(data, 4, batches, seed=3, epoch=0, rank=1)
    assert users.shape == items.shape == labels.shape == batches.shape
    assert abs(labels.mean().item() - 0.2) < 0.05
    keys = (users * data.items + items)[labels == 0].numpy()
    assert not np.isin(keys, data.seen.numpy()).any()
    again = training_instances(data, 4, batches, seed=3, epoch=0, rank=1)
    assert all(torch.equal(a, b) for a, b in zip((users, items, labels), again))
