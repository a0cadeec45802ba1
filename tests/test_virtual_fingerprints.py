"""The shipped configs' virtual runs keep their numbers and their simulated times.

Each case is a shipped config's smoke variant on the virtual clock with fixed task costs
(`cost.compute`, or the `cpu` preset), alone or with one of the simulator's schedule and
host settings. Its fingerprint — every logged record's `sim_time`, loss and accuracy, and
a digest of every task's lane, name, start and end in `trace.json` — is kept in
`tests/fingerprints/virtual_runs.json`. A refactoring of the cost model or of the virtual
clock must leave all of them as they are; a change that is meant to move simulated times
regenerates the file (`python -m tests.test_virtual_fingerprints`) and says why in its
commit.

Simulated times and the trace are compared exactly, on any machine: they are sums of
the priced costs in the order the schedule decides. The numbers (each record's train and
test loss and accuracy) are XLA's arithmetic, which may differ in the last bits from one
CPU or JAX version to another: the DDG cases' accuracies differed by up to 6 of the 1,000
test examples between the CPU that wrote the first file and an AVX2-only EPYC (what
differs was not isolated: capping XLA's generated code there at AVX or SSE4.2,
`--xla_cpu_max_isa`, moved every loss by 1e-8 to 5e-6 and no accuracy). So they are kept
per kind (`numbers_kind`: the machine, its widest vector extension, the CPU's model, JAX's
version and any XLA flag set: `--xla_backend_optimization_level=0` moved the losses' last
bits), assumed to compute the same bits — a kind that does not fails loudly — and
compared bit for bit on a kind the file holds; on any other kind, within `_OTHER_CPU` of
every kind's, with a warning that says so. The CPU's model is in the kind because XLA
compiles for the CPU it runs on: DC-ASGD's train losses after the first and its last test
loss differed in their last bits between two CPUs with AVX-512 (an AMD EPYC of family 25,
model 17, and the CPU its numbers were kept on). Numbers kept before the model was
(`isa_kind`: no model in it) stand for every CPU of their kind that has none of its own
in the file, bit for bit (`exact_kinds`). A CPU's numbers are added beside the others'
with `python -m tests.test_virtual_fingerprints --new-cpu <cases>`.
"""

import hashlib
import importlib
import json
import math
import os
import pathlib
import platform
import sys
import warnings

import pytest

from jaxsgd.scheduler import host as host_lib

FINGERPRINTS = pathlib.Path(__file__).parent / 'fingerprints' / 'virtual_runs.json'

_PIPELINE_COSTS = {
  'cost.calibrate': False,
  'cost.compute.forward': 0.003,
  'cost.compute.backward': 0.005,
  'cost.compute.update': 0.001,
}
_STEP_COSTS = {'cost.calibrate': False, 'cost.compute.step': 0.004}
_LINKS = {'cost.link_latency': 2e-4, 'cost.link_bandwidth': 1e9}
# The process executor's host (`cost.host`, a host profile written for the case): free
# links and take-ins and no host time unless a case gives them; as many cores as no case's lanes fill.
_PROCESSES = {
  'executor': 'processes',
  'cores': 64,
  **dict.fromkeys(host_lib.FIGURES['processes'], 0.0),
  'link_bandwidth': float('inf'),
  'take_in_bandwidth': float('inf'),
  'export_bandwidth': float('inf'),
}
_RUN_AHEAD = {'cost.host': _PROCESSES}
_DRIVER = {'cost.host': {**_PROCESSES, 'driver': 3e-4, 'driver_latency': 5e-4}}

