"""Experiment plumbing shared by every algorithm."""

from jaxsgd.training.loop import build_model
from jaxsgd.training.loop import check_config
from jaxsgd.training.loop import train_and_evaluate
from jaxsgd.training.run import NonFiniteLossError
from jaxsgd.training.run import Run
