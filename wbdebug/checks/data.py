"""Sanity check #4 of the seed: inspect the data pipeline's batches (80 % of deep-learning bugs live here).

This file reads batches and measures; ``data_rules.py`` judges the measurements.
"""

from __future__ import annotations

import hashlib
import random
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset

from wbdebug.checks import data_rules as rules
from wbdebug.checks.batches import describe, is_array_pair, iter_batches, split_batch, to_tensor
from wbdebug.events import Event

#: Default number of batches read from each split.
MAX_BATCHES = 50
#: Rows kept per split for the leakage test (statistics and hashes use every row read).
MAX_ROWS = 5000
#: Columns of a tabular input tested for leakage (the first ones).
MAX_LEAKAGE_FEATURES = 2048
#: Validation items read twice to catch random augmentation.
REREAD_ITEMS = 32
#: Distinct label values tracked; more means the targets are not class labels.
MAX_LABEL_VALUES = 10_000


@dataclass
class SplitScan:
    """What one split's batches measured: per-feature moments, labels, per-row hashes and feature values."""

    name: str
    rows: int = 0
    names: list[str] = field(default_factory=list)
    image_like: bool = False
    channels_last: bool = False
    integer_inputs: bool = False
    uint8: bool = False
    integral: bool = True
    count: np.ndarray | None = None
    total: np.ndarray | None = None
    total_sq: np.ndarray | None = None
    vmin: float = np.inf
    vmax: float = -np.inf
    features: list[np.ndarray] = field(default_factory=list)
    targets: list[np.ndarray] = field(default_factory=list)
    kept: int = 0
    scalar_targets: bool = True
    soft_targets: bool = False
    float_targets: bool = False
    label_counts: Counter = field(default_factory=Counter)
    nonintegral_labels: bool = False
    hashes: list[bytes] = field(default_factory=list)

    def mean_std(self) -> tuple[np.ndarray, np.ndarray]:
        mean = self.total / self.count
        var = np.maximum(self.total_sq / self.count - mean * mean, 0.0)
        return mean, np.sqrt(var)


def inspect_data(
    train: Any,
    val: Any = None,
    *,
    num_classes: int | None = None,
    max_batches: int = MAX_BATCHES,
) -> list[Event]:
    """Look at real batches for the data bugs that train silently.

    Events (each with a message and a fix): ``unnormalized_inputs`` (raw 0–255 pixels, features far from
    mean 0 / std 1, wildly different scales), ``label_range`` (labels outside [0, C), 1..C labels,
    non-integer labels, classes that never occur), ``target_leakage`` (one input column or channel predicts
    the target), ``class_imbalance`` (warning, with the histogram), and with ``val``: ``split_overlap``
    (validation samples identical to training ones) and ``val_augmentation`` (validation items that change
    between two reads). Thresholds and where they come from: ``wbdebug/checks/data_rules.py``.

    Args:
        train: a DataLoader, a Dataset (a seeded random subset is read), any iterable of
            ``(inputs, targets)`` batches, or one ``(X, y)`` pair; tensors or numpy arrays.
        val: the validation split, in any of the same forms.
        num_classes: C, when the targets are class indices; inferred otherwise. Integer targets (or float
            targets that are all 0/1) count as class labels; other float targets as regression.
        max_batches: batches read from each split; statistics are estimates from those.

    Returns:
        The events, errors first; empty for clean data.
    """
    if num_classes is not None and (isinstance(num_classes, bool) or not isinstance(num_classes, int)):
        raise TypeError(f"num_classes must be an int, got {type(num_classes).__name__}")
    if num_classes is not None and num_classes < 2:
        raise ValueError(f"num_classes must be at least 2, got {num_classes}")
    if isinstance(max_batches, bool) or not isinstance(max_batches, int) or max_batches < 1:
        raise ValueError(f"max_batches must be a positive int, got {max_batches!r}")
    with _preserved_rngs():
        scans = [scan(train, "train", max_batches=max_batches)]
        changes = None
        if val is not None:
            scans.append(scan(val, "val", max_batches=max_batches))
            changes = reread_changes(val)
    events: list[Event] = []
    for s in scans:
        events += judge(s, num_classes)
    if val is not None:
        train_hashes = set(scans[0].hashes)
        shared = sum(h in train_hashes for h in scans[1].hashes)
        events += [e for e in (rules.overlap_event(shared, len(scans[1].hashes)),) if e]
        if changes is not None:
            events += [e for e in (rules.augmentation_event(*changes),) if e]
    order = {"error": 0, "warning": 1, "info": 2}
    return sorted(events, key=lambda e: order[e.severity])


