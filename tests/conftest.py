"""Test set-up: 8 fake CPU devices and one compilation cache (set before JAX starts), one
Ray authentication mode, Ctrl-C heard by the processes the tests start, and a shared tfds
data_dir."""

import atexit
import os
import shutil
import signal
import tempfile

_FLAG = '--xla_force_host_platform_device_count=8'
if _FLAG.split('=')[0] not in os.environ.get('XLA_FLAGS', ''):
  os.environ['XLA_FLAGS'] = (os.environ.get('XLA_FLAGS', '') + ' ' + _FLAG).strip()

# One persistent compilation cache per test session, shared with every process the tests
# start (binaries, lane processes, the launcher's processes, notebooks): a program is
# compiled once per session instead of once per process and run. What runs is the same
# executable either way. Measured here: tests/test_checkpoints.py and tests/test_train.py
# took 118 s without it, 73 s with it.
_CACHE = tempfile.mkdtemp(prefix='jaxsgd-tests-xla-cache-')
os.environ.setdefault('JAX_COMPILATION_CACHE_DIR', _CACHE)
os.environ.setdefault('JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS', '0')
atexit.register(lambda: shutil.rmtree(_CACHE, ignore_errors=True))

# One Ray authentication mode for every cluster the tests start or join: a process keeps
# the mode of its first connection, so a module joining the tests' `ray start --head` node
# (token auth off) after a test in the same worker had started a cluster of its own (on by
# default) was refused by the node, which took its driver for dead and destroyed its lanes.
os.environ['RAY_AUTH_MODE'] = 'disabled'

import pytest  # pylint: disable=g-import-not-at-top,wrong-import-position

# A suite started in the background (`nohup make test &`) has SIGINT ignored, and so would
# every process it starts: Python then installs no KeyboardInterrupt handler, and the tests
# that send Ctrl-C to a binary or the launcher would wait out their timeouts. A Python-level
# handler here is reset to the default in each child, which then hears Ctrl-C.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
  signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture
def ctrl_c_raises():
  """Python's own Ctrl-C handler while the test runs (a test worker may start with another)."""
  before = signal.signal(signal.SIGINT, signal.default_int_handler)
  yield
  signal.signal(signal.SIGINT, signal.SIG_DFL if before is None else before)  # (None: set in C)


@pytest.fixture(scope='session')
def data_dir(tmp_path_factory) -> str:
  """One tfds data_dir per test session: offline datasets are generated once."""
  return str(tmp_path_factory.mktemp('tensorflow_datasets'))


def pytest_collection_modifyitems(config, items):
  """Modules with `slow` tests first, then the others, most tests first; a module's tests
  keep their order. `make test` hands whole modules to its workers in this order
  (`--dist loadfile --no-loadscope-reorder`): xdist's own order (most tests first) handed
  out a module of three one-minute tests last, and one worker ran it alone at the end."""
  del config
  modules = {}
  for item in items:
    modules.setdefault(item.nodeid.split('::')[0], []).append(item)

  def slow_first(tests):
    return (-sum(1 for test in tests if test.get_closest_marker('slow')), -len(tests))

  items[:] = [item for tests in sorted(modules.values(), key=slow_first) for item in tests]
