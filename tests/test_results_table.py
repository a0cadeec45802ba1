"""RESULTS.md's table: generated from report.json files, between its markers, by hand-checked
rules (speed-up interval, verdicts)."""

import json
import math

import numpy as np

import pytest

from experiments import report
from experiments import results_table
from experiments import suites

ERROR = results_table.SimulatorError(median=0.05, largest=0.25, source='a test figure')


def _stats(values):
  return report._stats(values)  # pylint: disable=protected-access


def _method(accuracies, times, total=2.0):
  """A report.json method: seeds' final accuracies, their times to target (None: never,
  in a run of `total` simulated seconds)."""
  seed_times = [{'reached': t is not None, 'time': total if t is None else t} for t in times]
  return {
    'seed_times_sim': seed_times,
    'seeds': list(range(len(accuracies))),
    'final_accuracy': _stats(accuracies),
    'reached_target': sum(t is not None for t in times),
    'time_to_target_sim': _stats(times),
    'total_sim_time': _stats([total] * len(accuracies)),
    'resolution_steps': 20,
    'train_steps': 2000,
    'resolution_checked': True,
  }


def _ddg_report():
  return {
    'suite': 'ddg',
    'methods': {
      'BP (staged, K=4)': _method([0.980, 0.982], [1.5, 1.7]),  # mean time 1.6
      'DDG K=2': _method([0.979, 0.981], [0.8, 0.8]),  # 2x sooner
      'DDG K=4': _method([0.970, 0.972], [1.5, 1.5]),  # 1.07x sooner
    },
  }


def test_interval_is_the_speedup_with_both_times_off_by_the_error():
  low, high = results_table.interval(2.0, 0.25)
  assert low == pytest.approx(2.0 * 0.75 / 1.25) and high == pytest.approx(2.0 * 1.25 / 0.75)


def test_each_time_takes_its_familys_error():
  """S = 2 with the method's time off by up to 10 % of the real time and the baseline's by
  20 % (each real time within T / (1 ± e)): 2 x 0.9 / 1.2 = 1.5 … 2 x 1.1 / 0.8 = 2.75. A
  family not measured takes the largest error of all."""
  low, high = results_table.interval(2.0, 0.1, 0.2)
  assert low == pytest.approx(1.5) and high == pytest.approx(2.75)
  error = results_table.SimulatorError(0.05, 0.3, 'a test figure', (('bp', 0.2), ('ddg', 0.1)))
  assert (error.of('ddg'), error.of('bp'), error.of('ssgd'), error.of(None)) == (0.1, 0.2, 0.3, 0.3)


def test_a_claim_row_prices_each_method_by_its_family():
  """DDG K=4 against BP: 1.6 / 1.5 = 1.0667. With one error of 25 % for both it is not
  shown (0.64 … 1.78); with DDG's 2 % and BP's 3 %: 1.0667 x 0.98 / 1.03 = 1.0149 > 1, shown."""
  claim = suites.Claim('DDG K=4', 'BP (staged, K=4)', 'faster', 'a paper figure')
  families = results_table.method_families(suites.SUITES['ddg'])
  assert (families['DDG K=4'], families['BP (staged, K=4)']) == ('ddg', 'bp')
  # A method's variant names its algorithm too (`dasgd.py:diloco,lm`).
  lm = results_table.method_families(suites.SUITES['lm'])
  assert (lm['DiLoCo M=4'], lm['local SGD M=4'], lm['DaSGD M=4']) == (
    'diloco',
    'local_sgd',
    'dasgd',
  )
  report_json = _ddg_report()
  one = results_table.claim_row(claim, report_json, 'link', ERROR, families)
  assert one[-1].startswith('not shown at this size') and '[0.64–1.78]' in one[-2]
  measured = results_table.SimulatorError(
    0.01, 0.25, 'a test figure', (('ddg', 0.02), ('bp', 0.03))
  )
  row = results_table.claim_row(claim, report_json, 'link', measured, families)
  assert row[-1] == 'reproduced (faster beyond the simulator error)' and '[1.01–1.12]' in row[-2]