def judge(s: SplitScan, num_classes: int | None) -> list[Event]:
    """Every per-split rule over one scan."""
    events: list[Event] = []
    if not s.integer_inputs or s.uint8:
        mean, std = s.mean_std()
        events += rules.normalization_events(
            s.name, mean, std, s.vmin, s.vmax, names=s.names, integral=s.integral, uint8=s.uint8,
            image_like=s.image_like,
        )
    classes = is_classification(s, num_classes) and not s.soft_targets
    if classes:
        events += rules.label_events(
            s.name, s.label_counts, nonintegral=s.nonintegral_labels, num_classes=num_classes, rows=s.rows
        )
        if s.name == "train":
            events += [e for e in (rules.imbalance_event(s.name, s.label_counts),) if e]
    if s.scalar_targets and s.features:
        feats = np.concatenate(s.features)
        targets = np.concatenate(s.targets)
        if not classes or not s.nonintegral_labels:
            events += rules.leakage_events(s.name, feats, s.names, targets, classes=classes)
    return events


def is_classification(s: SplitScan, num_classes: int | None) -> bool:
    """Class labels: integer targets, ``num_classes`` given, or float targets that are all 0 or 1."""
    if num_classes is not None or not s.float_targets:
        return True
    return not s.nonintegral_labels and set(s.label_counts) <= {0, 1} and bool(s.label_counts)


def scan(data: Any, name: str, *, max_batches: int = MAX_BATCHES) -> SplitScan:
    """Read up to ``max_batches`` batches of one split and measure them."""
    s = SplitScan(name)
    for i, batch in enumerate(iter_batches(data, name, max_items=max_batches * 64)):
        if i >= max_batches:
            break
        inputs, targets = split_batch(batch, f"{name} batch {i}")
        if not isinstance(inputs, torch.Tensor):
            raise TypeError(
                f"{name} batch {i} has inputs of type {describe(inputs)}; inspect_data expects a tensor "
                "or numpy array of inputs"
            )
        _measure_inputs(s, inputs.detach().cpu())
        _measure_targets(s, targets.detach().cpu())
        s.rows += int(inputs.shape[0])
    if s.rows == 0:
        raise ValueError(f"{name} yielded no batches; expected at least one (inputs, targets) batch")
    return s


def _measure_inputs(s: SplitScan, x: torch.Tensor) -> None:
    if x.dtype == torch.bool:
        x = x.to(torch.uint8)
    if x.dtype in (torch.float16, torch.bfloat16):
        x = x.float()
    n = x.shape[0]
    if s.count is None:
        s.integer_inputs = not x.is_floating_point()
        s.uint8 = x.dtype == torch.uint8
        channels_last = x.ndim == 4 and x.shape[-1] in (1, 3, 4) and x.shape[1] not in (1, 3, 4)
        s.image_like = x.ndim >= 3
        width = x.shape[-1] if channels_last else (x.shape[1] if x.ndim >= 2 else 1)
        s.names = [f"{'channel' if s.image_like else 'feature'} {j}" for j in range(width)]
        s.channels_last = channels_last
        s.count = np.zeros(width)
        s.total = np.zeros(width)
        s.total_sq = np.zeros(width)
    for row in x.reshape(n, -1).numpy() if x.ndim > 1 else x.reshape(n, 1).numpy():
        s.hashes.append(hashlib.blake2b(np.ascontiguousarray(row).tobytes(), digest_size=16).digest())
    if x.ndim == 1:
        v = x.reshape(n, 1, 1)
    elif x.ndim == 2:
        v = x.reshape(n, -1, 1)
    elif s.channels_last:
        v = x.movedim(-1, 1).reshape(n, x.shape[-1], -1)
    else:
        v = x.reshape(n, x.shape[1], -1)
    if v.shape[1] != len(s.names):
        raise ValueError(
            f"{s.name} inputs changed shape between batches ({tuple(x.shape)}); expected {len(s.names)} "
            "features/channels in every batch"
        )
    vf = v.double()
    s.count += vf.shape[0] * vf.shape[2]
    s.total += vf.sum(dim=(0, 2)).numpy()
    s.total_sq += (vf * vf).sum(dim=(0, 2)).numpy()
    if vf.numel():
        s.vmin = min(s.vmin, float(vf.min()))
        s.vmax = max(s.vmax, float(vf.max()))
    if s.integral and x.is_floating_point():
        s.integral = bool((x == x.round()).all())
    if s.kept < MAX_ROWS:
        take = min(n, MAX_ROWS - s.kept)
        per_row = vf[:take, :MAX_LEAKAGE_FEATURES].mean(2) if s.image_like else vf[:take, :MAX_LEAKAGE_FEATURES, 0]
        s.features.append(per_row.numpy())


