"""Step-time and memory overhead of wbdebug against a bare loop and ``wandb.watch`` (issue 5).

Run from the repository root::

    python benchmarks/overhead.py            # full run (~5 min on 2 cores), writes benchmarks/RESULTS.md
    python benchmarks/overhead.py --quick    # smoke run (~1 min), prints only

Method. Every variant trains its own copy of the model (same seed, same batches, its own criterion
module, so one variant's hooks never fire in another's step) in one process, with W&B in offline mode.
The variants run interleaved in rounds of ``block`` steps each (A B C D E, B C D E A, …, then
A C E B D, …: start and stride rotate so that machine drift cancels and no arm always follows the
same one). Between blocks the script waits until W&B's service process is idle again, so one
variant's records are never processed on another's clock; that work is left off every clock, which
flatters ``wandb.watch`` (the service works through its histograms on the same two cores in a real run). Before each block the arm's parameters and optimizer state are moved to fresh memory
(identical bare arms otherwise differed by up to 8% on the MLP, by where their tensors lay). A
round's ratio is a variant's block time over the bare block's time in that round; the table gives
the median over rounds and the amortised ratio (total time over total bare time). Blocks are a
multiple of wbdebug's check and activation intervals; in the full run the timed steps per variant
are also a multiple of its log interval and of ``wandb.watch``'s ``log_freq=100``, so every periodic
cost falls inside the amortised figure (exactly so when no round was set aside), while the median
over rounds can leave out a cost that only some rounds pay (a W&B row every 50 steps, a
``wandb.watch`` histogram every 100).

The machine this was written on is shared with other jobs, and with two intra-op threads on two
cores one busy neighbour slows a step tenfold. The CPU time other processes take is metered from
``/proc`` during every block; a round they disturbed is abandoned and set aside, and the next one
waits for quiet (within a time budget; the report says how many rounds were used).

Memory is the process's peak resident set size (Linux ``VmHWM``, reset through
``/proc/self/clear_refs``), not tracemalloc: PyTorch's CPU tensors bypass Python's allocator. It is
measured in a fresh process after the timings, with malloc's mmap threshold fixed at 64 KiB so freed
memory leaves the RSS at once: each variant is built from scratch and trained a few steps, and its
peak is taken above the RSS just before. Growth over a long run is the Python heap (tracemalloc,
which does see wbdebug's and W&B's host-side objects) and the RSS, between two points of equal
phase, on the MLP.
"""

from __future__ import annotations

import argparse
import copy
import ctypes
import gc
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import tracemalloc
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable

_TMP = tempfile.TemporaryDirectory(prefix="wbdebug-bench-")
os.environ["WANDB_MODE"] = "offline"
os.environ["WANDB_SILENT"] = "true"
os.environ["WANDB_DIR"] = _TMP.name
os.environ.setdefault("WANDB_CONSOLE", "off")  # wandb would otherwise wrap stdout, and this script prints

import torch  # noqa: E402
import wandb  # noqa: E402
from torch import nn  # noqa: E402

import wbdebug  # noqa: E402

HERE = Path(__file__).resolve().parent
MiB = 1024 * 1024

# ----------------------------------------------------------------------------------------- models


class SmallCNN(nn.Module):
    """Four conv–BatchNorm–ReLU blocks on 32×32 RGB (CIFAR-sized), global average pool, linear head."""

    def __init__(self, width: int = 32, classes: int = 10) -> None:
        super().__init__()
        w = width
        self.features = nn.Sequential(
            nn.Conv2d(3, w, 3, padding=1), nn.BatchNorm2d(w), nn.ReLU(),
            nn.Conv2d(w, 2 * w, 3, padding=1), nn.BatchNorm2d(2 * w), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(2 * w, 4 * w, 3, padding=1), nn.BatchNorm2d(4 * w), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(4 * w, 4 * w, 3, padding=1), nn.BatchNorm2d(4 * w), nn.ReLU(),
            nn.AdaptiveAvgPool2d(1), nn.Flatten(),
        )
        self.head = nn.Linear(4 * w, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


class SmallTransformer(nn.Module):
    """Pre-norm transformer encoder over token ids with learned positions and a vocabulary head."""

    def __init__(self, vocab: int = 1000, d_model: int = 256, layers: int = 2, seq: int = 64) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d_model)
        self.pos = nn.Parameter(torch.randn(seq, d_model) * 0.02)
        layer = nn.TransformerEncoderLayer(
            d_model, nhead=4, dim_feedforward=4 * d_model, dropout=0.1, batch_first=True, norm_first=True
        )
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.encoder(self.embed(x) + self.pos)))


