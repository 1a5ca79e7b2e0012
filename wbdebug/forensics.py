"""NaN forensics: where did the first non-finite value come from?

``replay`` re-runs the offending batch once, on a copy of the pre-step model, and pins the NaN down:
the first module (forward order) whose output was non-finite and whether it was created in that
module's own ``forward`` (its children's outputs were finite); in forward, the exact operation and the
user's source line (a TorchDispatchMode checks every op's output); in backward, the backward function
``torch.autograd.detect_anomaly`` stops at and the forward line that created it. It costs nothing on
healthy steps: it runs only when the first non-finite loss or gradient appears.
"""

from __future__ import annotations

import copy
import re
import traceback
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from wbdebug import keys

_SKIP_DIRS = (str(Path(torch.__file__).parent), str(Path(__file__).parent))
_USER_FILES = (str(Path(__file__).parent / "demo.py"),)  # wbdebug's own demo model is user code
INPUT, LOSS = keys.INPUT_NAME, keys.LOSS_NAME


@dataclass
class Finding:
    """What the replay found; every field may be None when it could not tell."""

    module: str | None = None  # the module whose own forward (not a child's) created the value
    first_output: str | None = None  # the first module, in forward order, whose output was non-finite
    op: str | None = None  # aten op (forward) or backward function (backward)
    phase: str | None = None  # "input", "forward", "loss" or "backward"
    source: str | None = None  # "file.py:42: return torch.log(x)"

    def describe(self) -> str:
        if self.phase == "input":
            return "the model's input batch already holds NaN/Inf"
        parts = []
        if self.op:
            parts.append(f"created by {self.op} in {self.phase}")
        if self.module and self.phase in ("forward", "loss"):
            parts.append(f"inside {self.module}'s own forward" if self.module != LOSS else "inside the loss")
        if self.phase == "backward" and self.module:
            parts.append(f"first non-finite gradient (backward order) in {self.module}")
        elif self.first_output and self.first_output != self.module:
            parts.append(f"first non-finite module output: {self.first_output}")
        if self.source:
            parts.append(f"at {self.source}")
        return ", ".join(parts) or "the replay did not reproduce the non-finite value"


def _user_frame(frames: list[traceback.FrameSummary]) -> str | None:
    """The innermost frame outside torch and wbdebug: the user's line."""
    for frame in reversed(frames):
        if _is_user_file(frame.filename):
            line = (frame.line or "").strip()
            return f"{Path(frame.filename).name}:{frame.lineno}: {line}"
    return None


def _is_user_file(filename: str) -> bool:
    return filename in _USER_FILES or (not filename.startswith(_SKIP_DIRS) and "<frozen" not in filename)


def _nonfinite(value: Any) -> bool:
    leaves, _ = tree_flatten(value)
    return any(
        isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel() and not torch.isfinite(t).all()
        for t in leaves
    )


class _FirstNonFiniteOp(TorchDispatchMode):
    """Records the first aten op whose output is non-finite while its inputs were finite, and who ran it."""

    def __init__(self, active_module: Callable[[], str | None]) -> None:
        super().__init__()
        self.active_module = active_module
        self.op: str | None = None
        self.source: str | None = None
        self.module: str | None = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.op is None and _nonfinite(out) and not _nonfinite((args, kwargs)):
            self.op = str(func.overloadpacket.__name__)
            self.source = _user_frame(traceback.extract_stack())
            self.module = self.active_module()
        return out


def replay(
    model: nn.Module,
    args: tuple,
    kwargs: dict,
    loss_fn: Callable[[Any], torch.Tensor] | None,
) -> Finding:
    """Re-run one batch on a deep copy of ``model`` and locate its first non-finite value.

    ``loss_fn(output) -> loss`` rebuilds the loss (the criterion applied to the captured target, or the
    output's own ``loss``); the live model, its gradients and the optimizer are untouched.
    """
    if _nonfinite((args, kwargs)):
        return Finding(module=INPUT, phase="input")
    clone = copy.deepcopy(model)
    clone.zero_grad(set_to_none=True)
    names = {m: keys.layer_name(n) for n, m in clone.named_modules()}
    finding = Finding()
    active: list[str] = []

    def pre(module, _args):
        active.append(names[module])

    def post(module, _args, output):
        active.pop()
        if finding.first_output is None and _nonfinite(output):
            finding.first_output = names[module]

    handles = [m.register_forward_pre_hook(pre) for m in clone.modules()]
    handles += [m.register_forward_hook(post) for m in clone.modules()]
    try:
        mode = _FirstNonFiniteOp(lambda: active[-1] if active else None)
        with mode:
            output = clone(*args, **kwargs)
        if mode.op is not None:
            finding.op, finding.phase, finding.source, finding.module = mode.op, "forward", mode.source, mode.module
            return finding
        if loss_fn is None:
            return finding
        loss_mode = _FirstNonFiniteOp(lambda: LOSS)
        with loss_mode:
            loss = loss_fn(output)
        if loss_mode.op is not None:
            finding.op, finding.phase, finding.source, finding.module = loss_mode.op, "loss", loss_mode.source, LOSS
            return finding
        _backward(loss, finding, clone)
    finally:
        for handle in handles:
            handle.remove()
        del clone
    return finding


def _backward(loss: torch.Tensor, finding: Finding, clone: nn.Module) -> None:
    """Backward under detect_anomaly: the first backward function that returns NaN, and its forward line.

    detect_anomaly only checks for NaN; an overflow to Inf is found by the same per-op check as the
    forward (on the CPU, where backward runs on this thread) and by the first parameter, in backward
    order, whose gradient is non-finite.
    """
    if not loss.requires_grad:
        return
    mode = _FirstNonFiniteOp(lambda: None)
    with warnings.catch_warnings(record=True) as caught, torch.autograd.detect_anomaly(check_nan=True):
        warnings.simplefilter("always")
        try:
            with mode:
                loss.backward()
        except RuntimeError as exc:
            match = re.search(r"Function '(\w+)' returned nan", str(exc))
            finding.op, finding.phase = (match.group(1) if match else str(exc)[:80]), "backward"
    if finding.op is None and mode.op is not None:
        finding.op, finding.phase = mode.op, "backward"
    if finding.op is None:
        # Finite gradients whose squared norm overflows float32 (|g| beyond ~1e19): an explosion, not a NaN.
        largest = max(
            ((p.grad.abs().max().item(), n) for n, p in clone.named_parameters() if p.grad is not None and p.grad.numel()),
            default=(0.0, None),
        )
        if largest[0] > 1e18:
            finding.op, finding.phase = f"gradient overflow (|g| = {largest[0]:.3g})", "backward"
            finding.module = finding.first_output = largest[1].rpartition(".")[0] or keys.ROOT_NAME
            return
    if finding.op is not None:
        for name, param in reversed(list(clone.named_parameters())):
            if param.grad is not None and not torch.isfinite(param.grad).all():
                finding.first_output = name.rpartition(".")[0] or keys.ROOT_NAME
                finding.module = finding.module or finding.first_output
                break
    for w in caught:
        text = str(w.message)
        if "Traceback of forward call" in text:
            frames = re.findall(r'File "([^"]+)", line (\d+), in \S+\n\s*(.*)', text)
            for filename, lineno, line in reversed(frames):
                if _is_user_file(filename):
                    finding.source = f"{Path(filename).name}:{lineno}: {line.strip()}"
                    break
