"""What a training run is made of, before anything is compiled: the model to train, the devices and
processes, the sharded model (`fully_shard`), its model metrics, the checkpoints and what a checkpoint
must share with the run to be resumed by it. `jfsdp.runtime.run.Run` puts them together; every
ConfigError or ValueError raised here is bad input (one `error:` line).

The model definitions come from the repository's `models` package, imported when a run builds its
model (`jfsdp` never imports `models` at import time; pip installs only `jfsdp`).
"""
from __future__ import annotations

import dataclasses
import functools
import os
import sys

import jax
import jax.numpy as jnp

import jfsdp
from jfsdp.config.args import async_tp_option
from jfsdp.config.zoo import repo_models
from jfsdp.io import checkpoint as jckpt
from jfsdp.io import hf as jhf
from jfsdp.runtime import console
from jfsdp.runtime.config import TrainConfig
from jfsdp.train import frozen
from jfsdp.runtime.console import note


def load_models():
    """The repository's model definitions, imported when a run needs them."""
    return repo_models("train.py")


@dataclasses.dataclass(frozen=True)
class ModelChoice:
    """The model a run trains: its config, the name it is shown by, whether it is a Mixture of Experts,
    and the tokenizer that comes with it (a Hugging Face folder's; None: byte-level)."""
    config: object
    name: str
    is_moe: bool
    tokenizer: str | None


def choose_model(c: TrainConfig, models) -> ModelChoice:
    """--model (or --init-from's config), checked against --seq-len."""
    if c.init_from:
        mcfg, name = models.LlamaConfig(**jhf.read_config(c.init_from)), f"{c.init_from} (Hugging Face)"
    else:
        mcfg, name = models.get_config(c.model), c.model
    is_moe = isinstance(mcfg, models.MoEConfig)
    if c.mlp_tile and is_moe:
        raise jfsdp.ConfigError("--mlp-tile applies to the Llama models (their dense MLP), not to MoE models")
    if not isinstance(mcfg, models.LlamaConfig) and not is_moe:
        raise jfsdp.ConfigError(f"model '{c.model}' is not a language model; train.py trains the llama-* "
                                "and MoE models")
    if c.seq_len > mcfg.max_seq_len:
        raise jfsdp.ConfigError(f"--seq-len {c.seq_len} exceeds the model's max_seq_len {mcfg.max_seq_len}")
    tokenizer = jhf.tokenizer_path(c.init_from) if c.init_from else None
    return ModelChoice(mcfg, name, is_moe, tokenizer)


def report_from_lead(c: TrainConfig) -> tuple[TrainConfig, bool]:
    """(the config this process runs, whether it is process 0). One process reports: the others print
    nothing but errors and write no files."""
    lead = jax.process_index() == 0
    if not lead:
        console.set_quiet()
        sys.stdout = open(os.devnull, "w")
        c = dataclasses.replace(c, metrics_out=None)
    return c, lead


def take_devices(c: TrainConfig, r: int, s: int) -> list:
    """The devices of an R x S mesh (S x T with tensor parallelism): the first R*S of `jax.devices()`."""
    devices = jax.devices()
    if len(devices) < r * s:
        raise jfsdp.ConfigError(f"mesh {c.mesh} needs {r * s} devices but {len(devices)} "
                                f"{devices[0].platform.upper()} device(s) are present")
    if len(devices) > r * s:
        note(f"using {r * s} of the {len(devices)} {devices[0].platform} devices")
    return devices[: r * s]


