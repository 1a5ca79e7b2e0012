"""Batches in, tensors out: the shapes the checks accept, and the user-state they must leave untouched.

A check accepts what a training loop already has: a DataLoader, a map-style Dataset, any iterable of
``(inputs, targets)`` batches, or one ``(inputs, targets)`` pair of tensors or numpy arrays.
"""

from __future__ import annotations

import contextlib
import copy
import warnings
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, IterableDataset, Subset

from wbdebug.probes.loss import logits_in_output

#: Batch size used to read a bare Dataset.
DATASET_BATCH_SIZE = 64


def to_tensor(x: Any) -> Any:
    """numpy arrays become tensors (shared memory); tensors and everything else pass through."""
    if isinstance(x, np.ndarray):
        return torch.from_numpy(np.ascontiguousarray(x))
    if isinstance(x, (tuple, list)):
        return type(x)(to_tensor(v) for v in x)
    if isinstance(x, Mapping):
        return {k: to_tensor(v) for k, v in x.items()}
    return x


def describe(x: Any) -> str:
    """A short description for error messages: ``float32 tensor (10, 64)``, ``dict with keys [...]``."""
    if isinstance(x, torch.Tensor):
        return f"{str(x.dtype).removeprefix('torch.')} tensor {tuple(x.shape)}"
    if isinstance(x, np.ndarray):
        return f"{x.dtype} array {x.shape}"
    if isinstance(x, Mapping):
        return f"dict with keys {sorted(map(str, x))[:6]}"
    if isinstance(x, (tuple, list)):
        return f"{type(x).__name__} of {len(x)}"
    return type(x).__name__


def split_batch(batch: Any, where: str) -> tuple[Any, torch.Tensor]:
    """``(inputs, targets)`` from a batch, both as tensors, with matching first dimensions."""
    if isinstance(batch, Mapping) or not isinstance(batch, (tuple, list)) or len(batch) < 2:
        raise TypeError(f"{where} is a {describe(batch)}; expected an (inputs, targets) pair")
    inputs, targets = to_tensor(batch[0]), to_tensor(batch[1])
    if not isinstance(targets, torch.Tensor):
        raise TypeError(f"{where}: targets are a {describe(targets)}; expected a tensor or numpy array")
    n_in, n_t = rows(inputs, f"{where} inputs"), rows(targets, f"{where} targets")
    if n_in != n_t:
        raise ValueError(
            f"{where}: inputs have {n_in} rows but targets have {n_t}; expected the same first dimension"
        )
    if n_in == 0:
        raise ValueError(f"{where} is empty; expected at least one sample")
    return inputs, targets


def rows(x: Any, what: str) -> int:
    """The batch dimension of a tensor, or of the first tensor in a tuple/list/dict of them."""
    if isinstance(x, torch.Tensor):
        if x.ndim == 0:
            raise ValueError(f"{what} is a 0-dim tensor; expected a batch with a first (batch) dimension")
        return int(x.shape[0])
    items = list(x.values()) if isinstance(x, Mapping) else list(x) if isinstance(x, (tuple, list)) else []
    for item in items:
        if isinstance(item, torch.Tensor):
            return rows(item, what)
    raise TypeError(f"{what} are a {describe(x)}; expected a tensor, a numpy array, or a tuple/dict of them")


def map_tensors(x: Any, fn) -> Any:
    if isinstance(x, torch.Tensor):
        return fn(x)
    if isinstance(x, (tuple, list)):
        return type(x)(map_tensors(v, fn) for v in x)
    if isinstance(x, Mapping):
        return {k: map_tensors(v, fn) for k, v in x.items()}
    return x


def take_rows(x: Any, n: int) -> Any:
    return map_tensors(x, lambda t: t[:n])


def to_device(x: Any, device: torch.device) -> Any:
    return map_tensors(x, lambda t: t.to(device))


def call_model(model: nn.Module, inputs: Any) -> Any:
    """``model(x)``, ``model(*x)`` for a tuple, ``model(**x)`` for a dict — with a one-line error if it fails."""
    try:
        if isinstance(inputs, Mapping):
            return model(**inputs)
        if isinstance(inputs, (tuple, list)):
            return model(*inputs)
        return model(inputs)
    except Exception as exc:  # the user's forward: report it as bad input, with its own message
        raise ValueError(
            f"the model's forward failed on inputs {describe(inputs)}: {type(exc).__name__}: {first_line(exc)}"
        ) from exc


def prediction(output: Any) -> torch.Tensor:
    """What the criterion gets: the output tensor, or the ``logits`` of a Hugging Face-style output."""
    if isinstance(output, torch.Tensor):
        return output
    logits = logits_in_output(output)
    if logits is None:
        raise TypeError(f"the model returned a {describe(output)}; expected a tensor (or an output with .logits)")
    return logits