def _measure_targets(s: SplitScan, t: torch.Tensor) -> None:
    n = t.shape[0]
    if t.ndim > 2 or (t.ndim == 2 and t.shape[1] != 1):
        s.scalar_targets = False
    s.float_targets = t.is_floating_point()
    if t.is_floating_point() and t.ndim >= 2 and t.shape[1] > 1:
        s.soft_targets = True  # one-hot / probability targets (N, C, ...): not class indices
        return
    flat = t.reshape(-1)
    if t.is_floating_point():
        flat = flat.double()
        if not s.nonintegral_labels and not bool((flat == flat.round()).all()):
            s.nonintegral_labels = True
    if not s.nonintegral_labels and len(s.label_counts) <= MAX_LABEL_VALUES:
        values, counts = torch.unique(flat, return_counts=True)
        for v, c in zip(values.tolist(), counts.tolist()):
            s.label_counts[int(v)] += c
    if s.kept < MAX_ROWS:
        take = min(n, MAX_ROWS - s.kept)
        if s.scalar_targets:
            s.targets.append(t[:take].reshape(take).double().numpy())
        s.kept += take


def reread_changes(val: Any, items: int = REREAD_ITEMS) -> tuple[int, int, float] | None:
    """``(changed, read, largest difference)`` over validation items read twice, or None when ``val``
    cannot be re-read (a one-shot iterator or generator)."""
    dataset = val.dataset if isinstance(val, DataLoader) else val
    if isinstance(dataset, Dataset) and not isinstance(dataset, IterableDataset) and hasattr(dataset, "__len__"):
        n = len(dataset)
        idx = sorted({int(i) for i in np.linspace(0, n - 1, min(n, items))}) if n else []
        first = [dataset[i] for i in idx]
        second = [dataset[i] for i in idx]
        pairs = list(zip(first, second))
    elif is_array_pair(val) or iter(val) is val:
        return None
    else:
        a = next(iter(val), None)
        b = next(iter(val), None)
        if a is None or b is None:
            return None
        (xa, ya), (xb, yb) = split_batch(a, "val batch 0"), split_batch(b, "val batch 0")
        if not isinstance(xa, torch.Tensor) or xa.shape != xb.shape:
            return None
        pairs = [((xa[i], ya[i]), (xb[i], yb[i])) for i in range(min(len(xa), items))]
    changed, biggest = 0, 0.0
    for one, two in pairs:
        diff = _difference(one, two)
        if diff is None:
            return None
        if diff > 0:
            changed += 1
            biggest = max(biggest, diff)
    return changed, len(pairs), biggest


def _difference(one: Any, two: Any) -> float | None:
    """Largest absolute difference between two reads of an ``(inputs, target)`` item; None if not tensors."""
    if not isinstance(one, (tuple, list)) or not isinstance(two, (tuple, list)) or len(one) < 2:
        return None
    biggest = 0.0
    for a, b in zip(one[:2], two[:2]):
        a, b = to_tensor(a), to_tensor(b)
        if not isinstance(a, torch.Tensor):
            a, b = torch.as_tensor(a), torch.as_tensor(b)
        if a.shape != b.shape:
            return float("inf")
        if not torch.equal(a, b):
            d = (a.double() - b.double()).abs()
            biggest = max(biggest, float(d.max()) if d.numel() else 0.0, 1e-300)
    return biggest


class _preserved_rngs:
    """Put torch's, numpy's and Python's global RNGs back after reading (augmentations draw from them)."""

    def __enter__(self) -> None:
        self.states = (torch.random.get_rng_state(), np.random.get_state(), random.getstate())

    def __exit__(self, *exc) -> None:
        torch.random.set_rng_state(self.states[0])
        np.random.set_state(self.states[1])
        random.setstate(self.states[2])
