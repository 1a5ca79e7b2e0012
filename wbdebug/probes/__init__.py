"""Probes: the tensor side. They compute statistics on the device and write them into a buffer row;
they never read a value back to the host and never know which sink exists."""

from wbdebug.probes.activations import ActivationProbe
from wbdebug.probes.gradients import GradientProbe
from wbdebug.probes.loss import find_loss_in_output, loss_family_of

__all__ = ["ActivationProbe", "GradientProbe", "find_loss_in_output", "loss_family_of"]
