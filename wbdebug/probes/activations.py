"""Activation statistics — zero fraction, dead-unit fraction, non-finite flag — on sampled steps only.

Measured at activation modules' outputs (``nn.ReLU`` …) and at the inputs of weight layers (Linear,
Conv*), so a functional ``F.relu`` inside ``forward`` is seen too. Hooks are attached for a sampled
step and removed right after (as Composer's activation monitor does): ordinary steps pay nothing.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from wbdebug import keys

#: Modules whose output is exactly zero for part of their domain.
ZEROING_ACTIVATIONS = (nn.ReLU, nn.ReLU6, nn.Threshold, nn.Hardswish)
#: Modules whose input is the previous layer's activation.
WEIGHT_LAYERS = (nn.Linear, nn.Bilinear, nn.modules.conv._ConvNd)

STATS_PER_LAYER = 3  # non-zero elements, dead units, sum (its finiteness stands for the tensor's)


def activation_counts(x: torch.Tensor, unit_dim: int, out: torch.Tensor) -> tuple[int, int]:
    """Write [non-zero elements, dead units, sum of x] into ``out`` (3 device floats); return (elements, units).

    A unit is a feature (last dim) for dense activations and a channel (dim 1) for images; a unit is
    dead when it is zero across the whole batch (and every position). The sum's finiteness stands for
    the tensor's (a NaN or Inf anywhere makes it non-finite). Raw counts, not fractions: the division
    happens on the host (:func:`activation_fractions`), which saves a handful of tiny device ops per layer.

    Cost decides the method (CPU, measured with ``benchmarks/``): ``x.bool()`` is ~10x faster than
    ``x != 0`` (same result; NaN counts as non-zero), and the 0/1 bytes are counted in ``uint8``
    (:func:`_count_nonzero_bytes`) because ``sum(dtype=int32)`` first casts the whole mask into a
    4-byte temporary — on a training step the page faults of that fresh buffer cost more than the sum.
    """
    nonzero = x.bool()
    if nonzero.ndim >= 2:
        unit = unit_dim % nonzero.ndim
        shape = nonzero.shape
        grid = nonzero.reshape(math.prod(shape[:unit]), shape[unit], math.prod(shape[unit + 1 :])).view(torch.uint8)
        if grid.shape[2] > 1:  # positions first (contiguous), then the batch rows
            per_unit = _count_nonzero_bytes(grid, 2).sum(dim=0)
        else:
            per_unit = _count_nonzero_bytes(grid[:, :, 0], 0)
    else:
        per_unit = nonzero.view(torch.uint8)
    torch.sum(per_unit, dim=0, dtype=torch.float32, out=out[0])  # per_unit is 1-D: [units]
    torch.sum(per_unit == 0, dim=0, dtype=torch.float32, out=out[1])
    torch.sum(x, dim=tuple(range(x.ndim)), dtype=torch.float32, out=out[2])
    return x.numel(), per_unit.numel()


def activation_fractions(counts: list[float], elements: int, units: int) -> tuple[float, float, bool]:
    """Host side of :func:`activation_counts`: (zero fraction, dead-unit fraction, any value non-finite)."""
    nonzero, dead, total = counts
    return 1.0 - nonzero / elements, dead / units, not math.isfinite(total)


def _count_nonzero_bytes(mask: torch.Tensor, dim: int) -> torch.Tensor:
    """Sum a 0/1 ``uint8`` tensor along ``dim`` exactly, as int32, with no full-size temporary.

    Groups of at most 255 bytes are summed in ``uint8`` (no overflow, no cast of the input), then the
    small per-group counts in int32.
    """
    n = mask.shape[dim]
    if n <= 255:
        return mask.sum(dim=dim, dtype=torch.uint8).int()
    group = next((g for g in range(255, 15, -1) if n % g == 0), 255)
    full = n - n % group
    counts = mask.narrow(dim, 0, full).unflatten(dim, (full // group, group)).sum(dim=dim + 1, dtype=torch.uint8)
    counts = counts.sum(dim=dim, dtype=torch.int32)
    if full < n:
        counts += mask.narrow(dim, full, n - full).sum(dim=dim, dtype=torch.uint8)
    return counts


def activation_layers(model: nn.Module) -> list[tuple[str, nn.Module, bool]]:
    """(name, module, is_weight_layer) for every module whose activations are measured."""
    out = []
    for name, module in model.named_modules():
        if isinstance(module, ZEROING_ACTIVATIONS):
            out.append((keys.layer_name(name), module, False))
        elif isinstance(module, WEIGHT_LAYERS):
            out.append((keys.layer_name(name), module, True))
    return out


def _unit_dim(module: nn.Module, x: torch.Tensor) -> int:
    if isinstance(module, nn.modules.conv._ConvNd):
        return 1
    if x.ndim in (4, 5):  # an activation module over images: channels
        return 1
    return -1


class ActivationProbe:
    """Attaches forward hooks for one sampled step; each writes its layer's stats into a buffer slot."""

    def __init__(
        self, root: nn.Module, layers: list[tuple[str, nn.Module, bool]], guard: Callable[[Callable], Callable] = lambda fn: fn
    ) -> None:
        """``guard`` wraps every hook (the Monitor's: a failing hook is reported once, never raised)."""
        self.root = root
        self.layers = layers
        self.names = [name for name, _, _ in layers]
        self._handles: list[RemovableHandle] = []
        self._out: torch.Tensor | None = None
        self.input_measured = False
        #: (layer index, elements, units) of each layer measured this sampled step, in forward order.
        self.order: list[tuple[int, int, int]] = []
        self._input_ptrs: set[int] = set()
        self._measured_ptrs: set[int] = set()
        self._recorded: set[int] = set()
        self._done = False
        # Hook callables built once: attach() runs every sampled step and only registers them.
        self._root_hooks = (guard(self._on_root_input), guard(self._on_root_output))
        self._layer_hooks = [
            guard(functools.partial(self._on_weight_input, i)) if is_weight else guard(functools.partial(self._on_output, i))
            for i, (_, _, is_weight) in enumerate(layers)
        ]

    @property
    def width(self) -> int:
        """Buffer columns: the input's sum (non-finite = bad input), then STATS_PER_LAYER per layer."""
        return 1 + STATS_PER_LAYER * len(self.layers)

    def slot(self, i: int) -> int:
        """First buffer column (within this probe's region) of layer ``i``."""
        return 1 + STATS_PER_LAYER * i

    @property
    def attached(self) -> bool:
        return bool(self._handles)

    def attach(self, out: torch.Tensor) -> None:
        """Hook every layer for the next training forward; stats go to ``out`` (a 1-D device view)."""
        self.detach()
        self._out, self._done = out, False
        self.order, self._input_ptrs, self._measured_ptrs, self._recorded = [], set(), set(), set()
        self.input_measured = False
        on_input, on_output = self._root_hooks
        self._handles.append(self.root.register_forward_pre_hook(on_input))
        self._handles.append(self.root.register_forward_hook(on_output))
        for (_, module, is_weight), hook in zip(self.layers, self._layer_hooks):
            register = module.register_forward_pre_hook if is_weight else module.register_forward_hook
            self._handles.append(register(hook))

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _active(self) -> bool:
        return not self._done and torch.is_grad_enabled() and not torch.compiler.is_compiling()

    def _on_root_input(self, module: nn.Module, args: tuple) -> None:
        if not self._active():
            return
        # The model's raw input (pixels, one-hot features) is data, not an activation: zeros there are not dead units.
        tensors = [a for a in args if isinstance(a, torch.Tensor) and a.numel()]
        self._input_ptrs = {a.untyped_storage().data_ptr() for a in tensors}
        floats = [a.detach() for a in tensors if a.is_floating_point()]
        if floats:
            total = floats[0].sum(dtype=torch.float32) if len(floats) == 1 else torch.stack(
                [a.sum(dtype=torch.float32) for a in floats]).sum()
            self._out[0].copy_(total)  # a NaN or Inf anywhere in the batch makes the sum non-finite
            self.input_measured = True

    def _on_root_output(self, module: nn.Module, args: tuple, output: object) -> None:
        if self._active():
            self._done = True  # measure one training forward per sampled step

    def _on_weight_input(self, i: int, module: nn.Module, args: tuple) -> None:
        self._record(i, module, args[0] if args else None, True)

    def _on_output(self, i: int, module: nn.Module, args: tuple, output: object) -> None:
        self._record(i, module, output, False)

    def _record(self, i: int, module: nn.Module, x: object, is_weight: bool) -> None:
        if not self._active() or not isinstance(x, torch.Tensor) or not x.is_floating_point() or not x.numel():
            return
        if i in self._recorded:
            return  # a module called twice in one forward (a shared nn.ReLU): its first use is measured
        ptr = x.untyped_storage().data_ptr()
        if is_weight and (ptr in self._input_ptrs or ptr in self._measured_ptrs):
            return  # raw input, or the output of an activation module measured already
        if not is_weight:
            self._measured_ptrs.add(ptr)
        start = self.slot(i)
        elements, units = activation_counts(x.detach(), _unit_dim(module, x), self._out[start : start + STATS_PER_LAYER])
        self.order.append((i, elements, units))
        self._recorded.add(i)