def test_verdicts_hand_computed():
  methods = _ddg_report()['methods']
  bp, k2, k4 = methods['BP (staged, K=4)'], methods['DDG K=2'], methods['DDG K=4']
  # 1.6 / 0.8 = 2.0, interval [1.2, 3.33]: above 1.
  assert results_table.faster_verdict(k2, bp, 0.25).startswith('reproduced')
  # 1.6 / 1.5 = 1.07, interval [0.64, 1.78]: straddles 1.
  assert results_table.faster_verdict(k4, bp, 0.25).startswith('not shown at this size')
  assert results_table.faster_verdict(bp, k2, 0.0).startswith('not reproduced')  # 0.5x
  # Never reaching it in runs of 4 s, against BP's 1.6: at most 0.4x, 0.67 with the error.
  never = _method([0.9, 0.9], [None, None], total=4.0)
  assert results_table.faster_verdict(never, bp, 0.25).startswith('not reproduced (never')
  # In runs of 2 s it is at most 0.8x, 1.33 with the error: open.
  short = _method([0.9, 0.9], [None, None], total=2.0)
  assert results_table.faster_verdict(short, bp, 0.25) == (
    'not shown at this size (seeds that never reach the target leave it open)'
  )
  assert results_table.faster_verdict(never, never, 0.25) == (
    'not shown at this size (neither reaches the target)'
  )
  # Gap -0.1 point, 2 sd = 2 x 0.141 = 0.28: matches; K=4's -1.0 point does not.
  assert results_table.accuracy_verdict('matches', k2, bp) == (
    'reproduced (-0.10 points, 2 sd = 0.28)'
  )
  assert results_table.accuracy_verdict('matches', k4, bp).startswith('not reproduced')
  # A method 1.0 point better than its baseline loses nothing: it matches ("no loss").
  assert results_table.accuracy_verdict('matches', bp, k4).startswith('reproduced (+1.00')
  assert results_table.accuracy_verdict('better', bp, k4).startswith('reproduced')
  assert results_table.accuracy_verdict('better', k2, bp).startswith('not shown at this size')


def test_seeds_that_never_reach_the_target_bound_the_speedup_on_one_side():
  """Chunked against BP as measured: 1.395 and 1.318 s in 2 seeds, the third never within
  its 1.938 s run; BP 1.54 s in all 3. Over the 2 seeds alone 1.14x; over all 3 the
  method's mean is at least (1.395 + 1.318 + 1.938) / 3 = 1.5503, so at most 0.9934x
  (1.0576 with 2.1 % / 4.1 % errors): not shown."""
  chunked = _method([0.95] * 3, [1.395, 1.318, None], total=1.938)
  bp = _method([0.98] * 3, [1.54] * 3)
  low, high = results_table.speedup(chunked, bp)
  assert low == 0 and high == pytest.approx(1.54 / 1.5503333333, rel=1e-9)
  assert results_table.faster_verdict(chunked, bp, 0.021, 0.041).startswith('not shown')
  assert results_table._speedup_cell(chunked, bp, 0.021, 0.041) == '< 0.99× [< 1.06]'
  # The other way round the bound is a lower one: BP at least 1.5503 / 1.54 = 1.0067x
  # faster, 1.0067 x 0.959 / 1.021 = 0.9456 with BP's 4.1 % and chunked's 2.1 %.
  assert results_table._speedup_cell(bp, chunked, 0.041, 0.021) == '> 1.01× [> 0.95]'
  # A baseline that never reaches it bounds from below: PD-ASGD 0.73 s against LPP-SGD's
  # whole runs of 2 s: more than 2.74x, 2.74 x 0.64 / 1.17 = 1.50 with 36 % / 17 %.
  pd, lpp = _method([0.98] * 3, [0.73] * 3), _method([0.93] * 3, [None] * 3, total=2.0)
  assert results_table.speedup(pd, lpp) == (pytest.approx(2 / 0.73), math.inf)
  assert results_table.faster_verdict(pd, lpp, 0.361, 0.174).startswith('reproduced')


def test_each_error_goes_with_its_own_side():
  """DDG 2 % and BP 30 %, S = 1.6 / 0.8 = 2: 2 x 0.98 / 1.3 = 1.5077 … 2 x 1.02 / 0.7 =
  2.9143; swapped they would be 2 x 0.7 / 1.02 = 1.3725 … 2 x 1.3 / 0.98 = 2.6531."""
  methods = _ddg_report()['methods']
  k2, bp = methods['DDG K=2'], methods['BP (staged, K=4)']
  assert results_table.speedup(k2, bp) == (pytest.approx(2.0), pytest.approx(2.0))
  error = results_table.SimulatorError(0.01, 0.3, 'a test', (('ddg', 0.02), ('bp', 0.3)))
  families = {'DDG K=2': 'ddg', 'BP (staged, K=4)': 'bp'}
  claim = suites.Claim('DDG K=2', 'BP (staged, K=4)', 'faster', 'a paper figure')
  row = results_table.claim_row(claim, _ddg_report(), 'link', error, families)
  assert row[-2] == '2.00× [1.51–2.91]'
  low, high = results_table.interval(2.0, 0.02, 0.3)
  assert (low, high) == (pytest.approx(2 * 0.98 / 1.3), pytest.approx(2 * 1.02 / 0.7))


