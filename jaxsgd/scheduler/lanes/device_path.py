"""The device path: a value moves lane to lane as device buffers, not as Python objects.

On the host path (wire.py) the source lane copies each leaf of a value out of its device
into a numpy array, the wire writes those arrays into a socket, and the receiving lane
puts them back on its device: on a GPU lane every move crosses host memory through
Python objects twice. On the device path the source *offers* the leaves where they are
(`jax.experimental.transfer`: its lane's transfer server keeps them until pulled) and the
wire carries only a small `Offer` — the server's address, a number and each leaf's shape
and dtype; the receiving lane *pulls* them straight into its own device through its own
transfer server. The message still goes over the wire, in its order, so everything the
lanes and the driver know of a copy (when it was ready, when it arrived, that it failed)
is the same on both paths; only where its bytes go differs.

Which path a move takes: the device path when both lanes have it on (`LaneSpec.moves`:
`device`, or `auto` on a lane whose device is not a CPU), the host path otherwise (within
a host through the memory the two processes share, unless either lane's `moves` is
`socket`: wire.py's `Arena`). A
leaf that is not a `jax.Array` on the source's device (a CPU lane's copy kept as the
host array it came in, an empty array) goes inline in the `Offer`, a numpy array as on
the host path (a PRNG key of JAX's typed key dtypes moves on neither path).

A source that dies before its offer is pulled fails the pull at once (its transfer
connection closes; `test_a_pull_from_a_source_that_died_fails_at_once`), and its wire
connection ends too: the receiving lane then takes the copy as lost with its source, as
on the host path (`LaneRuntime._read_lane`). The first pull from a source's
server is different: JAX waits for a server that is gone without bound, so that pull
waits in slices and gives up once `gone()` says the source's lane ended (`SourceGone`;
the reader asks whether its wire connection ended). A target that dies
before it pulls leaves that offer's buffers held by the source's server (one message per
lost lane). A target pulls every offer that reaches it, a copy freed before it came too
(then dropped), so that the source's server lets go of it.
"""

import itertools
import threading
import time
from typing import Any, NamedTuple

import numpy as np

MOVES = ('auto', 'device', 'host', 'socket')  # `LaneSpec.moves`
_GONE_CHECK_S = 0.1  # s between two looks at whether a source first pulled from is gone
_FIRST_PULL_POLL_S = 1e-4  # s between the first two looks at whether a first pull came
_FIRST_PULL_POLL_MAX_S = 2e-3  # ... and at most between two


class SourceGone(ConnectionError):
  """The source's lane ended before the first pull from its transfer server came."""


class Offer(NamedTuple):
  """What the wire carries of a value's leaves on the device path: pull `specs` (leaf
  index -> (shape, dtype)) as number `uuid` from the transfer server at `address`; the
  other leaves are in `inline` (None where pulled)."""

  address: str
  uuid: int
  specs: dict[int, tuple]
  inline: list


def uses_device_path(moves: str, platform: str) -> bool:
  """Whether a lane with `LaneSpec.moves` = `moves` on a device of `platform` offers and
  pulls its values on the device path."""
  return moves == 'device' or (moves == 'auto' and platform != 'cpu')


class DevicePath:
  """A lane's transfer server, its offers and its connections to other lanes' servers."""

  def __init__(self, jax, device, host: str):
    from jax.experimental import transfer

    self.jax, self.device = jax, device
    self.server = transfer.start_transfer_server(device.client, f'{host}:0', [f'{host}:0'])
    self.address = self.server.address()
    self._uuids = itertools.count(1)
    self._connections: dict[str, Any] = {}
    self._pulled_from: set[str] = set()  # servers a pull has come from (`_first_arrival`)
    self._lock = threading.Lock()
    self.pulled = 0  # copies whose leaves came through the transfer server (`info`)

  def offer(self, leaves: list) -> Offer:
    """Hands `leaves` to the transfer server, which keeps them until they are pulled."""
    pulled = [i for i, leaf in enumerate(leaves) if self._on_device(leaf)]
    uuid = next(self._uuids)
    if pulled:
      self.server.await_pull(uuid, [leaves[i] for i in pulled])
    specs = {i: (leaves[i].shape, leaves[i].dtype) for i in pulled}
    inline = [
      None if i in specs else np.asarray(self.jax.device_get(leaf)) for i, leaf in enumerate(leaves)
    ]
    return Offer(self.address, uuid, specs, inline)

  def pull(self, offer: Offer, gone=lambda: False) -> list:
    """The leaves of `offer`, those offered now on this lane's device (waits for them;
    raises `SourceGone` where `gone()` says the source's lane ended before the first pull
    from it came)."""
    leaves = list(offer.inline)
    if offer.specs:
      sharding = self.jax.sharding.SingleDeviceSharding(self.device)
      order = sorted(offer.specs)
      specs = [self.jax.ShapeDtypeStruct(*offer.specs[i], sharding=sharding) for i in order]
      try:
        arrays = self._connection(offer.address).pull(offer.uuid, specs)
        if offer.address in self._pulled_from:
          self.jax.block_until_ready(arrays)
        else:
          self._first_arrival(arrays, offer.address, gone)
      except Exception:
        with self._lock:  # a closed connection is not reused (a lane replaced there)
          self._connections.pop(offer.address, None)
          self._pulled_from.discard(offer.address)
        raise
      for i, array in zip(order, arrays):
        leaves[i] = array
      with self._lock:  # (each source's copies are pulled in a reader thread of its own)
        self.pulled += 1
    return leaves

  def _on_device(self, leaf) -> bool:
    jax = self.jax
    return (
      isinstance(leaf, jax.Array)
      and isinstance(leaf.dtype, np.dtype)  # (a typed PRNG key: inline, refused there)
      and leaf.size > 0
      and leaf.sharding.device_set == {self.device}
    )

  def _connection(self, address: str):
    with self._lock:
      connection = self._connections.get(address)
      if connection is None:
        connection = self._connections[address] = self.server.connect(address)
      return connection

  def _first_arrival(self, arrays: list, address: str, gone) -> None:
    """Waits for the first pull from the server at `address` in slices, looking at
    `gone()` between them (module docstring: JAX waits for a server that is gone without
    bound the first time; once a pull has come, a later one from a server gone fails)."""
    looked, pause = time.monotonic(), _FIRST_PULL_POLL_S
    while not all(array.is_ready() for array in arrays):
      if time.monotonic() - looked >= _GONE_CHECK_S:
        if gone():
          raise SourceGone(f'the lane of the transfer server at {address} ended before a pull')
        looked = time.monotonic()
      time.sleep(pause)
      pause = min(2 * pause, _FIRST_PULL_POLL_MAX_S)  # (a long wait wakes less often)
    self.jax.block_until_ready(arrays)  # (raises if the pull failed)
    with self._lock:
      self._pulled_from.add(address)
