"""What the compiled program does, read from XLA itself: collectives in the optimized HLO and
per-device memory from `compiled.memory_analysis()`. Tests and the planner assert on these."""
from __future__ import annotations

import dataclasses
import math
import re
from collections import Counter

KINDS = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")
_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4,
                "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16, "f8e4m3fn": 1, "f8e5m2": 1}
_COMP = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_OP = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(.+?)\s+(" + "|".join(KINDS) + r")(-start)?\(")
_ARRAY = re.compile(r"\b(" + "|".join(_DTYPE_BYTES) + r")\[([\d,]*)\]")
_CALLS = re.compile(r"(?:body|condition|to_apply|calls|branch_computations|called_computations)=\{?([^}\s,]+(?:,\s*%[\w.\-]+)*)")


@dataclasses.dataclass(frozen=True)
class Collective:
    kind: str
    result_bytes: int      # bytes of the op's result on one device
    group_size: int        # devices that take part in one group
    loops: tuple           # the while-loop bodies it sits in, outermost first ("" = none)
    dtypes: tuple = ()     # element types of its result arrays, e.g. ('bf16',)

    @property
    def wire_bytes(self) -> float:
        """Bytes each device sends (ring algorithms): the standard cost model of each collective."""
        g, b = self.group_size, self.result_bytes
        if g <= 1:
            return 0.0
        if self.kind == "all-gather":
            return b * (g - 1) / g
        if self.kind == "reduce-scatter":
            return b * (g - 1)
        if self.kind == "all-reduce":
            return 2 * b * (g - 1) / g
        return float(b)


def _array_bytes(type_text: str) -> int:
    total = 0
    for dt, dims in _ARRAY.findall(type_text):
        total += _DTYPE_BYTES[dt] * math.prod(int(d) for d in dims.split(",") if d)
    return total


def _group_size(line: str, n_devices: int | None) -> int:
    m = re.search(r"replica_groups=\[(\d+),(\d+)\]<=", line)
    if m:
        return int(m.group(2))
    m = re.search(r"replica_groups=\{\{([\d,]*)\}", line)
    if m:
        return len(m.group(1).split(","))
    return n_devices or 0


def collectives(hlo_text: str, n_devices: int | None = None) -> list[Collective]:
    """Every collective of an optimized HLO module (`compiled.as_text()`), with the while loops it is in.
    Async pairs (`*-start`/`*-done`) count once; the result of a `-start` is (operand, result)."""
    comps: dict[str, list[str]] = {}
    entry, cur = None, None
    for line in hlo_text.splitlines():
        m = _COMP.match(line)
        if m and not line.startswith(" "):
            cur = m.group(1)
            comps[cur] = []
            if line.startswith("ENTRY"):
                entry = cur
        elif cur is not None:
            comps[cur].append(line)
    # which computations each computation calls, and which of those calls are while bodies
    calls, bodies = {}, {}
    for name, lines in comps.items():
        calls[name], bodies[name] = set(), set()
        for line in lines:
            for group in _CALLS.findall(line):
                calls[name].update(c.strip().lstrip("%") for c in group.split(","))
            b = re.search(r"\bwhile\(.*body=%?([\w.\-]+)", line)
            if b:
                bodies[name].add(b.group(1))
    found: list[Collective] = []

    def walk(name, loops, seen):
        if name in seen or name not in comps:
            return
        seen = seen | {name}
        for line in comps[name]:
            m = _OP.match(line)
            if m:
                type_text, kind, start = m.groups()
                arrays = _ARRAY.findall(type_text)
                if start and len(arrays) > 1:  # (operand, result[, scratch]): the result is the second array
                    arrays = arrays[1:2]
                nbytes = sum(_array_bytes("%s[%s]" % a) for a in arrays)
                found.append(Collective(kind, nbytes, _group_size(line, n_devices), loops,
                                        tuple(sorted({a[0] for a in arrays}))))
        for callee in sorted(calls[name]):
            walk(callee, loops + ((callee,) if callee in bodies[name] else ()), seen)

    walk(entry, (), frozenset())
    return found


def summarize(colls: list[Collective]) -> dict:
    """{kind: {'count', 'result_bytes', 'wire_bytes'}} per execution of the program; an op inside
    loops counts once per listing (multiply by trip counts yourself where that matters)."""
    out = {}
    for c in colls:
        s = out.setdefault(c.kind, {"count": 0, "result_bytes": 0, "wire_bytes": 0.0})
        s["count"] += 1
        s["result_bytes"] += c.result_bytes
        s["wire_bytes"] += c.wire_bytes
    return out


def loops_with(colls: list[Collective], kind: str) -> Counter:
    """How many ops of `kind` sit in each innermost while-loop body ('' = outside any loop)."""
    return Counter(c.loops[-1] if c.loops else "" for c in colls if c.kind == kind)


def memory(compiled) -> dict:
    """Per-device bytes from XLA's buffer assignment of a compiled program."""
    m = compiled.memory_analysis()
    d = {k: int(getattr(m, f"{k}_size_in_bytes")) for k in ("argument", "output", "temp", "alias")}
    d["total"] = d["argument"] + d["output"] + d["temp"] - d["alias"]
    return d


_TRIP = re.compile(r"\bwhile\(.*?body=%?([\w.\-]+).*?\"known_trip_count\":\{\"n\":\"(\d+)\"")


def trip_counts(hlo_text: str) -> dict:
    """{while-body name: trip count} for loops whose count XLA knows (the unit scans: n_units).
    A loop without a known count is absent: callers treat it as running once and should check."""
    return {body: int(n) for body, n in _TRIP.findall(hlo_text)}


def per_step(hlo_text: str, n_devices: int | None = None) -> dict:
    """Like `summarize`, but per executed step: an op inside while loops counts once per iteration
    (product of the enclosing loops' trip counts). `unknown_loops` lists bodies with no known count."""
    trips = trip_counts(hlo_text)
    out, unknown = {}, set()
    for c in collectives(hlo_text, n_devices):
        times = 1
        for body in c.loops:
            if body in trips:
                times *= trips[body]
            else:
                unknown.add(body)
        s = out.setdefault(c.kind, {"count": 0, "result_bytes": 0, "wire_bytes": 0.0})
        s["count"] += times
        s["result_bytes"] += times * c.result_bytes
        s["wire_bytes"] += times * c.wire_bytes
    if unknown:
        out["unknown_loops"] = sorted(unknown)
    return out


def emitted_collectives(closed_jaxpr) -> Counter:
    """{(primitive, dtype): count} of the collectives in a jaxpr, nested jaxprs included: the program
    jfsdp hands to XLA. Use it for dtypes: XLA:CPU upcasts bf16 collectives to f32 during
    compilation (measured, jax 0.10.2), so on CPU the optimized HLO cannot show the bf16 all-gather
    that a GPU runs."""
    names = {"all_gather", "reduce_scatter", "psum", "all_to_all", "ppermute", "psum_scatter"}
    found: Counter = Counter()

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name in names:
                for v in eqn.outvars:
                    found[(eqn.primitive.name, str(v.aval.dtype))] += 1
            for p in eqn.params.values():
                for sub in (p if isinstance(p, (list, tuple)) else [p]):
                    inner = getattr(sub, "jaxpr", sub)
                    if hasattr(inner, "eqns"):
                        walk(inner)

    walk(getattr(closed_jaxpr, "jaxpr", closed_jaxpr))
    return found