def test_each_seeds_time_is_its_time_to_target_or_its_whole_run():
  def run(hit, end):
    return {'summary': {'time_to_target': hit}, 'records': [{'sim_time': end}]}

  seeds = [run({'step': 5, 'sim_time': 1.0}, 3.0), run(None, 3.5), run({'step': 7}, None)]
  assert [report._seed_time(r['summary']['time_to_target'] or {}, r) for r in seeds] == [
    {'reached': True, 'time': 1.0},
    {'reached': False, 'time': 3.5},
    {'reached': True, 'time': None},  # reached on a real clock: no simulated time
  ]
  method = _method([0.9] * 3, [1.0, None, 2.0], total=3.5)
  assert results_table.mean_time_bounds(method) == (pytest.approx(6.5 / 3), math.inf)
  method['seed_times_sim'][1]['time'] = None
  assert results_table.mean_time_bounds(method) is None
  other = _method([0.9] * 3, [1.0] * 3)
  assert results_table.faster_verdict(method, other, 0.1) == (
    'not shown at this size (no simulated times)'
  )


def test_a_simulator_error_outside_0_to_1_is_refused():
  with pytest.raises(ValueError, match=r'^simulator error ddg: a fraction in \[0, 1\), got 1.0$'):
    results_table.SimulatorError(0.01, 0.2, 'a test', (('ddg', 1.0),))


def test_a_language_models_claims_are_judged_on_perplexity():
  """DiLoCo 5.0 ± 0.14 against SSGD 5.2 ± 0.14 (perplexity): 0.2 lower, 2 sd = 0.28 — matches
  (and not 'better': not above the noise); accuracies that differ by 10 points do not
  decide it. Perplexities 0.5 apart with the same spread: better (and no loss, so a
  match); the other way round, worse: neither."""
  diloco = {**_method([0.5, 0.5], [None, None]), 'final_perplexity': _stats([4.9, 5.1])}
  ssgd = {**_method([0.4, 0.4], [None, None]), 'final_perplexity': _stats([5.1, 5.3])}
  sd = float(np.std([4.9, 5.1], ddof=1))
  assert results_table.accuracy_verdict('matches', diloco, ssgd) == (
    f'reproduced (perplexity -0.200, lower is better, 2 sd = {2 * sd:.3f})'
  )
  assert results_table.accuracy_verdict('better', diloco, ssgd).startswith('not shown')
  far = {**ssgd, 'final_perplexity': _stats([5.4, 5.6])}
  assert results_table.accuracy_verdict('better', diloco, far).startswith('reproduced')
  assert results_table.accuracy_verdict('matches', diloco, far).startswith('reproduced')
  assert results_table.accuracy_verdict('matches', far, diloco).startswith('not reproduced')
  assert results_table.accuracy_verdict('better', far, diloco).startswith('not reproduced')
  assert results_table._final(diloco) == '50.00 ± 0.00 (ppl 5.00 ± 0.14)'


def test_the_table_goes_between_the_markers_from_report_json(tmp_path):
  (tmp_path / 'results' / 'ddg').mkdir(parents=True)
  (tmp_path / 'results' / 'ddg' / 'report.json').write_text(json.dumps(_ddg_report()))
  results_md = tmp_path / 'RESULTS.md'
  results_md.write_text('# Results\n\nThe rest, kept.\n')
  ddg = suites.SUITES['ddg']
  block = results_table.write_results(
    str(results_md), str(tmp_path / 'results'), [ddg, suites.SUITES['local']], ERROR
  )
  text = results_md.read_text()
  assert text.startswith('# Results\n\n' + results_table.BEGIN) and text.endswith(
    results_table.END + '\n\nThe rest, kept.\n'
  )
  rows = [line for line in block.splitlines() if line.startswith('| DDG')]
  assert len(rows) == len(ddg.claims) == 3
  cells = [c.strip() for c in rows[1].split('|')[1:-1]]  # DDG K=2 vs BP: faster
  assert cells[0] == 'DDG K=2 vs BP (staged, K=4): faster ([ddg](results/ddg/report.md))'
  assert cells[2] == '98.00 ± 0.14 vs 98.10 ± 0.14'
  assert cells[3] == '0.8 (2/2) vs 1.6 (2/2)'
  assert cells[4] == '2.00× [1.20–3.33]'
  assert 'Not in the table yet (no report.json): local.' in block
  assert 'off by up to 25.0 % (median 5.0 %; a test figure)' in block
  results_table.write_results(
    str(results_md), str(tmp_path / 'results'), [ddg, suites.SUITES['local']], ERROR
  )
  assert results_md.read_text() == text  # Run again: the same file.