# case -> (config module, overrides).
CASES = {
  'bp': ('ddg', {**_PIPELINE_COSTS, 'algorithm.name': 'bp', 'algorithm.variant': None}),
  'ddg': ('ddg', _PIPELINE_COSTS),
  'ddg preset cpu': ('ddg', {'cost.device': 'cpu'}),
  'ddg links': ('ddg', {**_PIPELINE_COSTS, **_LINKS}),
  'local': ('local', _PIPELINE_COSTS),
  'asgd': ('asgd', {**_PIPELINE_COSTS, 'cost.straggler_std': 0.3}),
  'dcasgd': ('dcasgd', _PIPELINE_COSTS),
  'pdasgd': ('pdasgd', _PIPELINE_COSTS),
  'lppsgd': ('lppsgd', _PIPELINE_COSTS),
  'ddg run ahead': ('ddg', {**_PIPELINE_COSTS, **_RUN_AHEAD}),
  'asgd run ahead': ('asgd', {**_PIPELINE_COSTS, **_RUN_AHEAD}),
  'pdasgd run ahead': ('pdasgd', {**_PIPELINE_COSTS, **_RUN_AHEAD}),
  'lppsgd run ahead': ('lppsgd', {**_PIPELINE_COSTS, **_RUN_AHEAD}),
  'ddg driver': ('ddg', {**_PIPELINE_COSTS, **_DRIVER}),
  'asgd driver': ('asgd', {**_PIPELINE_COSTS, **_DRIVER}),
  'ddg copies on sender': (
    'ddg',
    {**_PIPELINE_COSTS, 'cost.host': {**_PROCESSES, 'link_latency': 2e-4, 'link_bandwidth': 1e9}},
  ),
  'ddg one core time-sliced': (
    'ddg',
    {**_PIPELINE_COSTS, **_RUN_AHEAD, 'placement.lanes': 'stage0@cores=0; stage1@cores=0'},
  ),
  'ddg one core fifo': (
    'ddg',
    {**_PIPELINE_COSTS, 'placement.lanes': 'stage0@cores=0; stage1@cores=0'},
  ),
  'ssgd': ('ssgd', {**_STEP_COSTS, **_LINKS}),
  'dasgd': ('dasgd', {**_STEP_COSTS, **_LINKS}),
  'streaming_diloco': ('streaming_diloco', {**_STEP_COSTS, **_LINKS}),
}


def _config(name, data_dir, overrides, directory):
  config = importlib.import_module(f'experiments.configs.{name}').get_config('smoke')
  config.data_dir = data_dir
  config.clock = 'virtual'
  for field, value in overrides.items():
    if field == 'cost.host':  # a host profile's figures: written to a file for the run
      value = _host_file(value, directory)
    parent, _, leaf = field.rpartition('.')
    node = config[parent] if parent else config
    if value is None:
      del node[leaf]  # a field the other algorithm does not have
    else:
      node[leaf] = value
  return config


def _host_file(figures, directory) -> str:
  figures = dict(figures)
  executor, cores = figures.pop('executor'), figures.pop('cores')
  path = os.path.join(directory, 'host.json')
  host_lib.save(host_lib.make(executor, figures, cores=cores), path)
  return path


def fingerprint(workdir) -> dict:
  """What a run must keep: its records' simulated times and metrics, and its trace."""
  records = [json.loads(line) for line in open(os.path.join(workdir, 'metrics.jsonl'))]
  path = os.path.join(workdir, 'trace.json')  # none for the data-parallel step
  events = json.load(open(path))['traceEvents'] if os.path.exists(path) else []
  tasks = [[e.get('tid'), e['name'], e['ts'], e.get('dur')] for e in events if e.get('ph') == 'X']
  return {
    'sim_time': [r.get('sim_time') for r in records],
    'tasks': len(tasks),
    'trace_sha1': hashlib.sha1(json.dumps(tasks).encode()).hexdigest(),
    'numbers': {
      numbers_kind(): {
        'train_loss': [r.get('train_loss', r.get('loss')) for r in records],
        'test_loss': [r.get('test_loss') for r in records],
        'accuracy': [r.get('test_accuracy', r.get('accuracy')) for r in records],
      }
    },
  }


# Where a CPU kind's numbers cannot be compared bit for bit: a loss within a relative 1e-2,
# an accuracy within 0.01 (10 of the smoke runs' 1,000 test examples).
_OTHER_CPU = {'train_loss': 1e-2, 'test_loss': 1e-2, 'accuracy': 0.01}
_RELATIVE = {'train_loss', 'test_loss'}
_METRICS = ('train_loss', 'test_loss', 'accuracy')


def numbers_kind() -> str:
  """The machine, the widest vector extension its CPU has, the CPU's model, JAX's version
  and the XLA flags set ('x86_64 avx512f AuthenticAMD 25/17, jax 0.10.2' with none): the
  runs of one kind are assumed to compute the same bits."""
  return _kind(with_model=True)


