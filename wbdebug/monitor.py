"""Monitor: owns every hook and the step clock, and wires probes → detectors → sinks.

Per step it only launches a few small device kernels (fused gradient norms, a loss copy) that write
into a preallocated device buffer. Every ``check_every`` steps the buffer is read back once — the
only sync point, made asynchronous on CUDA — and the detectors judge each step's numbers on the host.
"""

from __future__ import annotations

import atexit
import functools
import math
import warnings
import weakref
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, NamedTuple

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from wbdebug import keys
from wbdebug.alerts import NONFINITE_KINDS, AlertPolicy, AlertSink, RunRef, TrainingHealthError, http_channels
from wbdebug.config import Config
from wbdebug.detectors import DeadActivationDetector, GradientDetector, LossDetector, StepStats
from wbdebug.detectors.amp import AmpDetector
from wbdebug.detectors.base import is_finite
from wbdebug.detectors.ranks import RankDetector
from wbdebug.distributed import gather_packets, is_fsdp, world
from wbdebug.forensics import Finding, replay
from wbdebug.recovery import Cooldown, RollbackBudget, Snapshotter
from wbdebug.detectors.loss import CROSS_ENTROPY
from wbdebug.events import Event, EventKind
from wbdebug.probes.activations import STATS_PER_LAYER, ActivationProbe, activation_fractions, activation_layers
from wbdebug.probes.gradients import GradientProbe, parameterised_layers, squared_norms
from wbdebug.probes.loss import (
    as_scalar_loss,
    classes_in_logits,
    find_loss_in_output,
    first_grad_tensor,
    logits_in_output,
    loss_family_of,
)
from wbdebug.sinks import ConsoleSink, JournalSink, Sink, WandbAlerts, WandbSink, start_run

# Loss sources, highest priority first: an explicit observe_loss() wins over a criterion, which wins
# over a loss found in the model's output (a HF model given labels *and* a criterion would count twice).
_OBSERVED, _CRITERION, _MODEL_OUTPUT = 0, 1, 2

#: The open Monitor of each model, so that watching a model again replaces the old monitor instead of
#: stacking a second set of hooks (re-running a notebook cell). Weak: never keeps a model alive.
_ACTIVE: "weakref.WeakKeyDictionary[nn.Module, Monitor]" = weakref.WeakKeyDictionary()


@dataclass
class _Row:
    """Host-side facts about one buffer row: which of its device values are real."""

    step: int
    loss_seen: bool = False
    params: tuple[int, ...] = ()
    activations: list[tuple[int, int, int]] | None = None  # (layer, elements, units) measured
    input_measured: bool = False
    amp: bool = False


class _RowViews(NamedTuple):
    row: torch.Tensor
    loss: torch.Tensor
    grads: torch.Tensor
    acts: torch.Tensor


@dataclass
class _Pending:
    host: torch.Tensor
    ready: Any  # a torch.cuda.Event, or None when the copy is already complete
    rows: list[_Row] = field(default_factory=list)


def unwrap_model(model: nn.Module) -> nn.Module:
    """The user's own module inside DDP / DataParallel / torch.compile, so layer names carry no ``module.``."""
    while True:
        if isinstance(model, (nn.DataParallel, nn.parallel.DistributedDataParallel)):
            model = model.module
        elif is_compiled(model):
            model = model._orig_mod
        else:
            return model


def is_compiled(model: nn.Module) -> bool:
    """True for the wrapper ``torch.compile(model)`` returns."""
    return type(model).__name__ == "OptimizedModule" and hasattr(model, "_orig_mod")


