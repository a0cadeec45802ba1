"""Errors every layer may raise (the lowest layer: imports nothing of jaxsgd)."""


class NonFiniteLossError(FloatingPointError):
  """Training produced a NaN or infinite loss."""
