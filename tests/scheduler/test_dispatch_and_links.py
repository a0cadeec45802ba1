"""What the virtual clock adds for an executor's host dispatch, and how lanes share hardware.

- `cost.host`: the executor's measured host overhead per task (a host profile's
  `dispatch`) is added to every compute task, unscaled by lane speed, never to a transfer;
  a host profile of the process executor gives the driver its idle or loaded figures.
- A link is the pair of hardware it joins: transfers from two lanes of one device to
  another device queue on one FIFO link.
- `placement.lanes` on the virtual clock: lanes placed on the same cores share them.
Every expected time below is computed by hand.
"""

import dataclasses
import json

import jax
import numpy as np
import pytest

from experiments import profile as profile_command
from experiments.configs import ddg as ddg_config
from jaxsgd import data as data_lib
from jaxsgd import training
from jaxsgd.algorithms import clocks
from jaxsgd.algorithms.settings import cost_settings, shared_settings
from jaxsgd.scheduler import CostModel, VirtualExecutor, profiles, virtual
from jaxsgd.scheduler import profile_lookup, task_timing
from jaxsgd.scheduler.core import Cluster, Compute, Get, Process, Send
from jaxsgd.training.loop import build_model
from scheduler_helpers import host_file, profile_of


def _tasks(n, kind='forward', stage=0, lane=None):
  """A process body running `n` compute tasks in a row."""

  def program():
    for _ in range(n):
      yield Compute(lambda: None, kind=kind, stage=stage, lane=lane)

  return program()


def _spans(timeline, kind=None):
  return [(r.lane, r.start, r.end) for r in timeline.tasks(kind=kind)]


# --- dispatch ---------------------------------------------------------------------------------
def test_dispatch_is_added_to_every_compute_task():
  cluster = Cluster()
  lane = cluster.add_lane('a')
  model = CostModel({'forward': 1.0}, dispatch=0.25)
  timeline = VirtualExecutor(model).run(cluster, [Process('p', lane, _tasks(3))])
  assert _spans(timeline) == [(0, 0.0, 1.25), (0, 1.25, 2.5), (0, 2.5, 3.75)]


def test_dispatch_is_host_time_not_scaled_by_lane_speed():
  cluster = Cluster()
  slow = cluster.add_lane('slow')
  model = CostModel({'forward': 1.0}, device_speeds=(0.5,), dispatch=0.25)
  timeline = VirtualExecutor(model).run(cluster, [Process('p', slow, _tasks(2))])
  assert _spans(timeline) == [(0, 0.0, 2.25), (0, 2.25, 4.5)]  # 1 / 0.5 + 0.25 each


def test_dispatch_is_not_added_to_transfers():
  cluster = Cluster()
  a, b = cluster.add_lane('a'), cluster.add_lane('b')
  inbox = cluster.channel('inbox', b)

  def sender():
    yield Compute(lambda: None, kind='forward', stage=0)  # 0 -> 1.5
    yield Send(inbox, 'x')  # a transfer on link a -> b: 1.5 -> 1.5 + 0.5

  def receiver():
    yield Get(inbox)
    yield Compute(lambda: None, kind='forward', stage=0)  # 2.0 -> 3.5

  model = CostModel({'forward': 1.0}, link_latency=0.5, dispatch=0.5)
  timeline = VirtualExecutor(model).run(
    cluster, [Process('s', a, sender()), Process('r', b, receiver())]
  )
  assert _spans(timeline, 'forward') == [(a, 0.0, 1.5), (b, 2.0, 3.5)]
  assert [(r.start, r.end) for r in timeline.tasks(kind='transfer')] == [(1.5, 2.0)]


def test_zero_dispatch_changes_no_duration():
  sampler = CostModel({'forward': 0.1 + 0.2}, straggler_std=0.3, seed=4).sampler()
  with_zero = CostModel({'forward': 0.1 + 0.2}, straggler_std=0.3, seed=4, dispatch=0.0).sampler()
  for lane in range(3):
    assert sampler.duration('forward', 0, lane) == with_zero.duration('forward', 0, lane)


def _profile(dispatch: dict) -> profiles.Profile:
  """A profile with no tables and these dispatch figures (seconds per task)."""
  return profile_of(dispatch=dispatch)


def test_bad_host_settings_are_refused_naming_the_field(tmp_path):
  with pytest.raises(ValueError, match=r'^cost.dispatch: renamed; use cost.host \(a host profile'):
    cost_settings({'dispatch': 'processes'}, clock='virtual')
  with pytest.raises(ValueError, match=r"^cost.host: '/no/h.json': no such file; measure one"):
    cost_settings({'host': '/no/h.json'}, clock='virtual')
  with pytest.raises(ValueError, match='cost.dispatch: must be a finite number'):
    CostModel({'forward': 1.0}, dispatch=-1.0)
  bad = tmp_path / 'bad.json'
  for text, message in [
    ('{', r'not a readable JSON file'),
    ('{"format": "jaxsgd-cost-profile/1"}', r'not a host profile'),
    ('{"format": "jaxsgd-host-profile/1", "executor": "gpu", "cores": 2}', r"executor 'gpu'"),
    (
      '{"format": "jaxsgd-host-profile/1", "executor": "threads", "cores": 0, "dispatch": 0}',
      r'cores must be a positive integer',
    ),
    (
      '{"format": "jaxsgd-host-profile/1", "executor": "threads", "cores": 2}',
      r'no dispatch \(written by an older jaxsgd\?\); measure the host again: '
      r'python -m experiments.profile --host=threads --out=FILE\.',
    ),
    (
      '{"format": "jaxsgd-host-profile/1", "executor": "threads", "cores": 2, "dispatch": 0,'
      ' "driver": 1}',
      r"unknown field 'driver' for executor 'threads'",
    ),
  ]:
    bad.write_text(text)
    with pytest.raises(ValueError, match=rf"^cost.host: '{bad}': {message}"):
      cost_settings({'host': str(bad)}, clock='virtual')
  for bandwidth in (0.0, float('nan')):
    with pytest.raises(ValueError, match=r'link_bandwidth must be bytes/s > 0'):
      host_file(tmp_path, link_bandwidth=bandwidth)
  # `upkeep` is cores of CPU: at least 0 and fewer than the host has.
  for value in (-0.1, 2.0, float('nan')):
    with pytest.raises(ValueError, match=r'upkeep must be cores >= 0 and < 2, got'):
      host_file(tmp_path, cores=2, upkeep=value)


