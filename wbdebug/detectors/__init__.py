"""Detectors: pure Python over floats. No torch, no I/O; each keeps a small ``state_dict()``."""

from wbdebug.detectors.activations import DeadActivationDetector
from wbdebug.detectors.base import ConditionTracker, StepStats
from wbdebug.detectors.gradients import GradientDetector
from wbdebug.detectors.loss import LossDetector

__all__ = ["ConditionTracker", "DeadActivationDetector", "GradientDetector", "LossDetector", "StepStats"]