def isa_kind() -> str:
  """`numbers_kind` without the CPU's model ('x86_64 avx2, jax 0.10.2'): the kinds of
  the numbers kept before the model was."""
  return _kind(with_model=False)


def exact_kinds(kept: dict) -> set[str]:
  """The kinds whose numbers in `kept` (where it holds them) this run must equal bit for
  bit: its own; with none of its own, its `isa_kind`'s, kept on a CPU of the same
  extension whose model was not recorded."""
  here = numbers_kind()
  return {here} if here in kept else {here, isa_kind()}


def _cpu_fields(lines=None) -> dict[str, str]:
  """The first CPU's fields of `lines` (/proc/cpuinfo's; none where there is no such
  file): up to the first blank line, which ends a CPU's block."""
  if lines is None:
    try:
      with open('/proc/cpuinfo') as f:
        lines = f.read().splitlines()
    except OSError:
      lines = []
  fields = {}
  for line in lines:
    if not line.strip():
      break
    name, _, value = line.partition(':')
    fields.setdefault(name.strip(), value.strip())
  return fields


def _cpu_model(fields: dict[str, str]) -> str:
  """'AuthenticAMD 25/17' (x86: vendor, family/model), '0x41 0xd0c' (Arm: implementer,
  part), else the platform's processor string (which may name no model: a kind then
  holds every CPU of its extension, as one without a model did)."""
  if 'vendor_id' in fields:
    return f'{fields["vendor_id"]} {fields.get("cpu family", "?")}/{fields.get("model", "?")}'
  if 'CPU implementer' in fields:
    return f'{fields["CPU implementer"]} {fields.get("CPU part", "?")}'
  return platform.processor() or 'unknown'


def _kind(with_model: bool) -> str:
  """The kind, with or without the CPU's model. Every XLA flag but the fake device
  count (which changes no device's code) is in it; one that changes none either,
  `--xla_dump_to`, still makes a kind of its own."""
  import jax  # pylint: disable=g-import-not-at-top

  fields = _cpu_fields()
  flags = set((fields.get('flags') or fields.get('Features') or '').split())
  widest = next((x for x in ('avx512f', 'avx2', 'avx', 'sve', 'asimd') if x in flags), 'base')
  model = f' {_cpu_model(fields)}' if with_model else ''
  kind = f'{platform.machine()} {widest}{model}, jax {jax.__version__}'
  from jaxsgd.scheduler.lanes import cluster  # pylint: disable=g-import-not-at-top

  xla = [
    f
    for f in os.environ.get('XLA_FLAGS', '').split()
    if not f.startswith(cluster.DEVICE_COUNT_FLAG)
  ]
  return ', '.join([kind, *sorted(xla)])


def run_case(case, data_dir, workdir) -> dict:
  from jaxsgd.training import train_and_evaluate

  name, overrides = CASES[case]
  os.makedirs(f'{workdir}-host', exist_ok=True)
  config = _config(name, data_dir, overrides, f'{workdir}-host')
  train_and_evaluate(config, str(workdir), show_progress=False)
  return fingerprint(workdir)


def _within(got, want, tolerance, relative) -> bool:
  """Two lists of numbers alike: equal where `tolerance` is 0 (None where both are)."""

  def close(a, b):
    if a is None or b is None:
      return a is None and b is None
    # (1 + 1e-9): 0.26 - 0.25 is 0.010000000000000009 in binary, yet 10 examples apart
    return abs(a - b) <= tolerance * (abs(b) if relative else 1) * (1 + 1e-9)

  return len(got) == len(want) and all(close(a, b) for a, b in zip(got, want))


def numbers_differ(got: dict, kept: dict, exact_in: set[str] | None = None) -> list[str]:
  """What in `got` (this kind's numbers) differs from the numbers `kept` per kind: bit for
  bit from those of the kinds `exact_in` (`exact_kinds(kept)` by default), within
  `_OTHER_CPU` of every other kind's."""
  differ = []
  exact_in = exact_kinds(kept) if exact_in is None else exact_in
  for kind, theirs in kept.items():
    for name, values in theirs.items():
      exact = kind in exact_in
      tolerance = 0.0 if exact else _OTHER_CPU[name]
      if not _within(got[name], values, tolerance, name in _RELATIVE):
        differ.append(
          f'{name} on {kind!r} ({"bit for bit" if exact else tolerance}): '
          f'{got[name]} against {values}'
        )
  return differ


