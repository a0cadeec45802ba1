r"""Which engine runs lane processes: Ray actors or JAX's multi-controller runtime.

    python -m benchmarks.engine_candidates      # ~30 s on a loaded 2-core CPU

Measured between two lane processes of this machine, the driver being a third:

  dispatch     driver -> lane -> driver round trip of an empty task (median of 200)
  1 MB, 16 MB  one float32 array moved from lane A's JAX runtime into lane B's,
               ready on B's device, driver only issuing the commands (median of 15 / 7)

Candidates:
  ray + object store   Ray actors; A `ray.put`s the array, B `ray.get`s its reference
                       (shared memory on one host, node-to-node across hosts)
  ray + jax transfer   Ray actors for control; data pulled by B from A's
                       `jax.experimental.transfer` server (device buffers, no pickling)
  jaxsgd LanePool      the lane layer built on the pick (scheduler/lanes): `pool.run` of
                       a named task; a value moved a -> b by passing its handle to a
                       task on b (that task's own round trip subtracted)
  jax multi-controller `jax.distributed` over loopback (driver = process 0); commands
                       through its coordination service's key-value store, data by the
                       same `jax.experimental.transfer` pull. (Cross-process
                       `jax.device_put` with `jax_cross_host_transfer_socket_address` set
                       was tried first: on CPU the receiver never completed.)

The last line names the pick and its key figures. The pick is not made on speed (the
multi-controller runtime is as fast or faster here): docs/engine.md gives the figures
of seven runs and the reasons.
"""

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

SIZES = {'1 MB': 1 << 20, '16 MB': 16 << 20}
REPEATS = {'1 MB': 15, '16 MB': 7}
DISPATCHES = 200


