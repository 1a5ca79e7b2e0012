"""torch.distributed glue: which rank we are, and the one collective per read-back interval.

Detection stays in the detectors; this module only moves numbers. The collective is issued at the
same step on every rank (the read-back schedule counts optimizer steps, which DDP keeps in lockstep)
and never from close(), so a rank that stops early cannot leave the others waiting.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def world() -> tuple[int, int]:
    """(rank, world size); (0, 1) when torch.distributed is not initialised."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def gather_packets(packet: torch.Tensor, world_size: int) -> torch.Tensor:
    """Every rank's 1-D ``packet``, stacked as [world, len]: one all-gather, whatever the layer count."""
    out = torch.empty(world_size * packet.numel(), dtype=packet.dtype, device=packet.device)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # renamed in torch 2.10
    gather(out, packet.contiguous())  # the flat form: every backend (gloo included) accepts it
    return out.view(world_size, -1)


def is_fsdp(model: torch.nn.Module) -> bool:
    """True for a model wrapped (anywhere) by FullyShardedDataParallel, whose gradients are sharded."""
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
    except ImportError:  # pragma: no cover - builds without distributed
        return False
    return any(isinstance(m, FullyShardedDataParallel) for m in model.modules())
