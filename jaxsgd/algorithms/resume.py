"""Checkpoints of a scheduler run: the whole simulation, resumed exactly.

On the virtual clock the state is taken between any two events; on the in-process real
clock at a drained point: once every dispatched task has finished (one thread), or
once every worker thread has stopped between two ops (`scheduler.real`); on lane
processes once every dispatched task has finished and every copy landed
(`scheduler.process`, whose lanes' values are saved through their `Handle`s). All save
it in the same form.

    checkpoints = SimulationCheckpoints(run, executor, session, processes, streams, progress)
    resume = checkpoints.restore()        # None, or the executor's saved state (the
                                          # session's is loaded already)
    executor.run(session.cluster, processes, resume=resume)

A session (a policy's stores, counters and logs) provides `snapshot()` and `load(saved)`;
its processes are resumable (`scheduler.core.LoopState`). After every event in which
steps were reported (`progress()` grew) the run is asked to save (`Run.maybe_save`: due
every `checkpoint_every` steps, at the last step, or after SIGTERM); the state it saves
is `scheduler.snapshot.encode` of the session's and the executor's snapshots, taken
between two events. docs/checkpoints.md describes what is saved.
"""

from collections.abc import Callable, Sequence

from jaxsgd.scheduler import snapshot as snapshot_lib


class SimulationCheckpoints:
  """Saves and restores `session` run by the virtual `executor` (see the module docstring).

  Args:
    run: the `RunContext`.
    executor: a `VirtualExecutor` or a `RealExecutor` (threads or not).
    session: has `snapshot()`, `load(saved)`.
    processes: the session's processes, given to `executor.run`.
    streams: the data streams the session reads (positions saved by the run).
    progress: the last step reported to `run`.
  """

  def __init__(
    self,
    run,
    executor,
    session,
    processes: Sequence,
    streams: Sequence,
    progress: Callable[[], int],
  ):
    self.run, self.executor, self.session = run, executor, session
    self.processes, self.streams, self.progress = list(processes), list(streams), progress
    self.resumed_step: int | None = None
    self._checked = 0  # Steps asked about so far.
    executor.notes_vjps = True
    executor.between_events = self._between_events
    if hasattr(executor, 'on_sigterm') and run.preemption is not None:
      executor.on_sigterm = self._preempt  # lane processes: SIGTERM saves, then stops

  def _preempt(self) -> None:
    self.run.preemption.requested = True

  def restore(self) -> dict | None:
    """Loads the session's saved state and returns the executor's (None: start afresh)."""
    resumed = self.run.restore(None, self.streams)
    if resumed is None:
      return None
    self.resumed_step, state = resumed
    saved = snapshot_lib.decode(state, self.executor, self.session.cluster, self.processes)
    self.session.load(saved['session'])
    self._checked = self.resumed_step
    return saved['executor']

  def after_run(self) -> None:
    """Asks for a checkpoint of steps reported after the last event (the run's end)."""
    self._between_events()

  def _between_events(self) -> None:
    step = self.progress()
    if step > self._checked:
      steps, self._checked = step - self._checked, step
      self.run.maybe_save(step, self._state, self.streams, steps=steps)

  def _state(self) -> dict:
    executor = self.executor.snapshot()
    data = {'session': self.session.snapshot(), 'executor': executor}
    return snapshot_lib.encode(data, self.executor, [p for p, _, _ in executor['processes']])
