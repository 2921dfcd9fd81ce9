"""`train.py --moe adaptive --moe-switch host`: the capacity bucket chosen on the host from the load of two steps
before, instead of by the device-side switch inside the step (docs/moe.md).

One program per bucket is compiled at the start: the adaptive stage's variant of that capacity, forced
(`jfsdp.planning.moe_calibrate.forced`: one bucket, its mode and chunks, so no conditional in the program).
Every program reads and writes the adaptive plan's state layout (asserted: switching moves no data), so the
state, the checkpoints and the evaluation stay the adaptive plan's. Each step returns the router's load
(`moe_load`: the most choices of one sequence that picked one expert, the capacity that would have dropped
nothing). Before dispatching a step the host reads the load of the step before the previous one, which has
finished while the previous one is queued, so reading it does not stall the device; it runs the smallest
bucket that holds that load (the largest if none; the first two steps run the largest). A step whose load
jumps above its bucket drops the excess, as a static run does, and says so in `moe_dropped`.
"""
from __future__ import annotations

import bisect
from collections import deque

import jax

import jfsdp
from jfsdp.planning import moe_calibrate
from jfsdp.train.step import state_shardings


class HostSwitch:
    """(state, batch) -> (state, metrics), as the compiled train step, running the bucket the load of two
    steps before asks for. `plan`: the adaptive plan; `shard(moe_variant)`: build.shard_model's triple for
    one variant; `make_step(plan, loss_fn)`: the run's make_train_step; `state`, `batch`: to compile with."""

    def __init__(self, plan, shard, make_step, opt, trainable, state, batch):
        stages = [s for s in plan.moe_stages if s is not None and getattr(s, "variants", None)]
        if not stages:
            raise jfsdp.ConfigError("--moe-switch host needs an adaptive MoE stage (--moe adaptive)")
        variants = stages[0].variants
        if any([(v.capacity, v.mode, v.chunks) for v in s.variants] !=
               [(v.capacity, v.mode, v.chunks) for v in variants] for s in stages[1:]):
            raise jfsdp.ConfigError("--moe-switch host: the MoE stages run different variants per bucket; one "
                                    "program per bucket needs them equal (use --moe-switch device)")
        want = state_shardings(plan, opt, trainable)
        self.buckets, self.programs = [v.capacity for v in variants], []
        for v in variants:
            forced, _, loss_fn = shard(lambda option, v=v: moe_calibrate.forced(option, v.capacity, v.mode, v.chunks))
            if state_shardings(forced, opt, trainable) != want:   # every variant reads the one layout
                raise jfsdp.ConfigError(f"--moe-switch host: capacity {v.capacity}'s program lays the state out "
                                        "differently from the adaptive plan's")
            self.programs.append(make_step(forced, loss_fn).lower(state, batch).compile())
        self.index, self.loads = len(self.buckets) - 1, deque()

    def __call__(self, state, batch):
        if len(self.loads) == 2:   # the step before the previous one: done, so this read does not wait
            load = float(jax.device_get(self.loads.popleft()))
            self.index = min(bisect.bisect_left(self.buckets, load), len(self.buckets) - 1)
        state, m = self.programs[self.index](state, batch)
        self.loads.append(m["moe_load"])
        return state, m
