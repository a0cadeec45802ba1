r"""What one task call costs the driver, by the mechanism that carries it to a lane process.

    python -m benchmarks.dispatch_candidates            # ~1 min on 2 cores
    python -m benchmarks.dispatch_candidates --calls=2000 --rounds=5

A lane process (a Ray actor) runs a trivial task per call: it unpickles the call (a
small tuple, as `LanePool._task_call` sends), "runs" it (adds two numbers) and answers.
The candidates carry the same bytes:
  ray actor call    `actor.run.remote(call)`, the reply by `ray.get` (LanePool today)
  compiled graph    a Ray Compiled Graph of the same method (`experimental_compile`):
                    shared-memory channels, the actor's method run in a background
                    thread of its own; the graph is fixed when compiled
  direct socket     a socket from the driver to the lane process (a thread there reads
                    calls in order and writes the replies), framed by
                    `multiprocessing.connection`; Ray only starts the process
Per candidate and round: the round trip of one call waited for (median), and, with
`--calls` calls sent ahead before any reply is read (the driver running ahead, as it
does in a training), the driver's CPU per call (its main thread's `thread_time`) and
the wall time per call; the driver process's CPU too, which counts Ray's own threads
(a classic call is submitted by Ray's core worker threads). Rounds interleave the candidates. The last line is the driver's
process CPU per call of the cheapest candidate, against the ray actor call's. Not a test.
"""

import argparse
import os
import pickle
import socket
import statistics
import threading
import time
from multiprocessing import connection

import ray

from benchmarks import common as bench_common


class Lane:
  """A lane process: answers calls by every candidate's path."""

  def __init__(self):
    self.listener = None

  def run(self, call: bytes) -> bytes:
    _, args, key = pickle.loads(call)
    return pickle.dumps((key, args[0] + args[1]))

  def serve(self) -> tuple[str, int]:
    """Opens the direct socket; a thread answers the calls on it in order."""
    self.listener = connection.Listener(('127.0.0.1', 0))

    def answer():
      link = self.listener.accept()
      while True:
        try:
          call = link.recv_bytes()
        except EOFError:
          return
        link.send_bytes(self.run(call))

    threading.Thread(target=answer, daemon=True).start()
    return self.listener.address


def call_bytes(key: int) -> bytes:
  return pickle.dumps((7, (1.0, 2.0), key))


def timed(send, receive, calls: int) -> tuple[float, float, float, float]:
  """(round trip s, driver thread CPU s, driver process CPU s, wall s), per call."""
  trips = []
  for key in range(50):
    start = time.perf_counter()
    send(call_bytes(key))
    receive()
    trips.append(time.perf_counter() - start)
  cpu, process, wall = time.thread_time(), time.process_time(), time.perf_counter()
  for key in range(calls):
    send(call_bytes(key))
  for _ in range(calls):
    receive()
  return (
    statistics.median(trips),
    (time.thread_time() - cpu) / calls,
    (time.process_time() - process) / calls,
    (time.perf_counter() - wall) / calls,
  )


def ray_call(actor):
  sent = []
  return (lambda call: sent.append(actor.run.remote(call))), (lambda: ray.get(sent.pop(0)))


def compiled_graph(actor, calls: int):
  from ray.dag import InputNode

  with InputNode() as call:
    graph = actor.run.bind(call)
  compiled = graph.experimental_compile(
    _max_inflight_executions=calls + 1, _max_buffered_results=calls + 1
  )
  sent = []
  return (
    compiled,
    (lambda call: sent.append(compiled.execute(call))),
    (lambda: ray.get(sent.pop(0))),
  )


def direct_socket(actor):
  link = connection.Client(tuple(ray.get(actor.serve.remote())))
  return link, link.send_bytes, link.recv_bytes


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--calls', type=int, default=1000)
  parser.add_argument('--rounds', type=int, default=3)
  args = parser.parse_args()
  print(
    f'machine: {os.cpu_count()} CPU cores, {socket.gethostname()}, load average {os.getloadavg()[0]:.1f} at start; ray {ray.__version__}'
  )
  ray.init(num_cpus=os.cpu_count(), include_dashboard=False, configure_logging=False)
  lane = ray.remote(num_cpus=0, max_concurrency=2)(Lane)
  # One actor per candidate: a compiled graph's actor runs nothing else meanwhile.
  actors = {name: lane.remote() for name in ('ray actor call', 'compiled graph', 'direct socket')}
  ray.get([a.run.remote(call_bytes(0)) for a in actors.values()])
  compiled, *graph = compiled_graph(actors['compiled graph'], args.calls)
  link, *socket_ends = direct_socket(actors['direct socket'])
  paths = {
    'ray actor call': ray_call(actors['ray actor call']),
    'compiled graph': graph,
    'direct socket': socket_ends,
  }
  figures = {name: [] for name in paths}
  for _ in range(args.rounds):
    for name, (send, receive) in paths.items():
      figures[name].append(timed(send, receive, args.calls))
  print(
    f'load average {os.getloadavg()[0]:.1f} at end; {args.rounds} interleaved rounds, {args.calls} calls sent ahead each'
  )
  rows = []
  for name, runs in figures.items():
    medians = (statistics.median(run[i] for run in runs) for i in range(4))
    rows.append((name, *(round(1e6 * m) for m in medians)))
  bench_common.print_table(
    ('candidate', 'round trip µs', 'driver thread CPU µs', 'driver process CPU µs', 'wall µs'),
    rows,
  )
  print("(CPU and wall: per call, with the calls sent ahead; the process counts Ray's threads)")
  link.close()
  compiled.teardown()
  ray.shutdown()
  best = min(rows, key=lambda row: row[3])
  print(
    f'driver process CPU per task call: {best[0]} {best[3]} µs against ray actor call '
    f'{rows[0][3]} µs ({rows[0][3] / max(best[3], 1):.1f}x less)'
  )


if __name__ == '__main__':
  main()
