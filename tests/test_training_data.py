"""The embedded MNIST task and the per-epoch sharding across ranks."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch

from microsparse.training.data import load_mnist, shard_batches, stratified_split


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
