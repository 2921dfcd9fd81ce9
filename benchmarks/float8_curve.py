"""Loss curves of several train.py runs in one PNG, and their final validation losses compared.

    python train.py --mesh 1x8 --model llama-small --precision fp8 --steps 300 --metrics-out fp8.jsonl
    python train.py --mesh 1x8 --model llama-small --precision bf16 --steps 300 --metrics-out bf16.jsonl
    python benchmarks/float8_curve.py fp8=fp8.jsonl bf16=bf16.jsonl --png curve.png --json curve.json

The first run is compared with each other one: its final validation loss relative to theirs.
"""
import argparse
import json


def _read(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("runs", nargs="+", help="LABEL=METRICS.jsonl (train.py --metrics-out)")
    p.add_argument("--png", required=True)
    p.add_argument("--json", default=None)
    p.add_argument("--title", default="")
    a = p.parse_args(argv)
    runs = {}
    for spec in a.runs:
        label, _, path = spec.partition("=")
        if not path:
            p.error(f"run '{spec}': expected LABEL=METRICS.jsonl")
        runs[label] = _read(path)

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=110)
    out = {}
    for label, recs in runs.items():
        train = [(r["step"], r["loss"]) for r in recs if r.get("loss") is not None]
        val = [(r["step"], r["val_loss"]) for r in recs if r.get("val_loss") is not None]
        line = ax.plot(*zip(*train), lw=1.0, alpha=0.6, label=f"{label} train")[0] if train else None
        if val:
            ax.plot(*zip(*val), "o-", ms=4, lw=1.4, color=line.get_color() if line else None, label=f"{label} val")
        out[label] = {"final_step": val[-1][0] if val else None, "final_val_loss": val[-1][1] if val else None}
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_title(a.title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(a.png)
    first = next(iter(out))
    for label, r in out.items():
        if label != first and r["final_val_loss"] and out[first]["final_val_loss"]:
            rel = out[first]["final_val_loss"] / r["final_val_loss"] - 1
            out[first][f"relative_to_{label}"] = rel
        print(f"{label:>8}: final val loss {r['final_val_loss']} (step {r['final_step']})")
    for k, v in out[first].items():
        if k.startswith("relative_to_"):
            print(f"{first} vs {k[len('relative_to_'):]}: {100 * v:+.2f}%")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
