"""examples/lora.py from a small Llama made and saved by transformers (`save_pretrained`), run in this
process: the base weights stay bit for bit as loaded (frozen), every adapter moves, the loss goes down,
and the adapters (and only they) are saved."""
import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest

from tests import reference as ref

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

REPO = Path(__file__).resolve().parents[1]


def _lora_example():
    spec = importlib.util.spec_from_file_location("lora_example", REPO / "examples" / "lora.py")
    module = sys.modules["lora_example"] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_lora_on_a_transformers_llama(tmp_path, capsys):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=259, hidden_size=96, intermediate_size=200, num_hidden_layers=2,
                                   num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=128,
                                   tie_word_embeddings=False, rms_norm_eps=1e-5)
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path / "hf")
    out = tmp_path / "adapters.npz"
    lora = _lora_example()
    full, trained, losses = lora.run(lora.parse_args(["--init-from", str(tmp_path / "hf"), "--steps", "30",
                                                      "--rank", "4", "--out", str(out), "--mesh", "2x8"]))
    printed = capsys.readouterr().out
    # rank 4 on wq (96x96), wk and wv (96x32), wo (96x96): 4 * (192 + 128 + 128 + 192) per layer
    assert "5,120 trainable of" in printed
    adapters = 0
    for path, before, after in ref.paired(full, trained):
        if "lora_" not in path:   # the base, as loaded from the transformers folder: untouched
            np.testing.assert_array_equal(after, before, err_msg=path)
            continue
        adapters += before.size
        for layer in range(before.shape[0]):   # every adapter of every layer trained (B starts at zero)
            assert np.max(np.abs(after[layer] - before[layer])) > 1e-4 * max(np.max(np.abs(before[layer])), 1.0), \
                (path, layer)
    assert adapters == 5_120
    first, last = np.mean(losses[:3]), np.mean(losses[-3:])
    assert last < first - 0.2, losses
    saved = np.load(out)
    assert sorted(saved.files) == sorted(f"lora_{p}_{ab}" for p in ("wq", "wk", "wv", "wo") for ab in "ab")
    assert saved["lora_wq_a"].shape == (2, 96, 4) and saved["lora_wk_b"].shape == (2, 4, 32)
    for name in saved.files:
        np.testing.assert_array_equal(saved[name], trained["units"][name])
