"""Hugging Face weights in and out, against transformers' LlamaForCausalLM itself.

In: a model made and saved by transformers (`save_pretrained`), streamed into jfsdp's shards, gives
transformers' logits, on 2x8 and on 2x2 with tensor parallelism 2. Out: a jfsdp checkpoint exported
with `python -m jfsdp.export` loads in transformers (`from_pretrained`) and gives jfsdp's logits. A
tokenizer trained with `tokenizers` beside the weights drives train.py's text data, from the HF weights
at --tensor 2."""
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jfsdp
import models
from models import factory
from jfsdp.io import checkpoint as jckpt
from jfsdp import export as jexport
from jfsdp.io import hf

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

SEQ = 24


def make_hf_model(folder: Path, tied: bool):
    """A small Llama by transformers: GQA 6:2 heads, hidden 96, vocabulary 259, random weights
    (norm scales perturbed so that applying them is visible)."""
    torch.manual_seed(0 if tied else 1)
    cfg = transformers.LlamaConfig(vocab_size=259, hidden_size=96, intermediate_size=200, num_hidden_layers=2,
                                   num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=128,
                                   tie_word_embeddings=tied, rms_norm_eps=1e-5)
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(folder)
    return model


def hf_logits(model, tokens):
    with torch.no_grad():
        return model(torch.from_numpy(tokens)).logits.numpy()


def jfsdp_logits(plan, params, tokens):
    return np.asarray(jax.jit(plan.apply)(params, jax.device_put(tokens.astype(np.int32), plan.batch_sharding)))


