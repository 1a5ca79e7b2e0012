"""The demo: a small classifier on scikit-learn's digits (ships inside the package, no download),
healthy or with one of the seed's bugs injected, trained with ``watch`` on."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

#: bug name -> what it injects (shown by ``wbdebug demo --help``).
BUGS: dict[str, str] = {
    "lr": "learning rate far too high (SGD lr=5): gradients explode, then the loss goes NaN",
    "dead_relu": "hidden-layer biases initialised to -10: every ReLU is dead, no gradient reaches the first layers",
    "init": "output layer weights scaled by 50: the step-0 loss is far above log(10)",
    "nan": "a corrupt negative pixel at step 150 reaches the log-compression layer: log1p(-2) is NaN",
    "spike": "a corrupted batch at step 200 (shuffled labels, pixels x30): a loss spike, then recovery",
}


def digits_tensors(
    seed: int = 0, standardize: bool = True
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Digits features (8x8 pixels, 0..16; standardised unless told not to) and labels, split 80/20."""
    from sklearn.datasets import load_digits

    data = load_digits()
    x = torch.tensor(data.data, dtype=torch.float32)
    y = torch.tensor(data.target, dtype=torch.long)
    gen = torch.Generator().manual_seed(seed)
    order = torch.randperm(len(x), generator=gen)
    x, y = x[order], y[order]
    n_train = int(0.8 * len(x))
    if not standardize:
        return x[:n_train], y[:n_train], x[n_train:], y[n_train:]
    mean = x[:n_train].mean(0)
    std = x[:n_train].std(0).clamp_min(1e-3)  # constant border pixels: keep them at 0, not inf
    x = (x - mean) / std
    return x[:n_train], y[:n_train], x[n_train:], y[n_train:]


def digits_mlp(hidden: int = 64) -> nn.Sequential:
    """64 → hidden → hidden → 10 ReLU MLP."""
    return nn.Sequential(
        nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, 10)
    )


class PixelLog(nn.Module):
    """Log-compresses raw pixel intensities (0..16): a corrupt negative pixel makes it NaN."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log1p(x)


@dataclass
class DemoResult:
    monitor: Any
    losses: list[float] = field(default_factory=list)


def run_demo(
    bug: str | None = None, *, steps: int = 300, batch_size: int = 64, seed: int = 0, **settings: Any
) -> DemoResult:
    """Train the digits MLP for ``steps`` steps with ``watch`` on; return the closed Monitor and the losses."""
    import wbdebug

    if bug is not None and bug not in BUGS:
        raise ValueError(f"unknown bug {bug!r}; expected one of: {', '.join(BUGS)}")
    torch.manual_seed(seed)
    x_train, y_train, _, _ = digits_tensors(seed, standardize=bug != "nan")
    model = digits_mlp()
    if bug == "nan":
        model = nn.Sequential(PixelLog(), *model)
    if bug == "dead_relu":
        with torch.no_grad():
            model[0].bias.fill_(-10.0)
            model[2].bias.fill_(-10.0)
    if bug == "init":
        with torch.no_grad():
            model[-1].weight.mul_(50.0)
    if bug == "lr":
        optimizer: torch.optim.Optimizer = torch.optim.SGD(model.parameters(), lr=5.0, momentum=0.9)
    else:
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    criterion = nn.CrossEntropyLoss()
    gen = torch.Generator().manual_seed(seed)
    settings.setdefault("wandb_project", "wbdebug-demo")
    monitor = wbdebug.watch(model, optimizer, criterion, **settings)
    losses: list[float] = []
    with monitor:
        for step in range(steps):
            idx = torch.randint(0, len(x_train), (batch_size,), generator=gen)
            x, y = x_train[idx], y_train[idx]
            if bug == "nan" and step == 150:
                x = x.clone()
                x[0, 10] = -2.0
            if bug == "spike" and step == 200:
                x = x * 30.0
                y = y[torch.randperm(len(y), generator=gen)]
            optimizer.zero_grad()
            loss = criterion(model(x), y)
            loss.backward()
            optimizer.step()
            losses.append(loss.item())  # the demo's own progress display, not wbdebug's
    return DemoResult(monitor, losses)
