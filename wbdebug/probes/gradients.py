"""Per-layer gradient norms from one fused ``torch._foreach_norm``: no host-device sync."""

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


class GradientProbe:
    """Writes [global norm, norm of layer 0, layer 1, …] into a device buffer row.

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
        dense = [g for g in grads if not g.is_sparse]
        if len(dense) == len(grads):
            norms = torch._foreach_norm(grads, 2, dtype=torch.float32)
        else:
            norms = [g.coalesce().values().float().norm() if g.is_sparse else g.float().norm() for g in grads]
        device = out.device
        per_param = torch.stack([n if n.device == device else n.to(device, non_blocking=True) for n in norms])
        if scale is not None:
            per_param = per_param / scale.to(device=device, dtype=torch.float32)
        index, layers_present = self._index(present, device)
        squares = per_param * per_param
        layer_sq = torch.zeros(len(self.layer_names), device=device, dtype=torch.float32)
        layer_sq.index_add_(0, index, squares)
        out[0] = squares.sum().sqrt()
        out[1:].copy_(layer_sq.sqrt())
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
