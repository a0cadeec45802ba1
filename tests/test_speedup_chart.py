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
"""


def test_every_table_is_read_with_its_lanes_and_setting(tmp_path):
  runs = speedup_chart.parse_runs(TEXT)
  assert runs == [
    ('MLP 1536-1024-10, batch 512', {'bp': (1, 1.0), 'ddg K=2': (2, 1.74)}),
    ('MLP 512-1024-10, batch 512', {'bp': (1, 1.0), 'pdasgd 1:1': (2, 0.99)}),
  ]
  speedup_chart.plot(runs, str(tmp_path / 'chart.png'))
  assert (tmp_path / 'chart.png').stat().st_size > 5_000
