"""Tiny real models and data for the tests: the healthy architectures every detector must stay quiet on."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from wbdebug.demo import digits_tensors


@dataclass
class Setup:
    model: nn.Module
    optimizer: torch.optim.Optimizer
    criterion: nn.Module
    batch: Callable[[int], tuple[torch.Tensor, torch.Tensor]]  # step -> (inputs, targets)
    clip: float | None = None


def _sampler(x: torch.Tensor, y: torch.Tensor, batch_size: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)

    def batch(step: int):
        idx = torch.randint(0, len(x), (batch_size,), generator=gen)
        return x[idx], y[idx]

    return batch


def digits(batch_size: int = 64):
    x, y, _, _ = digits_tensors()
    return _sampler(x, y, batch_size)


def mlp() -> Setup:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
    return Setup(model, torch.optim.Adam(model.parameters(), 1e-3), nn.CrossEntropyLoss(), digits())


class SmallCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 8, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 16, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(16)
        self.head = nn.Linear(16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.view(-1, 1, 8, 8)
        x = F.max_pool2d(F.relu(self.bn1(self.conv1(x))), 2)
        x = F.relu(self.bn2(self.conv2(x)))
        return self.head(x.mean(dim=(2, 3)))


def cnn_batchnorm() -> Setup:
    torch.manual_seed(0)
    model = SmallCNN()
    return Setup(model, torch.optim.SGD(model.parameters(), 0.05, momentum=0.9), nn.CrossEntropyLoss(), digits())


class ResidualBlock(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, 2 * width)
        self.fc2 = nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.relu(self.fc1(self.norm(x))))


class DeepResNet(nn.Module):
    def __init__(self, depth: int = 16, width: int = 32) -> None:
        super().__init__()
        self.stem = nn.Linear(64, width)
        self.blocks = nn.ModuleList(ResidualBlock(width) for _ in range(depth))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def deep_residual() -> Setup:
    torch.manual_seed(0)
    model = DeepResNet()
    return Setup(model, torch.optim.AdamW(model.parameters(), 1e-3), nn.CrossEntropyLoss(), digits())


class TinyTransformer(nn.Module):
    """A 2-layer encoder classifying token sequences (token ids in, class logits out)."""

    def __init__(self, vocab: int = 32, width: int = 32, classes: int = 4, seq: int = 12) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.pos = nn.Parameter(torch.randn(seq, width) * 0.02)
        layer = nn.TransformerEncoderLayer(width, 4, 2 * width, dropout=0.1, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(width, classes)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.encoder(self.embed(tokens) + self.pos)
        return self.head(h.mean(dim=1))


def transformer() -> Setup:
    torch.manual_seed(0)
    model = TinyTransformer()
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 32, (1024, 12), generator=gen)
    labels = tokens[:, 0] % 4  # the class is in the first token
    return Setup(
        model, torch.optim.AdamW(model.parameters(), 1e-3), nn.CrossEntropyLoss(), _sampler(tokens, labels, 32)
    )


def regression() -> Setup:
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(2048, 8, generator=gen)
    y = torch.sin(x[:, :1] * 2) + 0.5 * x[:, 1:2] * x[:, 2:3] + 0.05 * torch.randn(2048, 1, generator=gen)
    model = nn.Sequential(nn.Linear(8, 64), nn.Tanh(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1))
    return Setup(model, torch.optim.Adam(model.parameters(), 3e-3), nn.MSELoss(), _sampler(x, y, 64))


def binary_classifier() -> Setup:
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(2048, 10, generator=gen)
    y = ((x[:, 0] + x[:, 1] * x[:, 2]) > 0).float().unsqueeze(1)
    model = nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 1))
    return Setup(model, torch.optim.Adam(model.parameters(), 3e-3), nn.BCEWithLogitsLoss(), _sampler(x, y, 64))


def frozen_layers() -> Setup:
    setup = mlp()
    for p in setup.model[0].parameters():
        p.requires_grad_(False)
    setup.optimizer = torch.optim.Adam([p for p in setup.model.parameters() if p.requires_grad], 1e-3)
    return setup


def clipped_gradients() -> Setup:
    setup = mlp()
    setup.optimizer = torch.optim.SGD(setup.model.parameters(), 0.1, momentum=0.9)
    setup.clip = 0.5
    return setup


HEALTHY: dict[str, Callable[[], Setup]] = {
    "mlp": mlp,
    "cnn_batchnorm": cnn_batchnorm,
    "deep_residual": deep_residual,
    "transformer": transformer,
    "regression": regression,
    "binary_classifier": binary_classifier,
    "frozen_layers": frozen_layers,
    "clipped_gradients": clipped_gradients,
}


def train(setup: Setup, steps: int, *, start: int = 0, corrupt: Callable | None = None) -> list[float]:
    """The ordinary loop a user writes; ``corrupt(step, x, y) -> (x, y)`` injects a bug."""
    losses = []
    for step in range(start, start + steps):
        x, y = setup.batch(step)
        if corrupt is not None:
            x, y = corrupt(step, x, y)
        setup.optimizer.zero_grad()
        loss = setup.criterion(setup.model(x), y)
        loss.backward()
        if setup.clip is not None:
            torch.nn.utils.clip_grad_norm_(setup.model.parameters(), setup.clip)
        setup.optimizer.step()
        losses.append(loss.item())
    return losses


def log_c(classes: int) -> float:
    return math.log(classes)
