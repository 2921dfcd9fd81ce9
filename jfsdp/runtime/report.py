"""The end of a run: the summary, the loss-curve PNG and, after a complete run, a sample of text."""
from __future__ import annotations

import os
import time

import jax
import numpy as np

from jfsdp.config.sequence import zigzag, zigzag_order
from jfsdp.io import data as jdata
from jfsdp.runtime import metrics as jm
from jfsdp.runtime.config import TrainConfig


def report(run, outcome) -> int:
    """The summary, the loss curve and (after a complete run) the sample; returns the exit status."""
    c, last, platform, vals = run.c, outcome.last, run.platform, run.history["val"]
    print(f"\n== summary: {run.loader.step}/{c.steps} steps in {time.perf_counter() - run.t_launch:.1f}s "
          f"(compile {run.compile_s:.1f}s, training + eval {outcome.train_s:.1f}s)")
    if last["loss"] is not None:
        tp = run.throughput((last["step"] - outcome.step0) * run.tokens_per_step / max(outcome.timed, 1e-9))
        print(f"   train loss {last['loss']:.4f} | {tp['tokens_per_sec']:,.0f} tokens/s (train steps only) | "
              f"{tp['tflops_per_device']:.3g} TFLOP/s per device | "
              + (f"MFU {tp['mfu']:.1%}" if run.peak else f"MFU n/a on {platform.upper()}"))
    if len(vals) > 1:
        print(f"   val loss {vals[0][1]:.4f} (step {vals[0][0]}) -> {vals[-1][1]:.4f} (step {vals[-1][0]}): "
              f"{vals[-1][1] / vals[0][1]:.3f}x")
    print(f"   peak memory per device {jm.fmt_bytes(run.mem)} "
          f"({run.mem_src if platform == 'cpu' else 'allocator peak'})")
    if c.metrics_out:
        png = jm.plot_loss(run.out.records, os.path.splitext(c.metrics_out)[0] + ".png",
                           f"{c.model} on {c.mesh} ({run.strategy.value}, {c.precision}): {run.corpus.name}")
        print(f"   metrics {c.metrics_out}" + (f" | loss curve {png}" if png else ""))
    if outcome.interrupted:
        return outcome.exit_status
    if c.gen_tokens and run.loader.step == c.steps:
        sample(run.logits_model(), run.state.params, run.corpus, c)
    return 0


def prompt_tokens(corpus, c: TrainConfig) -> list[int]:
    """--prompt, or the start of a validation document up to a line break (text the model has not
    trained on); at least one token, and room for one more in the window."""
    T = c.seq_len
    if c.prompt is not None:
        prompt = corpus.encode(c.prompt)
    else:
        head = np.asarray(corpus.val[: min(64, T // 2)], dtype=np.int32)
        breaks = np.nonzero(head == ord("\n"))[0] if corpus.is_bytes else []
        prompt = head[: breaks[-1] + 1] if len(breaks) and breaks[-1] > 8 else head
    return [int(t) for t in prompt][-(T - 1):] or [corpus.eos if corpus.eos is not None else 0]


def next_token(logits: np.ndarray, corpus, temperature: float, rng) -> int:
    """The next token from one position's logits: greedy at temperature 0, else sampled."""
    if corpus.is_bytes:
        logits[[jdata.BOS, jdata.PAD]] = -np.inf   # never seen as targets; EOS ends the sample
    if temperature == 0:
        return int(np.argmax(logits))
    z = (logits - logits.max()) / temperature
    p = np.exp(z) / np.exp(z).sum()
    return int(rng.choice(len(p), p=p))


def sample(sharded, params, corpus, c: TrainConfig) -> None:
    """A short continuation of a prompt, so a person sees what the model learned. The whole window is
    run through the model for every new token (no KV cache): simple, and the sample is
    short. Every device gets a copy of the row, since the batch is split over all of them."""
    T = c.seq_len
    tokens = prompt_tokens(corpus, c)
    replicated = jax.sharding.NamedSharding(sharded.mesh, jax.sharding.PartitionSpec())   # readable by every process

    def head_logits(p, x):   # a head that returns a dict (MoE: with its statistics) has the logits under 'out'
        out = sharded.apply(p, x)
        return out["out"] if isinstance(out, dict) else out
    fwd = jax.jit(lambda p, x, i: jax.lax.dynamic_index_in_dim(head_logits(p, x)[0], i, keepdims=False),
                  out_shardings=replicated)
    rng = np.random.default_rng(c.seed)
    buf = np.full((sharded.n_devices, T), jdata.PAD if corpus.is_bytes else 0, np.int32)
    n_prompt, context = len(tokens), c.context
    where = np.argsort(zigzag_order(T, context)) if context > 1 else np.arange(T)   # a position's place in zigzag order
    for _ in range(c.gen_tokens):
        ctx = tokens[-T:]
        buf[:, : len(ctx)] = ctx
        x = zigzag(buf, context) if context > 1 else buf   # the order the context ranks hold the tokens in
        last_logits = np.asarray(fwd(params, jax.device_put(x, sharded.batch_sharding), int(where[len(ctx) - 1])),
                                 np.float64)
        tokens.append(next_token(last_logits, corpus, c.temperature, rng))
        if tokens[-1] == corpus.eos:
            break
    how = "greedy" if c.temperature == 0 else f"temperature {c.temperature}"
    print(f"\n== sample ({how}, {len(tokens) - n_prompt} tokens after the prompt) ==")
    if corpus.can_decode:
        print(f"[prompt]{corpus.decode(tokens[:n_prompt])}[model]{corpus.decode(tokens[n_prompt:])}")
    else:
        print(f"prompt token ids {tokens[:n_prompt]}\ngenerated token ids {tokens[n_prompt:]} (no tokenizer here)")
