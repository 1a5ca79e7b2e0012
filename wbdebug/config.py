"""Config: every threshold, interval and sink option, with where its default comes from."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from wbdebug.alerts import DEFAULT_ALERT_KINDS
from wbdebug.events import EventKind


class Config(BaseSettings):
    """wbdebug settings: keyword arguments, then ``WBDEBUG_*`` environment variables, then ``.env``.

    The defaults are the benchmarked ones (``benchmarks/overhead.py``) and the ones the healthy-run
    tests in ``tests/test_detectors_healthy.py`` stay quiet with.
    """

    model_config = SettingsConfigDict(
        env_prefix="WBDEBUG_",
        env_file=".env",
        env_file_encoding="utf-8",
        extra="ignore",
        validate_assignment=True,
        env_ignore_empty=True,
    )

    # --- schedule -------------------------------------------------------------------------
    check_every: int = Field(
        10, ge=1,
        description="Steps between read-backs of the on-device statistics; bounds detection latency.",
    )
    log_every: int = Field(50, ge=1, description="Steps between W&B metric rows.")
    activation_every: int = Field(
        10, ge=1, description="Steps between activation samples (hooks attach only on sampled steps)."
    )
    activations: bool = Field(True, description="Collect activation zero/dead-unit fractions.")

    # --- gradients ------------------------------------------------------------------------
    exploding_norm: float = Field(
        1e4, gt=0, description="Global gradient norm above which gradients count as exploding."
    )
    exploding_factor: float = Field(
        10.0, gt=1, description="Jump of the global gradient norm over its recent median that counts as exploding."
    )
    exploding_tail: float = Field(
        3.0, gt=0,
        description="...widened to exp(this x the 90th-percentile log-excursion of recent norms) on noisy runs.",
    )
    vanishing_ratio: float = Field(
        1e-5, gt=0, lt=1,
        description="Layer gradient norm below this fraction of the largest layer's counts as vanishing.",
    )
    vanishing_floor: float = Field(
        1e-12, ge=0, description="Absolute layer gradient norm counted as vanishing whatever the other layers do."
    )
    vanishing_steps: int = Field(5, ge=1, description="Consecutive steps a layer must vanish before an event.")

    clear_steps: int = Field(
        10, ge=1, description="Healthy steps before a gradient or loss condition counts as cleared (no flapping)."
    )

    # --- activations ----------------------------------------------------------------------
    dead_fraction: float = Field(
        0.9, gt=0, le=1, description="Fraction of zero outputs (elements or units) that makes a layer dead."
    )
    dead_samples: int = Field(3, ge=1, description="Consecutive activation samples a layer must be dead.")

    # --- loss -----------------------------------------------------------------------------
    history: int = Field(50, ge=5, description="Steps of history the relative detectors compare against.")
    warmup_steps: int = Field(20, ge=1, description="Steps of history needed before relative detectors judge.")
    spike_factor: float = Field(
        2.0, gt=1, description="Loss above this multiple of its recent median can be a spike."
    )
    spike_tail: float = Field(
        3.0, gt=0,
        description="...widened to exp(this x the 90th-percentile log-excursion of recent losses) on noisy runs.",
    )
    spike_min_rise: float = Field(
        0.1, ge=0, description="...and must rise above the median by this fraction of the first loss (the loss's scale)."
    )
    initial_loss: bool = Field(True, description="Compare the first loss with an uninformed model's (log C).")
    initial_loss_warn_ratio: float = Field(
        1.5, gt=1, description="First loss more than this many times log C (or under 1/this) is a warning."
    )
    initial_loss_error_ratio: float = Field(3.0, gt=1, description="...this many times, an error.")

    # --- distributed and mixed precision -------------------------------------------------
    rank_zero_only: bool = Field(True, description="Under torch.distributed, only rank 0 writes to W&B, the journal and the console.")
    rank_loss_factor: float = Field(
        3.0, gt=1, description="A rank whose interval loss or gradient norm is this many times off the ranks' median diverges."
    )
    amp_min_scale: float = Field(
        1.0, gt=0, description="A GradScaler scale below this means overflow is persistent (the scale collapsed from 65536)."
    )

    # --- recovery and forensics --------------------------------------------------------------
    on_spike: Literal["warn", "rollback"] = Field(
        "warn", description="On a loss spike: only report it, or also roll back to a snapshot and cool the LR down."
    )
    on_nonfinite: Literal["warn", "raise", "stop", "rollback"] = Field(
        "warn", description="On a non-finite loss or gradient: report, raise TrainingHealthError, stop, or roll back."
    )
    nan_forensics: Literal["sampled", "replay"] = Field(
        "sampled",
        description="sampled: name layers from sampled statistics; replay: re-run the first non-finite batch under "
        "detect_anomaly (reads one flag per step).",
    )
    snapshot_every: int = Field(100, ge=1, description="Steps between recovery snapshots (taken only when a policy rolls back).")
    snapshot_keep: int = Field(3, ge=1, description="Snapshots kept in the ring.")
    snapshot_dir: Path | None = Field(None, description="Write snapshots here (atomically) instead of keeping them in CPU memory.")
    rollback_min_steps: int = Field(0, ge=0, description="Restore the newest snapshot at least this many steps before the event.")
    cooldown_factor: float = Field(0.1, gt=0, le=1, description="LR multiplier after a rollback.")
    cooldown_steps: int = Field(50, ge=0, description="Steps the LR stays cooled down after a rollback.")
    max_rollbacks: int = Field(3, ge=1, description="Rollbacks allowed within rollback_window steps before giving up (error).")
    rollback_window: int = Field(1000, ge=1, description="Window, in steps, for max_rollbacks.")

    # --- sinks ----------------------------------------------------------------------------
    wandb: bool = Field(True, description="Log metrics, alerts and the events table to Weights & Biases.")
    wandb_project: str = Field("wbdebug", description="Project for the run wbdebug starts when none is active.")
    wandb_mode: Literal["auto", "online", "offline", "disabled"] = Field(
        "auto", description="Mode for a run wbdebug starts: auto = offline unless an API key is configured."
    )
    console: bool = Field(True, description="Print one line per event and a summary table at close().")
    journal: bool = Field(True, description="Append every event to events.jsonl, flushed as written.")
    journal_path: Path | None = Field(
        None, description="Event journal file; default: events.jsonl in the W&B run directory."
    )
    strict: bool = Field(
        False, description="Re-raise wbdebug's own internal errors instead of reporting them once (for debugging)."
    )

    # --- alerts ---------------------------------------------------------------------------
    alerts: bool = Field(
        True, description="Send alerts for the events the policy below selects: W&B run.alert, and Slack / a webhook when set."
    )
    alert_kinds: list[EventKind] = Field(
        default_factory=lambda: list(DEFAULT_ALERT_KINDS),
        description="Event kinds whose warnings and errors alert (a JSON list in the environment).",
    )
    alert_all_errors: bool = Field(True, description="Also alert on errors of every other kind (rank_divergence, ...).")
    alert_min_severity: Literal["warning", "error"] = Field(
        "warning", description="Lowest severity that alerts: warning, or error for NaN-class failures only."
    )
    alert_cooldown_s: float = Field(
        300.0, ge=0,
        description="Seconds before the same kind may alert again (escalations and recoveries are sent at once); W&B's wait_duration.",
    )
    alert_reminder_s: float = Field(
        3600.0, ge=0, description="A condition still active this long after its last alert is alerted again; 0 = never."
    )
    alert_recovered: bool = Field(True, description="Send a 'recovered' alert when every alerted condition of a kind has cleared.")
    wandb_alerts: bool = Field(
        True, description="Send alerts to W&B (run.alert), which routes them to Slack/e-mail per your W&B settings."
    )
    slack_webhook_url: SecretStr | None = Field(
        None, description="Slack incoming-webhook URL: alerts go straight to Slack as Block Kit (a secret, never logged)."
    )
    webhook_url: SecretStr | None = Field(
        None, description="Any URL to POST each alert's event JSON to (Teams/Discord/PagerDuty bridges; a secret, never logged)."
    )
    alert_timeout_s: float = Field(10.0, gt=0, description="Seconds one HTTP delivery attempt of an alert may take.")
    alert_retry_s: float = Field(
        120.0, ge=0,
        description="Seconds to retry an alert on 429/5xx/connection errors before giving it up with one warning.",
    )
    alert_backoff_s: float = Field(
        1.0, gt=0, description="First delay between delivery attempts, doubled after each failure; Retry-After wins."
    )
    alert_backoff_max_s: float = Field(30.0, gt=0, description="Longest delay between delivery attempts (Retry-After aside).")
    alert_flush_s: float = Field(
        10.0, ge=0,
        description="Seconds close(), interpreter exit and on_nonfinite=raise wait for queued alerts to be delivered.",
    )
    alert_queue_size: int = Field(
        100, ge=1, description="Alerts waiting for delivery beyond this are dropped (one warning): memory stays bounded."
    )

    @model_validator(mode="after")
    def _check_warmup(self) -> "Config":
        if self.warmup_steps > self.history:
            raise ValueError(
                f"warmup_steps ({self.warmup_steps}) must not exceed history ({self.history})"
            )
        if self.initial_loss_error_ratio < self.initial_loss_warn_ratio:
            raise ValueError("initial_loss_error_ratio must be >= initial_loss_warn_ratio")
        return self


def make_config(config: Config | None, settings: dict) -> Config:
    """Merge ``config=`` and ``**settings`` into one validated Config, naming any unknown key."""
    if config is not None and not isinstance(config, Config):
        raise TypeError(f"config must be a wbdebug.Config, got {type(config).__name__}")
    unknown = sorted(set(settings) - set(Config.model_fields))
    if unknown:
        raise TypeError(
            f"unknown wbdebug setting(s) {unknown}; expected any of: {', '.join(sorted(Config.model_fields))}"
        )
    if config is None:
        return Config(**settings)
    return Config(**{**config.model_dump(exclude_unset=True), **settings}) if settings else config
