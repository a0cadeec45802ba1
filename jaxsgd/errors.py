"""Errors every layer may raise (the lowest layer: imports nothing of jaxsgd)."""


class NonFiniteLossError(FloatingPointError):
  """Training produced a NaN or infinite loss."""


class Preempted(Exception):
  """SIGTERM stopped the run after it saved a checkpoint (the binary exits with 143)."""

  EXIT_STATUS = 143  # 128 + SIGTERM, as for a process killed by the signal.