def test_merge_keeps_the_dispatch_figures_of_both():
  old = _profile({'jax_call': 1e-6, 'processes': 5e-4})
  new = _profile({'jax_call': 2e-6, 'real': 1e-5})
  assert profiles.merge(old, new).dispatch == {'jax_call': 2e-6, 'processes': 5e-4, 'real': 1e-5}


# DDG K = 2 with both stages on one device (as tests/scheduler/test_shared_hardware.py): the
# device is never idle, so the makespan is the sum of every task run, each + the dispatch.
STEPS = 10
COSTS = {
  (0, 'forward'): 1e-3,
  (1, 'forward'): 2e-3,
  (0, 'backward'): 3e-3,
  (1, 'backward'): 4e-3,
  (0, 'update'): 5e-4,
  (1, 'update'): 5e-4,
}
DISPATCH = 2.5e-4
# The simulated driver's figures of the profile below: idle lane, and every core busy.
DRIVER_FIGURES = {
  'driver': 1e-4,
  'driver_latency': 3e-4,
  'driver_loaded': 4e-4,
  'driver_latency_loaded': 1.2e-3,
  'driver_loaded_lanes': 2.0,
}


def _ddg_config(data_dir, **fields):
  config = ddg_config.get_config('smoke')
  config.data_dir = data_dir
  config.update_from_flattened_dict(
    {
      'stages': 2,
      'train_steps': STEPS,
      'eval_every': STEPS,
      'placement.stage_to_device': (0, 0),
      **fields,
    }
  )
  return config


@pytest.fixture(scope='module')
def ddg_profile(data_dir, tmp_path_factory):
  """A profile of the DDG smoke config with the hand-chosen costs above."""
  config = _ddg_config(data_dir)
  dataset = data_lib.load(config.dataset, data_dir)
  model = build_model(config, dataset)
  table, batch = profile_command.measure_table(
    config, model, lambda n: next(dataset.train_batches(n, seed=0)), warmup=1, reps=1
  )
  assert set(table.costs) == set(COSTS)
  profile = task_timing.make_profile(
    model,
    batch,
    profile_lookup.optimizer_id(dict(config.optimizer)),
    [dataclasses.replace(table, costs=COSTS, spread={})],
    warmup=1,
    reps=1,
    dispatch={
      'jax_call': 1e-6,
      'real': 1e-5,
      'processes': DISPATCH,
      'processes_cpu': 3 * DISPATCH,
      **DRIVER_FIGURES,
    },
  )
  path = str(tmp_path_factory.mktemp('profile') / 'ddg.json')
  profiles.save(profile, path)
  return path


# Host profiles: none; the in-process executor's; the process executor's on a host with a
# core to spare beside the two stages (its idle figures) and on one whose cores the stages
# take (its loaded ones). Dispatch per task of each; the process executor's driver free.
HOSTS = {
  'none': (None, 0.0),
  'in_process': (('in_process', 64, {'dispatch': DISPATCH}), DISPATCH),
  'processes idle': (('processes', 64, {'dispatch': DISPATCH, 'dispatch_loaded': 9.0}), DISPATCH),
  'processes loaded': (
    ('processes', 2, {'dispatch': 9.0, 'dispatch_loaded': 3 * DISPATCH}),
    3 * DISPATCH,
  ),
}


@pytest.mark.parametrize('host', HOSTS)
def test_ddg_on_one_device_takes_every_task_plus_its_dispatch(
  host, ddg_profile, data_dir, tmp_path
):
  given, dispatch = HOSTS[host]
  path = None if given is None else host_file(tmp_path, given[0], cores=given[1], **given[2])
  config = _ddg_config(data_dir, **{'cost.profile': ddg_profile, 'cost.host': path})
  summary = training.train_and_evaluate(config, str(tmp_path / 'run'), show_progress=False)
  tasks = 6 * STEPS - 2  # stage 0's last backward and update are never run (delay 1)
  total = STEPS * sum(COSTS.values()) - COSTS[(0, 'backward')] - COSTS[(0, 'update')]
  assert summary['sim_time'] == pytest.approx(total + tasks * dispatch, rel=1e-12)


def test_cost_model_reads_the_host_profiles_dispatch(ddg_profile, data_dir, tmp_path):
  path = host_file(tmp_path, 'threads', dispatch=1e-5)
  shared = shared_settings(
    _ddg_config(data_dir, **{'cost.profile': ddg_profile, 'cost.host': path})
  )
  host = clocks.simulated_host(shared, 2)
  assert clocks.cost_model(shared, COSTS, host=host).dispatch == 1e-5
  assert not host.run_ahead and not host.copies_on_sender and host.link is None


