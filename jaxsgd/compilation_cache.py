"""JAX's persistent compilation cache, shared by the processes of jaxsgd's runs.

Every run compiles the same small functions again: a model's initialization, op by op,
and its layers' cost analysis take a driver seconds before anything trains, and every
lane process compiles its stage's functions (`benchmarks/results/startup.txt`). Kept on disk, what any run of
this user compiled on this machine is loaded instead. The folder is
`JAX_COMPILATION_CACHE_DIR` if set, else one per user in the temporary directory; every
compilation is kept (none is too small or too quick to be worth it here). No size bound:
with one, JAX takes a file lock around every read and write and lists the whole folder
before every write. (Two processes writing one entry at once: JAX warns at a torn read
and compiles.) JAX's own switch turns it off (`JAX_ENABLE_COMPILATION_CACHE=false`);
a folder set in JAX's config before a run is kept.
"""

import os
import tempfile


def variables() -> dict[str, str]:
  """JAX's settings for the cache, as environment variables (what a lane process takes)."""
  folder = os.environ.get('JAX_COMPILATION_CACHE_DIR') or os.path.join(
    tempfile.gettempdir(), f'jaxsgd-xla-cache-{os.getuid()}'
  )
  return {
    'JAX_COMPILATION_CACHE_DIR': folder,
    'JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS': '0',
    'JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES': '0',
  }


def enable() -> None:
  """Uses the cache in this process from its next compilation on, unless JAX's config
  names a folder already."""
  import jax

  if jax.config.jax_compilation_cache_dir is None:
    set_jax_flags(variables())


def set_jax_flags(variables: dict[str, str]) -> None:
  """Sets JAX's config from those of `variables` that are JAX's flags (`JAX_*`): JAX
  reads them from the environment only when it is imported."""
  import jax

  for name, text in variables.items():
    flag = name.lower()
    if name.startswith('JAX_') and hasattr(jax.config, flag):
      jax.config.update(flag, _as_type_of(getattr(jax.config, flag), text))


def _as_type_of(current, text: str):
  if isinstance(current, bool):
    return text.strip().lower() in ('1', 'true', 'yes', 'on')
  if isinstance(current, (int, float)):
    return type(current)(text)
  return text
