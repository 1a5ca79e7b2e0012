"""Judging data-pipeline statistics (seed step 4): pure numpy over what ``data.py`` measured, no torch.

Every threshold is chosen so clean data stays quiet: standardised features have mean 0 / std 1 exactly on
the training split, images scaled to [0, 1] have magnitude <= 1, and a training split's statistics applied
to its validation split move them only a little (scikit-learn's digits: validation stds up to 2.3).
"""

from __future__ import annotations

from collections import Counter

import numpy as np

from wbdebug.events import Event, EventKind

#: A feature's magnitude is max(|mean|, std). Standardised data has 1; over 10 is "not standardised"
#: (warning), over 100 is on a scale that saturates or explodes default-initialised layers (error).
MAGNITUDE_WARN = 10.0
MAGNITUDE_ERROR = 100.0
#: Largest/smallest std among non-constant features above this: "wildly different scales". A rare
#: one-hot column (p = 1e-3, std 0.03) next to standardised ones stays under it.
SCALE_RATIO_WARN = 100.0
#: Below this std a feature counts as constant (left out of the scale ratio).
CONSTANT_STD = 1e-8
#: A feature predicting the target this well on held-out rows is leakage: for classes, the accuracy of a
#: value -> majority-label lookup fit on the even rows and scored on the odd ones; for regression, |Pearson r|.
LEAKAGE_SCORE = 0.99
#: ...unless always guessing the majority class already scores this (then no feature can stand out).
LEAKAGE_MAX_BASELINE = 0.9
#: Rows needed before leakage or missing classes are judged (fewer can match by chance).
LEAKAGE_MIN_ROWS = 100
MISSING_CLASS_MIN_ROWS_PER_CLASS = 10
#: Bins of a continuous feature's lookup table; features with at most this many distinct values use them as-is.
LEAKAGE_BINS = 64
#: Most frequent / least frequent class count above this is imbalanced (a common rule of thumb: beyond
#: 10:1, plain accuracy and an unweighted loss mostly learn the majority).
IMBALANCE_RATIO = 10.0
#: Share of validation samples also in training above which validation scores are inflated (error);
#: any overlap at all is a warning.
OVERLAP_ERROR_FRACTION = 0.01


def _names(names: list[str], idx) -> str:
    shown = [names[i] for i in list(idx)[:3]]
    more = len(list(idx)) - len(shown)
    return ", ".join(shown) + (f" and {more} more" if more > 0 else "")


def normalization_events(
    split: str, mean: np.ndarray, std: np.ndarray, vmin: float, vmax: float, *,
    names: list[str], integral: bool, uint8: bool, image_like: bool,
) -> list[Event]:
    """``unnormalized_inputs``: raw 8-bit pixels, features far from mean 0 / std 1, wildly different scales."""
    # 8-bit pixels: uint8, or integers in [0, 255] shaped like images (N, C, H, W) or flattened ones (>= 64 columns)
    if uint8 or (integral and vmin >= 0 and 1 < vmax <= 255 and (image_like or (vmax > 127 and len(names) >= 64))):
        return [Event(
            kind=EventKind.UNNORMALIZED_INPUTS, severity="error", step=0, layer=split, value=vmax, threshold=1.0,
            message=(
                f"The {split} inputs are raw 8-bit values: integers in [{vmin:.0f}, {vmax:.0f}] "
                f"({'uint8' if uint8 else 'integral floats'}), not scaled to [0, 1] or standardised."
            ),
            fix="Divide raw pixels by 255 (ToTensor does), then standardise per channel with the training split's mean and std.",
        )]
    events: list[Event] = []
    magnitude = np.maximum(np.abs(mean), std)
    worst = int(np.argmax(magnitude))
    if magnitude[worst] > MAGNITUDE_WARN:
        big = np.flatnonzero(magnitude > MAGNITUDE_WARN)
        big = big[np.argsort(-magnitude[big])]
        events.append(Event(
            kind=EventKind.UNNORMALIZED_INPUTS,
            severity="error" if magnitude[worst] > MAGNITUDE_ERROR else "warning",
            step=0, layer=split, value=float(magnitude[worst]), threshold=MAGNITUDE_WARN,
            message=(
                f"{len(big)} of {len(magnitude)} {split} input features are far from mean 0 / std 1: "
                f"{_names(names, big)} (worst: mean {mean[worst]:.4g}, std {std[worst]:.4g})."
            ),
        ))
    varying = np.flatnonzero(std > CONSTANT_STD)
    if len(varying) >= 2:
        hi, lo = varying[np.argmax(std[varying])], varying[np.argmin(std[varying])]
        ratio = float(std[hi] / std[lo])
        if ratio > SCALE_RATIO_WARN:
            events.append(Event(
                kind=EventKind.UNNORMALIZED_INPUTS, severity="warning", step=0, layer=split,
                value=ratio, threshold=SCALE_RATIO_WARN,
                message=(
                    f"The {split} input features are on wildly different scales: {names[hi]} has std "
                    f"{std[hi]:.4g}, {names[lo]} {std[lo]:.4g} ({ratio:.3g}x)."
                ),
            ))
    return events