@pytest.mark.parametrize('cores, pair', [(64, 'idle'), (2, 'loaded'), (1, 'loaded')])
def test_the_host_gives_the_driver_its_idle_or_loaded_figures(
  cores, pair, ddg_profile, data_dir, tmp_path
):
  """The process executor's host profile gives the run the driver figures measured with an
  idle lane where its two lanes leave the host a core, else those measured with every core
  busy: the same run as a host whose idle figures are that pair; the other pair differs."""

  def final(workdir, cores, **figures):
    path = host_file(tmp_path, cores=cores, **figures)
    config = _ddg_config(data_dir, **{'cost.profile': ddg_profile, 'cost.host': path})
    summary = training.train_and_evaluate(config, str(tmp_path / workdir), show_progress=False)
    return {k: v for k, v in summary['final'].items() if k != 'wall_time'}

  both = {name: DRIVER_FIGURES[name] for name in DRIVER_FIGURES if name != 'driver_loaded_lanes'}
  read = final('read', cores, **both)
  suffix = '_loaded' if pair == 'loaded' else ''
  driver, latency = DRIVER_FIGURES['driver' + suffix], DRIVER_FIGURES['driver_latency' + suffix]
  assert read == final('given', 64, driver=driver, driver_latency=latency)
  other = '' if pair == 'loaded' else '_loaded'
  other_figures = {'driver': DRIVER_FIGURES['driver' + other]}
  other_figures['driver_latency'] = DRIVER_FIGURES['driver_latency' + other]
  assert final('other', 64, **other_figures)['sim_time'] != read['sim_time']


def test_placed_lanes_on_one_core_leave_the_host_a_core(ddg_profile, data_dir, tmp_path):
  """Two lanes placed on core 0 of a 2-core host leave it core 1: the idle figures."""
  config = _ddg_config(data_dir, **{'cost.profile': ddg_profile})
  config.placement.stage_to_device = None
  config.placement.lanes = 'stage0@cores=0; stage1@cores=0'
  config.cost.host = host_file(tmp_path, cores=2, dispatch=1.0, dispatch_loaded=2.0)
  assert clocks.simulated_host(shared_settings(config), 2).dispatch == 1.0
  config.placement.lanes = 'stage0@cores=0; stage1@cores=1'
  assert clocks.simulated_host(shared_settings(config), 2).dispatch == 2.0


# --- links and shared hardware ------------------------------------------------------------------
def _two_senders(shares):
  """Lanes a and b (hardware `shares[0]`, `shares[1]`) each send one message to lane c at
  t = 0; the transfers take 1 s; c receives both. Returns the transfers' (start, end)."""
  cluster = Cluster()
  a = cluster.add_lane('a', shares=shares[0])
  b = cluster.add_lane('b', shares=shares[1])
  c = cluster.add_lane('c')
  inbox = cluster.channel('inbox', c)

  def sender(tag):
    yield Send(inbox, tag)

  def receiver():
    yield Get(inbox)
    yield Get(inbox)

  processes = [
    Process('a', a, sender('a')),
    Process('b', b, sender('b')),
    Process('c', c, receiver()),
  ]
  timeline = VirtualExecutor(CostModel({}, link_latency=1.0)).run(cluster, processes)
  return sorted((r.start, r.end) for r in timeline.tasks(kind='transfer'))


def test_transfers_from_one_device_to_another_share_the_link_fifo():
  assert _two_senders(('gpu0', 'gpu0')) == [(0.0, 1.0), (1.0, 2.0)]


def test_transfers_between_different_device_pairs_do_not_contend():
  assert _two_senders((None, None)) == [(0.0, 1.0), (0.0, 1.0)]
  assert _two_senders(('gpu0', 'gpu1')) == [(0.0, 1.0), (0.0, 1.0)]


def test_a_send_is_priced_by_its_bytes_and_copied_only_when_not_on_the_device():
  """Lane a sends lane b (both on cpu:0) an array already there, then the same values
  as host numpy: 1000 float32 each, 4000 B at 1000 B/s + 0.5 s = 4.5 s per transfer.
  The first arrives as the very same array (nothing to copy); the second as a copy
  committed to the device, equal to what was sent."""
  device = jax.devices()[0]
  on_device = jax.device_put(np.arange(1000, dtype=np.float32), device)
  on_host = np.arange(1000, dtype=np.float32)
  cluster = Cluster()
  a, b = cluster.add_lane('a', device), cluster.add_lane('b', device)
  inbox = cluster.channel('inbox', b)
  received = []

  def sender():
    yield Send(inbox, {'x': on_device})
    yield Send(inbox, {'x': on_host})

  def receiver():
    received.append((yield Get(inbox)))
    received.append((yield Get(inbox)))

  cost = CostModel({}, link_latency=0.5, link_bandwidth=1000.0)
  timeline = VirtualExecutor(cost).run(
    cluster, [Process('a', a, sender()), Process('b', b, receiver())]
  )
  assert sorted((r.start, r.end) for r in timeline.tasks(kind='transfer')) == [
    (0.0, 4.5),
    (4.5, 9.0),
  ]
  assert received[0]['x'] is on_device
  copy = received[1]['x']
  assert isinstance(copy, jax.Array) and copy.committed and copy.devices() == {device}
  np.testing.assert_array_equal(np.asarray(copy), on_host)


def test_a_message_pays_link_per_array_for_each_array_beyond_its_first():
  """Lane a sends lane b one array, then three (the process executor exports and takes
  in a message array by array): 0.5 s latency, 0.25 s per array beyond the first, bytes
  at 4000 B/s. One array of 1000 float32: 0.5 + 4000 / 4000 = 1.5 s. Three arrays of
  1000 + 500 + 500 float32: 0.5 + 2 × 0.25 + 8000 / 4000 = 3.0 s, after the first."""
  cluster = Cluster()
  a, b = cluster.add_lane('a'), cluster.add_lane('b')
  inbox = cluster.channel('inbox', b)

  def sender():
    yield Send(inbox, np.zeros(1000, np.float32))
    yield Send(
      inbox, (np.zeros(1000, np.float32), np.zeros(500, np.float32), np.zeros(500, np.float32))
    )

  def receiver():
    yield Get(inbox)
    yield Get(inbox)

  cost = CostModel({}, link_latency=0.5, link_bandwidth=4000.0, link_per_array=0.25)
  timeline = VirtualExecutor(cost).run(
    cluster, [Process('a', a, sender()), Process('b', b, receiver())]
  )
  assert sorted((r.start, r.end) for r in timeline.tasks(kind='transfer')) == [
    (0.0, 1.5),
    (1.5, 4.5),
  ]


