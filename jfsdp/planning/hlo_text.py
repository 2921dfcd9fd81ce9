"""The optimized HLO module as text (`compiled.as_text()`), parsed: computations of instructions in the
order the text lists them (for a scheduled module, the order they run in), who calls whom, which
computations are while-loop bodies, and the byte sizes of array types. `jfsdp.planning.hlo` reads
the collectives, their loops and their overlap with compute from it."""
from __future__ import annotations

import dataclasses
import math
import re

_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4,
                "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16, "f8e4m3fn": 1, "f8e5m2": 1}
_COMP = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_NAME = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*")
_ARRAY = re.compile(r"\b(" + "|".join(_DTYPE_BYTES) + r")\[([\d,]*)\]")
_COMMENT = re.compile(r"/\*.*?\*/")
_CALLS = re.compile(r"(?:body|condition|to_apply|calls|branch_computations|called_computations)=\{?([^}\s,]+(?:,\s*%[\w.\-]+)*)")


@dataclasses.dataclass(frozen=True)
class Instr:
    """One instruction of an HLO computation, in the order the text lists it (for a scheduled module,
    the order it runs in)."""
    name: str
    shape: str       # the result type, e.g. 'f32[8,16]{1,0}' or a (nested) tuple of them
    opcode: str      # e.g. 'fusion', 'all-gather-start'
    line: str


def _split_type(rest: str) -> tuple[str, str]:
    """'<type> <opcode>(...)...' -> (type, remainder): the type is one token or a balanced (...)."""
    if rest.startswith("("):
        depth = 0
        for i, ch in enumerate(rest):
            depth += ch == "("
            depth -= ch == ")"
            if depth == 0:
                return rest[: i + 1], rest[i + 1:].lstrip()
    cut = rest.find(" ")
    return (rest, "") if cut < 0 else (rest[:cut], rest[cut + 1:].lstrip())


def _parse_instr(line: str) -> Instr | None:
    m = _NAME.match(line)
    if not m:
        return None
    shape, rem = _split_type(_COMMENT.sub("", line[m.end():]))
    op = re.match(r"([\w\-]+)\(", rem)
    return Instr(m.group(1), shape, op.group(1) if op else "", line) if op else None


def tuple_elements(shape: str) -> list[str] | None:
    """Top-level elements of a tuple type '(a, (b, c), d)', or None for an array type."""
    shape = shape.strip()
    if not shape.startswith("("):
        return None
    out, depth, cur = [], 0, ""
    for ch in shape[1:-1]:
        if ch in "({[":
            depth += 1
        elif ch in ")}]":
            depth -= 1
        if ch == "," and depth == 0:
            out.append(cur.strip())
            cur = ""
        else:
            cur += ch
    if cur.strip():
        out.append(cur.strip())
    return out


def array_types(type_text: str) -> list[tuple[str, str]]:
    """[(element type, 'd0,d1,...')] of every array in a type, e.g. '(bf16[8,16], f32[4])'."""
    return _ARRAY.findall(type_text)


def array_bytes(type_text: str) -> int:
    """Bytes of every array in a type."""
    total = 0
    for dt, dims in array_types(type_text):
        total += _DTYPE_BYTES[dt] * math.prod(int(d) for d in dims.split(",") if d)
    return total


def _permute_group(line: str) -> list | None:
    """The devices that a collective-permute's first cycle joins (source_target_pairs={{0,1},{1,0},...}:
    those reachable from the first pair's source); None where the line has no pairs."""
    m = re.search(r"source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}", line)
    pairs = [tuple(map(int, p)) for p in re.findall(r"\{(\d+),(\d+)\}", m.group(1))] if m else []
    if not pairs:
        return None
    succ, group = {}, [pairs[0][0]]
    for a, b in pairs:
        succ.setdefault(a, b)
    while succ.get(group[-1]) is not None and succ[group[-1]] not in group:
        group.append(succ[group[-1]])
    return sorted(group)


def first_group(line: str) -> list | None:
    """The device ids of a collective's first replica group, in the explicit ({{0,1},{2,3}}) or iota
    ([G,S]<=[dims]T(perm)) form, or a collective-permute's first cycle; None for the mesh form or a
    line that names no groups."""
    if "source_target_pairs=" in line:
        return _permute_group(line)
    m = re.search(r"replica_groups=\{\{([\d,]*)\}", line)
    if m:
        return [int(x) for x in m.group(1).split(",") if x]
    m = re.search(r"replica_groups=\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", line)
    if m:
        dims = [int(x) for x in m.group(3).split(",")]
        ids = list(range(math.prod(dims)))
        if m.group(4):   # the iota's dims transposed by perm, then read row-major
            perm = [int(x) for x in m.group(4).split(",")]
            strides = [math.prod(dims[i + 1:]) for i in range(len(dims))]
            shape = [dims[p] for p in perm]
            ids = [sum(c * strides[perm[k]] for k, c in enumerate(_unravel(i, shape))) for i in range(len(ids))]
        return ids[: int(m.group(2))]
    return None


