"""Low-rank adapters (LoRA) on a frozen Llama loaded from a Hugging Face folder, trained with jfsdp.

    python examples/lora.py --init-from HF_LLAMA_DIR [--mesh 2x4] [--rank 8] [--steps 100] [--out adapters.npz]

The adapters are written here: `LoRABlock` is the repository's Llama block (`models.llama.LlamaBlock`)
whose attention projections read W + (alpha / rank) * A @ B instead of W (`nn.map_variables` adds the
product to the kernels the block reads; the block itself is unchanged, so the Hugging Face weights load
into it as they are). A starts small and random, B at zero, so training starts from the base model.
Everything but the adapters is frozen (`trainable=`): the base is sharded and gathered for compute, but
gets no gradient, reduce-scatter, optimizer state or update (jfsdp/train/frozen.py). At the end the
adapters (and only they) are saved to an .npz file, one array per projection, stacked over the layers.
On a machine without accelerators the script fakes 8 CPU devices.
"""
from __future__ import annotations

import os

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
import sys  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # jfsdp and models/ from here

from jfsdp.config.xla_flags import accelerator_present  # noqa: E402  (jax-free)

if not accelerator_present():
    os.environ.setdefault("JAX_PLATFORMS", "cpu")   # don't probe for GPU plugins

import argparse  # noqa: E402

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import jfsdp  # noqa: E402
from jfsdp.io import data as jdata, hf as jhf  # noqa: E402
from models import llama  # noqa: E402

PROJECTIONS = ("wq", "wk", "wv", "wo")


class LoRABlock(nn.Module):
    """The Llama block with a low-rank update on each attention projection: kernel + scale * A @ B."""
    cfg: llama.LlamaConfig
    rank: int
    alpha: float

    @nn.compact
    def __call__(self, x):
        c, hd = self.cfg, self.cfg.head_dim
        fan_in = {"wq": c.dim, "wk": c.dim, "wv": c.dim, "wo": c.n_heads * hd}
        fan_out = {"wq": c.n_heads * hd, "wk": c.n_kv_heads * hd, "wv": c.n_kv_heads * hd, "wo": c.dim}
        ab = {p: (self.param(f"lora_{p}_a", nn.initializers.normal(1 / fan_in[p] ** 0.5), (fan_in[p], self.rank)),
                  self.param(f"lora_{p}_b", nn.initializers.zeros, (self.rank, fan_out[p])))
              for p in PROJECTIONS}
        scale = self.alpha / self.rank

        def with_adapters(variables):
            params = variables.get("params", {})
            if "attention" not in params:   # being initialized: nothing to add to yet
                return variables
            attn = dict(params["attention"])
            for p, (a, b) in ab.items():
                kernel = attn[p]["kernel"]
                attn[p] = {**attn[p], "kernel": kernel + (scale * (a @ b)).astype(kernel.dtype)}
            return {**variables, "params": {**params, "attention": attn}}

        block = nn.map_variables(llama.LlamaBlock, "params", trans_in_fn=with_adapters, init=self.is_initializing())
        return block(c, name="base")(x)


def is_adapter(path: str) -> bool:
    """`trainable=`'s predicate: only the adapters train (paths like 'units/lora_wq_a')."""
    return "/lora_" in path


def load(args, mesh):
    """(config, the LoRA plan, its initial parameters): the base from the Hugging Face folder, streamed
    into a plain Llama plan's shards and gathered here (an example-sized model), the adapters initialized."""
    cfg = llama.LlamaConfig(**jhf.read_config(args.init_from))
    x = jnp.zeros((args.batch_size, args.seq_len), jnp.int32)
    root, unit, n = llama.parts(cfg)
    base_plan = jfsdp.fully_shard(jfsdp.Stacked(root, unit, n), mesh, x)
    base = jax.device_get(base_plan.gather(jhf.load_params(base_plan, args.init_from)))
    plan = jfsdp.fully_shard(jfsdp.Stacked(root, LoRABlock(cfg, args.rank, args.alpha), n), mesh, x,
                             remat=args.remat)
    full = jax.device_get(plan.init_full(jax.random.key(args.seed)))
    full["root"] = base["root"]
    full["units"]["base"] = base["units"]
    return cfg, plan, full


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--init-from", required=True, help="a Hugging Face Llama folder (config.json + *.safetensors)")
    p.add_argument("--mesh", default="2x4")
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--alpha", type=float, default=16.0)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--remat", default="full")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="out/lora_adapters.npz", help="where the adapters are saved (.npz)")
    return p.parse_args(argv)


def run(args):
    """Train and save the adapters -> (the initial full parameters, the trained ones gathered, losses)."""
    mesh = jfsdp.make_mesh(args.mesh)
    cfg, plan, full = load(args, mesh)
    opt = jfsdp.adamw(args.lr, weight_decay=0.0, mask=plan.decay_mask())
    state = jfsdp.init_state(plan, opt, params=full, trainable=is_adapter)
    step = jfsdp.make_train_step(plan, opt, llama.lm_loss, trainable=is_adapter)
    n_adapter = sum(np.size(v) for k, v in jax.tree_util.tree_flatten_with_path(full)[0]
                    if "lora_" in jax.tree_util.keystr(k))
    n_all = sum(np.size(v) for v in jax.tree.leaves(full))
    print(f"LoRA rank {args.rank} on {', '.join(PROJECTIONS)} of {cfg.n_layers} layers: {n_adapter:,} trainable "
          f"of {n_all:,} parameters; mesh {args.mesh}")

    corpus = jdata.load_tokens(None, cfg.vocab_size, tokenizer=jhf.tokenizer_path(args.init_from))
    loader = jdata.Loader(corpus, args.batch_size, args.seq_len, seed=args.seed)
    losses = []
    for i in range(args.steps):
        state, m = step(state, plan.put_batch(loader.batch(i)))
        losses.append(float(m["loss"]))
        if i % max(1, args.steps // 5) == 0 or i == args.steps - 1:
            print(f"step {i + 1:4d} | loss {losses[-1]:.4f}", flush=True)
    first, last = np.mean(losses[: max(1, args.steps // 10)]), np.mean(losses[-max(1, args.steps // 10):])
    print(f"loss {first:.4f} -> {last:.4f} (mean of the first and last tenth of the steps)")

    trained = jax.device_get(plan.gather(state.params))
    adapters = {k: np.asarray(v) for k, v in trained["units"].items() if k.startswith("lora_")}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    np.savez(args.out, **adapters)
    print(f"saved {len(adapters)} adapter arrays ({sum(a.nbytes for a in adapters.values()):,} bytes) to {args.out}")
    return full, trained, losses


def main(argv=None):
    run(parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
