"""Per-layer gradient norms: one read of each gradient, summed per layer on the device, no host-device sync."""

from __future__ import annotations

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


def squared_norms(grads: list[torch.Tensor]) -> list[torch.Tensor]:
    """Σg² of each gradient, as float32 device scalars, in the fewest passes over memory.

    On CUDA one fused ``torch._foreach_norm`` launch covers every tensor. On CPU that op falls back to
    one slow reduction per tensor; a BLAS ``dot(g, g)`` reads the same memory 2–3× faster (measured on
    the 784-512-512-10 MLP: 57 µs against 147 µs per step).
    """
    if all(g.is_cuda and not g.is_sparse for g in grads):
        return [n.square() for n in torch._foreach_norm(grads, 2, dtype=torch.float32)]
    out = []
    for g in grads:
        if g.is_sparse:
            g = g.coalesce().values()
        if g.dtype == torch.float32 and g.is_contiguous() and g.device.type == "cpu":
            flat = g.view(-1)
            out.append(torch.dot(flat, flat))
        else:
            out.append(torch.linalg.vector_norm(g, dtype=torch.float32).square())
    return out


class GradientProbe:
    """Writes [global norm, norm of layer 0, layer 1, …] into a device buffer row (no host sync).

    Measured where it is called from: the Monitor calls it when backward finishes, so the norms are
    the gradients backward produced, before any clipping or optimizer step in the user's loop.
    Parameters without a gradient (frozen, unused this step) are skipped.
    """

    def __init__(self, layers: list[tuple[str, nn.Module, list[nn.Parameter]]]) -> None:
        self.layer_names = [name for name, _, _ in layers]
        self.params: list[nn.Parameter] = []
        self.param_layer: list[int] = []
        for i, (_, _, params) in enumerate(layers):
            for p in params:
                self.params.append(p)
                self.param_layer.append(i)
        self._index_cache: dict[tuple[int, ...], tuple[torch.Tensor, tuple[int, ...]]] = {}

    @property
    def width(self) -> int:
        """Buffer columns this probe writes: the global norm and one per layer."""
        return 1 + len(self.layer_names)

    def measure(self, out: torch.Tensor, scale: torch.Tensor | None = None) -> tuple[int, ...]:
        """Write the norms into ``out`` (a 1-D device view) and return which layers had gradients.

        ``scale`` is a GradScaler's current scale (a device tensor): the gradients backward produced are
        multiplied by it, so the norms are divided by it — reported unscaled, with no sync.
        """
        present = tuple(i for i, p in enumerate(self.params) if p.grad is not None)
        if not present:
            return ()
        grads = [self.params[i].grad for i in present]
        device = out.device
        squares = torch.stack([s if s.device == device else s.to(device, non_blocking=True)
                               for s in squared_norms(grads)])
        if scale is not None:
            squares.div_(scale.to(device=device, dtype=torch.float32).square())
        index, layers_present = self._index(present, device)
        layers = out[1:]
        layers.zero_().index_add_(0, index, squares)
        torch.sum(layers, dim=0, keepdim=True, out=out[:1])
        out.sqrt_()
        return layers_present

    def _index(self, present: tuple[int, ...], device: torch.device) -> tuple[torch.Tensor, tuple[int, ...]]:
        cached = self._index_cache.get(present)
        if cached is None:
            layer_of = [self.param_layer[i] for i in present]
            cached = (torch.tensor(layer_of, device=device), tuple(sorted(set(layer_of))))
            if len(self._index_cache) > 64:  # frozen/unfrozen patterns change rarely; stay bounded anyway
                self._index_cache.clear()
            self._index_cache[present] = cached
        return cached