class Monitor:
    """Watches one model's training; see :func:`wbdebug.watch`."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        criterion: nn.Module | None = None,
        *,
        num_classes: int | None = None,
        run: Any = None,
        config: Config,
        sinks: list[Sink] | None = None,
        scaler: Any = None,
        scheduler: Any = None,
    ) -> None:
        self.config = config
        self.model = unwrap_model(model)
        self.scaler = scaler
        self.rank, self.world_size = world()
        self._ddp = isinstance(model, nn.parallel.DistributedDataParallel)
        # Guarded hook callables, built once: wrapping per call would cost more than the hook itself.
        self._h_output_grad = self._guarded(self._on_output_grad)
        self._h_backward_start = self._guarded(self._requeue_backward_end if self._ddp else self._on_backward_end)
        self._h_backward_end = self._guarded(self._on_backward_end)
        self.optimizer = optimizer
        self.criterion = criterion
        self.num_classes = num_classes
        self.events: list[Event] = []
        self.step = 0
        self.sinks: list[Sink] = []
        self._closed = False
        self._handles: list[RemovableHandle] = []
        self._reported_errors: set[str] = set()
        #: on_nonfinite="stop": set when the loss or gradients go non-finite; end the loop when it is True.
        self.should_stop = False
        self._health_error: TrainingHealthError | None = None
        self._alerts: AlertSink | None = None

        layers = parameterised_layers(self.model)
        self.grads = GradientProbe(layers)
        self.acts = ActivationProbe(self.model, activation_layers(self.model), self._guarded) if config.activations else None
        device = next(self.model.parameters()).device
        # Buffer columns: loss, AMP overflow count, AMP scale, gradient norms, activation statistics.
        self._g0 = 3
        self._a0 = self._g0 + self.grads.width
        width = self._a0 + (self.acts.width if self.acts else 0)
        self._buf = torch.full((config.check_every, width), math.nan, device=device, dtype=torch.float32)
        # Views of each buffer row, built once: slicing a tensor per step costs more than the copy into it.
        self._views = [_RowViews(r, r[0], r[self._g0 : self._a0], r[self._a0 :]) for r in self._buf]
        self._pinned: list[torch.Tensor] = []
        if device.type == "cuda":
            self._pinned = [torch.empty_like(self._buf, device="cpu").pin_memory() for _ in range(2)]
        self._rows: list[_Row] = []
        self._pending: deque[_Pending] = deque()
        self._cur = _Row(step=0)
        self._losses: dict[int, list[torch.Tensor]] = {}
        self._grads_measured = False
        self._backward_queued = False
        self._loss_sum, self._loss_n = 0.0, 0
        self._last_logged: int | None = None
        self._last_processed: _Row | None = None
        self._final_values = StepStats(step=0)
        self._next_pinned = 0
        self.journal_path: Path | None = None
        self._fresh_acts: dict[str, tuple[float, float, bool]] = {}
        self._compiled_seen = False
        self._input_layers = frozenset(name for name, _, is_weight in (self.acts.layers if self.acts else []) if is_weight)
        self.amp_overflows = 0
        # recovery and forensics
        rolls_back = "rollback" in (config.on_spike, config.on_nonfinite)
        self.snapshots = (
            Snapshotter(self.model, optimizer, keep=config.snapshot_keep, directory=config.snapshot_dir,
                        scaler=scaler, scheduler=scheduler)
            if rolls_back and optimizer is not None else None
        )
        self.rollback_budget = RollbackBudget(config.max_rollbacks, config.rollback_window)
        self.skipped_steps: list[int] = []
        self._cooldown: Cooldown | None = None
        self._replaying = False
        self._replayed = False
        self._batch: tuple[tuple, dict] | None = None
        self._target: tuple = ()
        self._findings: dict[int, Finding] = {}
        self.rank_detector = RankDetector(loss_factor=config.rank_loss_factor)
        self.amp_detector = AmpDetector(min_scale=config.amp_min_scale)

        self.loss_detector = LossDetector(
            history=config.history, warmup_steps=config.warmup_steps, spike_factor=config.spike_factor,
            spike_tail=config.spike_tail, spike_min_rise=config.spike_min_rise, check_initial=config.initial_loss,
            initial_warn_ratio=config.initial_loss_warn_ratio, initial_error_ratio=config.initial_loss_error_ratio,
            clear_steps=config.clear_steps,
        )
        self.grad_detector = GradientDetector(
            history=config.history, warmup_steps=config.warmup_steps, exploding_norm=config.exploding_norm,
            exploding_factor=config.exploding_factor, exploding_tail=config.exploding_tail, vanishing_ratio=config.vanishing_ratio,
            vanishing_floor=config.vanishing_floor, vanishing_steps=config.vanishing_steps,
            clear_steps=config.clear_steps,
        )
        self.dead_detector = DeadActivationDetector(threshold=config.dead_fraction, samples=config.dead_samples)
        family = loss_family_of(criterion)
        self.loss_detector.describe_loss(family, num_classes)
        self._loss_described = family is not None and (num_classes is not None or family != CROSS_ENTROPY)

        previous = _ACTIVE.get(self.model)
        if previous is not None and not previous._closed:
            warnings.warn("wbdebug: this model was already watched; closing the previous monitor", stacklevel=3)
            previous.close()
        _ACTIVE[self.model] = self

        self.run = None
        if is_compiled(model) and self.acts is not None:
            self._disable_activations("the model is compiled with torch.compile")
        if is_fsdp(model):
            warnings.warn(
                "wbdebug: FullyShardedDataParallel is not supported yet: gradient norms are of each rank's "
                "local shard and activation statistics are off", RuntimeWarning, stacklevel=3,
            )
            self.acts = None
        self._open_sinks(run, sinks)
        self._attach_hooks()
        self._schedule_activations()
        self._atexit = functools.partial(_close_at_exit, weakref.ref(self))
        atexit.register(self._atexit)

    # ------------------------------------------------------------------ set-up
    def _open_sinks(self, run: Any, extra: list[Sink] | None) -> None:
        cfg = self.config
        if cfg.rank_zero_only and self.rank != 0:
            self.sinks.extend(extra or [])
            return  # every rank detects; only rank 0 writes to W&B, the journal and the console
        channels = http_channels(cfg)  # first: a malformed webhook URL fails before a run is started
        if cfg.wandb:
            import wandb

            owns = False
            if run is None:
                run = wandb.run
            if run is None and cfg.wandb_mode != "disabled":
                run, owns = start_run(cfg.wandb_project, cfg.wandb_mode), True
            if run is not None:
                self.run = run
                self.sinks.append(WandbSink(run, owns_run=owns))
        if cfg.journal:
            path = cfg.journal_path
            if path is None and self.run is not None and getattr(self.run, "dir", None):
                path = Path(self.run.dir) / "events.jsonl"
            if path is not None:
                self.journal_path = Path(path)
                self.sinks.append(JournalSink(path))
        if cfg.alerts and cfg.wandb_alerts and self.run is not None:
            channels.insert(0, WandbAlerts(self.run, wait_duration_s=cfg.alert_cooldown_s))
        if channels:
            self._alerts = AlertSink(
                AlertPolicy.from_config(cfg), channels, run=RunRef.of(self.run), flush_s=cfg.alert_flush_s
            )
            self.sinks.append(self._alerts)
        if cfg.console:
            self.sinks.append(ConsoleSink())
        self.sinks.extend(extra or [])

    def _attach_hooks(self) -> None:
        self._handles.append(self.model.register_forward_hook(self._guarded(self._on_model_output)))
        if self.criterion is not None:
            self._handles.append(self.criterion.register_forward_hook(self._guarded(self._on_criterion)))
        if self.optimizer is not None:
            self._handles.append(self.optimizer.register_step_post_hook(self._guarded(self._on_optimizer_step)))
            if self.snapshots is not None or self.config.nan_forensics == "replay":
                self._handles.append(self.optimizer.register_step_pre_hook(self._guarded(self._on_optimizer_pre_step)))
        if self.config.nan_forensics == "replay":
            self._handles.append(
                self.model.register_forward_pre_hook(self._guarded(self._on_model_input), with_kwargs=True)
            )
        if self.snapshots is not None:
            self.snapshots.take(0)

    # ------------------------------------------------------------------ public
    def observe_loss(self, loss: torch.Tensor | float) -> None:
        """Record this step's loss when it comes from neither the criterion nor the model's output."""
        if isinstance(loss, bool) or not isinstance(loss, (torch.Tensor, int, float)):
            raise TypeError(f"observe_loss expects a loss tensor or a number, got {type(loss).__name__}")
        if isinstance(loss, torch.Tensor):
            value = as_scalar_loss(loss)
        else:
            value = torch.tensor(float(loss), dtype=torch.float32).to(self._buf.device, non_blocking=True)
        self._losses.setdefault(_OBSERVED, []).append(value)

    def close(self) -> None:
        """Read back what is left, flush every sink and remove every hook. Safe to call twice."""
        if self._closed:
            return
        try:
            for handle in self._handles:
                handle.remove()
            self._handles.clear()
            if self.acts is not None:
                self.acts.detach()
            self._flush()
        except Exception as exc:  # noqa: BLE001 - close() must finish its job
            self._internal_error("close", exc)
        finally:
            self._closed = True
            for sink in self.sinks:
                self._call_sink(sink, "close", self.events)
            atexit.unregister(self._atexit)
            if _ACTIVE.get(self.model) is self:
                del _ACTIVE[self.model]

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self) -> "Monitor":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return f"<wbdebug.Monitor {type(self.model).__name__} step={self.step} events={len(self.events)} {state}>"

    # ------------------------------------------------------------------ hooks
    def _on_model_input(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if torch.is_grad_enabled() and not self._replaying and not self._replayed:
            self._batch = (args, kwargs)  # by reference, released when the step ends

    def _on_model_output(self, module: nn.Module, args: tuple, output: object) -> None:
        if self._replaying:
            return
        if torch.compiler.is_compiling():
            self._compiled_seen = True  # inside a compiled graph: stay out of it, the criterion hook still works
            return
        if not torch.is_grad_enabled() or (self.criterion is not None and isinstance(output, torch.Tensor)):
            return  # a plain tensor carries no loss, and the criterion anchors the backward callback
        loss = find_loss_in_output(output)
        if loss is not None and loss.requires_grad:
            self._losses.setdefault(_MODEL_OUTPUT, []).append(as_scalar_loss(loss))
            if not self._loss_described and self.criterion is None:
                logits = logits_in_output(output)
                classes = self.num_classes or (int(logits.shape[-1]) if logits is not None else None)
                if classes is not None and classes >= 2:
                    self.loss_detector.describe_loss(CROSS_ENTROPY, classes)
                self._loss_described = True
        if self.criterion is not None:
            return  # the criterion's loss anchors the end-of-backward callback
        anchor = loss if loss is not None and loss.requires_grad else first_grad_tensor(output)
        if anchor is not None:
            anchor.register_hook(self._h_output_grad)

    def _on_output_grad(self, grad: torch.Tensor) -> None:
        if not self._backward_queued:
            self._backward_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._h_backward_start)

    def _requeue_backward_end(self) -> None:
        # Queued when backward starts, this runs before callbacks queued later in the same backward —
        # DDP's gradient all-reduce finalisation among them. Re-queueing puts the measurement after them.
        torch.autograd.Variable._execution_engine.queue_callback(self._h_backward_end)

    def _on_backward_end(self) -> None:
        """Runs once backward has finished: every gradient exists, none is clipped yet."""
        self._backward_queued = False
        self._measure_grads()
        if self.optimizer is None:
            self._maybe_replay()
            self._commit()

    def _on_criterion(self, module: nn.Module, args: tuple, output: object) -> None:
        if self._replaying or not isinstance(output, torch.Tensor) or not output.requires_grad:
            return  # evaluation under no_grad is not the training loss
        if self.config.nan_forensics == "replay" and not self._replayed:
            self._target = args[1:]
        self._losses.setdefault(_CRITERION, []).append(as_scalar_loss(output))
        output.register_hook(self._h_output_grad)
        if not self._loss_described:
            self._loss_described = True
            if self.num_classes is None and args and isinstance(args[0], torch.Tensor):
                self.loss_detector.describe_loss(loss_family_of(module), classes_in_logits(args[0]))

    def _on_optimizer_pre_step(self, optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
        self._maybe_replay()
        if self._cooldown is not None:
            if self.step < self._cooldown.until_step:
                self._cooldown.apply(optimizer)
            else:
                self._cooldown = None

    def _on_optimizer_step(self, optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
        if self._cooldown is not None and self._cooldown.saved:
            self._cooldown.undo(optimizer)
        self._commit()

    # ------------------------------------------------------------------ the step clock
    def _views_now(self) -> _RowViews:
        return self._views[self.step % len(self._views)]

    def _measure_grads(self) -> None:
        views = self._views_now()
        scale = self.scaler._get_scale_async() if self.scaler is not None and self.scaler.is_enabled() else None
        self._cur.params = self.grads.measure(views.grads, scale)
        if scale is not None and self._cur.params:
            # GradScaler skips optimizer.step() on inf/NaN gradients: count those backward passes on the device.
            row = views.row
            if not self._grads_measured:
                row[1] = 0.0
            row[1] += (~torch.isfinite(views.grads.sum())).float()
            row[2] = scale.reshape(())
        self._grads_measured = True

    def _commit(self) -> None:
        """Close the current step: loss into the buffer, activation hooks off, read back when the buffer is full."""
        try:
            if not self._grads_measured:
                self._measure_grads()  # backward did not flow through a hooked output; measure now
            losses = self._take_losses()
            if losses:
                self._views_now().loss.copy_(torch.stack(losses).mean() if len(losses) > 1 else losses[0])
                self._cur.loss_seen = True
            if self.acts is not None and self.acts.attached:
                if self.acts.order:
                    self._cur.activations = list(self.acts.order)
                self._cur.input_measured = self.acts.input_measured
                self.acts.detach()
            self._cur.amp = self.scaler is not None and self.scaler.is_enabled()
        finally:
            # Whatever failed above, the step clock and the read-back (a collective under DDP) stay in
            # lockstep on every rank: a rank that skipped it would leave the others waiting forever.
            self._batch, self._target = None, ()
            self._rows.append(self._cur)
            self.step += 1
            self._cur = _Row(step=self.step)
            self._grads_measured = False
            if len(self._rows) == len(self._views):
                self._read_back(collective=True)
        self._poll()
        if self.snapshots is not None and self.step % self.config.snapshot_every == 0:
            self.snapshots.take(self.step)
        if self._compiled_seen and self.acts is not None:
            self._disable_activations("the model runs inside a torch.compile graph")
        self._schedule_activations()
        if self._health_error is not None:
            self._raise_health_error()

    # ------------------------------------------------------------------ on_nonfinite: raise / stop
    def _on_nonfinite(self, event: Event) -> None:
        """``on_nonfinite="raise"``: arm TrainingHealthError for the step clock; ``"stop"``: set should_stop."""
        policy = self.config.on_nonfinite
        if event.cleared or event.kind not in NONFINITE_KINDS or policy not in ("raise", "stop"):
            return
        if policy == "stop":
            if not self.should_stop:
                self.should_stop = True
                warnings.warn(
                    f"wbdebug: {event.headline()}; monitor.should_stop is now True (on_nonfinite='stop'): "
                    "end the training loop with `if monitor.should_stop: break`.",
                    RuntimeWarning, stacklevel=2,
                )
        elif self._health_error is None and not self._closed:
            self._health_error = TrainingHealthError(event)

    def _raise_health_error(self) -> None:
        """Raise from the optimizer step that read the NaN back — once its alerts are out (bounded wait)."""
        error, self._health_error = self._health_error, None
        if self._alerts is not None:
            self._alerts.flush(self.config.alert_flush_s)
        raise error

    # ------------------------------------------------------------------ forensics and recovery
    def _maybe_replay(self) -> None:
        """In replay mode, on the first step whose loss or gradients are non-finite, re-run its batch."""
        if self.config.nan_forensics != "replay" or self._replayed or self._batch is None:
            return
        losses = [t for source in self._losses.values() for t in source]
        grads = self._views_now().grads
        # sync point (replay mode only): one flag per step decides whether this batch must be replayed
        checks = [torch.isfinite(t).all() for t in losses]
        if self._cur.params:
            checks.append(torch.isfinite(grads.sum()))
        if not checks or bool(torch.stack(checks).all()):
            return
        self._replayed = True
        args, kwargs = self._batch
        if self.criterion is not None and self._target:
            loss_fn = lambda out: self.criterion(out, *self._target)  # noqa: E731
        else:
            loss_fn = find_loss_in_output
        self._replaying = True
        try:
            self._findings[self.step] = replay(self.model, args, kwargs, loss_fn)
        finally:
            self._replaying = False

    def _recover(self, event: Event) -> None:
        """Apply the rollback policy to a spike or non-finite event."""
        if self.snapshots is None or event.cleared or event.severity == "info":
            return
        policy = self.config.on_spike if event.kind == EventKind.LOSS_SPIKE else self.config.on_nonfinite
        if policy != "rollback":
            return
        if not self.rollback_budget.allows(self.step):
            self._emit(Event(
                kind=EventKind.ROLLBACK, severity="error", step=self.step, value=float(self.config.max_rollbacks),
                message=f"Gave up rolling back after {self.config.max_rollbacks} rollbacks within "
                        f"{self.config.rollback_window} steps; {event.kind.value} keeps coming back.",
            ))
            return
        snap = self.snapshots.newest_at_or_before(event.step - self.config.rollback_min_steps)
        if snap is None:
            self._emit(Event(kind=EventKind.ROLLBACK, severity="warning", step=self.step,
                             message=f"No snapshot old enough to roll back {event.kind.value} at step {event.step}."))
            return
        self.rollback_budget.spend(self.step)
        self.snapshots.restore(snap)
        skipped = list(range(snap.step, self.step))
        self.skipped_steps.extend(skipped)
        lrs = [group["lr"] for group in self.optimizer.param_groups]
        self._cooldown = Cooldown(self.config.cooldown_factor, self.step + self.config.cooldown_steps)
        self._emit(Event(
            kind=EventKind.ROLLBACK, severity="warning", step=self.step, value=float(len(skipped)),
            message=(
                f"Rolled back to the snapshot of step {snap.step} after {event.kind.value} at step {event.step}: "
                f"{len(skipped)} steps lost, the batches of steps {snap.step}-{self.step - 1} skipped, LR x"
                f"{self.config.cooldown_factor:g} for {self.config.cooldown_steps} steps."
            ),
            data={"restored_step": snap.step, "event_step": event.step, "skipped_steps": [snap.step, self.step - 1],
                  "lr": lrs, "cooldown_factor": self.config.cooldown_factor,
                  "cooldown_until": self.step + self.config.cooldown_steps},
        ))

    def _disable_activations(self, why: str) -> None:
        if self.acts is not None:
            self.acts.detach()
        self.acts = None
        self._emit(Event(
            kind=EventKind.MONITOR_ERROR, severity="info", step=self.step,
            message=f"Activation statistics are off: {why}, and hooks inside a compiled graph would break "
                    "it; loss, gradient norms and non-finite checks continue.",
        ))

    def _take_losses(self) -> list[torch.Tensor]:
        for source in (_OBSERVED, _CRITERION, _MODEL_OUTPUT):
            if self._losses.get(source):
                chosen = self._losses[source]
                self._losses = {}
                return chosen
        return []

    def _schedule_activations(self) -> None:
        if self.acts is not None and self.step % self.config.activation_every == 0:
            self.acts.attach(self._views_now().acts)

    # ------------------------------------------------------------------ read-back
    def _read_back(self, collective: bool = False) -> None:
        """Copy the interval's rows to the host — the one sync point — and judge them.

        Under torch.distributed (and ``collective``), every rank's rows plus its parameter norm travel in
        one all-gather first, so each rank judges all ranks' numbers alike.
        """
        rows, self._rows = self._rows, []
        if not rows:
            return
        n = len(rows)
        packet = self._buf[:n].reshape(-1)
        if collective and self.world_size > 1:
            param_norm = squared_norms([p.detach() for p in self.grads.params]).sum().sqrt()
            packet = gather_packets(torch.cat([packet, param_norm.to(packet.device).reshape(1)]), self.world_size)
        else:
            packet = packet.reshape(1, -1)
        if not self._pinned:
            self._process(packet.clone(), rows)
            return
        if len(self._pending) == len(self._pinned):
            self._drain(block=True, limit=1)  # the GPU is two intervals behind: wait for the oldest copy
        self._next_pinned = (self._next_pinned + 1) % len(self._pinned)
        host = self._pinned[self._next_pinned]
        view = host.reshape(-1)[: packet.numel()].view(packet.shape)
        view.copy_(packet, non_blocking=True)  # sync point (asynchronous: read when the event completes)
        ready = torch.cuda.Event()
        ready.record()
        self._pending.append(_Pending(view, ready, rows))

    def _poll(self) -> None:
        self._drain(block=False)

    def _drain(self, *, block: bool, limit: int | None = None) -> None:
        done = 0
        while self._pending and (limit is None or done < limit):
            pending = self._pending[0]
            if pending.ready is not None:
                if block:
                    pending.ready.synchronize()
                elif not pending.ready.query():
                    return
            self._pending.popleft()
            self._process(pending.host, pending.rows)
            done += 1

    def _flush(self) -> None:
        self._read_back()
        self._drain(block=True)
        last = self._last_processed
        if last is not None and self._last_logged != last.step:
            self._log_row(last, self._final_values)

    def _process(self, packets: torch.Tensor, rows: list[_Row]) -> None:
        """Judge each step's numbers on the host, in step order, and log the rows that are due.

        ``packets`` is [ranks, n × width (+ 1 parameter norm when gathered)]; this rank's row is judged,
        with non-finite losses and activation statistics taken across ranks.
        """
        n, width = len(rows), self._buf.shape[1]
        ranks = packets.shape[0]
        per_rank = packets[:, : n * width].reshape(ranks, n, width)
        local = per_rank[self.rank if ranks > 1 else 0]
        values = local.tolist()
        per_rank_np = per_rank.numpy()
        local_np = per_rank_np[self.rank if ranks > 1 else 0]
        # Gradient norms of all rows at once, one numpy pass per run of rows with the same parameters.
        grad_rows: list[Any] = [None] * n
        start = 0
        while start < n:
            present, end = rows[start].params, start + 1
            while end < n and rows[end].params == present:
                end += 1
            if present:
                grad_rows[start:end] = self.grads.norms(local_np[start:end, self._g0 : self._a0], present)
            start = end
        all_losses = per_rank[:, :, 0].tolist()
        mean_rows = per_rank.mean(0).tolist() if ranks > 1 else values
        act_names = self.acts.names if self.acts else []
        rank_losses: list[list[float]] = [[] for _ in range(ranks)]
        rank_grads: list[list[float]] = [[] for _ in range(ranks)]
        for i, (meta, vals) in enumerate(zip(rows, values)):
            stats = StepStats(step=meta.step)
            if meta.loss_seen:
                stats.loss = vals[0]
                if ranks > 1:
                    bad = [r for r in range(ranks) if not is_finite(all_losses[r][i])]
                    if bad:
                        stats.loss = all_losses[bad[0]][i]
                        stats.nonfinite_ranks = bad
                    totals = self.grads.totals(per_rank_np[:, i, self._g0 : self._a0], meta.params)
                    for r in range(ranks):
                        rank_losses[r].append(all_losses[r][i])
                        rank_grads[r].append(totals[r])
                self._loss_sum += vals[0]
                self._loss_n += 1
            finding = self._findings.pop(meta.step, None)
            if finding is not None:
                stats.origin_layer = finding.module or finding.first_output
                stats.origin = finding.describe()
            if meta.amp:
                stats.amp_overflows, stats.amp_scale = int(vals[1]), vals[2]
                self.amp_overflows += stats.amp_overflows
            if grad_rows[i] is not None:
                stats.grad_total, stats.grad_layers, stats.nonfinite_param = grad_rows[i]
            if meta.input_measured:
                stats.input_nonfinite = not math.isfinite(vals[self._a0])
            if meta.activations:
                mean = mean_rows[i]  # activation counts are averaged over ranks
                stats.activations = {}
                for k, elements, units in meta.activations:
                    s = self._a0 + self.acts.slot(k)
                    stats.activations[act_names[k]] = activation_fractions(mean[s : s + STATS_PER_LAYER], elements, units)
                self._fresh_acts.update(stats.activations)
                stats.measured_at_input = self._input_layers
            row_events = [
                event
                for detector in (self.loss_detector, self.grad_detector, self.dead_detector, self.amp_detector)
                for event in detector.observe(stats)
            ]
            for event in row_events:
                self._emit(event)
            recoverable = (EventKind.LOSS_SPIKE, EventKind.NONFINITE_LOSS, EventKind.NONFINITE_GRAD)
            for event in row_events:
                if event.kind in recoverable and not event.cleared:
                    self._recover(event)  # once per step, after every detector has spoken
                    break
            self._last_processed, self._final_values = meta, stats
            if meta.step % self.config.log_every == 0:
                self._log_row(meta, stats)
        if ranks > 1 and packets.shape[1] > n * width:
            param_norms = packets[:, n * width].tolist()
            for event in self.rank_detector.observe(
                rows[-1].step, [_finite_mean(v) for v in rank_losses], [_finite_mean(v) for v in rank_grads],
                param_norms,
            ):
                self._emit(event)

    def _log_row(self, meta: _Row, stats: StepStats) -> None:
        metrics: dict[str, float] = {}
        if self._loss_n:
            metrics[keys.LOSS] = self._loss_sum / self._loss_n
        if stats.grad_total is not None:
            metrics[keys.GRAD_NORM_TOTAL] = stats.grad_total
        for layer, norm in stats.grad_layers.items():
            metrics[keys.grad_norm(layer)] = norm
        for layer, (zero_frac, dead_frac, _) in self._fresh_acts.items():
            metrics[keys.act_zero_frac(layer)] = zero_frac
            metrics[keys.dead_unit_frac(layer)] = dead_frac
        self._loss_sum, self._loss_n, self._fresh_acts = 0.0, 0, {}
        self._last_logged = meta.step
        for sink in self.sinks:
            self._call_sink(sink, "log", meta.step, metrics)

    # ------------------------------------------------------------------ events and failures
    def _emit(self, event: Event) -> None:
        self.events.append(event)
        for sink in self.sinks:
            self._call_sink(sink, "emit", event)
        if event.kind in NONFINITE_KINDS:
            self._on_nonfinite(event)


    def _call_sink(self, sink: Sink, method: str, *args: Any) -> None:
        try:
            getattr(sink, method)(*args)
        except Exception as exc:  # noqa: BLE001 - a sink must never break training
            self._internal_error(f"{type(sink).__name__}.{method}", exc, skip_sink=sink)

    def _guarded(self, fn: Callable) -> Callable:
        """Wrap a hook so an exception in it is reported once and training goes on."""
        name = getattr(fn, "__name__", None) or getattr(getattr(fn, "func", None), "__name__", "hook")  # partials too

        @functools.wraps(fn)
        def hook(*args: Any, **kwargs: Any) -> Any:
            if self._closed:
                return None
            try:
                return fn(*args, **kwargs)
            except TrainingHealthError:
                raise  # on_nonfinite="raise": meant for the training loop, not a failure of wbdebug
            except Exception as exc:  # noqa: BLE001
                self._internal_error(name, exc)
                return None

        return hook

    def _internal_error(self, where: str, exc: BaseException, skip_sink: Sink | None = None) -> None:
        if self.config.strict:
            raise exc
        if where in self._reported_errors:
            return
        self._reported_errors.add(where)
        message = f"wbdebug's {where} failed ({type(exc).__name__}: {exc}); training continues without it."
        warnings.warn(message, RuntimeWarning, stacklevel=2)
        event = Event(kind=EventKind.MONITOR_ERROR, severity="warning", step=self.step, message=message)
        self.events.append(event)
        for sink in self.sinks:
            if sink is not skip_sink:
                self._call_sink(sink, "emit", event)


def _finite_mean(values: list[float]) -> float:
    finite = [v for v in values if is_finite(v)]
    return sum(finite) / len(finite) if finite else math.nan


def _close_at_exit(ref: "weakref.ref[Monitor]") -> None:
    monitor = ref()
    if monitor is not None:
        monitor.close()