def test_the_process_hosts_link_per_array_reaches_the_cost_model(tmp_path):
  """A host profile's `link_per_array` prices the run's links with its latency and
  bandwidth; `cost.link_latency` given describes other links, which it does not."""
  profile = host_file(tmp_path, link_latency=0.002, link_bandwidth=1e9, link_per_array=6e-5)
  config = ddg_config.get_config()
  config.clock, config.cost.host = 'virtual', profile
  shared = shared_settings(config)
  model = clocks.cost_model(shared, {'forward': 1.0}, host=clocks.simulated_host(shared, 2))
  assert (model.link_latency, model.link_bandwidth, model.link_per_array) == (0.002, 1e9, 6e-5)
  assert model.transfer_time(1000, arrays=34) == 0.002 + 33 * 6e-5 + 1000 / 1e9
  config.cost.link_latency = 0.001
  model = clocks.cost_model(
    shared_settings(config), {'forward': 1.0}, host=clocks.simulated_host(shared, 2)
  )
  assert (model.link_latency, model.link_per_array) == (0.001, 0.0)


def test_the_process_hosts_take_in_reaches_the_cost_model_on_any_link(tmp_path):
  """A host profile's `take_in_*` figures price a lane taking in a message, with the
  host's links and with `cost.link_latency` describing others alike (the take-in is the
  receiving lane process's, not the link's); a profile without them (an older jaxsgd's)
  is refused in one line saying how to measure it again."""
  figures = dict(take_in_latency=5e-4, take_in_bandwidth=1e10, take_in_per_array=7e-5)
  figures.update(export_latency=3e-4, export_bandwidth=4e9, export_per_array=2e-5)
  config = ddg_config.get_config()
  config.clock, config.cost.host = 'virtual', host_file(tmp_path, **figures)
  for link_latency in (0.0, 0.001):
    config.cost.link_latency = link_latency
    shared = shared_settings(config)
    model = clocks.cost_model(shared, {'forward': 1.0}, host=clocks.simulated_host(shared, 2))
    assert model.take_in == (5e-4, 1e10, 7e-5)
    assert model.take_in_time(2000, arrays=34) == 5e-4 + 33 * 7e-5 + 2000 / 1e10
    # The sender's export thread's part of a copy (the time it holds its interpreter).
    assert model.export == (3e-4, 4e9, 2e-5)
    assert model.export_time(2000, arrays=34) == 3e-4 + 33 * 2e-5 + 2000 / 4e9
  # Without the figures (no host profile): a copy holds its sender for the whole of it.
  plain = CostModel({}, link_latency=0.5, link_bandwidth=1000.0, link_per_array=0.25)
  assert plain.export_time(2000, arrays=3) == plain.transfer_time(2000, arrays=3) == 3.0
  old = json.loads(open(config.cost.host).read())
  del old['take_in_per_array']
  with open(config.cost.host, 'w') as f:
    json.dump(old, f)
  with pytest.raises(ValueError, match=r'no take_in_per_array \(written by an older jaxsgd\?\)'):
    shared_settings(config)
  for bad in ((-1e-3, 1e9, 0.0), (0.0, 0.0, 0.0), (0.0, 1e9, float('inf'))):
    with pytest.raises(ValueError, match=r'^take_in: \(latency s >= 0, bandwidth B/s > 0'):
      CostModel({}, take_in=bad)
    with pytest.raises(ValueError, match=r'^export: \(latency s >= 0, bandwidth B/s > 0'):
      CostModel({}, export=bad)


def test_lanes_placed_on_one_core_run_one_task_at_a_time():
  """`lane_hardware` (from `placement.lanes`): worker0 and the server on core 0, worker1
  on core 1; each lane runs two 1 s tasks from t = 0."""
  cluster = Cluster()
  names = ('server (cpu:0)', 'worker 0 (cpu:0)', 'worker 1 (cpu:0)')
  lanes = [cluster.add_lane(name) for name in names]
  processes = [Process(n, lane, _tasks(2)) for n, lane in zip(names, lanes)]
  executor = VirtualExecutor(
    CostModel({'forward': 1.0}),
    lane_hardware={'server': 'core 0', 'worker0': 'core 0', 'worker1': 'core 1'},
  )
  spans = _spans(executor.run(cluster, processes))
  on_core0 = sorted((s, e) for lane, s, e in spans if lane in (0, 1))
  assert on_core0 == [(0.0, 1.0), (1.0, 2.0), (2.0, 3.0), (3.0, 4.0)]
  assert sorted((s, e) for lane, s, e in spans if lane == 2) == [(0.0, 1.0), (1.0, 2.0)]


def test_placement_lanes_map_lanes_on_the_same_cores_to_one_key(data_dir):
  config = _ddg_config(data_dir)
  config.placement.stage_to_device = None
  config.placement.lanes = 'server@cores=0; worker0@cores=0; worker1@cores=1; g@gpu=1; free'
  hardware = clocks.lane_hardware(shared_settings(config))
  assert hardware['server'] == hardware['worker0'] != hardware['worker1']
  assert len({hardware['g'], hardware['worker1'], hardware['server']}) == 3
  assert 'free' not in hardware  # pinned to nothing: its own hardware, shared with nothing