def _unravel(i: int, shape) -> list:
    out = []
    for n in reversed(shape):
        out.append(i % n)
        i //= n
    return out[::-1]


def group_axes(line: str, mesh_axes) -> tuple:
    """The mesh axes (of `mesh_axes`, ((name, size), ...) in the mesh's order, devices numbered row-major)
    that a collective's replica groups span: by which devices a group holds, not by its size, so that
    an `fsdp` group and a `tensor` group of the same size are told apart."""
    names = [n for n, _ in mesh_axes]
    sizes = [k for _, k in mesh_axes]
    ids = first_group(line)
    if ids is not None:
        coords = [_unravel(i, sizes) for i in ids]
        return tuple(n for j, n in enumerate(names) if len({c[j] for c in coords}) > 1)
    m = re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", line)
    if m:   # XLA's mesh: each of its axes a run of ours (their sizes' product), in order
        xla = re.findall(r"'([^']+)'=(\d+)", m.group(1))
        spanned, ours, k = set(re.findall(r"'([^']+)'", m.group(2))), {}, 0
        for name, size in xla:
            run, prod = [], 1
            while k < len(names) and (prod < int(size) or (sizes[k] == 1 and prod == int(size))):
                run.append(names[k])
                prod *= sizes[k]
                k += 1
            ours[name] = run
        return tuple(n for n in names if any(n in ours.get(a, []) for a in spanned) and sizes[names.index(n)] > 1)
    return tuple(n for n, k in mesh_axes if k > 1)


def group_size(line: str, n_devices: int | None) -> int:
    """Devices in one replica group of a collective's line (all `n_devices` where the line names none; a
    collective-permute's: the devices its first cycle joins)."""
    if "source_target_pairs=" in line:
        return len(_permute_group(line) or []) or n_devices or 0
    m = re.search(r"replica_groups=\[(\d+),(\d+)\]<=", line)
    if m:
        return int(m.group(2))
    m = re.search(r"replica_groups=\{\{([\d,]*)\}", line)
    if m:
        return len(m.group(1).split(","))
    # the mesh form of newer XLA: replica_groups=mesh['axis_0'=2,'axis_1'=8] {'axis_1'}
    m = re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", line)
    if m:
        sizes = dict(re.findall(r"'([^']+)'=(\d+)", m.group(1)))
        axes = re.findall(r"'([^']+)'", m.group(2))
        if axes and all(a in sizes for a in axes):
            return math.prod(int(sizes[a]) for a in axes)
    return n_devices or 0


@dataclasses.dataclass(frozen=True)
class Module:
    """An optimized HLO module as text, split into computations of instructions."""
    comps: dict          # name -> [Instr] in listed (scheduled) order
    entry: str
    calls: dict          # name -> set of computations it calls
    bodies: dict         # name -> set of while bodies it calls


def parse(hlo_text: str) -> Module:
    """The module's computations, calls and while bodies, from its text."""
    comps: dict[str, list[Instr]] = {}
    entry, cur = None, None
    for line in hlo_text.splitlines():
        m = _COMP.match(line)
        if m and not line.startswith(" "):
            cur = m.group(1)
            comps[cur] = []
            if line.startswith("ENTRY"):
                entry = cur
        elif cur is not None:
            ins = _parse_instr(line)
            if ins is not None:
                comps[cur].append(ins)
    calls, bodies = {}, {}
    for name, instrs in comps.items():
        calls[name], bodies[name] = set(), set()
        for ins in instrs:
            for group in _CALLS.findall(ins.line):
                calls[name].update(c.strip().lstrip("%") for c in group.split(","))
            b = re.search(r"\bbody=%?([\w.\-]+)", ins.line) if ins.opcode == "while" else None
            if b:
                bodies[name].add(b.group(1))
    return Module(comps, entry, calls, bodies)


def walk(mod: Module):
    """(computation, enclosing while bodies) for every computation reachable from the entry."""
    out = []

    def visit(name, loops, seen):
        if name in seen or name not in mod.comps:
            return
        seen = seen | {name}
        out.append((name, loops))
        for callee in sorted(mod.calls[name]):
            visit(callee, loops + ((callee,) if callee in mod.bodies[name] else ()), seen)

    visit(mod.entry, (), frozenset())
    return out
