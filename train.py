"""Train a byte-level Llama with jfsdp: flags -> TrainConfig -> data + FSDP plan -> loop -> summary.

    python train.py --mesh 2x8                      # the default run: 16 fake CPU devices if no GPU
    python train.py --mesh 1x8 --model llama-small --precision bf16 --steps 2000 --data my_text/

The command is `jfsdp.cli` (flags, checks, devices; it imports jax only after choosing the platform and
faking the devices a CPU-only machine needs) and `jfsdp.runtime.run` (model, sharding, data, loop,
checkpoints, summary, sample).
Bad input ends with one line `error: ...` and exit status 2; Ctrl-C and SIGTERM save (with
--ckpt-dir) and exit 130 and 143; on CPU a run that XLA aborts, or that dies of any signal, still ends with
one line naming what happened and the last checkpoint (jfsdp/runtime/supervisor.py). See docs/training.md
and docs/checkpoints.md for every flag.
"""
import sys

from jfsdp.cli import main

if __name__ == "__main__":
    sys.exit(main())
