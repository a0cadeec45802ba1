"""Test set-up: 8 fake CPU devices (set before JAX starts), Ctrl-C heard by the processes
the tests start, and a shared tfds data_dir."""

import os
import signal

_FLAG = '--xla_force_host_platform_device_count=8'
if _FLAG.split('=')[0] not in os.environ.get('XLA_FLAGS', ''):
  os.environ['XLA_FLAGS'] = (os.environ.get('XLA_FLAGS', '') + ' ' + _FLAG).strip()

import pytest  # pylint: disable=g-import-not-at-top,wrong-import-position

# A suite started in the background (`nohup make test &`) has SIGINT ignored, and so would
# every process it starts: Python then installs no KeyboardInterrupt handler, and the tests
# that send Ctrl-C to a binary or the launcher would wait out their timeouts. A Python-level
# handler here is reset to the default in each child, which then hears Ctrl-C.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
  signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture(scope='session')
def data_dir(tmp_path_factory) -> str:
  """One tfds data_dir per test session: offline datasets are generated once."""
  return str(tmp_path_factory.mktemp('tensorflow_datasets'))
