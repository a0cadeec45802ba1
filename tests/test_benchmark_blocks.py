"""The simulator benchmarks' time per iteration where every update is an iteration
(LPP-SGD): blocks of whole rounds, computed by hand."""

from benchmarks import simulator_accuracy as accuracy


def _lockstep_ends(workers: int, rounds: int, round_s: float = 55.0, apart: float = 2.0):
  """`workers` workers of equal costs, each updating once a round, `apart` s after one
  another (as on the virtual clock): one round per `round_s`."""
  return [r * round_s + i * apart for r in range(rounds) for i in range(workers)]


def test_blocks_are_the_fewest_whole_rounds_of_at_least_five_updates():
  assert [accuracy.block_for(m) for m in (1, 2, 3, 4, 8, 16, 32)] == [5, 6, 6, 8, 8, 16, 32]


def test_blocks_of_whole_rounds_measure_the_round_wherever_they_begin():
  """Two workers, a round of 55 s: 27.5 s per update. Blocks of 6 updates (3 rounds) span
  165 s each wherever they begin. Blocks of 5 span 2 rounds and a burst (112 s) or 3
  rounds less one (163 s), alternately: from the first update of a round their median is
  22.4 s (three blocks of 112 s, two of 163 s), from the second 27.5 s."""
  ends = _lockstep_ends(2, 13)
  assert accuracy.blocks_median(ends, accuracy.block_for(2)) == 27.5
  assert accuracy.blocks_median(ends[1:], accuracy.block_for(2)) == 27.5
  assert accuracy.blocks_median(ends, 5) == 112 / 5
  assert accuracy.blocks_median(ends[1:], 5) == 27.5


def test_too_few_iterations_for_a_block_give_none():
  assert accuracy.blocks_median([0.0, 1.0, 2.0], 5) is None
