"""Per-layer gradient norms: one read of each gradient, summed per layer on the device, no host-device sync."""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import nn

from wbdebug import keys


def parameterised_layers(model: nn.Module) -> list[tuple[str, nn.Module, list[nn.Parameter]]]:
    """Every module with parameters of its own, in ``named_modules()`` order; a shared parameter counts once."""
    seen: set[int] = set()
    layers = []
    for name, module in model.named_modules():
        own = []
        for p in module.parameters(recurse=False):
            if id(p) not in seen:
                seen.add(id(p))
                own.append(p)
        if own:
            layers.append((keys.layer_name(name), module, own))
    return layers


def squared_norms(grads: list[torch.Tensor], out: torch.Tensor | None = None) -> torch.Tensor:
    """Σg² of each gradient as one float32 vector (written into ``out`` when given), in the fewest passes.

    On CUDA one fused ``torch._foreach_norm`` launch covers every tensor. On CPU that op falls back to
    one slow reduction per tensor; a BLAS ``dot(g, g)`` reads the same memory 2–3× faster (measured on
    the 784-512-512-10 MLP: 57 µs against 147 µs per step).
    """
    if all(g.is_cuda and not g.is_sparse for g in grads):
        squares = [n.square() for n in torch._foreach_norm(grads, 2, dtype=torch.float32)]
    else:
        squares = []
        for g in grads:
            if g.dtype == torch.float32 and not g.is_sparse and g.is_contiguous() and not g.is_cuda:
                flat = g.view(-1)
                squares.append(torch.dot(flat, flat))
            else:
                if g.is_sparse:
                    g = g.coalesce().values()
                squares.append(torch.linalg.vector_norm(g, dtype=torch.float32).square())
    if out is not None and any(s.device != out.device for s in squares):  # a model split over devices
        squares = [s.to(out.device, non_blocking=True) for s in squares]
    return torch.stack(squares, out=out)


class GradientProbe:
    """Writes each parameter's Σg² into a device buffer row (no host sync); norms are formed on the host.

    Measured where it is called from: the Monitor calls it when backward finishes, so the norms are
    the gradients backward produced, before any clipping or optimizer step in the user's loop.
    Parameters without a gradient (frozen, unused this step) are skipped. Keeping per-parameter
    squares (not per-layer sums) costs no extra device op and lets a NaN be traced to its parameter.
    """

    def __init__(self, layers: list[tuple[str, nn.Module, list[nn.Parameter]]]) -> None:
        self.layer_names = [name for name, _, _ in layers]
        self.params: list[nn.Parameter] = []
        self.param_names: list[str] = []
        self.param_layer: list[int] = []
        for i, (name, module, params) in enumerate(layers):
            own = {id(p): n for n, p in module.named_parameters(recurse=False)}
            for p in params:
                self.params.append(p)
                self.param_names.append(f"{name}.{own.get(id(p), '?')}" if name != keys.ROOT_NAME else own.get(id(p), "?"))
                self.param_layer.append(i)
        self._param_layer = np.asarray(self.param_layer, dtype=np.int64)
        self._index_cache: dict[tuple[int, ...], torch.Tensor] = {}
        self._all = tuple(range(len(self.params)))
        self._layouts: dict[tuple[int, ...], tuple[np.ndarray, np.ndarray, list[str]]] = {}

    @property
    def width(self) -> int:
        """Buffer columns this probe writes: one per parameter."""
        return len(self.params)

    def measure(self, out: torch.Tensor, scale: torch.Tensor | None = None) -> tuple[int, ...]:
        """Write Σg² of every parameter with a gradient into ``out`` (a 1-D device view); return their indices.

        ``scale`` is a GradScaler's current scale (a device tensor): the gradients backward produced are
        multiplied by it, so the squares are divided by its square — reported unscaled, with no sync.
        """
        grads = [p.grad for p in self.params]
        if any(g is None for g in grads):
            present = tuple(i for i, g in enumerate(grads) if g is not None)
            if not present:
                return ()
            grads = [grads[i] for i in present]
        else:
            present = self._all
        if present is self._all and scale is None:
            squared_norms(grads, out=out)  # the usual step: straight into the buffer row
            return present
        stacked = squared_norms(grads).to(out.device, non_blocking=True)
        if scale is not None:
            stacked.div_(scale.to(device=out.device, dtype=torch.float32).square())
        if present is self._all:
            out.copy_(stacked)
        else:
            out.index_copy_(0, self._index(present, out.device), stacked)
        return present

    def _index(self, present: tuple[int, ...], device: torch.device) -> torch.Tensor:
        cached = self._index_cache.get(present)
        if cached is None:
            if len(self._index_cache) > 64:  # frozen/unfrozen patterns change rarely; stay bounded anyway
                self._index_cache.clear()
            cached = self._index_cache[present] = torch.tensor(present, device=device)
        return cached

    def norms(
        self, squares: np.ndarray, present: tuple[int, ...]
    ) -> list[tuple[float, dict[str, float], str | None]]:
        """Host side, for rows of Σg² ``[rows, params]`` that share ``present``: per row, (global norm,
        {layer: norm} for the layers with gradients, first non-finite parameter). One numpy pass for all rows."""
        idx, starts, names = self._layout(present)
        sq = squares[:, idx].astype(np.float64)
        totals = np.sqrt(sq.sum(axis=1)).tolist()
        per_layer = np.sqrt(np.add.reduceat(sq, starts, axis=1)).tolist()  # params are grouped by layer
        out = []
        for r, total in enumerate(totals):
            first_bad = None
            if not math.isfinite(total):
                bad = np.flatnonzero(~np.isfinite(sq[r]))
                first_bad = self.param_names[present[bad[0]]] if len(bad) else None
            out.append((total, dict(zip(names, per_layer[r])), first_bad))
        return out

    def totals(self, squares: np.ndarray, present: tuple[int, ...]) -> list[float]:
        """Global norm of each row of Σg² ``[rows, params]`` (NaN for a row with no gradients)."""
        if not present:
            return [math.nan] * len(squares)
        return np.sqrt(squares[:, np.asarray(present)].astype(np.float64).sum(axis=1)).tolist()

    def _layout(self, present: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray, list[str]]:
        cached = self._layouts.get(present)
        if cached is None:
            if len(self._layouts) > 64:
                self._layouts.clear()
            idx = np.asarray(present, dtype=np.int64)
            layer_of = self._param_layer[idx]
            starts = np.flatnonzero(np.r_[True, layer_of[1:] != layer_of[:-1]])
            cached = self._layouts[present] = (idx, starts, [self.layer_names[i] for i in layer_of[starts]])
        return cached
