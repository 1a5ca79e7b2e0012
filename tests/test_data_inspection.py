"""inspect_data on real batches: clean tabular and image data stay quiet, each pipeline bug is named."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Dataset, TensorDataset

from wbdebug import EventKind as K, inspect_data
from wbdebug.checks.data_rules import lookup_accuracy


pytestmark = pytest.mark.usefixtures("one_thread")


def loader(x, y, batch_size=64, shuffle=True):
    return DataLoader(TensorDataset(x, y), batch_size=batch_size, shuffle=shuffle,
                      generator=torch.Generator().manual_seed(0))


def loud(events):
    """Events at warning level or above, as {kind: severity}."""
    return {e.kind: e.severity for e in events if e.severity != "info"}


class Images(Dataset):
    """Synthetic 3x16x16 images in [0, 1] (what ToTensor gives), class = which quadrant is bright."""

    def __init__(self, n: int, seed: int, transform=None) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.y = torch.randint(0, 4, (n,), generator=gen)
        self.x = torch.rand(n, 3, 16, 16, generator=gen) * 0.5
        for i, c in enumerate(self.y.tolist()):
            r, q = divmod(c, 2)
            self.x[i, :, r * 8:(r + 1) * 8, q * 8:(q + 1) * 8] += 0.5
        self.transform = transform

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i):
        x = self.x[i]
        return (self.transform(x) if self.transform else x), self.y[i]


MEAN, STD = torch.tensor([0.5, 0.5, 0.5]).view(3, 1, 1), torch.tensor([0.29, 0.29, 0.29]).view(3, 1, 1)


def standardise(x):
    return (x - MEAN) / STD


def random_flip_and_noise(x):
    if torch.rand(()) < 0.5:
        x = x.flip(-1)
    return x + 0.05 * torch.randn_like(x)


# --- clean data: nothing at warning level or above ----------------------------------------------------


def test_clean_standardised_tabular_data_is_quiet_in_every_input_form(digits):
    x, y, xv, yv = digits
    forms = [
        (loader(x, y), loader(xv, yv, shuffle=False)),
        ((x, y), (xv, yv)),
        ((x.numpy(), y.numpy()), (xv.numpy(), yv.numpy())),
        (TensorDataset(x, y), TensorDataset(xv, yv)),
        ([(x[i:i + 100], y[i:i + 100]) for i in range(0, len(x), 100)], None),
    ]
    for train, val in forms:
        assert loud(inspect_data(train, val, num_classes=10)) == {}
        assert loud(inspect_data(train, val)) == {}


def test_clean_regression_and_mixed_tabular_data_is_quiet():
    gen = torch.Generator().manual_seed(0)
    n = 3000
    numeric = torch.randn(n, 6, generator=gen)
    onehot = torch.nn.functional.one_hot(torch.randint(0, 5, (n,), generator=gen), 5).float()
    rare = (torch.rand(n, 1, generator=gen) < 0.01).float()  # a rare binary flag
    x = torch.cat([numeric, onehot, rare], 1)
    y = numeric[:, :1] * 0.8 + 0.6 * torch.randn(n, 1, generator=gen)  # a strong but honest feature
    assert loud(inspect_data(loader(x[:2400], y[:2400]), loader(x[2400:], y[2400:]))) == {}
    labels = (numeric[:, 0] + numeric[:, 1] > 0).float().unsqueeze(1)  # BCE targets
    assert loud(inspect_data((x[:2400], labels[:2400]), (x[2400:], labels[2400:]))) == {}


def test_clean_images_unit_range_and_standardised_are_quiet():
    for transform in (None, standardise):
        train, val = Images(800, 0, transform), Images(200, 1, transform)
        assert loud(inspect_data(DataLoader(train, batch_size=64, shuffle=True), DataLoader(val, batch_size=64),
                                 num_classes=4)) == {}
    # random augmentation on the training split is fine
    train = Images(800, 0, lambda x: standardise(random_flip_and_noise(x)))
    assert loud(inspect_data(train, Images(200, 1, standardise), num_classes=4)) == {}


def test_one_hot_and_probability_targets_are_not_class_indices(digits):
    x, y, xv, yv = digits
    onehot = torch.nn.functional.one_hot(y, 10).float()
    smooth = onehot * 0.9 + 0.01
    for targets in (onehot, smooth):
        assert loud(inspect_data((x, targets), num_classes=10)) == {}


# --- unnormalized_inputs --------------------------------------------------------------------------------


def test_raw_0_255_pixels_are_an_error_as_uint8_and_as_floats():
    images = Images(400, 0)
    raw = (images.x * 255).round()
    for x in (raw.to(torch.uint8), raw):
        events = inspect_data((x, images.y))
        assert loud(events) == {K.UNNORMALIZED_INPUTS: "error"}
        assert "raw 8-bit values" in events[0].message and "255" in events[0].fix
    channels_last = raw.permute(0, 2, 3, 1).numpy().astype(np.uint8)  # HWC numpy, as images load
    assert loud(inspect_data((channels_last, images.y.numpy()))) == {K.UNNORMALIZED_INPUTS: "error"}
    flat = raw[:, 0].reshape(400, 256)  # flattened grey images, as float
    assert loud(inspect_data((flat, images.y))) == {K.UNNORMALIZED_INPUTS: "error"}


def test_features_far_from_standard_and_on_different_scales(digits):
    from sklearn.datasets import load_digits

    data = load_digits()  # raw 0..16 intensities: not standardised, a warning
    events = inspect_data((torch.tensor(data.data, dtype=torch.float32), torch.tensor(data.target)))
    assert loud(events) == {K.UNNORMALIZED_INPUTS: "warning"}
    x, y, _, _ = digits
    dollars = x.clone()
    dollars[:, 20] = dollars[:, 20] * 5000 + 40000  # an income column left in dollars
    event = next(e for e in inspect_data((dollars, y)) if e.kind == K.UNNORMALIZED_INPUTS)
    assert event.severity == "error" and "feature 20" in event.message
    tiny = x.clone()
    tiny[:, 20] *= 1e-4  # a column in the wrong unit
    event = next(e for e in inspect_data((tiny, y)) if e.kind == K.UNNORMALIZED_INPUTS)
    assert event.severity == "warning" and "wildly different scales" in event.message and "feature 20" in event.message


# --- label_range and class_imbalance -------------------------------------------------------------------


def test_labels_shifted_to_1_to_c(digits):
    x, y, xv, yv = digits
    for num_classes in (10, 11, None):
        events = inspect_data(loader(x, y + 1), loader(xv, yv + 1), num_classes=num_classes)
        assert loud(events) == {K.LABEL_RANGE: "error"}, num_classes
        assert "shifted by one" in events[0].message and "subtract 1" in events[0].fix


def test_labels_outside_the_range_non_integer_and_missing_classes(digits):
    x, y, _, _ = digits
    bad = y.clone()
    bad[:5] = 12
    event = inspect_data((x, bad), num_classes=10)[0]
    assert event.kind == K.LABEL_RANGE and event.severity == "error" and "[12]" in event.message
    bad[:5] = -1
    assert inspect_data((x, bad))[0].kind == K.LABEL_RANGE
    halves = y.float() + 0.5
    event = inspect_data((x, halves), num_classes=10)[0]
    assert event.kind == K.LABEL_RANGE and "not integers" in event.message
    no_sevens = y != 7
    events = inspect_data((x[no_sevens], y[no_sevens]), num_classes=10)
    assert loud(events) == {K.LABEL_RANGE: "warning"} and "[7]" in events[0].message


def test_class_imbalance_is_a_warning_with_the_histogram(digits):
    x, y, _, _ = digits
    keep = (y != 3) | (torch.arange(len(y)) % 15 == 0)  # class 3 down to ~10 samples
    events = inspect_data((x[keep], y[keep]), num_classes=10)
    assert loud(events) == {K.CLASS_IMBALANCE: "warning"}
    assert f"3: {int((y[keep] == 3).sum())}" in events[0].message


# --- target_leakage -------------------------------------------------------------------------------------


def test_a_feature_column_equal_to_the_label_leaks(digits):
    x, y, xv, yv = digits
    leaked = x.clone()
    leaked[:, 5] = (y.float() - 4.5) / 2.9
    events = inspect_data(loader(leaked, y), num_classes=10)
    assert loud(events) == {K.TARGET_LEAKAGE: "error"}
    assert "feature 5" in events[0].message and events[0].value >= 0.99


def test_regression_target_and_image_channel_leaks():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1000, 8, generator=gen)
    y = torch.randn(1000, 1, generator=gen)
    x[:, 3] = y[:, 0] + 0.01 * torch.randn(1000, generator=gen)
    event = inspect_data((x, y))[0]
    assert event.kind == K.TARGET_LEAKAGE and "feature 3" in event.message
    images = Images(400, 0, standardise)
    x = torch.stack([images[i][0] for i in range(400)])
    x[:, 2] = images.y.float().view(-1, 1, 1) - 1.5  # the label painted into the blue channel
    event = inspect_data((x, images.y))[0]
    assert event.kind == K.TARGET_LEAKAGE and "channel 2" in event.message


def test_lookup_accuracy_table():
    rng = np.random.default_rng(0)
    labels = rng.integers(0, 10, 2000)
    assert lookup_accuracy(labels.astype(float), labels) == 1.0
    assert lookup_accuracy(labels * 0.37 + 5, labels) == 1.0
    assert lookup_accuracy(rng.normal(size=2000), labels) < 0.2
    assert lookup_accuracy(rng.integers(0, 50, 2000).astype(float), labels) < 0.2


# --- val_augmentation and split_overlap ------------------------------------------------------------------


def test_random_flips_and_noise_on_the_validation_split():
    train = Images(400, 0, standardise)
    val = Images(200, 1, lambda x: standardise(random_flip_and_noise(x)))
    for v in (val, DataLoader(val, batch_size=50), DataLoader(val, batch_size=50, shuffle=True)):
        events = inspect_data(train, v, num_classes=4)
        assert loud(events) == {K.VAL_AUGMENTATION: "error"}
        assert "changed between two reads" in events[0].message
    # deterministic validation data read through a shuffling loader is not augmentation
    clean = DataLoader(Images(200, 1, standardise), batch_size=50, shuffle=True)
    assert loud(inspect_data(train, clean, num_classes=4)) == {}


def test_validation_rows_copied_from_train(digits):
    x, y, xv, yv = digits
    copied = inspect_data(loader(x, y), loader(x[:300], y[:300]), num_classes=10)
    assert loud(copied) == {K.SPLIT_OVERLAP: "error"}
    assert copied[0].value == 1.0 and "300 of 300" in copied[0].message
    few = torch.cat([xv[:-1], x[:1]]), torch.cat([yv[:-1], y[:1]])  # one duplicate in 360: under 1 %
    events = inspect_data(loader(x, y), few, num_classes=10)
    assert loud(events) == {K.SPLIT_OVERLAP: "warning"}


# --- plumbing ---------------------------------------------------------------------------------------------


def test_inspection_leaves_the_global_random_generators_alone(digits):
    x, y, _, _ = digits
    val = Images(100, 1, random_flip_and_noise)
    torch.manual_seed(123)
    np.random.seed(123)
    expected = torch.rand(3), np.random.rand(3)
    torch.manual_seed(123)
    np.random.seed(123)
    inspect_data(DataLoader(TensorDataset(x, y), batch_size=64, shuffle=True), val)
    assert torch.equal(torch.rand(3), expected[0]) and np.array_equal(np.random.rand(3), expected[1])


def test_one_shot_iterators_and_max_batches(digits):
    x, y, xv, yv = digits
    batches = ((x[i:i + 64], y[i:i + 64]) for i in range(0, len(x), 64))
    val = ((xv[i:i + 64], yv[i:i + 64]) for i in range(0, len(xv), 64))
    assert loud(inspect_data(batches, val, num_classes=10)) == {}
    many = [(x[i:i + 8], y[i:i + 8]) for i in range(0, len(x), 8)]
    assert inspect_data(many, max_batches=3, num_classes=10) == []  # 24 rows: too few to judge classes


def test_bad_input_names_what_was_expected(digits):
    x, y, _, _ = digits
    with pytest.raises(ValueError, match="train yielded no batches"):
        inspect_data(DataLoader(TensorDataset(x[:0], y[:0]), batch_size=8))
    with pytest.raises(TypeError, match=r"expected an \(inputs, targets\) pair"):
        inspect_data([{"pixels": x, "label": y}])
    with pytest.raises(ValueError, match="inputs have 1437 rows but targets have 100"):
        inspect_data((x, y[:100]))
    with pytest.raises(TypeError, match="expected a DataLoader, a Dataset"):
        inspect_data(42)
    with pytest.raises(ValueError, match="max_batches must be a positive int"):
        inspect_data((x, y), max_batches=0)
    with pytest.raises(TypeError, match="inspect_data expects a tensor"):
        inspect_data([((x, x), y)])