@pytest.mark.parametrize('case', CASES)
def test_a_shipped_config_keeps_its_simulated_times_and_numbers(case, data_dir, tmp_path):
  want = json.loads(FINGERPRINTS.read_text())[case]
  got = run_case(case, data_dir, tmp_path)
  assert got['sim_time'] == want['sim_time']
  assert (got['tasks'], got['trace_sha1']) == (want['tasks'], want['trace_sha1'])
  (numbers,) = got['numbers'].values()
  kept = want['numbers']
  assert any(set(theirs) == set(_METRICS) for theirs in kept.values()), kept  # one whole kind
  if numbers_kind() in kept:
    assert set(kept[numbers_kind()]) == set(_METRICS), kept
  elif isa_kind() in kept:
    assert set(kept[isa_kind()]) == set(_METRICS), kept
  else:
    warnings.warn(
      f'{numbers_kind()}: no numbers of this kind kept; compared within {_OTHER_CPU}',
      stacklevel=1,
    )
  assert numbers_differ(numbers, kept) == []


def test_numbers_are_compared_bit_for_bit_on_the_same_cpu_kind_only(monkeypatch):
  """A hand case: one last bit apart is a difference on this CPU kind, and nothing on
  another; an accuracy 11 examples of 1,000 apart, a loss 2 % apart or one number more is
  one on any; 10 examples and 0.9 % are none on another."""
  monkeypatch.setattr(sys.modules[__name__], 'numbers_kind', lambda: 'here')
  got = {'train_loss': [None, 1.5], 'test_loss': [2.0], 'accuracy': [0.25]}
  apart = {'train_loss': [None, math.nextafter(1.5, 2)], 'test_loss': [2.0], 'accuracy': [0.25]}
  assert numbers_differ(got, {'here': got, 'other': apart}) == []
  assert len(numbers_differ(got, {'here': apart})) == 1
  assert numbers_differ(got, {'other': {**got, 'accuracy': [0.26]}}) == []
  assert numbers_differ(got, {'other': {**got, 'test_loss': [2.018]}}) == []
  for kind in ('here', 'other'):
    assert len(numbers_differ(got, {kind: {**got, 'accuracy': [0.261]}})) == 1
    assert len(numbers_differ(got, {kind: {**got, 'test_loss': [2.04]}})) == 1
    assert len(numbers_differ(got, {kind: {**got, 'accuracy': [0.25, 0.3]}})) == 1
  assert len(numbers_differ(got, {'other': {'accuracy': [None]}})) == 1
  assert numbers_differ(got, {'other': {'accuracy': [0.25]}}) == []  # what a kind kept


def test_a_cpu_with_no_numbers_of_its_own_is_held_bit_for_bit_to_its_extension(monkeypatch):
  """A hand case: with no numbers of its own model kept, a run is held bit for bit to its
  extension's kept without a model (`isa_kind`); with its own kept, to those, and to the
  extension's within `_OTHER_CPU` (another CPU of the same extension computed them)."""
  module = sys.modules[__name__]
  monkeypatch.setattr(module, 'numbers_kind', lambda: 'x86_64 avx512f AMD 25/17, jax')
  monkeypatch.setattr(module, 'isa_kind', lambda: 'x86_64 avx512f, jax')
  got = {'test_loss': [1.5]}
  apart = {'test_loss': [math.nextafter(1.5, 2)]}
  assert numbers_differ(got, {'x86_64 avx512f, jax': got}) == []
  assert len(numbers_differ(got, {'x86_64 avx512f, jax': apart})) == 1
  own = 'x86_64 avx512f AMD 25/17, jax'
  assert numbers_differ(got, {own: got, 'x86_64 avx512f, jax': apart}) == []
  assert len(numbers_differ(got, {own: apart, 'x86_64 avx512f, jax': got})) == 1
  assert numbers_differ(got, {'x86_64 avx2, jax': apart}) == []  # another extension


_X86_CPUINFO = [
  'processor\t: 0',
  'vendor_id\t: AuthenticAMD',
  'cpu family\t: 25',
  'model\t\t: 17',
  'model name\t: AMD EPYC',
  'flags\t\t: fpu avx2 avx512f',
  'vmx flags\t: vnmi',
  '',
  'processor\t: 1',
  'vendor_id\t: GenuineIntel',
  'flags\t\t: fpu avx2',
]
_ARM_CPUINFO = [
  'processor\t: 0',
  'Features\t: fp asimd sve',
  'CPU implementer\t: 0x41',
  'CPU part\t: 0xd0c',
  '',
]


