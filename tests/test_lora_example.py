"""examples/lora.py from a small Llama made and saved by transformers (`save_pretrained`): only the
adapters train (the base is frozen), the loss goes down, and the adapters are saved."""
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

REPO = Path(__file__).resolve().parents[1]


def test_lora_on_a_transformers_llama(tmp_path):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=259, hidden_size=96, intermediate_size=200, num_hidden_layers=2,
                                   num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=128,
                                   tie_word_embeddings=False, rms_norm_eps=1e-5)
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path / "hf")
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["JAX_PLATFORMS"] = "cpu"
    out = tmp_path / "adapters.npz"
    r = subprocess.run([sys.executable, str(REPO / "examples" / "lora.py"), "--init-from", str(tmp_path / "hf"),
                        "--steps", "30", "--rank", "4", "--out", str(out)],
                       capture_output=True, text=True, env=env, cwd=REPO, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    # rank 4 on wq (96x96), wk and wv (96x32), wo (96x96): 4 * (192 + 128 + 128 + 192) per layer
    assert "5,120 trainable of" in r.stdout
    first, last = map(float, re.search(r"loss ([\d.]+) -> ([\d.]+)", r.stdout).groups())
    assert last < first - 0.2, r.stdout
    saved = np.load(out)
    assert sorted(saved.files) == sorted(f"lora_{p}_{ab}" for p in ("wq", "wk", "wv", "wo") for ab in "ab")
    assert saved["lora_wq_a"].shape == (2, 96, 4) and saved["lora_wk_b"].shape == (2, 4, 32)
    assert np.abs(saved["lora_wo_b"]).max() > 0   # B starts at zero: it trained
