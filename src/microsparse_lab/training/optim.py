"""The recipe's optimiser and learning-rate schedule (docs/METHOD.md, "The paper's recipes")."""

from __future__ import annotations

import torch
from torch import nn

from microsparse_lab.training.config import TrainConfig


def build_optimizer(model: nn.Module, config: TrainConfig) -> torch.optim.Optimizer:
    """SGD (Nesterov if asked and momentum > 0) or Adam; no weight decay on batch norm.

    It steps on ``p.grad``, which the averaging has replaced by the sparse average of all
    workers' gradients, so momentum and weight decay act on the average; with
    ``momentum_correction`` the momentum is in the averaged values already, and SGD runs
    without its own; with ``adam_correction`` the averaged values are Adam steps, applied by
    plain SGD at Adam's rate.

    Example:
        >>> config = TrainConfig().resolved()
        >>> build_optimizer(nn.Linear(2, 1), config).param_groups[0]["nesterov"]
        True
    """
    norm_ids = {
        id(p)
        for module in model.modules()
        if isinstance(module, nn.modules.batchnorm._BatchNorm)
        for p in module.parameters(recurse=False)
    }
    parameters = list(model.parameters())
    groups = [
        {"params": [p for p in parameters if id(p) not in norm_ids]},
        {"params": [p for p in parameters if id(p) in norm_ids], "weight_decay": 0.0},
    ]
    groups = [group for group in groups if group["params"]]
    if config.optimizer == "adam" and config.adam_correction:  # Adam is in the averaged steps
        return torch.optim.SGD(groups, lr=config.lr)
    if config.optimizer == "adam":
        return torch.optim.Adam(
            groups, lr=config.lr, betas=config.betas, weight_decay=config.weight_decay
        )
    # With momentum correction the averaged update already carries the momentum.
    momentum = 0.0 if config.momentum_correction else config.momentum
    return torch.optim.SGD(
        groups,
        lr=config.lr,
        momentum=momentum,
        nesterov=bool(config.nesterov and momentum),
        weight_decay=config.weight_decay,
    )


def learning_rate(config: TrainConfig, step: int, steps_per_epoch: int, world_size: int) -> float:
    """The learning rate of ``step``: scaled with the workers, warmed up, decayed in steps.

    Scaled: ``lr · batch_size · workers / lr_reference_batch`` (unscaled if the reference is 0).
    Warm-up: linear from 1/workers of that to all of it over ``warmup_epochs``. Decay: times
    ``decay_factor`` at each of ``decay_epochs``.

    Example:
        >>> config = TrainConfig(task="cifar10", data_dir="x").resolved()  # paper: 0.1·32·n/128
        >>> round(learning_rate(config, 100 * 5 * 1000, 1000, world_size=16), 6)
        0.04
    """
    lr = config.lr
    if config.lr_reference_batch:
        lr *= config.batch_size * world_size / config.lr_reference_batch
    epoch = step / steps_per_epoch
    if epoch < config.warmup_epochs and world_size > 1:
        lr *= (1 + (world_size - 1) * epoch / config.warmup_epochs) / world_size
    for milestone in config.decay_epochs:
        if epoch >= milestone:
            lr *= config.decay_factor
    return lr
