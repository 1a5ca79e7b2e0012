"""Pre-flight checks (the seed's steps 1, 2 and 4): run them before spending GPU money on the long run."""

from wbdebug.checks.data import inspect_data
from wbdebug.checks.factory import CheckSetup
from wbdebug.checks.initial_loss import check_initial_loss
from wbdebug.checks.overfit import overfit_one_batch
from wbdebug.checks.preflight import CHECKS, preflight
from wbdebug.checks.result import CheckResult, Report

__all__ = [
    "CHECKS", "CheckResult", "CheckSetup", "Report", "check_initial_loss", "inspect_data", "overfit_one_batch",
    "preflight",
]
