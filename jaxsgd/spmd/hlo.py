"""What a compiled all-reduce depends on, read from the optimized HLO text.

DaSGD's claim is that the average does not wait for the step's gradients. In a
compiled step that is a graph property: the all-reduce's operands must not be
reachable from the batch (nor from the parameters being trained this step).
`collective_inputs` lists, for each all-reduce of the entry computation (or each
instruction calling a computation that contains one, e.g. a `conditional`), the
jitted function's arguments it depends on, by their pytree path — JAX puts the path
in each entry parameter's `op_name` metadata.
"""

import dataclasses
import re

_INSTR = re.compile(r'^\s*(?:ROOT\s+)?%([\w.\-]+)\s*=\s*(.*)$')
_OPCODE = re.compile(r'\s([a-z][\w\-]*)\(')
_REF = re.compile(r'%([\w.\-]+)')
_CALLS = re.compile(
  r'(?:calls|to_apply|body|condition|true_computation|false_computation)'
  r'=%([\w.\-]+)|branch_computations=\{([^}]*)\}'
)
_OP_NAME = re.compile(r'op_name="((?:[^"\\]|\\.)*)"')
COLLECTIVES = (
  'all-reduce',
  'all-reduce-start',
  'reduce-scatter',
  'all-gather',
  'all-gather-start',
  'all-to-all',
  'collective-permute',
)
HEAVY = ('dot', 'convolution')


@dataclasses.dataclass
class Instruction:
  name: str
  opcode: str
  operands: list[str]
  calls: list[str]
  op_name: str


def parse(hlo_text: str) -> tuple[dict[str, list[Instruction]], str]:
  """`({computation: [instructions in printed (schedule) order]}, entry name)`."""
  computations, entry, current = {}, None, None
  for line in hlo_text.splitlines():
    stripped = line.strip()
    if not line.startswith(' ') and stripped.endswith('{'):  # A computation's header.
      header = stripped.removeprefix('ENTRY').strip()
      current = header.split()[0].lstrip('%')
      computations[current] = []
      if stripped.startswith('ENTRY'):
        entry = current
      continue
    match = _INSTR.match(line)
    if current is None or match is None:
      continue
    computations[current].append(_instruction(match.group(1), match.group(2)))
  return computations, entry


def _instruction(name: str, rest: str) -> Instruction:
  opcode_match = _OPCODE.search(rest)
  opcode = opcode_match.group(1) if opcode_match else ''
  start = opcode_match.end() if opcode_match else 0
  depth, end = 1, start
  while end < len(rest) and depth:
    depth += {'(': 1, ')': -1}.get(rest[end], 0)
    end += 1
  operands = _REF.findall(rest[start:end])
  calls = [
    c for one, many in _CALLS.findall(rest[end:]) for c in ([one] if one else _REF.findall(many))
  ]
  op_name = _OP_NAME.search(rest)
  return Instruction(name, opcode, operands, calls, op_name.group(1) if op_name else '')


def _contains(computations, name, opcodes, seen=None) -> bool:
  """Whether computation `name` (or one it calls) has an instruction in `opcodes`."""
  seen = set() if seen is None else seen
  if name in seen or name not in computations:
    return False
  seen.add(name)
  return any(
    i.opcode in opcodes or any(_contains(computations, c, opcodes, seen) for c in i.calls)
    for i in computations[name]
  )


def _is_site(computations, instr, opcodes) -> bool:
  return instr.opcode in opcodes or any(_contains(computations, c, opcodes) for c in instr.calls)


def collective_inputs(hlo_text: str) -> list[set[str]]:
  """For each collective in the entry computation, the argument paths it reads.

  Returns:
    One set per collective site (in schedule order), of the `op_name`s of the entry
    parameters it transitively depends on, e.g. `{"opt_state[1].snapshot['w']"}`.
  """
  computations, entry = parse(hlo_text)
  instrs = {i.name: i for i in computations[entry]}
  params = {
    i.name: i.op_name.replace("\\'", "'") for i in instrs.values() if i.opcode == 'parameter'
  }

  memo = {}
  for instr in computations[entry]:  # Printed in a topological order: operands first.
    memo[instr.name] = (
      {params[instr.name]}
      if instr.name in params
      else set().union(*(memo.get(o, set()) for o in instr.operands))
    )

  return [memo[i.name] for i in computations[entry] if _is_site(computations, i, COLLECTIVES)]


def compute_around_collectives(hlo_text: str) -> list[tuple[int, int]]:
  """For each collective site: (heavy ops scheduled before it, heavy ops after it).

  Heavy ops are dots and convolutions (or fusions containing them). In a scheduled
  module the entry computation is printed in execution order, so this shows
  where the scheduler put the all-reduce relative to the forward/backward work.
  """
  computations, entry = parse(hlo_text)
  order = computations[entry]
  heavy = [_is_site(computations, i, HEAVY) for i in order]
  return [
    (sum(heavy[:k]), sum(heavy[k + 1 :]))
    for k, i in enumerate(order)
    if _is_site(computations, i, COLLECTIVES)
  ]


_TRIP_COUNT = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')


def collective_count(hlo_text: str) -> dict[str, int | None]:
  """How many collectives one run of the compiled program executes, and where.

  Returns:
    `{'top_level': collectives in the entry computation (each runs once),
      'in_loops': executions inside while loops (each site times its loop's known
        trip count; None when a trip count is unknown),
      'in_conditionals': sites inside conditional branches (each runs at most
        once per run of the conditional)}`.
  """
  computations, entry = parse(hlo_text)
  lines = {m.group(1): m.group(2) for m in map(_INSTR.match, hlo_text.splitlines()) if m}
  counts = {'top_level': 0, 'in_loops': 0, 'in_conditionals': 0}

  def visit(name, weight, where, seen):
    for instr in computations.get(name, []):
      if instr.opcode in COLLECTIVES:
        key = 'top_level' if where is None else where
        if counts[key] is not None:
          counts[key] += 1 if key == 'in_conditionals' else weight
      if instr.opcode == 'while':
        trip = _TRIP_COUNT.search(lines[instr.name])
        inner = None if trip is None or weight is None else weight * int(trip.group(1))
        if inner is None and _has_collective(computations, instr):
          counts['in_loops'] = None
        for callee in instr.calls:
          visit(callee, inner, where or 'in_loops', seen | {name})
      elif instr.opcode == 'conditional':
        for callee in instr.calls:
          visit(callee, weight, 'in_conditionals', seen | {name})
      else:
        for callee in instr.calls:
          if callee not in seen:
            visit(callee, weight, where, seen | {name})

  visit(entry, 1, None, frozenset())
  return counts


def _has_collective(computations, instr) -> bool:
  return any(_contains(computations, c, COLLECTIVES) for c in instr.calls)
