"""Pre-flight checks on tiny real models: overfit one batch, the step-0 loss, and preflight()."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import wbdebug
from wbdebug import CheckResult, EventKind as K, Report, check_initial_loss, overfit_one_batch, preflight
from wbdebug.checks.overfit import TARGET_FRACTION, describe_curve
from wbdebug.demo import digits_mlp
from models import HEALTHY

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # examples/ is a folder of the repository, not an installed package

from examples import digits as example  # noqa: E402


pytestmark = pytest.mark.usefixtures("one_thread")


def micro(digits, n=10):
    x, y, _, _ = digits
    return x[:n], y[:n]


def fresh(lr=1e-3, seed=0):
    torch.manual_seed(seed)
    model = digits_mlp()
    return model, torch.optim.Adam(model.parameters(), lr), nn.CrossEntropyLoss()


def kinds(result, severity="error"):
    return {e.kind for e in result.events if e.severity == severity}


# --- overfit one batch: healthy --------------------------------------------------------------------


@pytest.mark.parametrize("name", list(HEALTHY))
def test_healthy_models_overfit_one_batch_and_start_at_the_uninformed_loss(name):
    setup = HEALTHY[name]()
    x, y = setup.batch(0)
    result = overfit_one_batch(setup.model, (x[:10], y[:10]), setup.criterion, setup.optimizer)
    assert result.passed, result.events
    assert [e for e in result.events if e.severity != "info"] == []
    assert result.loss_curve[-1] <= result.metrics["target"] < result.loss_curve[0]
    assert len(result.loss_curve) < 200, "stops once the loss has settled under the target"
    initial = check_initial_loss(setup.model, (x, y), setup.criterion)
    assert initial.passed and initial.events == []
    assert 1 / 1.5 < initial.metrics["ratio"] < 1.5


def test_target_follows_the_loss_type(digits):
    model, opt, crit = fresh()
    assert overfit_one_batch(model, micro(digits), crit, opt).metrics["target"] == pytest.approx(
        TARGET_FRACTION * math.log(10)
    )
    bce = HEALTHY["binary_classifier"]()
    x, y = bce.batch(0)
    assert overfit_one_batch(bce.model, (x[:10], y[:10]), bce.criterion, bce.optimizer).metrics[
        "target"] == pytest.approx(TARGET_FRACTION * math.log(2))
    reg = HEALTHY["regression"]()
    x, y = reg.batch(0)
    result = overfit_one_batch(reg.model, (x[:10], y[:10]), reg.criterion, reg.optimizer)
    assert result.metrics["target"] == pytest.approx(TARGET_FRACTION * float((y[:10] ** 2).mean()))
    tight = overfit_one_batch(model, micro(digits), crit, opt, target=1e-9, steps=30)
    assert not tight.passed and tight.metrics["target"] == 1e-9


# --- overfit one batch: the user's state is left alone ----------------------------------------------


def test_overfit_restores_model_optimizer_gradients_mode_and_rng(digits):
    model, opt, crit = fresh()
    x, y = micro(digits, 64)
    for _ in range(3):  # the optimizer has state (Adam moments, step counts) before the check
        opt.zero_grad()
        crit(model(x), y).backward()
        opt.step()
    model.eval()
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    grads = [p.grad.clone() for p in model.parameters()]
    opt_state = {k: {n: t.clone() for n, t in s.items()} for k, s in opt.state_dict()["state"].items()}
    rng = torch.random.get_rng_state()
    result = overfit_one_batch(model, micro(digits), crit, opt)
    assert result.passed and result.loss_curve[-1] < 0.12
    assert all(torch.equal(weights[k], v) for k, v in model.state_dict().items())
    assert all(torch.equal(g, p.grad) for g, p in zip(grads, model.parameters()))
    after = opt.state_dict()["state"]
    assert all(torch.equal(opt_state[k][n], after[k][n]) for k in opt_state for n in opt_state[k])
    assert not model.training
    assert torch.equal(rng, torch.random.get_rng_state())
    # and training goes on exactly as it would have without the check
    opt.zero_grad()
    crit(model(x), y).backward()
    opt.step()


def test_overfit_restores_batchnorm_statistics_and_the_other_models_parameters(digits):
    setup = HEALTHY["cnn_batchnorm"]()
    before = {k: v.clone() for k, v in setup.model.state_dict().items()}
    x, y = setup.batch(0)
    overfit_one_batch(setup.model, (x[:10], y[:10]), setup.criterion, setup.optimizer, steps=20)
    assert all(torch.equal(before[k], v) for k, v in setup.model.state_dict().items())

    model, _, crit = fresh()
    other = digits_mlp()
    other_weights = [p.clone() for p in other.parameters()]
    overfit_one_batch(model, micro(digits), crit, torch.optim.SGD(other.parameters(), lr=0.1), steps=20)
    assert all(torch.equal(a, b) for a, b in zip(other_weights, other.parameters()))


# --- overfit one batch: the bugs -------------------------------------------------------------------


def test_double_softmax_before_cross_entropy_plateaus_at_its_floor(digits):
    torch.manual_seed(0)
    model = nn.Sequential(digits_mlp(), nn.Softmax(dim=1))
    result = overfit_one_batch(model, micro(digits), nn.CrossEntropyLoss(), torch.optim.Adam(model.parameters(), 1e-3))
    assert not result.passed
    curve = next(e for e in result.events if e.kind == K.OVERFIT_FAILED and e.severity == "error")
    assert "levelled off at a floor" in curve.message and "softmax" in curve.message
    floor = math.log(1 + 9 / math.e)
    assert result.metrics["final_loss"] >= floor - 1e-3
    output = next(e for e in result.events if e.layer == "(output)")
    assert output.value == pytest.approx(floor) and "raw logits" in output.fix


def test_optimizer_over_another_models_parameters_stays_flat(digits):
    model, _, crit = fresh()
    result = overfit_one_batch(model, micro(digits), crit, torch.optim.Adam(digits_mlp().parameters(), 1e-3))
    assert not result.passed and kinds(result) == {K.OVERFIT_FAILED}
    messages = " ".join(e.message for e in result.events)
    assert "stayed flat" in messages and "another model's parameters" in messages


class ListMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = [nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU()]  # the bug
        self.head = nn.Linear(64, 10)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def test_layers_in_a_plain_python_list_are_named(digits):
    torch.manual_seed(0)
    model = ListMLP()
    result = overfit_one_batch(model, micro(digits), nn.CrossEntropyLoss(), torch.optim.Adam(model.parameters(), 1e-3))
    assert not result.passed
    event = next(e for e in result.events if e.layer == "blocks")
    assert event.kind == K.OVERFIT_FAILED and event.severity == "error"
    assert "plain Python list of 4 module(s)" in event.message and event.value == 4
    assert "nn.ModuleList" in event.fix
    # the same model with nn.ModuleList passes
    model.blocks = nn.ModuleList(model.blocks)
    assert overfit_one_batch(model, micro(digits), nn.CrossEntropyLoss(), torch.optim.Adam(model.parameters(), 1e-3)).passed


def test_zero_learning_rate_and_detached_graph(digits):
    model, _, crit = fresh()
    result = overfit_one_batch(model, micro(digits), crit, torch.optim.SGD(model.parameters(), lr=0.0))
    assert not result.passed
    assert any("learning rate is 0" in e.message for e in result.events)

    class Detached(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = digits_mlp()

        def forward(self, x):
            return self.net(x).detach()

    model = Detached()
    result = overfit_one_batch(model, micro(digits), crit, torch.optim.Adam(model.parameters()))
    assert not result.passed and result.loss_curve and len(result.loss_curve) == 1
    assert "does not require grad" in result.events[0].message


def test_partly_detached_model_warns_about_the_cut_off_layers(digits):
    class HalfDetached(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.encoder = nn.Sequential(nn.Linear(64, 64), nn.ReLU())
            self.head = nn.Linear(64, 10)

        def forward(self, x):
            return self.head(self.encoder(x).detach())

    torch.manual_seed(0)
    model = HalfDetached()
    result = overfit_one_batch(model, micro(digits), nn.CrossEntropyLoss(), torch.optim.Adam(model.parameters(), 1e-2))
    warning = next(e for e in result.events if e.severity == "warning")
    assert warning.kind == K.OVERFIT_FAILED and warning.layer == "encoder.0" and "detach" in warning.message


def test_nll_loss_on_probabilities_fails_even_though_its_loss_goes_down(digits):
    torch.manual_seed(0)
    model = nn.Sequential(digits_mlp(), nn.Softmax(dim=1))
    result = overfit_one_batch(model, micro(digits), nn.NLLLoss(), torch.optim.Adam(model.parameters(), 1e-2))
    assert not result.passed
    assert any("log-probabilities" in e.message for e in result.events if e.severity == "error")


@pytest.mark.parametrize(
    "curve, shape",
    [
        ([2.3] * 50, "flat"),
        ([2.3, 2.31, 2.29] * 20, "flat"),
        ([2.3 * 0.97**i + 1.46 for i in range(200)], "plateau"),
        ([2.3, 1.0] + [0.2, 1.4] * 40, "fluctuating"),
        ([2.3 * 1.05**i for i in range(40)], "rising"),
        ([2.3, 1.0, float("nan"), 1.0], "nonfinite"),
    ],
)
def test_describe_curve(curve, shape):
    assert describe_curve(curve)[0] == shape


# --- step-0 loss ------------------------------------------------------------------------------------


def test_initial_loss_flags_a_mis_scaled_output_layer(digits):
    model, _, crit = fresh()
    x, y, _, _ = digits
    with torch.no_grad():
        model[4].weight.mul_(50)
    result = check_initial_loss(model, (x[:64], y[:64]), crit)
    assert not result.passed
    (event,) = result.events
    assert event.kind == K.INITIAL_LOSS and event.severity == "error"
    assert event.threshold == pytest.approx(math.log(10)) and event.value > 3 * math.log(10)
    assert "log(10)" in event.message


def test_initial_loss_names_reduction_sum_and_catches_a_model_that_already_knows(digits):
    model, _, _ = fresh()
    x, y, _, _ = digits
    result = check_initial_loss(model, (x[:64], y[:64]), nn.CrossEntropyLoss(reduction="sum"))
    assert not result.passed and "reduction='sum'" in result.events[0].message

    class Cheat(nn.Module):  # the label leaks in as the last input column
        def forward(self, inputs):
            return 20 * F.one_hot(inputs[:, -1].long(), 10).float()

    leaked = torch.cat([x[:64], y[:64, None].float()], dim=1)
    result = check_initial_loss(Cheat(), (leaked, y[:64]), nn.CrossEntropyLoss())
    assert not result.passed and result.metrics["ratio"] < 1 / 3
    assert "already knows" in result.events[0].message


def test_initial_loss_uses_num_classes_and_skips_unknown_losses(digits):
    model, _, crit = fresh()
    x, y, _, _ = digits
    assert check_initial_loss(model, (x[:64], y[:64]), crit, num_classes=10).metrics["expected"] == pytest.approx(math.log(10))
    skipped = check_initial_loss(model, (x[:64], F.one_hot(y[:64], 10).float()), nn.KLDivLoss(reduction="batchmean"))
    assert skipped.passed and skipped.summary.startswith("skipped")


def test_initial_loss_leaves_batchnorm_statistics_alone():
    setup = HEALTHY["cnn_batchnorm"]()
    before = {k: v.clone() for k, v in setup.model.state_dict().items()}
    check_initial_loss(setup.model, setup.batch(0), setup.criterion)
    assert all(torch.equal(before[k], v) for k, v in setup.model.state_dict().items())


# --- preflight and the example factory ---------------------------------------------------------------


def test_preflight_runs_all_three_and_round_trips_as_json(digits):
    x, y, xv, yv = digits
    model, opt, crit = fresh()
    train = DataLoader(TensorDataset(x, y), batch_size=64, shuffle=True, generator=torch.Generator().manual_seed(0))
    report = preflight(model, train, crit, opt, val=DataLoader(TensorDataset(xv, yv), batch_size=128), num_classes=10)
    assert isinstance(report, Report) and report.passed and report.events == []
    assert [c.name for c in report.checks] == ["overfit", "initial_loss", "data"]
    assert all(isinstance(c, CheckResult) and c.passed for c in report.checks)
    assert report.loss_curve == report.check("overfit").loss_curve and report.loss_curve[-1] < 0.12
    assert report.check("overfit").metrics["samples"] == 10
    again = Report.model_validate_json(report.model_dump_json())
    assert again.passed and again.loss_curve == report.loss_curve
    assert report.summary_metrics()["wbdebug/check/passed"] == 1.0


EXAMPLE_BUGS = {
    "softmax": {K.OVERFIT_FAILED},
    "optimizer": {K.OVERFIT_FAILED},
    "list": {K.OVERFIT_FAILED},
    "labels": {K.LABEL_RANGE},
    "leak": {K.TARGET_LEAKAGE},
    "val_aug": {K.VAL_AUGMENTATION},
    "overlap": {K.SPLIT_OVERLAP},
    "raw": {K.UNNORMALIZED_INPUTS, K.INITIAL_LOSS},
}


def test_every_bug_of_the_example_is_listed():
    assert set(EXAMPLE_BUGS) == set(example.BUGS)


@pytest.mark.parametrize("bug", [None, *EXAMPLE_BUGS], ids=lambda b: b or "healthy")
def test_example_factory_healthy_passes_and_each_bug_fails_with_its_event(bug):
    setup = example.build(bug=bug, threads=None)
    report = preflight(setup.model, setup.train, setup.criterion, setup.optimizer, val=setup.val,
                       num_classes=setup.num_classes)
    errors = {e.kind for e in report.events if e.severity == "error"}
    assert errors == EXAMPLE_BUGS.get(bug, set())
    assert report.passed is (bug is None)


# --- bad input -------------------------------------------------------------------------------------------


def test_bad_arguments_raise_naming_what_was_expected(digits):
    model, opt, crit = fresh()
    x, y = micro(digits)
    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
        overfit_one_batch("model", (x, y), crit, opt)
    with pytest.raises(TypeError, match="optimizer must be a torch.optim.Optimizer"):
        overfit_one_batch(model, (x, y), crit, "adam")
    with pytest.raises(ValueError, match="steps must be a positive int"):
        overfit_one_batch(model, (x, y), crit, opt, steps=0)
    with pytest.raises(ValueError, match="inputs have 10 rows but targets have 9; expected the same first dimension"):
        overfit_one_batch(model, (x, y[:9]), crit, opt)
    with pytest.raises(TypeError, match=r"expected an \(inputs, targets\) pair"):
        check_initial_loss(model, x, crit)
    with pytest.raises(ValueError, match="the criterion MSELoss\\(\\) does not accept the model output"):
        check_initial_loss(model, (x, y), nn.MSELoss())
    with pytest.raises(ValueError, match="the model's forward failed on inputs float32 tensor \\(10, 32\\)"):
        check_initial_loss(model, (x[:, :32], y), crit)
    with pytest.raises(ValueError, match="train yielded no batches"):
        preflight(model, [], crit, opt)
    with pytest.raises(ValueError, match="checks must be a non-empty list drawn from"):
        preflight(model, (x, y), crit, opt, checks=["overfit", "gradients"])
    with pytest.raises(ValueError, match="num_classes must be at least 2"):
        check_initial_loss(model, (x, y), crit, num_classes=1)


def test_checks_are_public():
    for name in ("overfit_one_batch", "check_initial_loss", "inspect_data", "preflight", "CheckResult", "Report",
                 "CheckSetup"):
        assert name in wbdebug.__all__ and hasattr(wbdebug, name)


def test_progress_is_reported_each_step_with_a_loss_every_readback(digits):
    model, opt, crit = fresh()
    calls = []
    result = overfit_one_batch(model, micro(digits), crit, opt, steps=25, target=1e-9,
                               progress=lambda done, loss: calls.append((done, loss)))
    assert [d for d, _ in calls] == list(range(1, 26))
    assert [d for d, loss in calls if loss is not None] == [10, 20, 25]
    assert calls[-1][1] == result.loss_curve[-1]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_checks_run_on_the_models_device_and_restore_it(digits):
    x, y, xv, yv = digits
    model, _, crit = fresh()
    model.cuda()
    opt = torch.optim.Adam(model.parameters(), 1e-3)
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    cuda_rng = torch.cuda.get_rng_state()
    report = preflight(model, (x, y), crit, opt, val=(xv, yv), num_classes=10)  # CPU batches, CUDA model
    assert report.passed, report.events
    assert all(torch.equal(weights[k], v) for k, v in model.state_dict().items())
    assert torch.equal(cuda_rng, torch.cuda.get_rng_state())


def test_a_diverging_learning_rate_fails_and_the_report_survives_json(digits):
    model, _, crit = fresh()
    result = overfit_one_batch(model, micro(digits), crit, torch.optim.SGD(model.parameters(), lr=1e6))
    assert not result.passed
    assert "became nan" in result.events[0].message or "became inf" in result.events[0].message
    assert len(result.loss_curve) < 200, "stops at the first non-finite read-back"
    again = Report.model_validate_json(Report(checks=[result]).model_dump_json())
    assert math.isnan(again.loss_curve[-1]) and not again.passed