@dataclass
class Workload:
    name: str
    description: str
    build: Callable[[], nn.Module]
    batches: Callable[[], list[tuple[torch.Tensor, torch.Tensor]]]
    block: int  # steps per variant per round
    rounds: int
    warmup: int
    memory_steps: int
    budget_s: float  # give up on further rounds after this long (a busy machine)


def _teacher_batches(shape: tuple[int, ...], classes: int, n: int = 8) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Random inputs labelled by a fixed random linear teacher: learnable, so the run stays healthy."""
    gen = torch.Generator().manual_seed(1)
    features = math.prod(shape[1:])
    teacher = torch.randn(features, classes, generator=gen)
    out = []
    for _ in range(n):
        x = torch.randn(*shape, generator=gen)
        out.append((x, (x.reshape(shape[0], -1) @ teacher).argmax(1)))
    return out


def _token_batches(vocab: int = 1000, batch: int = 16, seq: int = 64, n: int = 8):
    gen = torch.Generator().manual_seed(1)
    out = []
    for _ in range(n):
        x = torch.randint(0, vocab, (batch, seq), generator=gen)
        out.append((x, (x * 7 + 3) % vocab))  # a per-token mapping: learnable from the embedding alone
    return out


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(784, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10))


def workloads(quick: bool) -> list[Workload]:
    """The three models; block sizes are multiples of wbdebug's check/activation period (checked below)."""
    return [
        Workload("MLP", "784-512-512-10, batch 128, Adam", _mlp,
                 lambda: _teacher_batches((128, 784), 10),
                 block=50, rounds=3 if quick else 12, warmup=50 if quick else 200, memory_steps=20,
                 budget_s=40 if quick else 120),
        Workload("CNN+BN", "4 conv-BN-ReLU blocks (32-64-128-128 ch), 32×32×3, batch 32, Adam", SmallCNN,
                 lambda: _teacher_batches((32, 3, 32, 32), 10),
                 block=10, rounds=3 if quick else 20, warmup=20, memory_steps=10,
                 budget_s=40 if quick else 150),
        Workload("Transformer", "2-layer encoder, d=256, 4 heads, seq 64, vocab 1000, batch 16, Adam",
                 SmallTransformer, _token_batches,
                 block=10 if quick else 20, rounds=3 if quick else 10, warmup=5 if quick else 20, memory_steps=10,
                 budget_s=60 if quick else 240),
    ]


# --------------------------------------------------------------------------------------- variants

EVERY_STEP = {"check_every": 1, "log_every": 1, "activation_every": 1}


@dataclass(frozen=True)
class Variant:
    name: str
    wbdebug_settings: dict | None = None  # wbdebug.watch(**settings) when not None
    wandb_log_freq: int | None = None  # wandb.watch(log="all", log_freq=...) when not None


VARIANTS = [
    Variant("bare"),
    Variant("wbdebug (defaults)", wbdebug_settings={}),
    Variant("wbdebug (every stat, every step)", wbdebug_settings=EVERY_STEP),
    Variant("wandb.watch log_freq=100", wandb_log_freq=100),
    Variant("wandb.watch log_freq=1", wandb_log_freq=1),
]


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, criterion: nn.Module, x, y) -> None:
    """One ordinary training step, identical for every variant."""
    optimizer.zero_grad(set_to_none=True)
    out = model(x)
    loss = criterion(out.reshape(-1, out.shape[-1]), y.reshape(-1))
    loss.backward()
    optimizer.step()


