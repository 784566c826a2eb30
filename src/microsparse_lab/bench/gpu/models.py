"""The models whose training step is timed: ResNet-50 and GPT-2 small, or tiny stand-ins.

A :class:`Workload` is a model template built once (seeded) on the CPU, a fixed batch, the
loss and the optimiser; every averaging method trains a fresh copy of the template.
torchvision and transformers are imported only when their model is asked for.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

Batch = tuple[torch.Tensor, ...]


@dataclass
class Workload:
    """One model's training step: template, batch, loss and optimiser."""

    name: str
    template: nn.Module
    batch: Batch
    loss: Callable[[nn.Module, Batch], torch.Tensor]
    optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer]
    autocast: torch.dtype | None = None
    """Run forward and loss under autocast to this dtype (CUDA only)."""
    description: str = ""

    @property
    def numel(self) -> int:
        """d: the model's parameter count (a shared parameter counted once)."""
        return sum(p.numel() for p in self.template.parameters())

    def fresh(self, device: torch.device) -> tuple[nn.Module, Batch]:
        """A copy of the template and the batch on ``device`` (the same for every method)."""
        return (copy.deepcopy(self.template).to(device),
                tuple(t.to(device) for t in self.batch))  # fmt: skip


def workloads(quick: bool) -> list[Callable[[], Workload | str]]:
    """Builders of the models to time, in order; a builder returns a reason if it cannot build.

    ``quick``: a small CNN and a 2-layer transformer (seconds on a CPU), else ResNet-50 and
    GPT-2 small.
    """
    if quick:
        return [tiny_cnn, tiny_transformer]
    return [resnet50, gpt2]


def _sgd(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.01, momentum=0.9)


def _adamw(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-4)


def _classify(module: nn.Module, batch: Batch) -> torch.Tensor:
    images, labels = batch
    return F.cross_entropy(module(images), labels)


def _next_token(module: nn.Module, batch: Batch) -> torch.Tensor:
    (tokens,) = batch
    logits = module(tokens)
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), tokens[:, 1:].flatten())


def _hf_causal_lm(module: nn.Module, batch: Batch) -> torch.Tensor:
    (tokens,) = batch
    return module(input_ids=tokens, labels=tokens).loss


def _images(batch: int, size: int, classes: int) -> Batch:
    generator = torch.Generator().manual_seed(0)
    return (torch.randn(batch, 3, size, size, generator=generator),
            torch.randint(classes, (batch,), generator=generator))  # fmt: skip


def _tokens(batch: int, length: int, vocabulary: int) -> Batch:
    generator = torch.Generator().manual_seed(0)
    return (torch.randint(vocabulary, (batch, length), generator=generator),)


def tiny_cnn() -> Workload:
    """A 3-layer CNN on 8 images of 3×32×32: the ResNet-50 stand-in of the dry run."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
        nn.Conv2d(16, 32, 3, stride=2, padding=1), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 10),
    )  # fmt: skip
    return Workload("tiny CNN", model, _images(8, 32, 10), _classify, _sgd,
                    description="batch 8 of 3×32×32, fp32, SGD momentum 0.9")  # fmt: skip


def tiny_transformer() -> Workload:
    """A 2-layer decoder on 4 × 32 tokens: the GPT-2 stand-in of the dry run."""
    torch.manual_seed(0)
    model = Decoder(vocabulary=1000, width=64, layers=2, heads=4, positions=64)
    return Workload("tiny transformer", model, _tokens(4, 32, 1000), _next_token, _adamw,
                    description="batch 4 × 32 tokens, fp32, AdamW")  # fmt: skip


def resnet50() -> Workload | str:
    """torchvision's ResNet-50 on 64 images of 3×224×224, fp32, SGD momentum 0.9."""
    try:
        import torchvision
    except Exception as error:  # noqa: BLE001 - absent, or built for another torch
        return f"torchvision is not importable ({type(error).__name__}: {error})"[:300]
    torch.manual_seed(0)
    return Workload(
        "ResNet-50",
        torchvision.models.resnet50(),
        _images(64, 224, 1000),
        _classify,
        _sgd,
        description="torchvision, batch 64 of 3×224×224, fp32, SGD momentum 0.9",
    )


def gpt2() -> Workload:
    """GPT-2 small (124 M) on 8 × 512 tokens under bf16 autocast, AdamW.

    transformers' ``GPT2LMHeadModel`` where it is importable, else :class:`Decoder` of the
    same size.
    """
    torch.manual_seed(0)
    try:
        import transformers

        model: nn.Module = transformers.GPT2LMHeadModel(transformers.GPT2Config())
        loss, source = _hf_causal_lm, "transformers GPT2LMHeadModel"
    except Exception as error:  # noqa: BLE001 - absent, or built for another torch
        torch.manual_seed(0)
        model = Decoder(vocabulary=50257, width=768, layers=12, heads=12, positions=1024)
        loss = _next_token
        source = f"plain-torch decoder of GPT-2 small's size (transformers: {error})"[:300]
    return Workload(
        "GPT-2 small",
        model,
        _tokens(8, 512, 50257),
        loss,
        _adamw,
        autocast=torch.bfloat16,
        description=f"{source}, batch 8 × 512 tokens, bf16 autocast, AdamW",
    )


class Decoder(nn.Module):
    """A GPT-style decoder from torch's own layers: pre-norm, causal, tied output head."""

    def __init__(self, vocabulary: int, width: int, layers: int, heads: int,
                 positions: int) -> None:  # fmt: skip
        super().__init__()
        self.embed = nn.Embedding(vocabulary, width)
        self.position = nn.Embedding(positions, width)
        layer = nn.TransformerEncoderLayer(width, heads, 4 * width, dropout=0.1,
                                           activation="gelu", batch_first=True,
                                           norm_first=True)  # fmt: skip
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocabulary, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        length = tokens.shape[1]
        where = torch.arange(length, device=tokens.device)
        mask = nn.Transformer.generate_square_subsequent_mask(length, device=tokens.device)
        hidden = self.embed(tokens) + self.position(where)
        return self.head(self.norm(self.blocks(hidden, mask=mask, is_causal=True)))