def label_events(split: str, counts: Counter, *, nonintegral: bool, num_classes: int | None, rows: int) -> list[Event]:
    """``label_range``: non-integer labels, labels outside [0, C), labels shifted to 1..C, classes never seen."""
    if nonintegral:
        return [Event(
            kind=EventKind.LABEL_RANGE, severity="error", step=0, layer=split,
            message=f"The {split} class labels are not integers (e.g. 2.5); expected class indices in [0, {num_classes}).",
        )]
    if not counts:
        return []
    lo, hi = min(counts), max(counts)
    c = num_classes
    events: list[Event] = []
    # 1..K with no 0: out of range when K = C, and a classic off-by-one whenever all of 1..K occur in a
    # sample big enough that class 0 would have shown up.
    contiguous = all(counts.get(k, 0) > 0 for k in range(1, hi + 1))
    shifted = lo == 1 and (
        hi == c or (contiguous and hi >= 2 and rows >= MISSING_CLASS_MIN_ROWS_PER_CLASS * (hi + 1))
    )
    outside = sorted(v for v in counts if v < 0 or (c is not None and v >= c))
    if shifted:
        events.append(Event(
            kind=EventKind.LABEL_RANGE, severity="error", step=0, layer=split, value=float(lo), threshold=0.0,
            message=(
                f"The {split} labels run from 1 to {hi} and class 0 never occurs: they look shifted by one "
                "(1-based)" + (
                    f": label {hi} is out of range for C = {c}." if hi == c
                    else ": output 0 is never trained and every class is off by one."
                )
            ),
        ))
    elif outside:
        bad = sum(counts[v] for v in outside)
        events.append(Event(
            kind=EventKind.LABEL_RANGE, severity="error", step=0, layer=split, value=float(outside[-1] if outside[-1] >= 0 else outside[0]),
            threshold=float(c) if c is not None else 0.0,
            message=(
                f"{bad} {split} label(s) are outside [0, {c if c is not None else 'C'}): values {outside[:6]}"
                + (f" (C = {c})." if c is not None else " (negative class indices).")
            ),
        ))
    classes = c if c is not None else hi + 1
    if not shifted and 0 < classes and rows >= MISSING_CLASS_MIN_ROWS_PER_CLASS * classes:
        missing = [k for k in range(classes) if counts.get(k, 0) == 0]
        if missing:
            events.append(Event(
                kind=EventKind.LABEL_RANGE, severity="warning", step=0, layer=split, value=float(len(missing)),
                message=(
                    f"{len(missing)} of {classes} classes never occur in {rows} {split} samples: {missing[:10]}."
                ),
                fix="Check num_classes against the data, and that filtering or splitting did not drop classes.",
            ))
    return events


def imbalance_event(split: str, counts: Counter) -> Event | None:
    """``class_imbalance`` (warning) with the class histogram, when most/least frequent exceeds IMBALANCE_RATIO."""
    present = {k: v for k, v in counts.items() if v > 0}
    if len(present) < 2:
        return None
    most, least = max(present.values()), min(present.values())
    if most / least <= IMBALANCE_RATIO:
        return None
    histogram = ", ".join(f"{k}: {present[k]}" for k in sorted(present))
    return Event(
        kind=EventKind.CLASS_IMBALANCE, severity="warning", step=0, layer=split, value=most / least,
        threshold=IMBALANCE_RATIO,
        message=f"The {split} classes are imbalanced {most / least:.3g}:1 (class counts {{{histogram}}}).",
    )