@dataclass
class Arm:
    """One variant's own model, optimizer, criterion and monitoring, kept across the rounds."""

    variant: Variant
    model: nn.Module
    optimizer: torch.optim.Optimizer
    criterion: nn.Module
    monitor: Any = None
    step: int = 0
    log_calls: list[tuple[int, float]] = field(default_factory=list)  # (keys, seconds) of wbdebug's W&B rows

    @classmethod
    def build(cls, variant: Variant, base: nn.Module, run: Any, instrument: bool = False) -> "Arm":
        model = copy.deepcopy(base)
        arm = cls(variant, model, torch.optim.Adam(model.parameters(), lr=1e-3), nn.CrossEntropyLoss())
        if variant.wbdebug_settings is not None:
            arm.monitor = wbdebug.watch(
                model, arm.optimizer, arm.criterion, run=run, console=False, **variant.wbdebug_settings
            )
            if instrument:
                arm._time_log_calls()
        elif variant.wandb_log_freq is not None:
            wandb.watch(model, log="all", log_freq=variant.wandb_log_freq)
        return arm

    def _time_log_calls(self) -> None:
        from wbdebug.sinks import WandbSink

        for sink in self.monitor.sinks:
            if isinstance(sink, WandbSink):
                inner = sink.log

                def timed(step: int, metrics: dict, inner=inner) -> None:
                    t0 = time.perf_counter()
                    inner(step, metrics)
                    self.log_calls.append((len(metrics) + 1, time.perf_counter() - t0))

                sink.log = timed  # instance attribute: the Monitor looks the method up per call

    def relocate(self) -> None:
        """Move the parameters and optimizer state to freshly allocated memory, keeping every object.

        Identical bare arms differed by up to 8% (MLP) depending on where their tensors happened to
        be placed; re-drawing the placement before each block turns that bias into noise the median
        absorbs. Parameter objects stay the same, so every hook stays attached.
        """
        with torch.no_grad():
            for p in self.model.parameters():
                p.data = p.data.clone()
            for state in self.optimizer.state.values():
                for key, value in state.items():
                    if torch.is_tensor(value) and value.numel() > 1:
                        state[key] = value.clone()

    def run_steps(self, batches: list, n: int) -> float:
        t0 = time.perf_counter()
        for _ in range(n):
            x, y = batches[self.step % len(batches)]
            train_step(self.model, self.optimizer, self.criterion, x, y)
            self.step += 1
        return time.perf_counter() - t0

    def close(self) -> int:
        """Remove every hook; return how many hooks are left on the model, criterion and optimizer."""
        if self.monitor is not None:
            self.monitor.close()
        elif self.variant.wandb_log_freq is not None:
            wandb.unwatch(self.model)
        return hooks_left(self.model, self.criterion, self.optimizer)

    @property
    def events(self) -> int:
        return len(self.monitor.events) if self.monitor is not None else 0


