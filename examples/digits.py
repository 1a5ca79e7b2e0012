"""Example factory for ``wbdebug check``: the demo's digits MLP, healthy or with one of the seed's bugs.

    wbdebug check --factory examples.digits:build                    # passes
    wbdebug check --factory examples.digits:build --param lr=0.01    # a sweep varies lr, seed, init_scale
    wbdebug check --factory examples.digits:build_buggy              # fails: overfit_failed, unnormalized_inputs
    wbdebug check --factory examples.digits:build --param bug=leak   # any one bug from BUGS
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

from wbdebug.checks import CheckSetup
from wbdebug.demo import digits_mlp, digits_tensors

#: bug name -> what it injects, and the event it must raise.
BUGS: dict[str, str] = {
    "softmax": "nn.Softmax at the end of the model, before CrossEntropyLoss (overfit_failed)",
    "optimizer": "the optimizer is built over another model's parameters (overfit_failed)",
    "list": "hidden layers kept in a plain Python list, not nn.ModuleList (overfit_failed)",
    "labels": "labels shifted to 1..10, with an 11-way output so nothing crashes (label_range)",
    "leak": "input column 0 replaced by the standardised label (target_leakage)",
    "val_aug": "random flips and noise on every read of the validation set (val_augmentation)",
    "overlap": "the validation rows copied from the training rows (split_overlap)",
    "raw": "raw 0-255 pixels: digits' 0-16 values scaled to 8 bits, not standardised (unnormalized_inputs)",
}


class ListMLP(nn.Module):
    """The digits MLP with its hidden layers in a plain list: only the head is registered."""

    def __init__(self, hidden: int = 64) -> None:
        super().__init__()
        self.layers = [nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU()]
        self.head = nn.Linear(hidden, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


class FlipNoise(Dataset):
    """Validation samples with a random horizontal flip and Gaussian noise on every read (the bug)."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.x, self.y = x, y

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        image = self.x[i].view(8, 8)
        if torch.rand(()) < 0.5:
            image = image.flip(1)
        return (image + 0.1 * torch.randn_like(image)).reshape(64), self.y[i]


def build(
    lr: float = 1e-3,
    batch_size: int = 64,
    hidden: int = 64,
    seed: int = 0,
    init_scale: float = 1.0,
    bug: Optional[str] = None,
    threads: Optional[int] = 1,
) -> CheckSetup:
    """The digits classifier as ``wbdebug check`` wants it: model, loss, optimizer and both loaders.

    Args:
        lr: Adam's learning rate.
        batch_size: training batch size.
        hidden: hidden width of the MLP.
        seed: seeds the initialisation and the shuffling.
        init_scale: multiplies the output layer's weights (large values fail the step-0 loss check).
        bug: one of :data:`BUGS`, or several joined by commas.
        threads: torch CPU threads for this process (a 64-unit MLP runs fastest on one); None leaves it.
    """
    bugs = set(bug.split(",")) if bug else set()
    unknown = sorted(bugs - set(BUGS))
    if unknown:
        raise ValueError(f"unknown bug(s) {unknown}; expected any of: {', '.join(BUGS)}")
    if threads is not None:
        torch.set_num_threads(threads)
    torch.manual_seed(seed)
    x_train, y_train, x_val, y_val = digits_tensors(seed)
    if "raw" in bugs:
        from sklearn.datasets import load_digits

        raw = torch.tensor(load_digits().data, dtype=torch.float32)
        order = torch.randperm(len(raw), generator=torch.Generator().manual_seed(seed))
        raw = (raw[order] * 255 / 16).round()
        x_train, x_val = raw[: len(x_train)], raw[len(x_train):]
    if "leak" in bugs:
        x_train, x_val = x_train.clone(), x_val.clone()
        x_train[:, 0] = (y_train.float() - 4.5) / 2.87
        x_val[:, 0] = (y_val.float() - 4.5) / 2.87
    if "overlap" in bugs:
        x_val, y_val = x_train[: len(x_val)].clone(), y_train[: len(y_val)].clone()
    classes = 10
    if "labels" in bugs:
        y_train, y_val, classes = y_train + 1, y_val + 1, 11

    model: nn.Module = ListMLP(hidden) if "list" in bugs else digits_mlp(hidden)
    if classes != 10:
        model[4] = nn.Linear(hidden, classes)  # type: ignore[index]
    head = model.head if isinstance(model, ListMLP) else model[-1]
    with torch.no_grad():
        head.weight.mul_(init_scale)
    if "softmax" in bugs:
        model = nn.Sequential(model, nn.Softmax(dim=1))
    params = digits_mlp(hidden).parameters() if "optimizer" in bugs else model.parameters()
    optimizer = torch.optim.Adam(params, lr=lr)

    train = DataLoader(
        TensorDataset(x_train, y_train), batch_size=batch_size, shuffle=True,
        generator=torch.Generator().manual_seed(seed),
    )
    val_set: Dataset = FlipNoise(x_val, y_val) if "val_aug" in bugs else TensorDataset(x_val, y_val)
    val = DataLoader(val_set, batch_size=256)
    return CheckSetup(model=model, criterion=nn.CrossEntropyLoss(), optimizer=optimizer, train=train, val=val,
                      num_classes=classes)


def build_buggy(**params) -> CheckSetup:
    """The seed's two classic bugs at once: softmax before CrossEntropyLoss, and raw 0-255 pixels."""
    params.setdefault("bug", "softmax,raw")
    return build(**params)