def shard_model(c: TrainConfig, models, model: ModelChoice, mesh, strategy, mp, calibration=None,
                moe_variant=None) -> tuple:
    """(the sharded model the loss trains, a function that gives the sharded model that returns logits, the
    loss function).
    --mlp-tile is applied here, not to `model.config`: the checkpoints' identity keeps the config without it
    (tiling changes how the MLP runs, not its parameters, so a run resumes under any tile).
    The fused loss takes (hidden, head weight) from the root; sampling needs logits: a second sharded
    model over the same parameters with the plain head, built the first time it is asked for (a run that
    samples nothing, and the fit check's and calibration's plans, never trace it).
    `calibration`: an adaptive MoE stage's measured {(capacity, mode, chunks): seconds} (--moe-calibrate),
    instead of --moe-calibration's file; `moe_variant`: a function of the MoE option that replaces it (one
    variant's own program, jfsdp.runtime.calibrate)."""
    # an MoE model's cost model reads the tokens per device from the example: one micro-batch
    rows = max(1, c.batch_size // c.grad_accum) if model.is_moe else 1
    example = jax.ShapeDtypeStruct((rows, c.seq_len), jnp.int32)
    loss_fn = None
    config = dataclasses.replace(model.config, mlp_tile=c.mlp_tile) if c.mlp_tile else model.config

    def shard(head):
        nonlocal loss_fn
        module, moe, loss_fn = models.factory.language_model(config, c.loss, c.moe, c.moe_chunks, head=head,
                                                                     buckets=c.moe_buckets, capacity_cap=c.moe_capacity_cap,
                                                                     calibration=calibration or c.moe_calibration)
        if moe_variant is not None:
            moe = moe_variant(moe)
        plan = models.factory.tensor_plan(model.config) if c.tensor > 1 else None
        ring = (models.factory.context_kernel(ring_sums=c.ring_sums, attention=models.factory.ring_attention_impl(config, mp, c.ring_attention))
                if c.context > 1 else None)   # docs/context-parallel.md
        return jfsdp.fully_shard(module, mesh, example, strategy=strategy, mp_policy=mp, remat=c.remat, moe=moe,
                                 tensor_plan=plan, async_tp=async_tp_option(c.async_tp, c.tensor),
                                 context_attention=ring)
    sharded = shard(None if c.loss == "fused" else "head")
    logits = functools.cache(lambda: shard("head")) if c.loss == "fused" else (lambda: sharded)
    return sharded, logits, loss_fn


def make_optimizer(c: TrainConfig, sharded) -> tuple:
    """(the learning-rate schedule, the run's AdamW): warmup then cosine, weight decay on matrices."""
    schedule = jfsdp.warmup_cosine(c.lr, c.steps, c.warmup)
    return schedule, jfsdp.adamw(schedule, weight_decay=c.weight_decay, clip_norm=c.clip or None,
                                 mask=sharded.decay_mask())


def trainable(c: TrainConfig, sharded):
    """--freeze REGEX -> make_train_step's `trainable` predicate (None: everything trains). A regex
    that matches no parameter, or every one, is bad input."""
    predicate, hit = frozen.freeze(sharded, c.freeze)
    if predicate is None:
        return None
    if c.update_in_backward:
        raise jfsdp.ConfigError("--freeze cannot combine with --update-in-backward")
    note(f"frozen: {', '.join(hit)}")
    return predicate


def model_metrics(models, model: ModelChoice) -> dict:
    """A model's own metrics, returned by the train step from its forward pass (make_train_step's
    `metrics`): the capacity is the largest any micro-batch ran with, the load the most choices of one
    routing group that picked one expert (the capacity that would have dropped nothing)."""
    if not model.is_moe:
        return {}
    return {"moe_aux_loss": models.moe.aux_loss, "moe_dropped": models.moe.dropped_fraction,
            "moe_capacity": (models.moe.capacity_used, "max"), "moe_load": (models.moe.max_load, "max")}


def eval_metrics(models, model: ModelChoice, loss_fn) -> dict:
    """What an evaluation measures beside the loss, in the same forward pass: for an MoE model the
    language-model loss alone (the loss is it plus aux_coef x the load-balancing loss), the
    load-balancing loss and the dropped share of the validation batches' routed choices. The
    evaluation runs the training plan, so a static capacity drops validation tokens as it drops
    training ones, and an adaptive one follows the validation batches' load."""
    if not model.is_moe:
        return {}
    return {"lm_loss": loss_fn.lm_loss, "moe_aux_loss": models.moe.aux_loss,
            "moe_dropped": models.moe.dropped_fraction}


def moe_variant(sharded, metrics: dict) -> dict:
    """What the last MoE stage ran with at a logged step: its mode and chunks at the measured capacity
    (an adaptive stage's variant of that capacity; a static stage's own)."""
    stages = [s for s in getattr(sharded, "moe_stages", None) or () if s is not None]
    if not stages or "moe_capacity" not in metrics:
        return {}
    s = stages[-1]
    v = next((v for v in getattr(s, "variants", ()) if v.capacity == round(metrics["moe_capacity"])), s)
    return {"moe_mode": v.mode, "moe_chunks": v.chunks}


def open_checkpoints(c: TrainConfig) -> tuple:
    """(the checkpointer, the step to resume from): (None, None) without --ckpt-dir. A folder that
    holds checkpoints needs --resume."""
    if not c.ckpt_dir:
        return None, None
    ckpt = jckpt.Checkpointer(c.ckpt_dir, keep=c.keep)
    console.on_fail(ckpt.close)
    resume_step = ckpt.latest_step()
    if resume_step is not None and not c.resume:
        raise jfsdp.ConfigError(f"--ckpt-dir {c.ckpt_dir} already holds checkpoints (latest: step "
                                f"{resume_step}); pass --resume to continue from it, or use another folder")
    if ckpt.partial_writes():
        note(f"{c.ckpt_dir}: ignoring unfinished checkpoint write(s) "
             f"{', '.join(ckpt.partial_writes())} (a save that was killed)")
    if c.resume and resume_step is None:
        note(f"--resume: no checkpoint in {c.ckpt_dir} yet: starting at step 0")
    return ckpt, resume_step


def identity(c: TrainConfig, model: ModelChoice) -> dict:
    """What a checkpoint must share with this run to be resumed by it (mesh and strategy may differ)."""
    return {"model_config": dataclasses.asdict(model.config), "precision": c.precision,
            "data": c.data or "stdlib", "data_dtype": c.data_dtype, "tokenizer": model.tokenizer,
            "batch_size": c.batch_size, "seq_len": c.seq_len, "seed": c.seed}
