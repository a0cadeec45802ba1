"""The replay `benchmarks/simulator_host_cost` holds a simulated session against: the
session's own jitted calls, made again without the simulator, must be the same work."""

import jax
import numpy as np

from benchmarks import simulator_host_cost as host_cost


def _leaves_equal(a, b) -> bool:
  a, b = jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)
  return len(a) == len(b) and all(np.array_equal(x, y) for x, y in zip(a, b))


def test_replayed_calls_of_an_asgd_session_end_at_its_server_parameters_bit_for_bit():
  setup = host_cost.Setup(num_workers=3)
  trace, final = host_cost.record_calls(setup, steps=12)
  updates = [i for i, call in enumerate(trace) if call.fn is setup.apply_fn]
  assert len(updates) == 12
  _, replayed = host_cost.replay_cost(trace, updates[-1])
  assert _leaves_equal(replayed, final)
  # A data-flow replay, not the recorded inputs run again: the last update reads the
  # parameters the update before it made, and the only arrays the trace takes as they are
  # (not as outputs of its calls) are the server's initial values and its constants (one
  # per worker id and per staleness), not the thousands of arrays the calls made.
  assert any(
    type(source) is host_cost._Output and source[0] == updates[-2]  # pylint: disable=protected-access,unidiomatic-typecheck
    for source in trace[updates[-1]].sources
  )
  given = {
    id(source)
    for call in trace
    for source in call.sources
    if isinstance(source, jax.Array) and type(source) is not host_cost._Output  # pylint: disable=protected-access,unidiomatic-typecheck
  }
  ps, _ = setup.server()
  initial = len(jax.tree_util.tree_leaves(ps.store.read().value))
  assert 0 < len(given) <= initial + setup.num_workers + len(updates)
