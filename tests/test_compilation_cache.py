"""The persistent compilation cache a run's driver uses (`jaxsgd.compilation_cache`)."""

import json
import os
import subprocess
import sys

PROBE = r"""
import json, jax
from jaxsgd import compilation_cache
served = []
jax.monitoring.register_event_duration_secs_listener(
  lambda event, *_, **__: served.append(event)
  if event == '/jax/compilation_cache/cache_retrieval_time_sec' else None
)
compilation_cache.enable()
jax.jit(lambda x: x * 3.0 + 1.0)(jax.numpy.ones(7)).block_until_ready()
print(json.dumps({'folder': jax.config.jax_compilation_cache_dir, 'served': len(served)}))
"""


def _probe(env: dict) -> dict:
  done = subprocess.run(
    [sys.executable, '-c', PROBE], capture_output=True, text=True, env=env, timeout=120
  )
  assert done.returncode == 0, done.stderr[-2000:]
  return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_second_process_loads_what_the_first_compiled(tmp_path):
  """With no folder set, the cache is one per user in the temporary directory: the first
  process compiles and keeps the program, the second is served it."""
  env = {k: v for k, v in os.environ.items() if not k.startswith('JAX_COMPILATION_CACHE')}
  env.update(TMPDIR=str(tmp_path), JAX_PLATFORMS='cpu')
  first, second = _probe(env), _probe(env)
  folder = str(tmp_path / f'jaxsgd-xla-cache-{os.getuid()}')
  assert first == {'folder': folder, 'served': 0}
  assert second['folder'] == folder
  assert second['served'] >= 1  # the jitted function (and `ones`, compiled op by op)


def test_a_folder_the_user_set_is_kept(tmp_path):
  env = {**os.environ, 'JAX_COMPILATION_CACHE_DIR': str(tmp_path / 'mine'), 'JAX_PLATFORMS': 'cpu'}
  assert _probe(env)['folder'] == str(tmp_path / 'mine')
