"""What a run of `experiments.train` prints on the terminal, beside its own lines: its
last line, and the libraries' lines left out (without flags of its own, so that tests and
other commands can import it beside `experiments.train`'s or `experiments.profile`'s)."""

import logging as std_logging
import os


def final_line(summary: dict, workdir: str) -> str:
  """The run's last line: test accuracy (a language model's perplexity), step, wall time
  (and simulated time; a language model's tokens per second), workdir."""
  final = summary['final']
  perplexity = final.get('test_perplexity')
  return (
    f'final test accuracy {final["test_accuracy"]:.4f}'
    + (f' (perplexity {perplexity:.3f})' if perplexity is not None else '')
    + f' at step {final["step"]} ({times(summary)}{tokens_per_second(summary)}); '
    f'results in {workdir}'
  )


def tokens_per_second(summary: dict) -> str:
  """`'; 20,500 tokens/s simulated'` for a language model (wall time without the virtual
  clock), else `''`."""
  rates = summary.get('tokens_per_second') or {}
  clock = 'simulated' if 'simulated' in rates else 'wall'
  return f'; {rates[clock]:,.0f} tokens/s {clock}' if rates else ''


def times(summary: dict) -> str:
  """`'5.5 s wall'`, with `', 0.00812 s simulated'` on the virtual clock: the makespan of a
  scheduler run, the simulated time of the last step of a data-parallel one."""
  final = summary['final']
  text = f'{final["wall_time"]:.1f} s wall'
  simulated = summary.get('sim_time', final.get('sim_time'))
  if simulated is not None:
    text += (
      f', {simulated:,.1f} s simulated' if simulated >= 1 else f', {simulated:.3g} s simulated'
    )
  return text


# Libraries' INFO lines a run would print (tfds: "Load dataset info from ...", "No config
# specified, defaulting to ..."; JAX: "Unable to initialize backend 'tpu'") say nothing a
# user can act on; their warnings and errors still show.
_OWN_CODE = tuple(
  os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), package) + os.sep
  for package in ('jaxsgd', 'experiments')
)
# Ray's notice, when it starts the run's cluster, that the cluster has token authentication
# on (the safe default; the cluster is this run's own and ends with it).
_RAY_AUTH_LOGGER = 'ray._private.authentication.authentication_token_setup'


def _is_ours_or_a_warning(record: std_logging.LogRecord) -> bool:
  return record.levelno >= std_logging.WARNING or record.pathname.startswith(_OWN_CODE)


def _not_ray_auth_notice(record: std_logging.LogRecord) -> bool:
  return 'Token authentication is enabled' not in record.getMessage()


def quiet_libraries() -> None:
  """Keeps the libraries' INFO lines and Ray's token notice off the terminal."""
  for handler in std_logging.getLogger().handlers:  # absl's, which app.run installs
    if _is_ours_or_a_warning not in handler.filters:
      handler.addFilter(_is_ours_or_a_warning)
  ray_auth = std_logging.getLogger(_RAY_AUTH_LOGGER)
  if _not_ray_auth_notice not in ray_auth.filters:
    ray_auth.addFilter(_not_ray_auth_notice)