def hooks_left(model: nn.Module, criterion: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    n = 0
    for module in [*model.modules(), criterion]:
        n += len(module._forward_hooks) + len(module._forward_pre_hooks) + len(module._backward_hooks)
        n += len(getattr(module, "_backward_pre_hooks", {}))
    for p in model.parameters():
        n += len(p._backward_hooks or {})
        n += len(getattr(p, "_post_accumulate_grad_hooks", None) or {})
    n += len(optimizer._optimizer_step_pre_hooks) + len(optimizer._optimizer_step_post_hooks)
    return n



# ------------------------------------------------------------------------------- other processes


def _descendants(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [root]
    while todo:
        kids = children.get(todo.pop(), [])
        out += kids
        todo += kids
    return out


class CpuMeter:
    """CPU that *other* processes used over an interval, in cores: the system's busy time (steal
    included) minus this process's and its children's (W&B's service). Linux only; elsewhere 0.

    The machine this was written on is shared, and with two intra-op threads on two cores one busy
    neighbour makes every OpenMP barrier wait for a descheduled thread — steps slow down tenfold and
    more — so rounds a neighbour disturbed are set aside instead of being averaged in.
    """

    def __init__(self) -> None:
        self.tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
        self.available = Path("/proc/stat").exists()
        self.pids = [os.getpid()]

    def refresh(self) -> None:
        if self.available:
            self.pids = [os.getpid(), *_descendants(os.getpid())]

    def read(self) -> tuple[float, int, int]:
        t = time.perf_counter()
        if not self.available:
            return t, 0, 0
        cpu = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
        busy = cpu[0] + cpu[1] + cpu[2] + cpu[5] + cpu[6] + cpu[7]  # user nice system irq softirq steal
        own = 0
        for pid in self.pids:
            try:
                fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
                own += int(fields[11]) + int(fields[12])  # utime, stime
            except (OSError, IndexError, ValueError):
                pass
        return t, busy, own

    def children_ticks(self) -> int:
        """CPU ticks used so far by this process's children (W&B's service and its system monitor)."""
        total = 0
        for pid in self.pids[1:]:
            try:
                fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
                total += int(fields[11]) + int(fields[12])
            except (OSError, IndexError, ValueError):
                pass
        return total

    def settle(self, limit_s: float = 3.0) -> float:
        """Wait until the children have been idle (≤ 1 tick in 0.1 s) — W&B's service has caught up."""
        t0 = time.perf_counter()
        while self.available and time.perf_counter() - t0 < limit_s:
            before = self.children_ticks()
            time.sleep(0.1)
            if self.children_ticks() - before <= 1:
                break
        return time.perf_counter() - t0

    def foreign(self, start: tuple[float, int, int]) -> float:
        """Cores' worth of CPU other processes used since ``start`` (a :meth:`read`)."""
        end = self.read()
        wall = end[0] - start[0]
        if wall <= 0:
            return 0.0
        return max(0.0, ((end[1] - start[1]) - (end[2] - start[2])) / self.tick / wall)

    def wait_quiet(self, threshold: float, budget_s: float) -> float:
        """Sleep while other processes use more than ``threshold`` cores, up to ``budget_s``; the seconds waited."""
        waited = 0.0
        while True:
            start = self.read()
            time.sleep(0.25)
            if self.foreign(start) <= threshold or waited + 0.25 > budget_s:
                return waited
            waited += 0.25

# ------------------------------------------------------------------------------------------ memory

_libc = ctypes.CDLL("libc.so.6") if sys.platform.startswith("linux") else None


def _status_kib(field_name: str) -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field_name + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return None


def rss() -> int:
    """Current resident set size in bytes (after collecting garbage and trimming malloc)."""
    gc.collect()
    if _libc is not None:
        _libc.malloc_trim(0)
    return (_status_kib("VmRSS") or 0) * 1024


def reset_peak() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS (Linux ≥ 4.0)
        return True
    except OSError:
        return False


def peak_rss() -> int:
    return (_status_kib("VmHWM") or 0) * 1024


def exact_rss() -> bool:
    """Make malloc hand every block over 64 KiB to mmap, so freed memory leaves the RSS at once.

    Without it, heap fragmentation left behind by one variant moved the next one's peak by ±5 MiB;
    with it, repeated measurements agree within 0.1 MiB. It slows allocation, so only the memory
    phase runs with it, in a process of its own (which also gets the same setting from the
    environment, ``MALLOC_MMAP_THRESHOLD_``, before its first allocation).
    """
    if _libc is None:
        return False
    M_MMAP_THRESHOLD = -3
    return bool(_libc.mallopt(M_MMAP_THRESHOLD, 64 * 1024))


def measure_memory(work: Workload, run: Any, reps: int) -> tuple[dict[str, float], dict[str, int]]:
    """Peak MiB per variant (the smallest of ``reps`` measurements in rotating order, after a discarded
    warm-up build of every variant: lazy imports and one-off caches only ever inflate a peak) and the
    hooks left behind."""
    batches = work.batches()
    for v in VARIANTS:
        measure_peak(v, work, batches, run, steps=2)
    peaks: dict[str, float] = {v.name: math.inf for v in VARIANTS}
    left: dict[str, int] = {v.name: 0 for v in VARIANTS}
    for rep in range(reps):
        for v in VARIANTS[rep % len(VARIANTS):] + VARIANTS[: rep % len(VARIANTS)]:
            peak, extra = measure_peak(v, work, batches, run)
            peaks[v.name] = min(peaks[v.name], peak)
            left[v.name] += extra
    return peaks, left


def measure_peak(
    variant: Variant, work: Workload, batches: list, run: Any, steps: int | None = None
) -> tuple[float, int]:
    """Peak RSS above the baseline while building one variant from scratch and training it a few steps."""
    base_rss = rss()
    if not reset_peak():
        return math.nan, 0
    torch.manual_seed(0)
    arm = Arm.build(variant, work.build(), run)
    arm.run_steps(batches, work.memory_steps if steps is None else steps)
    peak = peak_rss() - base_rss
    left = arm.close()
    del arm
    gc.collect()
    return peak / MiB, left


def measure_growth(variant: Variant, work: Workload, batches: list, run: Any, steps: int) -> Growth:
    """Python-heap and RSS growth per step over the second of two equal intervals after 100 warm-up steps.

    The first interval lets bounded histories (the detectors' windows) fill up; a leak keeps growing
    through the second. Both intervals span whole log periods, so the end points share their phase.
    """
    torch.manual_seed(0)
    arm = Arm.build(variant, work.build(), run)
    arm.run_steps(batches, 100)
    tracemalloc.start()
    arm.run_steps(batches, steps)
    gc.collect()
    heap1, rss1, snap1 = tracemalloc.get_traced_memory()[0], rss(), tracemalloc.take_snapshot()
    arm.run_steps(batches, steps)
    gc.collect()
    heap2, rss2, snap2 = tracemalloc.get_traced_memory()[0], rss(), tracemalloc.take_snapshot()
    tracemalloc.stop()
    arm.close()
    top = [
        f"{_short(stat.traceback[0].filename)}:{stat.traceback[0].lineno} {stat.size_diff:+d} B"
        for stat in _own(snap2).compare_to(_own(snap1), "lineno")[:3]
        if stat.size_diff > 0
    ]
    return Growth((heap2 - heap1) / steps, (rss2 - rss1) / steps, top)


def _short(path: str) -> str:
    if "site-packages/" in path:
        return path.rsplit("site-packages/", 1)[1]
    return "/".join(Path(path).parts[-2:])


def _own(snapshot: tracemalloc.Snapshot) -> tracemalloc.Snapshot:
    return snapshot.filter_traces([tracemalloc.Filter(False, tracemalloc.__file__)])


@dataclass
class Growth:
    heap_per_step: float
    rss_per_step: float
    top: list[str]


# ----------------------------------------------------------------------------------------- W&B log


def log_call_cost(run: Any, n_keys: int = 300, calls: int = 50) -> float:
    """Median seconds of one ``run.log`` of ``n_keys`` floats (a wbdebug-sized row) in offline mode."""
    run.define_metric("bench/step", hidden=True)
    run.define_metric("bench/*", step_metric="bench/step")
    times = []
    for i in range(calls + 5):
        row = {f"bench/grad_norm/layer{k}": 1.0 / (k + i + 1) for k in range(n_keys - 1)}
        row["bench/step"] = i
        t0 = time.perf_counter()
        run.log(row)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[5:])


# ------------------------------------------------------------------------------------------ driver


@dataclass
class Result:
    work: Workload
    bare_ms: float
    ratios: dict[str, list[float]]  # per clean round
    amortised: dict[str, float]
    peak_mib: dict[str, float]
    hooks_left: dict[str, int]
    events: dict[str, int]
    log_calls: dict[str, list[tuple[int, float]]]
    rounds_run: int
    rounds_used: int
    short: bool  # fewer clean rounds than planned within the time budget
    foreign_max: float  # the most CPU (cores) other processes took during any block
    waited_s: float
    seconds: float


@dataclass
class Quiet:
    """How much CPU other processes may take during a clean round, and how long to wait for them."""

    block_threshold: float = 0.15  # cores, averaged over a block, in every block of a clean round
    chunk_threshold: float = 0.3  # cores over one ~0.25 s chunk: abandon the round at once
    chunk_s: float = 0.25  # timing is checked for disturbance every this many seconds of bare steps
    wait_threshold: float = 0.1  # cores: wait before a round while the neighbours take more
    wait_budget_s: float = 240.0  # total waiting allowed over the whole run

    def wait(self, meter: CpuMeter) -> float:
        waited = meter.wait_quiet(self.wait_threshold, self.wait_budget_s)
        self.wait_budget_s -= waited
        return waited


QUIET = Quiet()


def timed_block(arm: Arm, batches: list, steps: int, chunk: int, meter: CpuMeter, quiet: Quiet) -> tuple[float, float]:
    """(seconds, the neighbours' mean load in cores) for ``steps`` steps; seconds is NaN if abandoned."""
    total, done, start = 0.0, 0, meter.read()
    while done < steps:
        n = min(chunk, steps - done)
        chunk_start = meter.read()
        total += arm.run_steps(batches, n)
        done += n
        if meter.foreign(chunk_start) > quiet.chunk_threshold:
            return math.nan, meter.foreign(start)
    return total, meter.foreign(start)


def block_order(r: int, n: int) -> list[int]:
    """Round ``r``'s order of the ``n`` arms: start and stride both rotate, so each arm runs in every
    position and after every other arm equally often (``n`` prime; 5 here)."""
    stride = 1 + (r // n) % (n - 1)
    return [(r + stride * j) % n for j in range(n)]


def bench(work: Workload, run: Any, meter: CpuMeter, quiet: Quiet, log: Callable[[str], None]) -> Result:
    t_start = time.perf_counter()
    batches = work.batches()
    torch.manual_seed(0)
    base = work.build()
    arms = [Arm.build(v, base, run, instrument=True) for v in VARIANTS]
    meter.refresh()
    for arm in arms:
        arm.run_steps(batches, work.warmup)
    step_s = min(arms[0].run_steps(batches, 1) for _ in range(5))
    chunk = max(1, min(work.block, round(quiet.chunk_s / step_s)))
    rounds: list[list[float]] = []  # block seconds per arm, for the clean rounds
    run_, waited, foreign_max = 0, 0.0, 0.0
    while len(rounds) < work.rounds and time.perf_counter() - t_start < work.budget_s:
        waited += quiet.wait(meter)
        order = block_order(run_, len(arms))
        run_ += 1
        times, foreign = [0.0] * len(arms), 0.0
        for i in order:
            arms[i].relocate()
            gc.collect()
            meter.settle()  # W&B's service catches up on the previous block's records off the clock
            times[i], load = timed_block(arms[i], batches, work.block, chunk, meter, quiet)
            foreign = max(foreign, load)
            if math.isnan(times[i]):
                break
        foreign_max = max(foreign_max, foreign)
        clean = not any(math.isnan(t) for t in times) and foreign <= quiet.block_threshold
        if clean:
            rounds.append(times)
        log(f"  {work.name}: round {run_}: " + (f"bare {1e3 * times[0] / work.block:.1f} ms/step, " if clean else "")
            + f"neighbours up to {foreign:.2f} cores" + ("" if clean else " — disturbed, set aside"))
    if not rounds:
        raise SystemExit(f"{work.name}: no undisturbed round within {work.budget_s:.0f} s; the machine is too busy")
    ratios = {a.variant.name: [t[i] / t[0] for t in rounds] for i, a in enumerate(arms) if i}
    amortised = {a.variant.name: sum(t[i] for t in rounds) / sum(t[0] for t in rounds) for i, a in enumerate(arms) if i}
    events = {a.variant.name: a.events for a in arms}
    log_calls = {a.variant.name: a.log_calls for a in arms if a.log_calls}
    left = {a.variant.name: a.close() for a in arms}
    del arms, base
    gc.collect()
    return Result(
        work, 1e3 * statistics.median(t[0] for t in rounds) / work.block, ratios, amortised, {}, left, events,
        log_calls, run_, len(rounds), len(rounds) < work.rounds, foreign_max, waited,
        time.perf_counter() - t_start,
    )


def machine() -> dict[str, str]:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = _status_kib("MemTotal")
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                mem = int(line.split()[1])
    except OSError:
        pass
    package = Path(wbdebug.__file__).resolve().parent
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                cwd=package, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "."], capture_output=True, text=True,
                               cwd=package, check=True).stdout.strip()
        commit = f"commit {commit}" + (" with uncommitted changes in wbdebug/" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        commit = f"imported from {package}"
    return {
        "CPU": f"{cpu}, {os.cpu_count()} logical cores visible"
               + (f", {len(os.sched_getaffinity(0))} usable" if hasattr(os, "sched_getaffinity") else ""),
        "Memory": f"{mem / 1024 / 1024:.1f} GiB" if mem else "unknown",
        "OS": f"{platform.system()} {platform.release()}",
        "Python": platform.python_version(),
        "torch": f"{torch.__version__} ({torch.get_num_threads()} intra-op threads)",
        "wandb": f"{wandb.__version__} (offline mode)",
        "wbdebug": f"{wbdebug.__version__}, {commit}",
        "Date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
    }


def _q(values: list[float], q: float) -> float:
    values = sorted(values)
    pos = q * (len(values) - 1)
    lo, hi = math.floor(pos), math.ceil(pos)
    return values[lo] + (values[hi] - values[lo]) * (pos - lo)


def report(results: list[Result], log_cost: float, growth: dict[str, Growth], args, total_s: float) -> str:
    cfg = wbdebug.Config()
    lines = [
        "# wbdebug overhead benchmark",
        "",
        f"Produced by `python benchmarks/overhead.py{' --quick' if args.quick else ''}` in {total_s:.0f} s. "
        "Step time of each monitoring variant over a bare training loop, measured interleaved in one process "
        "(method in the script's docstring).",
        "",
        "## Machine",
        "",
        *[f"- **{k}**: {v}" for k, v in machine().items()],
        "",
        f"wbdebug defaults benchmarked: `check_every={cfg.check_every}`, `log_every={cfg.log_every}`, "
        f"`activation_every={cfg.activation_every}`, `activations={cfg.activations}` "
        "(plus `console=False` so printing does not distort the timings). "
        "\"Every stat, every step\" is `check_every=1, log_every=1, activation_every=1`. "
        "`wandb.watch` runs with `log=\"all\"`.",
        "",
        "## Step time relative to the bare loop",
        "",
        "Median over rounds of (variant block time / bare block time in the same round), the interquartile "
        "range of those ratios in brackets, then the amortised ratio (total time / total bare time), which "
        "includes every periodic cost. Time in the training process only: W&B's service process works "
        "through the logged records between blocks, off the clock (this flatters `wandb.watch`).",
        "",
    ]
    header = "| variant | " + " | ".join(f"{r.work.name} ({r.bare_ms:.1f} ms/step bare)" for r in results) + " |"
    lines += [header, "|---|" + "---|" * len(results)]
    for v in VARIANTS[1:]:
        cells = []
        for r in results:
            rs = r.ratios[v.name]
            cells.append(f"**{statistics.median(rs):.3f}×** [{_q(rs, .25):.2f}–{_q(rs, .75):.2f}], "
                         f"amortised {r.amortised[v.name]:.3f}×")
        lines.append(f"| {v.name} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "Rounds used: steps per block × undisturbed rounds (other processes took at most "
        f"{QUIET.block_threshold} cores on average in each block, and at most {QUIET.chunk_threshold} in any "
        f"~{QUIET.chunk_s} s stretch; disturbed rounds are abandoned and set aside), of the rounds started: " + "; ".join(
            f"{r.work.name} {r.work.block} × {r.rounds_used} of {r.rounds_run}"
            + (" — fewer than planned within the time budget: **treat as noisy**" if r.short else "")
            + f" (neighbours' peak {r.foreign_max:.2f} cores, waited {r.waited_s:.0f} s)"
            for r in results) + ".",
        "",
        "## Peak memory",
        "",
        "Peak resident set size (Linux `VmHWM`) above the RSS just before, while building the variant from "
        f"scratch (model, Adam, monitoring) and training it {', '.join(f'{r.work.memory_steps} ({r.work.name})' for r in results)} "
        "steps; in brackets the difference from the bare run, as a share of the bare run's peak. "
        + ("Measured in a fresh process after the timings, with malloc's mmap threshold fixed at 64 KiB so that "
           "freed memory leaves the RSS at once; "
           if args.exact_rss else "malloc's mmap threshold could not be fixed: expect a few MiB of noise; ")
        + f"the smallest of {1 if args.quick else 2} measurements after a discarded warm-up build of each variant.",
        "",
        "| variant | " + " | ".join(r.work.name for r in results) + " |",
        "|---|" + "---|" * len(results),
    ]
    for v in VARIANTS:
        cells = []
        for r in results:
            peak, bare = r.peak_mib[v.name], r.peak_mib["bare"]
            cell = f"{peak:.1f} MiB"
            if v.name != "bare" and bare > 0:
                cell += f" ({peak - bare:+.1f} MiB, {100 * (peak - bare) / bare:+.1f}%)"
            cells.append(cell)
        lines.append(f"| {v.name} | " + " | ".join(cells) + " |")
    lines += [
        "",
        f"Growth over a long run: MLP, 100 warm-up steps, then two intervals of {args.growth_steps} steps; "
        "growth over the second interval (the first lets bounded histories fill). Python heap by tracemalloc "
        "(with the allocation sites that grew most), RSS after `malloc_trim`:",
        "",
        "| variant | Python heap | RSS | largest Python-heap increases |",
        "|---|---|---|---|",
        *[f"| {name} | {g.heap_per_step:+.1f} B/step | {g.rss_per_step:+.0f} B/step | {'; '.join(g.top) or '—'} |"
          for name, g in growth.items()],
        "",
        "## Cost of a W&B log call",
        "",
        f"- One offline `run.log` of a 300-key row: **{1e3 * log_cost:.2f} ms** (median of 50).",
    ]
    for r in results:
        for name, calls in r.log_calls.items():
            if calls:
                keys_ = statistics.median(k for k, _ in calls)
                lines.append(
                    f"- wbdebug's own rows, {r.work.name}, {name}: {len(calls)} calls of {keys_:.0f} keys, "
                    f"median {1e3 * statistics.median(t for _, t in calls):.2f} ms."
                )
    lines += ["", "## Targets (issue 5)", "", "| target | measured | met |", "|---|---|---|"]
    for target, measured, ok in targets(results):
        lines.append(f"| {target} | {measured} | {'yes' if ok else '**no**'} |")
    hooks = {name: n for r in results for name, n in r.hooks_left.items() if n}
    events = sum(n for r in results for n in r.events.values())
    lines += [
        "",
        "Sanity: hooks left on the models, criteria and optimizers after `monitor.close()` / `wandb.unwatch()`: "
        + ("none." if not hooks else ", ".join(f"{k}: {v}" for k, v in hooks.items()) + " (a leak)."),
        f"wbdebug events raised on these healthy runs: {events}"
        + (" (" + "; ".join(f"{r.work.name} {n}x {k}" for r in results for k, n in r.events.items() if n) + ")"
           if events else "") + ".",
        "",
    ]
    return "\n".join(lines)


MID = ("CNN+BN", "Transformer")
#: Everything after this line of RESULTS.md is written by hand and kept when the file is regenerated.
NOTES = "<!-- notes: kept across runs -->\n"


def targets(results: list[Result]) -> list[tuple[str, str, bool]]:
    by = {r.work.name: r for r in results}
    out = []
    med = lambda r, v: statistics.median(r.ratios[v])  # noqa: E731
    d, e, w100 = VARIANTS[1].name, VARIANTS[2].name, VARIANTS[3].name
    for name in MID:
        if name in by:
            out.append((f"{name}, defaults ≤ 1.03×", f"{med(by[name], d):.3f}×", med(by[name], d) <= 1.03))
    if "MLP" in by:
        out.append(("MLP, defaults ≤ 1.10×", f"{med(by['MLP'], d):.3f}×", med(by["MLP"], d) <= 1.10))
    for name in MID:
        if name in by:
            out.append((f"{name}, every stat every step ≤ 1.10×", f"{med(by[name], e):.3f}×",
                        med(by[name], e) <= 1.10))
    for r in results:
        a, b = r.amortised[d], r.amortised[w100]
        out.append((f"{r.work.name}, defaults cheaper than wandb.watch log_freq=100 (amortised)",
                    f"{a:.3f}× vs {b:.3f}×", a < b))
    for r in results:
        bare = r.peak_mib["bare"]
        over = 100 * (r.peak_mib[d] - bare) / bare if bare > 0 else math.nan
        out.append((f"{r.work.name}, defaults peak memory overhead < 5%", f"{over:+.1f}%", over < 5))
    return out


def memory_phase(args: argparse.Namespace) -> None:
    """The memory measurements, in a fresh process (``--memory-phase``): print them as JSON.

    Run apart so that malloc's mmap threshold is fixed before the first allocation (see
    :func:`exact_rss`) and nothing the timing phase left in the heap moves a peak.
    """
    exact = exact_rss()
    run = wandb.init(project="wbdebug-bench", mode="offline", dir=_TMP.name)
    try:
        out: dict[str, Any] = {"exact_rss": exact, "peaks": {}, "hooks_left": {}}
        for w in workloads(args.quick):
            if not args.only or w.name in args.only:
                out["peaks"][w.name], out["hooks_left"][w.name] = measure_memory(w, run, reps=1 if args.quick else 2)
        mlp = workloads(args.quick)[0]
        out["growth"] = {
            v.name: vars(measure_growth(v, mlp, mlp.batches(), run, args.growth_steps)) for v in VARIANTS[:3]
        }
    finally:
        run.finish()
    print(json.dumps(out))


def run_memory_phase(args: argparse.Namespace) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--memory-phase", "--threads", str(args.threads)]
    cmd += ["--quick"] if args.quick else []
    cmd += ["--only", *args.only] if args.only else []
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(64 * 1024),
           "GLIBC_TUNABLES": f"glibc.malloc.mmap_threshold={64 * 1024}"}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"memory phase failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds and steps; prints, writes nothing")
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads (default 2)")
    parser.add_argument("--only", nargs="*", help="model names to run (MLP, CNN+BN, Transformer)")
    parser.add_argument("--out", type=Path, help="write the markdown here (default: RESULTS.md unless --quick)")
    parser.add_argument("--memory-phase", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.growth_steps = 50 if args.quick else 500
    torch.set_num_threads(args.threads)
    if args.memory_phase:
        memory_phase(args)
        return
    out = args.out or (None if args.quick else HERE / "RESULTS.md")
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731

    cfg = wbdebug.Config()
    period = math.lcm(cfg.check_every, cfg.activation_every)
    meter, quiet = CpuMeter(), QUIET
    quiet.wait_budget_s = 60.0 if args.quick else 240.0
    t0 = time.perf_counter()
    works = [w for w in workloads(args.quick) if not args.only or w.name in args.only]
    for w in works:
        if w.block % period:
            raise SystemExit(f"{w.name}: block {w.block} is not a multiple of wbdebug's period {period}")
    run = wandb.init(project="wbdebug-bench", mode="offline", dir=_TMP.name)
    try:
        results = []
        for w in works:
            log(f"{w.name}: {w.description}")
            results.append(bench(w, run, meter, quiet, log))
            log(f"  {w.name}: {results[-1].seconds:.0f} s")
        log("W&B log call …")
        cost = log_call_cost(run, calls=20 if args.quick else 50)
    finally:
        run.finish()
    log("memory and growth (in a fresh process) …")
    memory = run_memory_phase(args)
    args.exact_rss = memory["exact_rss"]
    for r in results:
        r.peak_mib = memory["peaks"][r.work.name]
        for name, n in memory["hooks_left"][r.work.name].items():
            r.hooks_left[name] += n
    growth = {name: Growth(**g) for name, g in memory["growth"].items()}
    text = report(results, cost, growth, args, time.perf_counter() - t0)
    print(text)
    if out is not None:
        notes = out.read_text().partition(NOTES)[2] if out.exists() else ""
        out.write_text(text + (f"\n{NOTES}{notes}" if notes.strip() else ""))
        log(f"wrote {out}" + (" (hand-written notes kept: re-check them against the new numbers)" if notes.strip() else ""))


if __name__ == "__main__":
    main()