def _send(sender_goes_on: bool, receiver_first: str | None, export=None, **executor_options):
  """Lane a: a 1 s forward, a Send to lane b (a 1 s copy), and another 1 s forward if
  `sender_goes_on`; b runs a `receiver_first` task first (a 2 s backward) if given, then
  waits for the message and runs a 1 s forward (`export`: `CostModel.export`). Returns
  the (kind, lane, start, end) of every task."""
  cluster = Cluster()
  a, b = cluster.add_lane('a (cpu:0)'), cluster.add_lane('b (cpu:0)')
  inbox = cluster.channel('inbox', b)

  def sender():
    yield Compute(lambda: None, kind='forward', stage=0)
    yield Send(inbox, 'x')
    if sender_goes_on:
      yield Compute(lambda: None, kind='forward', stage=0)

  def receiver():
    if receiver_first is not None:
      yield Compute(lambda: None, kind=receiver_first, stage=0)
    yield Get(inbox)
    yield Compute(lambda: None, kind='forward', stage=0)

  costs = CostModel({'forward': 1.0, 'backward': 2.0}, link_latency=1.0, export=export)
  executor = virtual.make(costs, **executor_options)
  timeline = executor.run(cluster, [Process('a', a, sender()), Process('b', b, receiver())])
  return sorted((r.kind, r.lane, r.start, r.end) for r in timeline.records)


def _send_between_tasks(copies_on_sender, **executor_options):
  """Lane a: a 1 s task, a Send to lane b (1 s transfer), another 1 s task; b waits for
  the message, then runs a 1 s task (`_send`)."""
  return _send(True, None, copies_on_sender=copies_on_sender, **executor_options)


def test_a_copy_on_a_link_overlaps_the_senders_next_task():
  assert _send_between_tasks(False) == [
    ('forward', 0, 0.0, 1.0),
    ('forward', 0, 1.0, 2.0),  # the sender goes on at once
    ('forward', 1, 2.0, 3.0),
    ('transfer', 2, 1.0, 2.0),
  ]


def test_a_copy_made_by_the_sender_overlaps_its_next_task():
  """A copy made by the sender (the process executor: a lane process exports in a thread
  of its own) does not hold up the sender's next task: a lane not placed on a core shares
  no hardware with it. (It ran between them, on the lane's own queue: ASGD's server lane
  was busy 99 % of a run on the virtual clock against 77 % on emulated lanes, its update
  waiting behind each parameter copy.)"""
  assert _send_between_tasks(True) == _send_between_tasks(False)


def test_a_senders_copies_run_one_at_a_time():
  """Lane a sends x to b and y to c after its 1 s task: on links of their own both copies
  run 1 → 2; made by the sender (one export thread), the second runs 2 → 3, and c's
  task after it."""
  cluster = Cluster()
  a, b, c = (cluster.add_lane(f'{name} (cpu:0)') for name in 'abc')
  to_b, to_c = cluster.channel('to b', b), cluster.channel('to c', c)

  def sender():
    yield Compute(lambda: None, kind='forward', stage=0)
    yield Send(to_b, 'x')
    yield Send(to_c, 'y')

  def receiver(channel):
    yield Get(channel)
    yield Compute(lambda: None, kind='forward', stage=0)

  spans = {}
  for on_sender in (False, True):
    executor = virtual.make(
      CostModel({'forward': 1.0}, link_latency=1.0), copies_on_sender=on_sender
    )
    processes = [Process('a', a, sender()), Process('b', b, receiver(to_b))]
    processes.append(Process('c', c, receiver(to_c)))
    timeline = executor.run(cluster, processes)
    spans[on_sender] = sorted((r.kind, r.start, r.end) for r in timeline.records)
  assert (
    spans[False]
    == [('forward', 0, 1), ('forward', 2, 3), ('forward', 2, 3)] + [('transfer', 1, 2)] * 2
  )
  assert spans[True] == [('forward', 0, 1), ('forward', 2, 3), ('forward', 3, 4)] + [
    ('transfer', 1, 2),
    ('transfer', 2, 3),
  ]


# --- time-slicing (lane processes placed on one core) ---------------------------------------
def _on_one_core(programs, time_sliced=True, core_shares=None, **lanes):
  """Lanes `a` and `b` placed on core 0 (and any in `lanes`), each running its program
  (`core_shares`: the time-sliced executor's); returns `{lane name: [(start, end), ...]}`."""
  cluster = Cluster()
  names = list(programs)
  lane_ids = {name: cluster.add_lane(f'{name} (cpu:0)') for name in names}
  processes = [Process(name, lane_ids[name], programs[name]) for name in names]
  executor = virtual.make(
    CostModel({'forward': 1.0, 'update': 0.25}),
    lane_hardware={'a': 'core 0', 'b': 'core 0', **lanes},
    time_sliced=time_sliced,
    core_shares=core_shares,
  )
  timeline = executor.run(cluster, processes)
  by_lane = {lane_ids[n]: n for n in names}
  spans = {name: [] for name in names}
  for record in timeline.records:
    spans[by_lane[record.lane]].append((record.start, record.end))
  return spans


def test_two_lanes_time_sliced_on_one_core_each_run_at_half_speed():
  """Two 1 s tasks started together on one core: each progresses at 1/2, both end at 2 s
  (one FIFO: the first at 1 s, the second at 2 s)."""
  spans = _on_one_core({'a': _tasks(1), 'b': _tasks(1)})
  assert spans == {'a': [(0.0, 2.0)], 'b': [(0.0, 2.0)]}
  fifo = _on_one_core({'a': _tasks(1), 'b': _tasks(1)}, time_sliced=False)
  assert sorted(fifo.values()) == [[(0.0, 1.0)], [(1.0, 2.0)]]


def test_a_short_task_is_not_held_behind_a_long_one_on_a_time_sliced_core():
  """a: two 1 s forwards; b: one 0.25 s update (a parameter server's, say), both from 0.
  They share the core from 0: b's 0.25 s of work ends at
  0.5 s (half speed), a's first forward has 0.75 s left at 0.5 s and ends at 1.25 s; its
  second runs alone, 1.25-2.25 s. FIFO: b waits for a's first forward (1.0-1.25 s)."""
  spans = _on_one_core({'a': _tasks(2), 'b': _tasks(1, kind='update')})
  assert spans == {'a': [(0.0, 1.25), (1.25, 2.25)], 'b': [(0.0, 0.5)]}
  fifo = _on_one_core({'a': _tasks(2), 'b': _tasks(1, kind='update')}, time_sliced=False)
  assert fifo == {'a': [(0.0, 1.0), (1.25, 2.25)], 'b': [(1.0, 1.25)]}


