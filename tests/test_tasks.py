"""The task registry: models, metrics, recipes and config resolution (no process group)."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from microsparse_lab.training import build_resnet18
from microsparse_lab.training.config import (
    ConfigError,
    TrainConfig,
    config_from_file,
    resume_config,
)
from microsparse_lab.training.models import GoogLeNet, LSTMLanguageModel, NeuMF, SENet18, SmallCNN
from microsparse_lab.training.optim import build_optimizer, learning_rate
from microsparse_lab.training.tasks import available_tasks, get_task
from microsparse_lab.training.tasks.recommendation import hit_ratio_and_ndcg


def count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def test_cifar_resnet18_has_the_papers_parameter_count_and_is_seeded():
    model = build_resnet18(num_classes=10, seed=1)
    assert count(model) == 11_173_962
    assert model(torch.zeros(2, 3, 32, 32)).shape == (2, 10)
    again = build_resnet18(num_classes=10, seed=1)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), again.parameters()))


@pytest.mark.parametrize(
    ("build", "parameters"),
    [(lambda: SENet18(classes=100), 11_309_212), (GoogLeNet, 6_166_250)],
)
def test_other_cifar_models_classify_32x32_images(build, parameters):
    model = build().eval()
    assert count(model) == parameters
    assert model(torch.zeros(1, 3, 8, 8)).shape[1] in (10, 100)  # global pooling: any size


def test_small_cnn_adapts_to_channels_and_image_size():
    assert SmallCNN(classes=100, in_channels=3, image_size=32)(torch.zeros(2, 3, 32, 32)).shape == (
        2,
        100,
    )


def test_lstm_language_model_ties_embedding_and_decoder():
    model = LSTMLanguageModel(vocab=50, units=8, layers=3, dropout=0.4)
    assert model.decoder.weight is model.embedding.weight
    names = [name for name, _ in model.named_parameters()]
    assert "decoder.weight" not in names and "embedding.weight" in names  # listed once
    logits, (h, c) = model(torch.zeros(30, 4, dtype=torch.long), model.initial_hidden(4))
    assert logits.shape == (30, 4, 50) and h.shape == c.shape == (3, 4, 8)


def test_papers_lstm_is_three_layers_of_650_units():
    task = get_task("lm")
    assert task.model_options("lstm") == {"units": 650, "layers": 3, "dropout": 0.4}
    assert task.options["bptt"] == 30


def test_neumf_scores_user_item_pairs():
    model = NeuMF(users=5, items=7, factors=4, mlp=(8, 6, 4), dropout=0.5)
    assert model(torch.tensor([0, 4, 2]), torch.tensor([6, 0, 3])).shape == (3,)
    defaults = get_task("recommendation").model_options("neumf")
    assert defaults == {"factors": 64, "mlp": (256, 256, 128, 64), "dropout": 0.5}


def test_hit_ratio_and_ndcg_by_hand():
    # Row 0: 2 negatives above the held-out item -> rank 2: hit, NDCG 1/log2(4) = 0.5.
    # Row 1: 9 above -> rank 9: hit, 1/log2(11). Row 2: 10 above -> rank 10: miss.
    # Row 3: a tie counts against the held-out item -> rank 1: 1/log2(3).
    scores = torch.full((4, 12), 0.1)  # column 0: the held-out item, then 11 negatives
    scores[:, 0] = 0.5
    scores[0, 1:3] = 0.9
    scores[1, 1:10] = 0.9
    scores[2, 1:11] = 0.9
    scores[3, 5] = 0.5
    hit, gain = hit_ratio_and_ndcg(scores, k=10)
    assert hit.tolist() == [1.0, 1.0, 0.0, 1.0]
    expected = [0.5, 1 / math.log2(11), 0.0, 1 / math.log2(3)]
    assert gain.tolist() == pytest.approx(expected)


def test_registry_lists_the_papers_workloads_with_their_metrics():
    assert available_tasks() == ["cifar10", "cifar100", "lm", "mnist", "recommendation"]
    headline = {name: get_task(name).metrics[0] for name in available_tasks()}
    assert headline["cifar10"].name == "test_accuracy" and headline["cifar10"].higher_is_better
    assert headline["lm"].name == "valid_perplexity" and not headline["lm"].higher_is_better
    assert [m.name for m in get_task("recommendation").metrics] == ["hr@10", "ndcg@10"]


def test_real_data_gets_the_papers_recipe():
    cifar = TrainConfig(task="cifar10", data_dir="x").resolved()
    assert (cifar.epochs, cifar.lr, cifar.lr_reference_batch, cifar.nesterov) == (
        200,
        0.1,
        128,
        True,
    )
    assert (cifar.weight_decay, cifar.warmup_epochs, cifar.decay_epochs) == (1e-4, 5, (150,))
    lm = TrainConfig(task="lm", data_dir="x", model="lstm").resolved()
    assert (lm.epochs, lm.lr, lm.lr_reference_batch, lm.clip) == (90, 2.5, 64, 0.4)
    assert lm.decay_epochs == (60, 80) and lm.momentum == 0
    rec = TrainConfig(task="recommendation", data_dir="x").resolved()
    assert (rec.optimizer, rec.lr, rec.epochs, rec.task_options["negatives"]) == (
        "adam",
        0.0045,
        30,
        4,
    )


def test_given_values_override_the_recipe():
    config = TrainConfig(task="lm", lr=1.0, clip=0.0, model_options={"units": 16}).resolved()
    assert config.lr == 1.0 and config.clip == 0.0
    assert config.model_options == {"units": 16, "layers": 2, "dropout": 0.2}


@pytest.mark.parametrize(
    ("changes", "field", "fragment"),
    [
        ({"task": "nope"}, "task", "cifar10, cifar100, lm, mnist, recommendation"),
        ({"model": "vgg"}, "model", "smallcnn, resnet18, senet18, googlenet"),
        ({"task": "lm", "model_options": {"width": 3}}, "model_options", "units, layers"),
        ({"task_options": {"bptt": 3}}, "task_options", "accepted: none"),
        ({"optimizer": "lion"}, "optimizer", "sgd or adam"),
        ({"integration": "ddp", "capture_gradients": "x"}, "capture_gradients", "loop"),
    ],
)
def test_bad_config_names_the_field_and_the_choices(changes, field, fragment):
    with pytest.raises(ConfigError, match=fragment) as error:
        TrainConfig(**changes).resolved()
    assert error.value.field == field


def test_config_file_keys_are_checked(tmp_path):
    path = tmp_path / "config.json"
    path.write_text('{"task": "lm", "lr": 5, "decay_epochs": [2, 3]}')
    config = TrainConfig(**config_from_file(path)).resolved()
    assert config.lr == 5 and config.decay_epochs == (2, 3)
    path.write_text('{"learning_rate": 5}')
    with pytest.raises(ConfigError, match="unknown key 'learning_rate'"):
        config_from_file(path)


def test_resuming_refuses_changes_that_would_not_continue_exactly():
    saved = {"task": "lm", "lr": 5.0, "max_steps": 10, "decay_epochs": [2]}
    config = resume_config(saved, {"epochs": 9, "decay_epochs": (2,)}, "runs/x")
    assert config.epochs == 9 and config.resume and config.out == "runs/x"
    assert config.max_steps == 10  # the run stops where it was told to, unless told otherwise
    with pytest.raises(ConfigError, match="cannot change when resuming") as error:
        resume_config(saved, {"lr": 1.0}, "runs/x")
    assert error.value.field == "lr"


def test_learning_rate_scales_with_workers_warms_up_and_decays():
    config = TrainConfig(task="cifar10", data_dir="x").resolved()  # 0.1 x 32 n / 128
    steps = 100
    assert learning_rate(config, 0, steps, world_size=1) == pytest.approx(0.025)
    assert learning_rate(config, 0, steps, world_size=16) == pytest.approx(0.025)  # 1/n of 0.4
    assert learning_rate(config, 250, steps, world_size=16) == pytest.approx(0.025 + 0.375 / 2)
    assert learning_rate(config, 500, steps, world_size=16) == pytest.approx(0.4)
    assert learning_rate(config, 149 * steps, steps, world_size=16) == pytest.approx(0.4)
    assert learning_rate(config, 150 * steps, steps, world_size=16) == pytest.approx(0.04)
    adam = TrainConfig(task="recommendation").resolved()
    assert learning_rate(adam, 0, steps, world_size=4) == adam.lr  # not scaled


def test_sgd_has_nesterov_and_no_weight_decay_on_batch_norm():
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Flatten(), nn.Linear(4, 2))
    optimizer = build_optimizer(model, TrainConfig(task="cifar10", data_dir="x").resolved())
    decayed, exempt = optimizer.param_groups
    assert decayed["nesterov"] and decayed["momentum"] == 0.9
    assert decayed["weight_decay"] == 1e-4 and exempt["weight_decay"] == 0.0
    norm_ids = {id(m.weight) for m in model.modules() if isinstance(m, nn.BatchNorm2d)}
    assert norm_ids <= {id(p) for p in exempt["params"]}
    assert not norm_ids & {id(p) for p in decayed["params"]}
    assert len(decayed["params"]) + len(exempt["params"]) == len(list(model.parameters()))


def test_adam_takes_the_recipes_betas():
    config = TrainConfig(task="recommendation", adam_correction=False).resolved()
    optimizer = build_optimizer(NeuMF(3, 4, 2, (4, 2)), config)
    assert isinstance(optimizer, torch.optim.Adam)
    assert optimizer.param_groups[0]["betas"] == (0.25, 0.9949)


@pytest.mark.parametrize(
    "options, on",
    [
        ({"task": "recommendation"}, True),  # the Adam recipe: Adam moves into the feedback
        ({"task": "recommendation", "adam_correction": False}, False),
        ({"task": "recommendation", "sparsifier": "dense"}, False),  # no error feedback
        ({"task": "recommendation", "weight_decay": 1e-4}, False),  # it cannot run then
        ({"task": "recommendation", "integration": "ddp"}, True),
        ({"task": "recommendation", "integration": "ddp", "ddp_hook": "fp16"}, False),
        ({"task": "lm", "optimizer": "adam"}, False),  # the recipe clips
        ({"task": "mnist"}, False),  # SGD
    ],
)
def test_adam_correction_is_on_by_default_where_it_applies(options, on):
    config = TrainConfig(**options).resolved()
    assert config.adam_correction is on
    optimizer = build_optimizer(NeuMF(3, 4, 2, (4, 2)), config)
    expected = torch.optim.Adam if config.optimizer == "adam" and not on else torch.optim.SGD
    assert type(optimizer) is expected