def test_without_any_report_json_the_table_says_so(tmp_path):
  results_md = tmp_path / 'RESULTS.md'
  results_md.write_text('# Results\n')
  block = results_table.write_results(
    str(results_md), str(tmp_path / 'none'), list(suites.SUITES.values()), ERROR
  )
  assert 'No suite has a report.json yet' in block and '| ' not in block


def test_the_schedule_error_on_record_is_the_largest_per_family_of_the_latest_whole_runs(
  tmp_path,
):
  """Four runs in the benchmark's output, the third of two families only: the latest two
  whole runs are the second and the fourth; per family the larger of theirs, and the
  larger median."""
  path = tmp_path / 'schedule_error.txt'

  def run(date, median, errors):
    listed = ', '.join(f'{name} {x} %' for name, x in errors.items())
    return (
      f'machine: 2 CPU cores, no GPU; {date}; python -m benchmarks.schedule_error\n'
      f'(the tables)\nmedian error {median} % over 30 rows; largest: ...\n'
      f'largest error per family: {listed}\nsimulator max error across families: 9%\n'
    )

  path.write_text(
    run('2026-01-01 00:00', 0.5, {'bp': 9.0, 'asgd': 9.0})
    + run('2026-01-02 00:00', 1.4, {'bp': 1.0, 'asgd': 6.8})
    + run('2026-01-03 00:00', 3.0, {'bp': 5.0})
    + run('2026-01-04 00:00', 1.2, {'bp': 2.2, 'asgd': 3.5})
  )
  error = results_table.schedule_error_on_record(str(path), runs=2, families=('bp', 'asgd'))
  assert error.by_family == (('bp', 0.022), ('asgd', 0.068))
  assert (error.largest, error.median) == (0.068, 0.014)
  assert '2026-01-02 00:00, 2026-01-04 00:00 UTC' in error.source
  assert error.of('dasgd') == 0.068  # a family the benchmark does not run: the largest
  with pytest.raises(ValueError, match='no run of the schedule error that measured bp, ddg'):
    results_table.schedule_error_on_record(str(path), families=('bp', 'ddg'))


def test_the_report_command_reads_the_error_on_record_only_when_it_writes(monkeypatch, capsys):
  """`--help` and a bad call read no file (the schedule error on record was read first,
  so a clone without benchmarks/results could not even show its help)."""

  def unreadable(*args, **kwargs):
    raise AssertionError('read the schedule error on record')

  monkeypatch.setattr(results_table, 'schedule_error_on_record', unreadable)
  with pytest.raises(SystemExit) as stopped:
    report.main(['--help'])
  assert stopped.value.code == 0 and '--error_max' in capsys.readouterr().out
  with pytest.raises(SystemExit) as stopped:
    report.main([])
  assert stopped.value.code == 2
  assert 'nothing to do: pass --results' in capsys.readouterr().err


def _report_error(monkeypatch, argv, record) -> results_table.SimulatorError:
  """The `SimulatorError` `report.main(argv)` writes RESULTS.md's table with, the schedule
  error on record being `record()`."""
  written = []
  monkeypatch.setattr(results_table, 'schedule_error_on_record', record)
  monkeypatch.setattr(
    results_table, 'write_results', lambda md, results, suites, error: written.append(error)
  )
  report.main(['--results', *argv])
  (error,) = written
  return error


def test_the_report_command_takes_each_error_flag_given_and_the_record_for_the_rest(
  monkeypatch,
):
  on_record = results_table.SimulatorError(0.015, 0.066, 'on record', (('asgd', 0.066),))

  def unreadable():
    raise AssertionError('read the schedule error on record')

  given = ['--error_median=0.01', '--error_max=0.2', '--error_source=mine', '--error_by_family=']
  assert _report_error(monkeypatch, given, unreadable) == results_table.SimulatorError(
    0.01, 0.2, 'mine', ()
  )
  error = _report_error(monkeypatch, ['--error_max=0.2'], lambda: on_record)
  assert error == results_table.SimulatorError(0.015, 0.2, 'on record', (('asgd', 0.066),))


def test_the_report_command_without_a_readable_record_says_which_flags_to_pass(monkeypatch, capsys):
  def missing():
    raise FileNotFoundError('benchmarks/results/schedule_error.txt: no such file')

  with pytest.raises(SystemExit) as stopped:
    _report_error(monkeypatch, ['--error_max=0.2', '--error_source=mine'], missing)
  assert stopped.value.code == 2
  (line,) = capsys.readouterr().err.strip().splitlines()[-1:]
  assert 'no such file; or pass --error_median, --error_by_family' in line