def plan_for(folder, mesh="2x8", tensor=1):
    """jfsdp's Llama of the folder's config.json on `mesh` (x `tensor`: then with its TP plan, models/factory.py)."""
    cfg = models.LlamaConfig(**hf.read_config(folder))
    root, unit, n = models.parts(cfg)
    tok = jax.ShapeDtypeStruct((1, SEQ), jnp.int32)
    if tensor == 1:
        return cfg, jfsdp.fully_shard(jfsdp.Stacked(root, unit, n), jfsdp.make_mesh(mesh), tok)
    mesh = jfsdp.make_mesh(mesh, tensor=tensor, devices=jax.devices()[:jfsdp.MeshSpec(*jfsdp.parse_mesh(mesh), tensor).devices])
    return cfg, jfsdp.fully_shard(jfsdp.Stacked(root, unit, n), mesh, tok, tensor_plan=factory.tensor_plan(cfg))


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_init_from_and_export_match_transformers(tmp_path, tied, monkeypatch, capsys):
    src, out = tmp_path / "hf", tmp_path / "exported"
    model = make_hf_model(src, tied)
    assert ("lm_head.weight" in json.dumps(
        __import__("safetensors").safe_open(str(src / "model.safetensors"), "numpy").keys())) == (not tied)
    tokens = np.random.default_rng(0).integers(0, 259, (16, SEQ))
    cfg, plan = plan_for(src)
    assert cfg.tie_embeddings == tied and cfg.n_kv_heads == 2 and cfg.vocab_size == 259

    # in: streamed straight into shards. Every read from the file is one device's rows (at most 1/8
    # of a tensor on 8 shards, plus one row where a flat shard starts and ends mid-row: the 259-row
    # embedding is flat on 8 shards, 3108 elements = 32.4 rows each), and each leaf arrives placed
    reads, real_read = [], hf.read_slice
    monkeypatch.setattr(hf, "read_slice", lambda f, name, tr, rows, rest: reads.append(
        (name, rows.stop - rows.start)) or real_read(f, name, tr, rows, rest))
    params = hf.load_params(plan, str(src))
    assert reads and all(n <= -(-{"embed": 259, "gate_": 96, "up_pr": 96, "down_": 200}.get(
        name.split(".")[-2][:5] if "mlp" in name else name.split(".")[1][:5], 96) // 8) + 1 for name, n in reads), reads
    emb = params["root"]["tok_embeddings"]["embedding"]
    assert emb.sharding == plan.param_shardings["root"]["tok_embeddings"]["embedding"]
    assert {s.data.shape for s in emb.addressable_shards} == {(3108, 1)}   # 259*96 / 8 elements, flat
    np.testing.assert_array_equal(np.asarray(emb)[259 * 96:], 0)   # padding (none here: 8 divides 24864)
    theirs = hf_logits(model, tokens)
    np.testing.assert_allclose(jfsdp_logits(plan, params, tokens), theirs, rtol=1e-4, atol=1e-5)

    # in, tensor-parallel (2x2 --tensor 2): the TP kernels split into their 2 slices and the vocabulary-parallel
    # embedding (and untied head) padded to 2 x 130 rows, each leaf placed as the plan wants it. The file is
    # still read by rows, 1/4 of a tensor (plus a row) at most: a TP leaf as its whole parameter's rows over
    # fsdp x tensor, then split on the devices (io/tensor_rows.py); every other leaf as at T = 1
    reads.clear()
    tp = plan_for(src, "2x2", tensor=2)[1]
    tp_params = hf.load_params(tp, str(src))
    assert reads and all(n <= -(-{"embed": 259, "gate_": 96, "up_pr": 96, "down_": 200}.get(
        name.split(".")[-2][:5] if "mlp" in name else name.split(".")[1][:5], 96) // 4) + 1 for name, n in reads), reads
    assert all(jax.tree.leaves(jax.tree.map(lambda x, s: x.sharding.is_equivalent_to(s, x.ndim), tp_params,
                                            tp.param_shardings)))
    emb = tp_params["root"]["tok_embeddings"]["embedding"]
    assert emb.shape == (2 * 130, 96) and not np.asarray(emb)[259].any()   # slice 1's padding row is zeros
    np.testing.assert_allclose(jfsdp_logits(tp, tp_params, tokens), theirs, rtol=1e-4, atol=1e-5)

    # out: a checkpoint (after one training step, so the weights are jfsdp's own) exported and loaded back
    opt = jfsdp.adamw(1e-3, mask=plan.decay_mask())
    state = jfsdp.init_state(plan, opt, params=params)
    batch = {"inputs": tokens.astype(np.int32), "targets": np.roll(tokens, -1, 1).astype(np.int32)}
    state, _ = jfsdp.make_train_step(plan, opt, models.loss_fn(cfg))(state, jax.device_put(batch, plan.batch_sharding))
    c = jckpt.Checkpointer(tmp_path / "ck")
    c.save(1, state, {"model_config": __import__("dataclasses").asdict(cfg), "tokenizer": None}, plan=plan)
    c.wait()
    c.close()
    assert jexport.main([str(tmp_path / "ck"), str(out)]) == 0   # the command's main, in-process
    assert "exported checkpoint 1" in capsys.readouterr().out
    back = transformers.LlamaForCausalLM.from_pretrained(out).eval()
    assert back.config.tie_word_embeddings == tied and back.config.num_key_value_heads == 2
    ours = jfsdp_logits(plan, state.params, tokens)
    np.testing.assert_allclose(hf_logits(back, tokens), ours, rtol=1e-4, atol=1e-5)
    assert not np.allclose(ours, theirs, atol=1e-3)   # the step changed the model: the export is not the input


def test_tokenizer_json_drives_train_py(tmp_path, train_main):
    from tokenizers import Tokenizer, models as tm, pre_tokenizers, trainers, decoders
    src = tmp_path / "hf"
    make_hf_model(src, tied=True)
    text = Path(__file__).read_text() * 2      # Python source, as train.py's default corpus
    data = tmp_path / "some.txt"
    data.write_text(text)
    tok = Tokenizer(tm.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([text], trainers.BpeTrainer(vocab_size=250, special_tokens=["</s>"],
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(src / "tokenizer.json"))
    eos = tok.token_to_id("</s>")
    m = tmp_path / "m.jsonl"
    # train.py's main in this process; the mesh takes the first 4 of this session's 16 devices
    r = train_main(["--init-from", src, "--data", data, "--mesh", "1x2", "--tensor", "2", "--batch-size", "4",
                    "--seq-len", "32", "--steps", "4", "--log-every", "1", "--eval-every", "0", "--prompt",
                    "def unshard(", "--gen-tokens", "5", "--temperature", "0", "--metrics-out", m,
                    "--ckpt-dir", tmp_path / "ck"])
    assert r.returncode == 0, r.stderr
    assert f"text tokenized with {src / 'tokenizer.json'}" in r.stdout
    assert "mesh 1x2 --tensor 2 (1 replicas x 2 shards x 2 tensor-parallel ranks)" in r.stdout
    # the corpus is the tokenizer's ids: as many tokens as the tokenizer gives (plus the end of text), not bytes
    n_tokens = len(tok.encode(text).ids) + 1
    line = next(l for l in r.stdout.splitlines() if l.startswith("data "))
    n_train = int(line.split(" train / ")[0].split()[-1].replace(",", ""))
    n_val = int(line.split(" train / ")[1].split()[0].replace(",", ""))
    assert n_train + n_val == n_tokens and eos is not None
    assert "[prompt]def unshard([model]" in r.stdout
    # training starts from the HF weights: the loss of step 1 is transformers' loss on batch 0 of the same data
    from jfsdp.io import data as jdata
    corpus = jdata.load_tokens(str(data), 259, tokenizer=str(src / "tokenizer.json"))
    assert corpus.val[-1] == eos      # one document, split at its tail: the end-of-text token closes it
    b0 = jdata.Loader(corpus, 4, 32, seed=0).batch(0)
    model = transformers.LlamaForCausalLM.from_pretrained(src).eval()
    logp = torch.log_softmax(torch.from_numpy(hf_logits(model, b0["inputs"]).astype(np.float64)), -1).numpy()
    want = -np.take_along_axis(logp, b0["targets"][..., None], -1).mean()
    first = next(x for x in map(json.loads, m.read_text().splitlines()) if x.get("step") == 1 and "loss" in x)
    np.testing.assert_allclose(first["loss"], want, rtol=1e-5)
    meta = jckpt.Checkpointer(tmp_path / "ck").read_meta(4)
    assert meta["tokenizer"] == str(src / "tokenizer.json") and meta["model_config"]["n_kv_heads"] == 2


def test_bad_folders_are_one_line_errors(tmp_path, capsys):
    assert jexport.main([str(tmp_path / "nope"), str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err.strip() == f"error: {tmp_path / 'nope'}: no such checkpoint folder"
    (tmp_path / "empty").mkdir()
    assert jexport.main([str(tmp_path / "empty"), str(tmp_path / "out")]) == 2
    assert "no complete checkpoint" in capsys.readouterr().err
    with pytest.raises(jfsdp.ConfigError, match="config.json: missing"):
        hf.read_config(str(tmp_path / "empty"))
    (tmp_path / "empty" / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_act": "gelu"}))
    with pytest.raises(jfsdp.ConfigError, match=r"empty/config.json: hidden_act='gelu' is not supported"):
        hf.read_config(str(tmp_path / "empty"))