def test_a_lane_runs_its_own_tasks_one_at_a_time_on_a_time_sliced_core():
  """a: two 1 s tasks and b: one 1 s task, on one core. From 0 to 2 s, a's first and
  b's task share it (both end at 2 s); a's second then runs alone, 2-3 s. A lane on a
  core of its own (c, core 1) is not slowed."""
  spans = _on_one_core({'a': _tasks(2), 'b': _tasks(1), 'c': _tasks(1)}, c='core 1')
  assert spans == {'a': [(0.0, 2.0), (2.0, 3.0)], 'b': [(0.0, 2.0)], 'c': [(0.0, 1.0)]}


def test_time_sliced_shares_give_the_same_total_work_as_one_fifo():
  """Three lanes on one core, 1, 2 and 3 tasks of 1 s: 6 s of work ends at 6 s either way;
  time-sliced, the lane with one task ends first, at 3 s (three shares of 1/3)."""
  programs = lambda: {'a': _tasks(1), 'b': _tasks(2), 'd': _tasks(3)}  # noqa: E731
  sliced = _on_one_core(programs(), d='core 0')
  fifo = _on_one_core(programs(), time_sliced=False, d='core 0')
  assert max(e for spans in sliced.values() for _, e in spans) == 6.0
  assert max(e for spans in fifo.values() for _, e in spans) == 6.0
  assert sliced == {
    'a': [(0.0, 3.0)],
    'b': [(0.0, 3.0), (3.0, 5.0)],
    'd': [(0.0, 3.0), (3.0, 5.0), (5.0, 6.0)],
  }


def test_the_hosts_processes_take_half_of_each_core_while_every_core_has_a_task():
  """Cores 0 and 1 give their lanes half of themselves while both run tasks, the whole
  core otherwise (the host's processes then run on the idle one). From 0, a: two 1 s
  forwards and b: a 0.25 s update on core 0, c: a 1 s forward on core 1. Both busy: a and
  b progress at 0.5 / 2 = 0.25 per second, b ends at 1 s (a has 0.75 left); c at 0.5 per
  second. From 1 s a and c each at 0.5: c ends at 2 s, a has 0.25 left; core 1 idle, a
  runs at 1: ends at 2.25 s; its second alone, 1 s: 3.25 s."""
  programs = {'a': _tasks(2), 'b': _tasks(1, kind='update'), 'c': _tasks(1)}
  halves = {'core 0': 0.5, 'core 1': 0.5}
  spans = _on_one_core(programs, core_shares=halves, c='core 1')
  assert spans == {'a': [(0.0, 2.25), (2.25, 3.25)], 'b': [(0.0, 1.0)], 'c': [(0.0, 2.0)]}
  with pytest.raises(
    ValueError, match=r"^core_shares: a share of a core in \(0, 1\], got 0 for 'core 0'"
  ):
    _on_one_core({'a': _tasks(1)}, core_shares={'core 0': 0})


def test_a_core_that_starts_computing_takes_the_share_from_a_task_half_done():
  """Shares 0.5 while both cores compute. a: a 1 s forward on core 0; c: a 0.25 s update on
  core 1, a 0.25 s update on lane w (on no core), then a 1 s forward on core 1. From 0
  both compute at 0.5: c's update ends at 0.5 s, a has 0.75 left; core 1 idle until
  0.75 s, a at 1: 0.5 left; from 0.75 s both at 0.5: a ends at 1.75 s, c's forward has
  0.5 left, then alone at 1: ends at 2.25 s."""
  cluster = Cluster()
  a, c, w = (cluster.add_lane(f'{name} (cpu:0)') for name in 'acw')

  def c_program():
    yield Compute(lambda: None, kind='update')
    yield Compute(lambda: None, kind='update', lane=w)
    yield Compute(lambda: None, kind='forward')

  executor = virtual.make(
    CostModel({'forward': 1.0, 'update': 0.25}),
    lane_hardware={'a': 'core 0', 'c': 'core 1'},
    time_sliced=True,
    core_shares={'core 0': 0.5, 'core 1': 0.5},
  )
  records = executor.run(
    cluster, [Process('a', a, _tasks(1)), Process('c', c, c_program())]
  ).records
  spans = sorted((r.lane, r.kind, r.start, r.end) for r in records)
  assert spans == [
    (a, 'forward', 0.0, 1.75),
    (c, 'forward', 0.75, 2.25),
    (c, 'update', 0.0, 0.5),
    (w, 'update', 0.5, 0.75),
  ]


def test_lanes_on_every_core_lose_the_hosts_upkeep_to_it(ddg_profile, data_dir, tmp_path):
  """A 2-core host whose processes take 0.5 cores with no task (`upkeep`): DDG's two
  stages placed on its two cores get 1 - 0.5 / 2 = 0.75 of each while both compute, so
  the run takes longer than on a host that takes nothing, by less than 1 / 0.75 (stage 0
  waits for stage 1 at times); placed on one core, they leave the host core 1: the same
  run as on a host that takes nothing."""
  costs = {'forward': 3e-3, 'backward': 5e-3, 'update': 1e-3}

  def run(workdir, lanes, upkeep):
    config = _ddg_config(data_dir, **{'cost.calibrate': False})
    config.placement.stage_to_device = None
    config.placement.lanes = lanes
    config.cost.compute = costs
    config.cost.host = host_file(tmp_path, cores=2, upkeep=upkeep)
    shared = shared_settings(config)
    share = clocks.simulated_host(shared, 2).core_share
    two_cores = lanes.endswith('cores=1')
    assert share == (1 - upkeep / 2 if two_cores else 1.0)
    both = {'local cores 0': share, 'local cores 1': share} if two_cores and upkeep else {}
    assert clocks.core_shares(shared, share) == both
    return training.train_and_evaluate(config, str(tmp_path / workdir), show_progress=False)

  two_cores = 'stage0@cores=0; stage1@cores=1'
  free = run('free', two_cores, 0.0)['sim_time']
  assert free < run('taken', two_cores, 0.5)['sim_time'] < free / 0.75
  one_core = 'stage0@cores=0; stage1@cores=0'
  assert run('one', one_core, 0.5)['sim_time'] == run('one free', one_core, 0.0)['sim_time']
  # A lane pinned to nothing has no core to watch; two hosts, two upkeeps: not charged.
  for lanes in ('stage0@cores=0; stage1', 'stage0@cores=0; stage1@host=10.0.0.2@cores=1'):
    config = _ddg_config(data_dir, **{'placement.stage_to_device': None, 'placement.lanes': lanes})
    assert clocks.core_shares(shared_settings(config), 0.75) == {}