class BenchLane:
  """What a lane does in the benchmark: hold an array, hand it over, receive it."""

  def __init__(self):
    import jax

    self.jax = jax
    self.device = jax.local_devices()[0]
    self.value = None
    self.server = None
    self.connections = {}

  def noop(self):
    return None

  def make(self, nbytes: int):
    self.value = self.jax.device_put(np.ones(nbytes // 4, np.float32), self.device)
    self.value.block_until_ready()

  def put_object(self):
    import ray

    return [ray.put(np.asarray(self.value))]  # in a list: the receiver resolves it

  def get_object(self, refs):
    import ray

    self.jax.device_put(ray.get(refs[0]), self.device).block_until_ready()

  def transfer_address(self) -> str:
    from jax.experimental import transfer

    self.server = transfer.start_transfer_server(self.device.client, '127.0.0.1:0', ['127.0.0.1:0'])
    return self.server.address()

  def offer(self, uuid: int):
    self.server.await_pull(uuid, [self.value])

  def pull(self, uuid: int, address: str, nbytes: int):
    connection = self.connections.get(address)
    if connection is None:
      connection = self.connections[address] = self.server.connect(address)
    spec = self.jax.ShapeDtypeStruct(
      (nbytes // 4,), np.float32, sharding=self.jax.sharding.SingleDeviceSharding(self.device)
    )
    connection.pull(uuid, [spec])[0].block_until_ready()


def _median(step, repeats: int, warmup: int = 2) -> float:
  for _ in range(warmup):
    step()
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    step()
    times.append(time.perf_counter() - start)
  return float(np.median(times))


def measure_ray() -> dict[str, dict[str, float]]:
  os.environ['RAY_USAGE_STATS_ENABLED'] = '0'
  import ray

  temp_dir = tempfile.mkdtemp(prefix='jaxsgd-ray-')
  ray.init(num_cpus=2, include_dashboard=False, configure_logging=False, _temp_dir=temp_dir)
  try:
    lane = ray.remote(num_cpus=0)(BenchLane)
    a, b = lane.remote(), lane.remote()
    dispatch = _median(lambda: ray.get(a.noop.remote()), DISPATCHES, warmup=20)
    store, transfer = {'dispatch': dispatch}, {'dispatch': dispatch}
    address = ray.get(a.transfer_address.remote())
    ray.get(b.transfer_address.remote())
    uuid = iter(range(1, 1 << 30))
    for label, nbytes in SIZES.items():
      ray.get(a.make.remote(nbytes))
      store[label] = _median(
        lambda: ray.get(b.get_object.remote(a.put_object.remote())), REPEATS[label]
      )

      def pull(nbytes=nbytes):
        u = next(uuid)
        a.offer.remote(u)
        ray.get(b.pull.remote(u, address, nbytes))

      transfer[label] = _median(pull, REPEATS[label])
    results = {'ray + object store': store, 'ray + jax transfer': transfer}
    results['jaxsgd LanePool (ray)'] = measure_lane_pool()
    return results
  finally:
    ray.shutdown()
    shutil.rmtree(temp_dir, ignore_errors=True)


def build_probe_tasks():
  """Tasks of the LanePool row: nothing, an array of `n` floats, touch one."""
  import jax
  import jax.numpy as jnp

  return {
    'noop': lambda: None,
    'ones': lambda n: jnp.ones((n,), jnp.float32),
    'first': jax.jit(lambda x: x[0]),
  }


def measure_lane_pool() -> dict[str, float]:
  """The same figures through jaxsgd's lane layer (handles, named tasks, moves)."""
  # Recipes name the importable module (under `-m` this one is `__main__`).
  from benchmarks import engine_candidates as this
  from jaxsgd.scheduler.lanes import LanePlacement, LanePool
  from jaxsgd.scheduler.tasks import Task, TaskRecipe

  recipe = TaskRecipe.of(this.build_probe_tasks)
  with LanePool(LanePlacement.spread(['a', 'b']), verbose=False) as pool:
    figures = {
      'dispatch': _median(lambda: pool.run('a', Task(recipe, 'noop')), DISPATCHES, warmup=20)
    }
    for label, nbytes in SIZES.items():
      value = pool.run('a', Task(recipe, 'ones'), (nbytes // 4,))
      figures[label] = (
        _median(lambda value=value: pool.run('b', Task(recipe, 'first'), (value,)), REPEATS[label])
        - figures['dispatch']
      )  # a move, minus the task's own round trip
  return figures


def _mc_lane(process_id: int, port: int) -> None:
  """A lane of the multi-controller candidate: obey commands from the key-value store."""
  import jax
  from jax._src import distributed

  jax.distributed.initialize(f'127.0.0.1:{port}', num_processes=3, process_id=process_id)
  kv = distributed.global_state.client
  lane = BenchLane()
  kv.key_value_set(f'address/{process_id}', lane.transfer_address())
  for step in range(1 << 30):
    command = kv.blocking_key_value_get(f'cmd/{process_id}/{step}', 60_000).split()
    if command[0] == 'stop':
      break
    if command[0] == 'make':
      lane.make(int(command[1]))
    elif command[0] == 'offer':
      lane.offer(int(command[1]))
    elif command[0] == 'pull':
      lane.pull(int(command[1]), command[2], int(command[3]))
    kv.key_value_set(f'done/{process_id}/{step}', '')
  jax.distributed.shutdown()


def measure_multi_controller() -> dict[str, float]:
  import jax
  from jax._src import distributed

  port = 20000 + os.getpid() % 20000
  lanes = [
    subprocess.Popen(
      [
        sys.executable,
        '-m',
        'benchmarks.engine_candidates',
        '--mc-lane',
        str(i),
        '--port',
        str(port),
      ]
    )
    for i in (1, 2)
  ]
  try:
    jax.distributed.initialize(f'127.0.0.1:{port}', num_processes=3, process_id=0)
    jax.devices()  # every process must join the backend's start-up, the driver too
    kv = distributed.global_state.client
    steps = {1: 0, 2: 0}

    def command(lane: int, text: str, wait: bool = True):
      step = steps[lane]
      steps[lane] += 1
      kv.key_value_set(f'cmd/{lane}/{step}', text)
      if wait:
        kv.blocking_key_value_get(f'done/{lane}/{step}', 60_000)
      return step

    figures = {'dispatch': _median(lambda: command(1, 'noop'), DISPATCHES, warmup=20)}
    address = kv.blocking_key_value_get('address/1', 60_000)
    uuid = iter(range(1, 1 << 30))
    for label, nbytes in SIZES.items():
      command(1, f'make {nbytes}')

      def pull(nbytes=nbytes):
        u = next(uuid)
        command(1, f'offer {u}', wait=False)
        command(2, f'pull {u} {address} {nbytes}')

      figures[label] = _median(pull, REPEATS[label])
    for lane in (1, 2):
      command(lane, 'stop', wait=False)
    jax.distributed.shutdown()
    return figures
  finally:
    for process in lanes:
      try:
        process.wait(timeout=30)
      except subprocess.TimeoutExpired:
        process.kill()


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--mc-lane', type=int, help=argparse.SUPPRESS)
  parser.add_argument('--port', type=int, help=argparse.SUPPRESS)
  args = parser.parse_args()
  if args.mc_lane is not None:
    return _mc_lane(args.mc_lane, args.port)
  load = os.getloadavg()[0]
  results = measure_ray()
  results['jax multi-controller'] = measure_multi_controller()
  header = ['engine', 'dispatch (ms)'] + [f'{label} (ms)' for label in SIZES]
  print(
    'Lane-to-lane figures, 2 lane processes + driver, 2-core CPU (median); '
    f'load average before: {load:.1f}'
  )
  width = max(map(len, results))
  print(f'{header[0]:<{width}}  ' + '  '.join(f'{h:>13}' for h in header[1:]))
  for name, figures in results.items():
    cells = [figures['dispatch']] + [figures[label] for label in SIZES]
    print(f'{name:<{width}}  ' + '  '.join(f'{1e3 * c:13.3f}' for c in cells))
  store, multi = results['ray + object store'], results['jax multi-controller']
  print(
    f'pick: ray actors + object store: dispatch {1e3 * store["dispatch"]:.2f} ms '
    f'(multi-controller {1e3 * multi["dispatch"]:.2f} ms), 16 MB lane-to-lane '
    f'{1e3 * store["16 MB"]:.1f} ms'
  )


if __name__ == '__main__':
  main()
