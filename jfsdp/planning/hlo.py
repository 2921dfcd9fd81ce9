"""What the compiled program does, read from XLA itself: collectives in the optimized HLO, their
overlap with compute in the scheduled program, and per-device memory from
`compiled.memory_analysis()`. Tests and the planner assert on these.

Both backends' forms are read: XLA:CPU's synchronous collectives, and XLA:GPU's async pairs
(`all-gather-start` ... `all-gather-done`) whose start may combine several collectives into one op
of several operands (a unit's all-gathers, combined into one)."""
from __future__ import annotations

import dataclasses
import math
import re
from collections import Counter

from jfsdp.planning.hlo_text import (Instr, array_bytes, array_types, group_axes, group_size, parse, tuple_elements,
                                     walk)

KINDS = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")


def _collective_kind(opcode: str) -> tuple[str | None, bool]:
    """(kind, is_start) of a collective opcode; (None, False) for anything else, `-done` included."""
    for k in KINDS:
        if opcode == k:
            return k, False
        if opcode == k + "-start":
            return k, True
    return None, False


def _result_type(kind: str, start: bool, shape: str) -> str:
    """The part of a collective's type that is its result. A `-start` of an all-gather, reduce-scatter,
    all-to-all or collective-permute returns (operands, results[, scratch]): operands and results are
    each an array, or a tuple when XLA combined several collectives into one op (XLA:GPU combines a
    unit's all-gathers into one `all-gather-start` of several operands). An `all-reduce-start`
    returns its result(s) alone, like the synchronous ops."""
    if not start or kind == "all-reduce":
        return shape
    parts = tuple_elements(shape)
    return parts[1] if parts and len(parts) >= 2 else shape


@dataclasses.dataclass(frozen=True)
class Collective:
    kind: str
    result_bytes: int      # bytes of the op's result on one device (all operands of a combined op)
    group_size: int        # devices that take part in one group
    loops: tuple           # the while-loop bodies it sits in, outermost first ("" = none)
    dtypes: tuple = ()     # element types of its result arrays, e.g. ('bf16',)
    name: str = ""         # the instruction's name
    computation: str = ""  # the computation it is in
    operands: int = 1      # collectives combined into this op
    is_async: bool = False  # a -start/-done pair
    axes: tuple = ()       # the mesh axes its replica groups span (when the reader was given the mesh)

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
        if self.kind == "all-to-all":   # each device keeps its own 1/g of the buffer
            return b * (g - 1) / g
        return float(b)




def _collective(ins: Instr, comp: str, loops: tuple, n_devices: int | None, mesh_axes=None) -> Collective | None:
    """The collective that instruction `ins` (of computation `comp`, inside `loops`) starts; None for
    any other instruction. `mesh_axes` (((name, size), ...)): also which axes its groups span."""
    kind, start = _collective_kind(ins.opcode)
    if kind is None:
        return None
    res = _result_type(kind, start, ins.shape)
    arrays = array_types(res)
    return Collective(kind, array_bytes(res), group_size(ins.line, n_devices), loops,
                      tuple(sorted({a[0] for a in arrays})), ins.name, comp, max(1, len(arrays)), start,
                      group_axes(ins.line, mesh_axes) if mesh_axes else ())


def collectives(hlo_text: str, n_devices: int | None = None, mesh_axes=None) -> list[Collective]:
    """Every collective of an optimized HLO module (`compiled.as_text()`), with the while loops it is in.
    Async pairs (`*-start`/`*-done`) count once, at the start; a combined op (several operands in one
    collective, as XLA:GPU emits them) counts once with the bytes of all its results."""
    mod = parse(hlo_text) if isinstance(hlo_text, str) else hlo_text
    found: list[Collective] = []
    for name, loops in walk(mod):
        for ins in mod.comps[name]:
            c = _collective(ins, name, loops, n_devices, mesh_axes)
            if c is not None:
                found.append(c)
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


def per_axes(hlo_text: str, mesh_axes) -> dict:
    """{(kind, axes): {'count', 'wire_bytes'}} per executed step, each collective classified by the mesh
    axes its replica groups span (`group_axes`): ('fsdp',), ('tensor',), ('fsdp', 'tensor'), ...
    `mesh_axes`: ((name, size), ...) in the mesh's order, e.g. tuple(mesh.shape.items())."""
    trips = trip_counts(hlo_text)
    out = {}
    for c in collectives(hlo_text, math.prod(k for _, k in mesh_axes), tuple(mesh_axes)):
        times = math.prod(trips.get(body, 1) for body in c.loops)
        s = out.setdefault((c.kind, c.axes), {"count": 0, "wire_bytes": 0.0})
        s["count"] += times
        s["wire_bytes"] += times * c.wire_bytes
    return out