def test_the_old_host_settings_are_refused_naming_their_replacement():
  for field in ('sharing', 'copies', 'statistic', 'driver_from', 'driver', 'driver_latency'):
    with pytest.raises(ValueError, match=rf'^cost.{field}: renamed; use cost.host \(a host'):
      cost_settings({field: 'x'}, clock='virtual')


def test_a_copy_on_a_time_sliced_core_shares_it_with_the_senders_next_task():
  """Copies on the sender, lanes time-sliced on a core (the process executor, whose
  lanes export in a thread of their own, `LaneRuntime.serve`): lane a (core 0)
  runs a 1 s task, sends a 1 s copy to b (core 1), runs another 1 s task. From 1 s the
  copy and a's second task share core 0 at half speed each: both end at 3 s, and b's
  task runs 3-4 s. (One FIFO on the sender: copy 1-2 s, a's task 2-3 s, b's 2-3 s.)"""
  spans = _send_between_tasks(True, lane_hardware={'a': 'core 0', 'b': 'core 1'}, time_sliced=True)
  assert spans == [
    ('forward', 0, 0.0, 1.0),
    ('forward', 0, 1.0, 3.0),
    ('forward', 1, 3.0, 4.0),
    ('transfer', 2, 1.0, 3.0),
  ]


def _copy_to_a_busy_lane(lane_hardware, **executor_options):
  """a runs a 1 s task and sends b a 1 s copy; b runs a 2 s task from 0, then waits for
  the message and runs a 1 s task (`_send`), lanes time-sliced on `lane_hardware`."""
  return _send(False, 'backward', lane_hardware=lane_hardware, time_sliced=True, **executor_options)


@pytest.mark.parametrize('sender_placed', [True, False])
def test_a_copy_takes_the_receivers_core_for_its_seconds_too(sender_placed):
  """Lane processes (copies on the sender, lanes time-sliced): a (core 0, or on none)
  runs a 1 s task and sends b (core 1) a 1 s copy; b runs a 2 s task from 0, then waits
  for the message and runs a 1 s task. From 1 s the copy's reading (b's reader thread)
  and b's task share core 1 at half speed: b's task, 1 s of work left, and the read, 1 s,
  both end at 3 s. The sending part runs 1-2 s, alone on core 0 or on no core; the copy
  ends at 3 s, when both ends are done, and b's second task runs 3-4 s. (A link of its
  own, charging neither core: b's first task 0-2 s, the copy 1-2 s, b's second 2-3 s.)"""
  placed = {'a': 'core 0', 'b': 'core 1'} if sender_placed else {'b': 'core 1'}
  assert _copy_to_a_busy_lane(placed, copies_on_sender=True) == [
    ('backward', 1, 0.0, 3.0),
    ('forward', 0, 0.0, 1.0),
    ('forward', 1, 3.0, 4.0),
    ('transfer', 2, 1.0, 3.0),
  ]
  assert _copy_to_a_busy_lane(placed, copies_on_sender=False) == [
    ('backward', 1, 0.0, 2.0),
    ('forward', 0, 0.0, 1.0),
    ('forward', 1, 2.0, 3.0),
    ('transfer', 2, 1.0, 2.0),
  ]


@pytest.mark.parametrize('sender_placed', [True, False])
def test_a_copy_takes_the_receivers_core_on_the_run_ahead_schedule_too(sender_placed):
  """The same on the process executor's schedule (`run_ahead=4`): a goes on at its
  task's dispatch, and the message (no task's result) exists at once, so the copy starts
  at 0. Its reading shares core 1 with b's task from 0: the read's 1 s ends at 2 s, b's
  task has 1 s left then and ends at 3 s. Its sending part shares core 0 with a's task
  (both end at 2 s), or runs 0-1 s on no core (a's task 0-1 s); either way the copy ends
  at 2 s, and b's second task runs 3-4 s, after its first."""
  placed = {'a': 'core 0', 'b': 'core 1'} if sender_placed else {'b': 'core 1'}
  a_task_ends = 2.0 if sender_placed else 1.0
  assert _copy_to_a_busy_lane(placed, copies_on_sender=True, run_ahead=4) == [
    ('backward', 1, 0.0, 3.0),
    ('forward', 0, 0.0, a_task_ends),
    ('forward', 1, 3.0, 4.0),
    ('transfer', 2, 0.0, 2.0),
  ]


@pytest.mark.parametrize('sender_placed', [True, False])
def test_a_copy_that_lets_go_after_its_export_puts_only_that_on_the_senders_core(sender_placed):
  """As above, with the host profile's export figures (`cost.export`: 0.25 s): the
  sending part is the export alone. Placed, it shares core 0 with a's task from 0 at half
  speed: its 0.25 s end at 0.5 s, a's task has 0.75 s left then and ends at 1.25 s (2 s
  above, where the sending part was the whole copy); on no core a's task runs 0-1 s. The
  reading part is the whole copy's as before: the copy ends at 2 s, b's tasks at 3 and
  4 s."""
  placed = {'a': 'core 0', 'b': 'core 1'} if sender_placed else {'b': 'core 1'}
  export = (0.25, float('inf'), 0.0)
  assert _copy_to_a_busy_lane(placed, copies_on_sender=True, run_ahead=4, export=export) == [
    ('backward', 1, 0.0, 3.0),
    ('forward', 0, 0.0, 1.25 if sender_placed else 1.0),
    ('forward', 1, 3.0, 4.0),
    ('transfer', 2, 0.0, 2.0),
  ]


