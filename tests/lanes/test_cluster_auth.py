"""Joining a running Ray cluster by address, with and without Ray's token authentication.

Ray (2.59 on) turns token authentication on for a cluster that `ray start --head` starts,
and in a process that joins one only where Ray found that cluster itself: a run given
`cluster_address` kept it off and was refused after ~20 s ('Failed to connect to Ray
cluster'). `cluster.check_joinable` joins with this process's token where the cluster
asks for one, and says in one line why a cluster refuses the process. Each case runs the
binary in a process of its own (a process keeps the authentication it began with; the
tests' own is off: conftest.py), with no token but the one a case gives it (`HOME`
elsewhere: no `~/.ray/auth_token`).
"""

import os
import subprocess
import sys

import pytest
from ray_head import RayHead, serve_head
from test_lanes import gone

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOKEN = 'f' * 32  # the token cluster's (any string of Ray's accepted length)


@pytest.fixture(scope='module')
def token_head(tmp_path_factory):
  """A head that asks every process for `TOKEN`. (Short directory names: its Unix
  sockets' paths must fit in 107 bytes under pytest's temporary directory.)"""
  home = str(tmp_path_factory.mktemp('home'))
  env = {
    **os.environ,
    'RAY_AUTH_MODE': 'token',
    'RAY_AUTH_TOKEN': TOKEN,
    'RAY_USAGE_STATS_ENABLED': '0',
    'HOME': home,
  }
  node = RayHead(str(tmp_path_factory.mktemp('rt')), env)
  yield node
  node.stop()
  assert gone([p.pid for p in node.processes()]) == []


@pytest.fixture(scope='module')
def open_head(tmp_path_factory):
  """A head without authentication (as the tests' others)."""
  yield from serve_head(str(tmp_path_factory.mktemp('ro')))


def run(address: str, data_dir: str, workdir, **auth: str) -> subprocess.CompletedProcess:
  """A DDG smoke run on two lane processes of the cluster at `address`, in a process
  whose Ray authentication variables are `auth` alone."""
  env = {k: v for k, v in os.environ.items() if not k.startswith('RAY_AUTH_')}
  env.update(auth, HOME=str(workdir.parent), RAY_USAGE_STATS_ENABLED='0')
  return subprocess.run(
    [
      sys.executable,
      '-m',
      'experiments.train',
      '--config=experiments/configs/ddg.py:smoke',
      '--config.stages=2',
      '--config.clock=real',
      '--config.executor=processes',
      f'--config.cluster_address={address}',
      f'--config.data_dir={data_dir}',
      f'--workdir={workdir}',
    ],
    cwd=REPO,
    env=env,
    capture_output=True,
    text=True,
    timeout=240,
    check=False,
  )


def test_a_run_joins_a_token_cluster_by_address_with_its_token(token_head, data_dir, tmp_path):
  """No `RAY_AUTH_MODE`, the cluster's token: the run joins and trains (before, Ray kept
  authentication off for a cluster given by address, and refused the run after 20 s)."""
  done = run(token_head.address, data_dir, tmp_path / 'run', RAY_AUTH_TOKEN=TOKEN)
  assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
  assert 'final test accuracy' in done.stdout


def test_a_token_is_not_turned_on_for_a_cluster_without_authentication(
  open_head, data_dir, tmp_path
):
  """A token this process has is not turned on for a cluster that asks for none (its
  lanes died at start when it was: a regression test)."""
  done = run(open_head.address, data_dir, tmp_path / 'run', RAY_AUTH_TOKEN=TOKEN)
  assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
  assert 'final test accuracy' in done.stdout


@pytest.mark.parametrize(
  'auth, said',
  [
    ({'RAY_AUTH_TOKEN': 'e' * 32}, 'RAY_AUTH_MODE unset, with its token'),
    ({'RAY_AUTH_MODE': 'disabled'}, 'RAY_AUTH_MODE=disabled, without a token'),
  ],
  ids=['wrong token', 'authentication off'],
)
def test_a_cluster_that_refuses_the_run_is_one_line(auth, said, token_head, data_dir, tmp_path):
  done = run(token_head.address, data_dir, tmp_path / 'run', **auth)
  assert done.returncode == 2, done.stdout[-2000:] + done.stderr[-2000:]
  assert done.stderr.strip().splitlines()[-1] == (
    f'error: cluster_address: the Ray cluster at {token_head.address} refused this '
    f"process's authentication ({said}); give it the cluster's token (RAY_AUTH_TOKEN, "
    'RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token; `ray get-auth-token` on the head prints '
    'it), or RAY_AUTH_MODE=disabled where the cluster has none.'
  )
  assert 'Traceback' not in done.stdout + done.stderr
  assert not (tmp_path / 'run').exists()


def test_token_mode_without_a_token_is_one_line(token_head, data_dir, tmp_path):
  """`RAY_AUTH_MODE=token` and no token: Ray's client asked the cluster anyway would
  abort the process (stderr then silenced: no word at all)."""
  done = run(token_head.address, data_dir, tmp_path / 'run', RAY_AUTH_MODE='token')
  assert done.returncode == 2, done.stdout[-2000:] + done.stderr[-2000:]
  assert done.stderr.strip().splitlines()[-1] == (
    'error: cluster_address: RAY_AUTH_MODE=token here, but this process has no token '
    "(RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token); give it the cluster's "
    '(`ray get-auth-token` on the head prints it).'
  )
  assert not (tmp_path / 'run').exists()