def emitted_collectives(closed_jaxpr) -> Counter:
    """{(primitive, dtype): count} of the collectives in a jaxpr, nested jaxprs included: the program
    jfsdp hands to XLA. Use it for dtypes: XLA:CPU upcasts bf16 collectives to f32 during
    compilation (jax 0.10.2), so on CPU the optimized HLO cannot show the bf16 all-gather
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


# ---------------------------------------------------------------- overlap of communication and compute

# Instructions that do a kernel's worth of work on the device. A matmul (XLA:GPU: a gemm fusion or a
# cuBLAS/cuDNN custom call; XLA:CPU: a dot) is what can hide a unit's collective; elementwise fusions
# (a convert, a pad) take microseconds and cannot.
_NOT_COMPUTE = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "copy-start", "copy-done",
                "after-all", "partition-id", "replica-id", "opt-barrier", "optimization-barrier", ""}


def _is_matmul(ins: Instr) -> bool:
    if ins.opcode in ("dot", "convolution"):
        return True
    if ins.opcode == "custom-call":
        return bool(re.search(r'custom_call_target="(__cublas|__cudnn)', ins.line))
    if ins.opcode == "fusion":
        m = re.search(r"calls=%?([\w.\-]+)", ins.line)
        return bool(m and re.search(r"gemm|triton|cublas|cudnn|dot", m.group(1))) or "__cudnn" in ins.line
    return False


@dataclasses.dataclass(frozen=True)
class Overlap:
    """One async collective in the scheduled program and what runs while it is in flight."""
    collective: Collective
    per_step: int          # executions per step (trip counts of the loops around it)
    matmuls: tuple         # names of the matmuls scheduled between its start and its done
    other_compute: int     # other kernels (elementwise fusions, ...) between them
    loops_between: int     # while loops between them (whole loops run while it is in flight)

    @property
    def hidden(self) -> bool:
        """In flight while a matmul (or a whole loop) computes: the scheduler gave it compute to hide behind."""
        return bool(self.matmuls) or self.loops_between > 0

    @property
    def wire_bytes_per_step(self) -> float:
        return self.collective.wire_bytes * self.per_step


def overlap(hlo_text: str, n_devices: int | None = None, mesh_axes=None) -> list[Overlap]:
    """For every async collective (`X-start` ... `X-done`) of a scheduled module (`compiled.as_text()`
    of XLA:GPU, whose computations list instructions in their schedule order), the compute that is
    scheduled between its start and its done. Synchronous collectives (XLA:CPU) are reported with
    nothing between: they are exposed by construction. `mesh_axes` (((name, size), ...)): each
    collective also says which mesh axes its groups span (`overlap_summary(..., by_axes=True)`)."""
    mod = parse(hlo_text)
    trips = trip_counts(hlo_text)
    out = []
    for name, loops in walk(mod):
        times = math.prod(trips.get(b, 1) for b in loops)
        instrs = mod.comps[name]
        done_at = {}
        for i, ins in enumerate(instrs):
            if ins.opcode.endswith("-done"):
                m = re.search(r"-done\(%?([\w.\-]+)", ins.line)
                if m:
                    done_at[m.group(1)] = i
        for i, ins in enumerate(instrs):
            c = _collective(ins, name, loops, n_devices, mesh_axes)
            if c is None:
                continue
            between = instrs[i + 1: done_at.get(ins.name, i)] if c.is_async else []
            mm = tuple(b.name for b in between if _is_matmul(b))
            whiles = sum(b.opcode == "while" for b in between)
            other = sum(1 for b in between if b.opcode not in _NOT_COMPUTE and not _is_matmul(b)
                        and b.opcode != "while" and _collective_kind(b.opcode)[0] is None
                        and not b.opcode.endswith("-done"))
            out.append(Overlap(c, times, mm, other, whiles))
    return out


def overlap_summary(overlaps: list[Overlap], by_axes: bool = False) -> dict:
    """Per step and per kind: wire bytes sent while compute runs (`hidden`) and with none to hide
    behind (`exposed`), and the ops of each. Scalars (the loss) are counted too; they are bytes.
    `by_axes`: per 'kind over axes' (the overlaps read with `mesh_axes`)."""
    out = {}
    for o in overlaps:
        c = o.collective
        key = f"{c.kind} over {' x '.join(c.axes) or 'none'}" if by_axes else c.kind
        s = out.setdefault(key, {"hidden_bytes": 0.0, "exposed_bytes": 0.0, "hidden_ops": 0, "exposed_ops": 0})
        how = "hidden" if o.hidden else "exposed"
        s[f"{how}_bytes"] += o.wire_bytes_per_step
        s[f"{how}_ops"] += o.per_step
    return out


def render_overlap(overlaps: list[Overlap]) -> str:
    """One line per async collective: where it is, how big, how often, what runs while it is in flight."""
    lines = [f"  {'collective':34}{'where':>26}{'x/step':>8}{'MiB sent':>10}  in flight during"]
    for o in overlaps:
        c = o.collective
        where = c.loops[-1] if c.loops else "(top level)"
        what = (f"{len(o.matmuls)} matmul(s)" + (f" + {o.loops_between} loop(s)" if o.loops_between else "")
                + f", {o.other_compute} other kernel(s)") if o.hidden else (
                    f"EXPOSED ({o.other_compute} other kernel(s), no matmul)")
        label = f"{c.name} [{c.operands} x {'/'.join(c.dtypes)}]"
        lines.append(f"  {label:34}{where[-26:]:>26}{o.per_step:>8}{c.wire_bytes / 2**20:>10.2f}  {what}")
    return "\n".join(lines)


@dataclasses.dataclass(frozen=True)
class Gemm:
    """One matmul of the scheduled program: its instruction, the loops it sits in, the element types of
    its dot's two operands (read inside a gemm fusion's computation) and the jax op it came from."""
    name: str
    loops: tuple
    dtypes: tuple       # e.g. ('f8e4m3fn', 'f8e5m2'); () where unknown (a library call)
    op_name: str

    @property
    def float8(self) -> bool:
        return bool(self.dtypes) and all(d.startswith("f8") for d in self.dtypes)


def _dot_operand_types(instrs) -> tuple:
    types = {i.name: i.shape for i in instrs}
    for i in instrs:
        if i.opcode in ("dot", "scaled-dot"):
            args = re.match(r".*?\b(?:scaled-)?dot\(([^)]*)\)", i.line).group(1)
            names = [a.strip().split()[-1].lstrip("%") for a in args.split(",")][:2]
            return tuple(array_types(types.get(n, ""))[0][0] if array_types(types.get(n, "")) else "?" for n in names)
    return ()


def gemms(hlo_text: str) -> list[Gemm]:
    """Every matmul (dot, gemm fusion, cuBLAS call) of an optimized module, where it is scheduled, with
    its operand types: how a test tells float8 gemms from bf16 ones in a program compiled for a GPU."""
    mod = parse(hlo_text)
    out = []
    for name, loops in walk(mod):
        for ins in mod.comps[name]:
            if not _is_matmul(ins) or "__cudnn" in ins.line:
                continue
            m = re.search(r'op_name="([^"]*)"', ins.line)
            called = re.search(r"calls=%?([\w.\-]+)", ins.line)
            if ins.opcode == "fusion" and called and called.group(1) in mod.comps:
                dtypes = _dot_operand_types(mod.comps[called.group(1)])
            elif ins.opcode == "dot":
                dtypes = _dot_operand_types(mod.comps[name])
            else:
                dtypes = ("f8e4m3fn", "f8e4m3fn") if "f8" in ins.line.split("custom_call_target=")[-1][:40] else ()
            out.append(Gemm(ins.name, loops, dtypes, m.group(1) if m else ""))
    return out


def gathered_arrays(hlo_text: str) -> list[tuple]:
    """(dtype, dims) of every array an all-gather returns, one entry per operand of a combined op: what
    travels in which dtype (float8 gathers, the root's in bf16)."""
    out = []
    for comp in parse(hlo_text).comps.values():
        for ins in comp:
            if ins.opcode in ("all-gather", "all-gather-start"):
                parts = tuple_elements(ins.shape) if ins.opcode.endswith("start") else None
                out += array_types(parts[1] if parts else ins.shape)
    return out
