"""train.py starts without touching jax until it has chosen the platform: with jax's CUDA plugin
installed (the `gpu-target` extra) on a machine without a GPU, jax must not probe for CUDA, which
prints a long traceback ("Unable to load cuDNN") before falling back to the CPU. So the command line
parses and checks its flags and sets JAX_PLATFORMS / XLA_FLAGS with jax-free modules only."""
import os
import subprocess
import sys
from pathlib import Path
from tests.compile_flags import FAST

REPO = Path(__file__).resolve().parents[1]


def _env():
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "XLA_FLAGS")}
    env["XLA_FLAGS"] = FAST   # compiles faster; train.py adds its own flags
    env["PYTHONUNBUFFERED"] = "1"
    return env


def test_train_py_without_jax_platforms_starts_cleanly():
    """No JAX_PLATFORMS in the environment: the run chooses the platform itself (CPU here, a GPU where
    there is one) and nothing prints a traceback."""
    r = subprocess.run([sys.executable, "train.py", "--mesh", "1x1", "--model", "llama-test", "--batch-size", "2",
                        "--seq-len", "16", "--steps", "2", "--eval-iters", "1", "--gen-tokens", "0",
                        "--metrics-out", ""], capture_output=True, text=True, env=_env(), cwd=REPO, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    assert "summary: 2/2 steps" in r.stdout


def test_flags_and_devices_are_set_before_jax_is_imported():
    """Parsing, checking and the device set-up import no jax (XLA reads its flags once, when jax starts)."""
    code = """if True:
        import os, sys
        from jfsdp import cli
        c = cli.parse_args(["--mesh", "2x2", "--batch-size", "4"])
        n = cli.check_flags(c)
        assert n == 4, n
        assert "jax" not in sys.modules, "jax imported while parsing the flags"
        cli.setup_devices(c, n)
        assert "jax" not in sys.modules, "jax imported by the device set-up"
        assert os.environ.get("XLA_FLAGS"), "no XLA flags set"
        print("ok")
    """
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=_env(), cwd=REPO,
                       timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == "ok", (r.stdout, r.stderr)