@pytest.mark.parametrize('sender_placed', [True, False])
def test_a_copy_in_memory_both_ends_share_takes_none_of_the_receivers_core(sender_placed):
  """As `test_a_copy_takes_the_receivers_core_for_its_seconds_too`, the copy's bytes in
  memory both lane processes share (`receiver_reads=False`: the host path within a host,
  `wire.Arena`): b's reader reads only the message naming them, so b's 2 s task runs
  0-2 s alone; the sending part runs 1-2 s (alone on core 0, or on no core), the copy ends
  at 2 s, and b's second task runs 2-3 s."""
  placed = {'a': 'core 0', 'b': 'core 1'} if sender_placed else {'b': 'core 1'}
  assert _copy_to_a_busy_lane(placed, copies_on_sender=True, receiver_reads=False) == [
    ('backward', 1, 0.0, 2.0),
    ('forward', 0, 0.0, 1.0),
    ('forward', 1, 2.0, 3.0),
    ('transfer', 2, 1.0, 2.0),
  ]


def test_a_copy_in_shared_memory_between_two_lanes_of_one_core_takes_it_for_the_sender_only():
  """a and b on core 0, the copy's bytes in shared memory: b's 2 s task and a's 1 s task
  share the core from 0 (a's ends at 2 s, b's has 1 s left); then a's 1 s copy, its
  sending part alone, shares it with b's task at 1/2 each: both end at 4 s (5 s where b's
  reader read it too); b's second task runs 4-5 s."""
  placed = {'a': 'core 0', 'b': 'core 0'}
  assert _copy_to_a_busy_lane(placed, copies_on_sender=True, receiver_reads=False) == [
    ('backward', 1, 0.0, 4.0),
    ('forward', 0, 0.0, 2.0),
    ('forward', 1, 4.0, 5.0),
    ('transfer', 2, 2.0, 4.0),
  ]


def test_a_host_profile_names_the_path_its_links_were_measured_on():
  """`moves`: `host` (memory shared within the host: the receiver reads no copy) or
  `socket` (it does); a profile written before the field was measured over sockets; any
  other value is refused in one line."""
  from jaxsgd.scheduler import host

  figures = {name: 1.0 for name in host.FIGURES['processes'] if name != 'upkeep'}
  shared = host.make('processes', {**figures, 'upkeep': 0.0}, cores=2, moves='host')
  assert host.to_json(shared)['moves'] == 'host'
  assert not host.simulated(shared, 2).receiver_reads
  over_sockets = host.make('processes', {**figures, 'upkeep': 0.0}, cores=2, moves='socket')
  assert host.simulated(over_sockets, 2).receiver_reads
  older = {k: v for k, v in host.to_json(shared).items() if k != 'moves'}
  assert host.from_json(older, 'f').moves == 'socket'
  with pytest.raises(
    host.HostProfileError, match=r"^f: moves must be one of host, socket, got 'shm'\.$"
  ):
    host.from_json({**host.to_json(shared), 'moves': 'shm'}, 'f')


def test_a_copy_between_two_lanes_of_one_core_takes_it_for_both_ends():
  """a and b on core 0, copies on the sender: b's 2 s task, a's 1 s task from 0 (half
  speed each: a's ends at 2 s, b's has 1 s left), then a's 1 s copy to b: its sending
  part, its reading part and b's task share the core at 1/3 each from 2 s, all three
  ending at 5 s; b's second task runs 5-6 s."""
  assert _copy_to_a_busy_lane({'a': 'core 0', 'b': 'core 0'}, copies_on_sender=True) == [
    ('backward', 1, 0.0, 5.0),
    ('forward', 0, 0.0, 2.0),
    ('forward', 1, 5.0, 6.0),
    ('transfer', 2, 2.0, 5.0),
  ]


def test_the_driver_figures_are_the_median_over_repeated_chains(monkeypatch):
  """Three chains of 10 tasks (one lane), whose tasks are heard 0.2, 0.9 and 0.3 ms after
  their ends (the first of each left out: warm-up 10), and whose driver thread spent 2, 8
  and 4 µs of CPU (0.1, 0.4, 0.2 µs per event, two a task): per chain 0.1999, 0.8996 and
  0.2998 ms of latency; the figures are the medians, 0.2 µs per event and 0.2998 ms."""
  from jaxsgd.scheduler import lane_timing
  from jaxsgd.scheduler.timeline import TaskRecord

  delays, cpu = iter([2e-4, 9e-4, 3e-4]), iter([0.0, 2e-6, 10e-6, 18e-6, 20e-6, 24e-6])

  def chains(executor, **kwargs):
    heard = next(delays)
    records = [TaskRecord(0, 'dispatch', i, i + 0.5, heard=i + 0.5 + heard) for i in range(10)]
    return type('Timeline', (), {'records': records})()

  monkeypatch.setattr(lane_timing, '_run_chains', chains)
  # (a stand-in for the module's `time`: the real one's `thread_time` stays as it is)
  monkeypatch.setattr(lane_timing, 'time', type('Clock', (), {'thread_time': lambda: next(cpu)}))
  per_event, latency = lane_timing._driver_figures(None, lanes=('a',), tasks=10, repeats=3)
  assert per_event == pytest.approx(2e-7, rel=1e-9)
  assert latency == pytest.approx(3e-4 - 2e-7, rel=1e-9)
