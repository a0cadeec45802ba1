"""Renamed: `python -m experiments.reprice` re-prices a profile from a pilot run's trace.

"Calibrate" means one thing here: `cost.calibrate`, the tasks measured on this machine
the first time a run needs them and kept as a profile by the data. This command made a
profile re-priced from a pilot run's trace; it is refused in one line naming its new
name, with the same flags.
"""

if __name__ == '__main__':
  raise SystemExit(
    'experiments.calibrate is now experiments.reprice (a profile re-priced from a pilot '
    "run's trace; the same flags): python -m experiments.reprice --profile=... --run=... "
    '--out=...'
  )