def compute_loss(criterion: Any, pred: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """``criterion(pred, targets)`` as a scalar (the mean of an unreduced loss), or a one-line ValueError."""
    try:
        with warnings.catch_warnings():
            # MSELoss/L1Loss broadcast (N, C) against (N,) silently, with only this warning
            warnings.filterwarnings("error", message=".*target size.*different to the input size")
            loss = criterion(pred, targets)
    except Exception as exc:
        raise ValueError(
            f"the criterion {criterion_name(criterion)} does not accept the model output {describe(pred)} "
            f"with targets {describe(targets)}: {type(exc).__name__}: {first_line(exc)}"
        ) from exc
    if not isinstance(loss, torch.Tensor) or not loss.is_floating_point():
        raise TypeError(f"the criterion returned a {describe(loss)}; expected a floating-point loss tensor")
    return loss if loss.numel() == 1 else loss.mean()


def criterion_name(criterion: Any) -> str:
    return f"{type(criterion).__name__}()" if isinstance(criterion, nn.Module) else getattr(
        criterion, "__name__", type(criterion).__name__
    )


def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def model_device(model: nn.Module) -> torch.device:
    for t in model.parameters():
        return t.device
    for t in model.buffers():
        return t.device
    return torch.device("cpu")


def is_array_pair(data: Any) -> bool:
    """``(X, y)``: one batch given as two arrays, rather than an iterable of batches."""
    return (
        isinstance(data, (tuple, list))
        and len(data) == 2
        and all(isinstance(v, (torch.Tensor, np.ndarray)) for v in data)
    )


def iter_batches(data: Any, where: str, *, max_items: int | None = None, seed: int = 0) -> Iterator[Any]:
    """Raw batches of a DataLoader, a Dataset (read in order, or a seeded random subset of ``max_items``),
    an ``(X, y)`` pair (one batch), or any iterable of batches."""
    if isinstance(data, DataLoader):
        yield from data
    elif isinstance(data, IterableDataset):
        yield from DataLoader(data, batch_size=DATASET_BATCH_SIZE)
    elif isinstance(data, Dataset):
        n = len(data)  # type: ignore[arg-type]
        if max_items is not None and n > max_items:
            # a random subset: a dataset sorted by class must not look like one class
            idx = torch.randperm(n, generator=torch.Generator().manual_seed(seed))[:max_items].sort().values
            data = Subset(data, idx.tolist())
        yield from DataLoader(data, batch_size=DATASET_BATCH_SIZE, shuffle=False)
    elif is_array_pair(data):
        yield tuple(data)
    elif isinstance(data, Iterable) and not isinstance(data, (str, bytes, Mapping, torch.Tensor, np.ndarray)):
        yield from data
    else:
        raise TypeError(
            f"{where} is a {describe(data)}; expected a DataLoader, a Dataset, an iterable of (inputs, targets) "
            "batches, or an (inputs, targets) pair of arrays"
        )


def first_batch(data: Any, where: str) -> tuple[Any, torch.Tensor]:
    """The first ``(inputs, targets)`` batch of ``data``; ValueError when there is none."""
    for batch in iter_batches(data, where):
        return split_batch(batch, f"the first batch of {where}")
    raise ValueError(f"{where} yielded no batches; expected at least one (inputs, targets) batch")


class UserState:
    """Snapshot of everything a check may change, restored by :meth:`restore`.

    The model's ``state_dict`` (parameters and buffers such as BatchNorm statistics), each module's
    train/eval flag, the gradients, the optimizer's state (and the data of any parameter it holds that the
    model does not), so a check never leaves the user's model trained.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> None:
        self.model = model
        self.optimizer = optimizer
        self.modes = [(m, m.training) for m in model.modules()]
        self.state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        params = {id(p): p for p in model.parameters()}
        self.extra: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.opt_state = None
        if optimizer is not None:
            self.opt_state = copy.deepcopy(optimizer.state_dict())
            for group in optimizer.param_groups:
                for p in group["params"]:
                    if id(p) not in params:
                        params[id(p)] = p
                        self.extra.append((p, p.detach().clone()))
        self.grads = [(p, None if p.grad is None else p.grad.detach().clone()) for p in params.values()]

    def restore(self) -> None:
        with torch.no_grad():
            self.model.load_state_dict(self.state)
            for p, data in self.extra:
                p.copy_(data)
        if self.optimizer is not None and self.opt_state is not None:
            self.optimizer.load_state_dict(self.opt_state)
        for p, grad in self.grads:
            p.grad = grad
        for module, training in self.modes:
            module.training = training


@contextlib.contextmanager
def preserved(model: nn.Module, optimizer: torch.optim.Optimizer | None = None):
    """Run a block, then put the model, optimizer and random number generators back as they were."""
    state = UserState(model, optimizer)
    cuda = sorted({p.device.index or 0 for p in model.parameters() if p.device.type == "cuda"})
    try:
        with torch.random.fork_rng(devices=cuda):
            yield
    finally:
        state.restore()
