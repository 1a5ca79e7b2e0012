"""DDP across two real processes (gloo): every rank detects, rank 0 alone writes, replicas are compared."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _scenario(name: str, rank: int, out: Path) -> dict:
    import wbdebug

    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)))
    opt = torch.optim.SGD(model.parameters(), 0.05)
    crit = nn.CrossEntropyLoss()
    gen = torch.Generator().manual_seed(100 + rank)  # each rank its own data shard
    memory = wbdebug.MemorySink()
    monitor = wbdebug.watch(model, opt, crit, console=False, log_every=10, sinks=[memory],
                            wandb_project=f"ddp-{name}")
    for step in range(40):
        x = torch.randn(32, 16, generator=gen)
        y = (x[:, :4]).argmax(1)
        if name == "nan_on_rank1" and rank == 1 and step == 25:
            x[0, 0] = float("nan")
        if name == "desync" and rank == 1 and step == 15:
            with torch.no_grad():  # a replica that drifted: DDP never re-broadcasts parameters
                model.module[0].weight.add_(0.05)
        opt.zero_grad()
        crit(model(x), y).backward()
        opt.step()
    monitor.close()
    return {
        "events": [e.model_dump(mode="json") for e in monitor.events],
        "run_dir": str(Path(monitor.run.dir).parent) if monitor.run is not None else None,
        "grad_total": memory.series("wbdebug/grad_norm_total"),
        "layers": sorted(k for k in (memory.rows[-1][1] if memory.rows else {}) if "grad_norm/" in k),
    }


def _worker(rank: int, world: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        results = {name: _scenario(name, rank, Path(out)) for name in ("healthy", "nan_on_rank1", "desync")}
        Path(out, f"rank{rank}.json").write_text(json.dumps(results))
    finally:
        dist.destroy_process_group()


def test_ddp_two_processes(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    mp.spawn(_worker, args=(2, _free_port(), str(tmp_path)), nprocs=2, join=True)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]

    def problems(rank, name):
        return [(e["kind"], e["severity"]) for e in ranks[rank][name]["events"] if e["severity"] != "info"]

    # healthy: quiet on both ranks; layer names are the user's (no "module." prefix)
    assert problems(0, "healthy") == problems(1, "healthy") == []
    assert ranks[0]["healthy"]["layers"] == ["wbdebug/grad_norm/0", "wbdebug/grad_norm/2"]

    # gradients are measured after DDP's all-reduce: every rank reports the same averaged gradient
    g0, g1 = ranks[0]["healthy"]["grad_total"], ranks[1]["healthy"]["grad_total"]
    assert g0 and g0 == g1

    # only rank 0 writes to W&B
    assert ranks[0]["healthy"]["run_dir"] is not None and ranks[1]["healthy"]["run_dir"] is None
    assert len(list((tmp_path / "wandb").glob("offline-run-*"))) == 3  # one per scenario, all rank 0's

    # a NaN on rank 1 only is an event on both ranks, naming rank 1, at the step it happened
    for rank in (0, 1):
        nan = next(e for e in ranks[rank]["nan_on_rank1"]["events"] if e["kind"] == "nonfinite_loss")
        assert nan["step"] == 25 and "rank(s) [1]" in nan["message"], nan

    # a replica whose parameters drifted is reported on both ranks
    for rank in (0, 1):
        div = [e for e in ranks[rank]["desync"]["events"] if e["kind"] == "rank_divergence" and not e["cleared"]]
        assert div and div[0]["severity"] == "error" and "[1]" in div[0]["message"]
        assert 19 <= div[0]["step"] <= 29  # the first read-back after the drift at step 15
