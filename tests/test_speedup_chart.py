"""The real speed-up chart reads every table of real_speedup.txt with its setting."""

from benchmarks import speedup_chart

TEXT = """\
# the latest run
machine: 2 CPU cores, load average 1.5 at start; jax 0.10.2; MLP 1536-1024-10, batch 512, 20 steps
case                     ms / iteration  speed-up over bp  busiest lane ms / it
bp (1 lane, core 0)      152.7           1.00              147.1
ddg K=2 (cores 0, 1)     87.1            1.74              77.6
machine: 2 CPU cores, load average 1.0 at start; jax 0.10.2; MLP 512-1024-10, batch 512, 20 steps
case                         ms / iteration  speed-up over bp  host ms / task
bp (1 lane, core 0)          150.0           1.00              1.5
pdasgd 1:1 K=2 (cores 0, 1)  202.1           0.99              2.30
case                    ms / iteration  speed-up over bp
ddg K=8 (cores 0-7)     42.1            6.79
"""


def test_every_table_is_read_with_its_lanes_and_setting(tmp_path):
  runs = speedup_chart.parse_runs(TEXT)
  assert runs == [
    ('MLP 1536-1024-10, batch 512', {'bp': (1, 1.0), 'ddg K=2': (2, 1.74)}),
    ('MLP 512-1024-10, batch 512', {'bp': (1, 1.0), 'pdasgd 1:1': (2, 0.99)}),
    ('MLP 512-1024-10, batch 512', {'ddg K=8': (8, 6.79)}),
  ]
  assert speedup_chart.short('MLP 1024-1024-1024-10, batch 256') == 'MLP 1024x3-10, batch 256'
  setting, latest, earlier = speedup_chart.latest_and_earlier(runs[1:] + runs[:1])
  assert setting == 'MLP 512-1024-10, batch 512' and latest['ddg K=8'] == (8, 6.79)
  assert earlier == {}  # bp appears once in that setting's tables
  speedup_chart.plot(runs[1:], str(tmp_path / 'chart.png'))
  assert (tmp_path / 'chart.png').stat().st_size > 5_000


def test_tables_below_the_earlier_window_line_are_left_out():
  """A table under `EARLIER_WINDOW` (DDG's speed-up overstated there) is not read."""
  text = TEXT.replace(
    'case                    ms', f'{speedup_chart.EARLIER_WINDOW} ---\ncase    ms'
  )
  assert [table for _, table in speedup_chart.parse_runs(text)] == [
    {'bp': (1, 1.0), 'ddg K=2': (2, 1.74)},
    {'bp': (1, 1.0), 'pdasgd 1:1': (2, 0.99)},
  ]


def test_a_run_with_copy_threads_apart_is_a_setting_of_its_own():
  """`real_speedup --copies` places lanes otherwise: its tables are not earlier runs of
  the default placement's cases (no dot of the chart)."""
  apart = TEXT.replace(
    'case                     ms',
    f'{speedup_chart.COPIES_APART} stage1 on 0\ncase                     ms',
  )
  from benchmarks import real_speedup

  assert speedup_chart.COPIES_APART == real_speedup.COPIES_APART  # what it prints
  settings = [setting for setting, _ in speedup_chart.parse_runs(apart)]
  assert settings == [
    f'MLP 1536-1024-10, batch 512; {speedup_chart.COPIES_APART} stage1 on 0',
    'MLP 512-1024-10, batch 512',
    'MLP 512-1024-10, batch 512',
  ]


def test_a_run_with_copy_threads_placed_by_load_is_a_setting_of_its_own():
  """`real_speedup --copies=auto` prints a line per case under its own: one setting."""
  by_load = TEXT.replace(
    'case                     ms',
    f'{speedup_chart.BY_LOAD_LINE} (from a round first, not counted):\n'
    '  ddg K=2 (cores 0, 1): stage0 on 0: 82.4 + 1.1 ms; copies of stage1 to 0\n'
    'case                     ms',
  )
  from benchmarks import real_speedup

  assert speedup_chart.BY_LOAD_LINE == real_speedup.BY_LOAD_LINE  # what it prints
  runs = speedup_chart.parse_runs(by_load)
  assert runs[0] == (
    f'MLP 1536-1024-10, batch 512; {speedup_chart.BY_LOAD_LINE}',
    {'bp': (1, 1.0), 'ddg K=2': (2, 1.74)},  # the case's line is no row of the table
  )
  assert [setting for setting, _ in runs[1:]] == ['MLP 512-1024-10, batch 512'] * 2