def test_a_cpus_fields_are_its_first_blocks_and_its_model_vendor_family_or_implementer_part():
  """Hand cases of /proc/cpuinfo: x86's (a `vmx flags` line after `flags`, `model name`
  beside `model`, a second CPU's block not read) and Arm's."""
  x86 = _cpu_fields(_X86_CPUINFO)
  assert (x86['flags'], x86['model'], x86['model name']) == ('fpu avx2 avx512f', '17', 'AMD EPYC')
  assert _cpu_model(x86) == 'AuthenticAMD 25/17'
  arm = _cpu_fields(_ARM_CPUINFO)
  assert (arm['Features'], _cpu_model(arm)) == ('fp asimd sve', '0x41 0xd0c')


def test_the_kinds_strings_are_those_kept_in_the_file(monkeypatch):
  """`isa_kind` is the kind the numbers kept before the CPU's model were written under,
  to the character (else every CPU would fall back to the tolerance, with a warning
  alone); `numbers_kind` is it with the model after the extension."""
  import jax  # pylint: disable=g-import-not-at-top

  module = sys.modules[__name__]
  amd = _cpu_fields(_X86_CPUINFO)
  monkeypatch.setattr(module, '_cpu_fields', lambda: amd)
  monkeypatch.setenv('XLA_FLAGS', '--xla_force_host_platform_device_count=4')
  machine = platform.machine()
  assert isa_kind() == f'{machine} avx512f, jax {jax.__version__}'
  assert numbers_kind() == f'{machine} avx512f AuthenticAMD 25/17, jax {jax.__version__}'
  monkeypatch.setenv('XLA_FLAGS', '--xla_backend_optimization_level=0')
  assert (
    isa_kind() == f'{machine} avx512f, jax {jax.__version__}, --xla_backend_optimization_level=0'
  )


def main() -> None:
  """Writes the fingerprints of every case (or of the cases named on the command line):
  this kind's numbers beside the other kinds' where the schedule did not move and this
  kind's numbers are as kept (`exact_kinds`: its own, or with none of its own its
  extension's; new to the file, within `_OTHER_CPU` of the others'); alone, the others
  dropped and named, where anything moved. `--new-cpu`: this CPU's numbers are new, and
  every other kind's, its extension's too, is compared within `_OTHER_CPU` — for a CPU
  whose bits differ from its extension's kept ones where nothing else changed."""
  import tempfile

  import conftest  # noqa: F401  (the tests' XLA flags, set before JAX starts)

  new_cpu = '--new-cpu' in sys.argv[1:]
  wanted = [a for a in sys.argv[1:] if a != '--new-cpu'] or list(CASES)
  old = json.loads(FINGERPRINTS.read_text()) if FINGERPRINTS.exists() else {}
  with tempfile.TemporaryDirectory() as tmp:
    for i, case in enumerate(wanted):
      new = run_case(case, os.path.join(tmp, 'data'), os.path.join(tmp, f'run{i}'))
      kept = old.get(case, {})
      others = {k: v for k, v in kept.get('numbers', {}).items() if k != numbers_kind()}
      schedule = ('sim_time', 'tasks', 'trace_sha1')
      (numbers,) = new['numbers'].values()
      if (
        all(kept.get(key) == new[key] for key in schedule)
        and numbers_differ(numbers, kept['numbers'], {numbers_kind()} if new_cpu else None) == []
      ):  # the other kinds' numbers still hold
        new['numbers'] = {**others, **new['numbers']}
      elif others:
        print(f'{case}: moved; numbers dropped for {sorted(others)}', flush=True)
      old[case] = new
      print(case, new['sim_time'][-1], new['tasks'], sorted(new['numbers']), flush=True)
  FINGERPRINTS.parent.mkdir(exist_ok=True)
  FINGERPRINTS.write_text(json.dumps(old, indent=1, sort_keys=True) + '\n')


if __name__ == '__main__':
  sys.path.insert(0, str(pathlib.Path(__file__).parent))
  main()