def lookup_accuracy(feature: np.ndarray, labels: np.ndarray) -> float:
    """Held-out accuracy of predicting ``labels`` from one feature with a value -> majority-label table.

    Fit on even rows, scored on odd rows; a continuous feature is cut into LEAKAGE_BINS quantile bins.
    """
    values = np.unique(feature)
    if len(values) <= LEAKAGE_BINS:
        bins = np.searchsorted(values, feature)
        nbins = len(values)
    else:
        edges = np.unique(np.quantile(feature, np.linspace(0, 1, LEAKAGE_BINS + 1)[1:-1]))
        bins = np.searchsorted(edges, feature, side="right")
        nbins = len(edges) + 1
    classes, y = np.unique(labels, return_inverse=True)
    fit, test = slice(0, None, 2), slice(1, None, 2)
    table = np.zeros((nbins, len(classes)), dtype=np.int64)
    np.add.at(table, (bins[fit], y[fit]), 1)
    majority = np.bincount(y[fit], minlength=len(classes)).argmax()
    guess = np.where(table.sum(1) > 0, table.argmax(1), majority)
    return float((guess[bins[test]] == y[test]).mean())


def leakage_events(split: str, features: np.ndarray, names: list[str], targets: np.ndarray, *, classes: bool) -> list[Event]:
    """``target_leakage``: an input feature (column, or an image channel's mean) that predicts the target."""
    n = len(targets)
    if n < LEAKAGE_MIN_ROWS or features.size == 0:
        return []
    std = features.std(0)
    if classes:
        _, y = np.unique(targets, return_inverse=True)
        baseline = np.bincount(y).max() / n
        if baseline >= LEAKAGE_MAX_BASELINE:
            return []
        scores = [lookup_accuracy(features[:, j], targets) if std[j] > 0 else 0.0 for j in range(features.shape[1])]
        how = "held-out accuracy of a value -> label lookup"
    else:
        yc = targets - targets.mean()
        if not yc.any():
            return []
        xc = features - features.mean(0)
        denom = np.sqrt((xc * xc).sum(0) * (yc * yc).sum())
        scores = list(np.abs(np.divide(xc.T @ yc, denom, out=np.zeros(len(denom)), where=denom > 0)))
        how = "|Pearson correlation|"
    leaks = [j for j, s in enumerate(scores) if s >= LEAKAGE_SCORE]
    if not leaks:
        return []
    leaks.sort(key=lambda j: -scores[j])
    best = leaks[0]
    return [Event(
        kind=EventKind.TARGET_LEAKAGE, severity="error", step=0, layer=split, value=float(scores[best]),
        threshold=LEAKAGE_SCORE,
        message=(
            f"{_names(names, leaks)} of the {split} inputs predict the target almost perfectly on their own "
            f"({how}: {scores[best]:.3f} for {names[best]}): the target is leaking into the inputs."
        ),
    )]


def overlap_event(shared: int, val_rows: int) -> Event | None:
    """``split_overlap``: validation samples whose inputs are byte-identical to a training sample's."""
    if shared == 0 or val_rows == 0:
        return None
    fraction = shared / val_rows
    return Event(
        kind=EventKind.SPLIT_OVERLAP, severity="error" if fraction >= OVERLAP_ERROR_FRACTION else "warning",
        step=0, layer="train+val", value=fraction, threshold=OVERLAP_ERROR_FRACTION,
        message=(
            f"{shared} of {val_rows} validation samples ({fraction:.1%}) are identical to training samples: "
            "validation scores on them measure memorisation, not generalisation."
        ),
    )


def augmentation_event(changed: int, read: int, max_diff: float) -> Event | None:
    """``val_augmentation``: validation items that differ between two reads of the same index."""
    if changed == 0:
        return None
    return Event(
        kind=EventKind.VAL_AUGMENTATION, severity="error", step=0, layer="val", value=changed / read,
        message=(
            f"{changed} of {read} validation samples changed between two reads of the same item "
            f"(largest difference {max_diff:.4g}): random augmentation (flips, crops, noise) runs on the validation split."
        ),
    )
