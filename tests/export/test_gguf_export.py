"""``export --format gguf`` without llama.cpp: the file read back with the gguf package's own reader, and the
refusals before any work (issue 35, item 1). llama.cpp itself runs the file in tests/export/test_llamacpp.py.

Oracles: the keys llama.cpp's deepseek2 loader reads (llama-cpp-python 0.3.36, ``load_arch_hparams``) written as
numbers here; ``attn_k_b`` / ``attn_v_b`` checked through ggml's ``mul_mat`` semantics (``out[h, t, i] = sum_k
a[h, i, k] b[h, t, k]``, numpy) against the key and value rows of the DeepSeek-V3 export's ``kv_b_proj`` that stock
transformers runs (tests/export/test_deepseek_v3.py): the absorbed score ``(W_UK^T q) . c`` must equal ``q . (W_UK c)``.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from tiny import copy_tokenizer, write_tiny_family, write_tiny_llama
from typer.testing import CliRunner

import mla_convert  # noqa: F401
from mla_convert.cli.commands import app
from mla_convert.convert.options.options import ConvertOptions
from mla_convert.engines.llamacpp import gguf_file, gguf_vocab
from mla_convert.engines.precheck import export_problems
from mla_convert.sources.checkpoint import open_source

SMALL = ["--calib-tokens", "128", "--window", "64", "--eval-windows", "1"]
LLAMA3 = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory) -> Path:
    """A tiny MLA conversion (2 layers, 4 heads / 2 KV heads, SmolLM2's vocabulary)."""
    root = tmp_path_factory.mktemp("gguf")
    src = write_tiny_llama(root / "src")
    copy_tokenizer(src)
    out = root / "mla"
    res = CliRunner().invoke(app, ["--quiet", "factor", str(src), str(out), *SMALL, "--cache-budget", "40"])
    assert res.exit_code == 0, res.output + str(res.exception)
    return out


@pytest.fixture
def bundled_tokenizer(monkeypatch):
    """The tiny conversion's tokenizer is SmolLM2's: carry it from the bundled SmolLM2 GGUF."""
    from mla_convert.sources.assets import bundled_gguf_path

    monkeypatch.setattr(gguf_vocab, "source_gguf", lambda ckpt: bundled_gguf_path())


def _export(ckpt: Path, out: Path, *extra: str) -> str:
    res = CliRunner().invoke(app, ["export", str(ckpt), str(out), "--format", "gguf", "--no-check", *extra])
    assert res.exit_code == 0, res.output + str(res.exception)
    return res.output


def _read(path: Path) -> tuple[dict, dict]:
    from gguf import GGUFReader

    r = GGUFReader(str(path))
    return {k: f.contents() for k, f in r.fields.items()}, {t.name: t for t in r.tensors}


def test_gguf_keys_and_tensors_read_back(tiny_ckpt, bundled_tokenizer, tmp_path):
    from mla_convert.engines.deepseek_v3.mapping import export_state_dict
    from mla_convert.mla.checkpoint import load_checkpoint

    out = tmp_path / "tiny.gguf"
    output = _export(tiny_ckpt, out, "--dtype", "float32")
    assert f"wrote {out}: llama.cpp deepseek2 GGUF (float32)" in " ".join(output.split())
    keys, tensors = _read(out)
    model = load_checkpoint(tiny_ckpt).eval()
    plan, ds = export_state_dict(model, torch.float32)
    c = model.config
    d_c, d_r, h, d_n, d_v = max(c.kv_lora_rank), 2 * len(plan.rope.inv_freq), 4, plan.qk_nope_head_dim, plan.v_head_dim
    a = "deepseek2."
    assert keys["general.architecture"] == "deepseek2"
    assert keys[a + "block_count"] == 2 and keys[a + "leading_dense_block_count"] == 2
    assert keys[a + "attention.head_count"] == 4 and keys[a + "attention.head_count_kv"] == 1
    assert keys[a + "attention.q_lora_rank"] == 0 and keys[a + "attention.kv_lora_rank"] == d_c
    assert keys[a + "attention.key_length"] == d_c + d_r and keys[a + "attention.value_length"] == d_c
    assert keys[a + "attention.key_length_mla"] == d_n + d_r and keys[a + "attention.value_length_mla"] == d_v
    assert keys[a + "rope.dimension_count"] == d_r
    assert keys[a + "rope.freq_base"] == pytest.approx(plan.rope.parameters["rope_theta"], rel=1e-6)
    assert keys[a + "attention.layer_norm_rms_epsilon"] == pytest.approx(1e-6)
    assert keys[a + "expert_shared_count"] == 0 and keys[a + "expert_feed_forward_length"] == 128
    assert not any(k.startswith(a + "expert_count") or k.startswith(a + "expert_used") for k in keys)
    assert len(keys["tokenizer.ggml.tokens"]) == 49152 and keys["tokenizer.ggml.model"] == "gpt2"
    # the reserved parity field, filled in place: here with why nothing was measured
    assert json.loads(keys["mla_convert.parity"]) == {"not_measured": "parity not measured (--no-check)"}
    assert "<|im_start|>" in keys["tokenizer.chat_template"]
    expected = {"token_embd.weight", "output_norm.weight", "output.weight"} | {
        f"blk.{i}.{n}.weight" for i in range(2) for n in ("attn_norm", "ffn_norm", "attn_q", "attn_kv_a_mqa",
                                                           "attn_kv_a_norm", "attn_k_b", "attn_v_b", "attn_output",
                                                           "ffn_gate", "ffn_up", "ffn_down")}
    assert set(tensors) == expected
    # ggml shapes (ne, fastest first) as llama.cpp's loader creates them
    assert list(tensors["blk.0.attn_k_b.weight"].shape) == [d_n, d_c, h]
    assert list(tensors["blk.0.attn_v_b.weight"].shape) == [d_c, d_v, h]
    assert list(tensors["blk.0.attn_kv_a_mqa.weight"].shape) == [64, d_c + d_r]
    assert list(tensors["blk.0.attn_q.weight"].shape) == [64, h * (d_n + d_r)]
    for i in range(2):
        p = f"model.layers.{i}."
        for name, ours in (("attn_q", "self_attn.q_proj"), ("attn_kv_a_mqa", "self_attn.kv_a_proj_with_mqa"),
                           ("attn_kv_a_norm", "self_attn.kv_a_layernorm"), ("attn_output", "self_attn.o_proj"),
                           ("ffn_down", "mlp.down_proj")):
            np.testing.assert_array_equal(np.asarray(tensors[f"blk.{i}.{name}.weight"].data).reshape(-1),
                                          ds[p + ours + ".weight"].numpy().reshape(-1))
        kv_b = ds[p + "self_attn.kv_b_proj.weight"].double().view(h, d_n + d_v, d_c)
        k_b = torch.from_numpy(np.asarray(tensors[f"blk.{i}.attn_k_b.weight"].data).copy()).double()  # [H, d_c, d_N]
        v_b = torch.from_numpy(np.asarray(tensors[f"blk.{i}.attn_v_b.weight"].data).copy()).double()  # [H, d_V, d_c]
        q, lat = torch.randn(h, 5, d_n, dtype=torch.float64), torch.randn(7, d_c, dtype=torch.float64)
        q_abs = torch.einsum("hik,htk->hti", k_b, q)  # ggml_mul_mat(wk_b, q_nope)
        stock = torch.einsum("htk,hkc,jc->htj", q, kv_b[:, :d_n], lat)  # q . (W_UK c), DeepSeek-V3's kv_b rows
        torch.testing.assert_close(torch.einsum("hti,ji->htj", q_abs, lat), stock, rtol=1e-9, atol=1e-9)
        out_lat = torch.randn(h, 5, d_c, dtype=torch.float64)
        torch.testing.assert_close(torch.einsum("hji,hti->htj", v_b, out_lat),  # ggml_mul_mat(wv_b, latent_out)
                                   torch.einsum("hjc,htc->htj", kv_b[:, d_n:], out_lat), rtol=1e-9, atol=1e-9)
    np.testing.assert_array_equal(np.asarray(tensors["output.weight"].data), ds["lm_head.weight"].numpy())


def test_gguf_float_types(tiny_ckpt, bundled_tokenizer, tmp_path):
    """float16 keeps attn_kv_a_mqa float32 (its scaled latent rows are subnormal in float16); 1-D tensors are float32."""
    from gguf import GGMLQuantizationType as T

    for dtype, matrix in (("float16", T.F16), ("bfloat16", T.BF16)):
        out = tmp_path / f"{dtype}.gguf"
        _export(tiny_ckpt, out, "--dtype", dtype)
        _, tensors = _read(out)
        assert tensors["blk.0.attn_q.weight"].tensor_type == matrix
        assert tensors["blk.1.attn_k_b.weight"].tensor_type == matrix
        assert tensors["blk.0.attn_kv_a_norm.weight"].tensor_type == T.F32
        assert tensors["blk.0.attn_kv_a_mqa.weight"].tensor_type == (T.F32 if dtype == "float16" else T.BF16)
        assert tensors["blk.0.attn_kv_a_mqa.weight"].data.any()


def test_gguf_output_rules(tiny_ckpt, bundled_tokenizer, tmp_path, monkeypatch):
    """A folder OUT gets model.gguf; an existing file needs --overwrite; --target is refused; a quantized type without
    llama.cpp names the install command; nothing is left behind."""
    _export(tiny_ckpt, tmp_path / "folder", "--dtype", "float32")
    assert (tmp_path / "folder" / "model.gguf").is_file()
    runner = CliRunner()
    res = runner.invoke(app, ["export", str(tiny_ckpt), str(tmp_path / "folder"), "--format", "gguf", "--no-check"])
    assert res.exit_code != 0 and "pass --overwrite" in res.output
    res = runner.invoke(app, ["export", str(tiny_ckpt), str(tmp_path / "t.gguf"), "--format", "gguf", "--target",
                              "vllm-cpu"])
    assert res.exit_code != 0 and "drop --target" in " ".join(res.output.split())
    monkeypatch.delenv("MLA_LLAMACPP_PYTHON", raising=False)
    monkeypatch.setenv("MLA_LLAMACPP_VENV_ROOT", str(tmp_path / "none"))
    res = runner.invoke(app, ["export", str(tiny_ckpt), str(tmp_path / "q.gguf"), "--format", "gguf", "--dtype", "q8_0"])
    assert res.exit_code != 0 and "bash scripts/llamacpp_env.sh" in " ".join(res.output.split())
    monkeypatch.setenv("MLA_LLAMACPP_PYTHON", str(tmp_path / "no-such-python"))  # set: never ignored silently
    res = runner.invoke(app, ["export", str(tiny_ckpt), str(tmp_path / "q.gguf"), "--format", "gguf", "--dtype", "q8_0"])
    assert res.exit_code == 2 and "is not a file" in " ".join(res.output.split()), res.output
    for extra in (["--dtype", "float32"], ["--dtype", "q8_0"]):  # a .gguf OUT with the folder format
        res = runner.invoke(app, ["export", str(tiny_ckpt), str(tmp_path / "d.gguf"), *extra])
        text = " ".join(res.output.split())
        assert res.exit_code == 2 and "give --format gguf" in text, res.output
    res = runner.invoke(app, ["export", str(tiny_ckpt), str(tmp_path / "d"), "--dtype", "q8_0"])
    assert res.exit_code == 2 and "quantized types are for --format gguf" in " ".join(res.output.split())
    for block in ("16", "64", "0"):  # llama.cpp's quantized caches all store blocks of 32: 32 or 1, nothing else
        res = runner.invoke(app, ["export", str(tiny_ckpt), str(tmp_path / "b.gguf"), "--format", "gguf",
                                  "--cache-block", block])  # fmt: skip
        assert res.exit_code == 2 and f"--cache-block {block} is neither 32" in " ".join(res.output.split())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["folder"]


def test_folder_source_tokenizer_needs_llamacpps_converter(tiny_ckpt, tmp_path, monkeypatch):
    """A checkpoint converted from a Hugging Face folder carries the HF tokenizer, which only llama.cpp's own
    converter writes as GGUF keys: without a llama.cpp venv the export is refused with the fix, and without tokenizer
    files in the checkpoint too; nothing is written."""
    monkeypatch.delenv("MLA_LLAMACPP_PYTHON", raising=False)
    monkeypatch.setenv("MLA_LLAMACPP_VENV_ROOT", str(tmp_path / "no-venvs"))
    res = CliRunner().invoke(app, ["export", str(tiny_ckpt), str(tmp_path / "t.gguf"), "--format", "gguf"])
    text = " ".join(res.output.split())
    assert res.exit_code == 2 and "convert_hf_to_gguf.py --vocab-only" in text and "scripts/llamacpp_env.sh" in text
    bare = tmp_path / "bare"
    shutil.copytree(tiny_ckpt, bare)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (bare / name).unlink()
    res = CliRunner().invoke(app, ["export", str(bare), str(tmp_path / "t.gguf"), "--format", "gguf"])
    assert res.exit_code == 2 and "holds no tokenizer (tokenizer.json or tokenizer.model)" in " ".join(res.output.split())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bare"]


def test_hf_tokenizer_keys_equal_the_published_ggufs(llamacpp_python, tiny_ckpt, tmp_path, monkeypatch):
    """The HF tokenizer written by llama.cpp's converter (the tiny checkpoint carries SmolLM2's tokenizer files)
    equals what the model's publishers wrote into the bundled SmolLM2 GGUF (an oracle made by another conversion):
    vocabulary, token types, merges, special ids, the pre-tokenizer llama.cpp recognises."""
    from mla_convert.mla.configuration import MLAConfig
    from mla_convert.sources.assets import bundled_gguf_path

    monkeypatch.setenv("MLA_LLAMACPP_PYTHON", llamacpp_python)
    ours, origin = gguf_vocab.tokenizer_fields(tiny_ckpt, MLAConfig.from_pretrained(str(tiny_ckpt)))
    assert origin.startswith("the checkpoint's Hugging Face tokenizer")
    published = {k: v for k, v, *_ in gguf_vocab.gguf_tokenizer_fields(bundled_gguf_path())}
    mine = {k: v for k, v, *_ in ours}
    for key in ("tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.tokens", "tokenizer.ggml.token_type",
                "tokenizer.ggml.merges", "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id"):
        assert mine[key] == published[key], key
    assert mine["tokenizer.ggml.pre"] == "smollm" and len(mine["tokenizer.ggml.tokens"]) == 49152
    # tokenizer.json without tokenizer_config.json: no EOS, so llama.cpp could never stop; refused before any work
    no_eos = tmp_path / "no-eos"
    shutil.copytree(tiny_ckpt, no_eos)
    (no_eos / "tokenizer_config.json").unlink()
    res = CliRunner().invoke(app, ["export", str(no_eos), str(tmp_path / "t.gguf"), "--format", "gguf"])
    assert res.exit_code == 2 and "tokenizer has no EOS token" in " ".join(res.output.split())
    assert not (tmp_path / "t.gguf").exists()


def test_gguf_refusals_before_any_work(tmp_path):
    """Biases, per-head RoPE, a scaled RoPE selection and a non-SiLU MLP are refused from the config alone; factor
    --export gguf stops before the source's weights are read."""
    qwen2 = write_tiny_family(tmp_path / "qwen2", "qwen2")
    copy_tokenizer(qwen2)
    problems = export_problems(open_source(qwen2), ConvertOptions(cache_budget=24, rope_pairs=4), fmt="gguf")
    assert any("llama.cpp's deepseek2 attention has no biases" in p for p in problems)
    res = CliRunner().invoke(app, ["factor", str(qwen2), str(tmp_path / "out"), "--export", "gguf", *SMALL,
                                   "--cache-budget", "24"])
    assert res.exit_code != 0 and "would not be exact" in res.output and not (tmp_path / "out").exists()
    llama = write_tiny_llama(tmp_path / "llama")
    assert export_problems(open_source(llama), ConvertOptions(), fmt="gguf") == []
    per_head = export_problems(open_source(llama), ConvertOptions(rope_mode="per-head"), fmt="gguf")
    assert per_head and "use rope_mode shared" in per_head[0]
    assert export_problems(open_source(llama), ConvertOptions(dtype="float16"), fmt="gguf") == []  # float16 is fine
    scaled = write_tiny_llama(tmp_path / "llama3", rope_parameters=LLAMA3, max_position_embeddings=131072)
    given = export_problems(open_source(scaled), ConvertOptions(rope_strategy="2-norm", rope_pairs=6), fmt="gguf")
    assert any("llama3-scaled" in p and "--rope-strategy high" in p for p in given)
    gelu = write_tiny_llama(tmp_path / "gelu", hidden_act="gelu")
    assert any("SiLU only" in p for p in export_problems(open_source(gelu), ConvertOptions(), fmt="gguf"))
    assert any("drop --target" in p for p in export_problems(open_source(llama), ConvertOptions(), "vllm", "gguf"))


def test_recipe_gguf_export_is_checked_at_load(tmp_path):
    """A recipe's ``export: {format: gguf}`` is checked against llama.cpp before any work, in its own keys."""
    from mla_convert.recipes.load import load_recipe
    from mla_convert.recipes.schema import RecipeError

    text = ("name: t\nsource: smollm2-135m\noutput: " + str(tmp_path / "job") + "\n"
            "factor: {rope_strategy: rotation, rope_pairs: 40, cache_budget: 200}\nexport: {format: gguf}\n")
    with pytest.raises(RecipeError) as exc:
        load_recipe("t.yaml", text=text)
    assert any(p.startswith("export.target") and "factor.rope_pairs 32 or fewer" in p for p in exc.value.problems)
    ok = load_recipe("t.yaml", text=text.replace("rope_strategy: rotation, rope_pairs: 40, cache_budget: 200",
                                                 "rope_pairs: 24"))
    assert ok.recipe.export is not None and ok.recipe.export.format == "gguf"


def test_cache_block_rank():
    """The latent width that makes the latent and the K row whole blocks of 32 (llama.cpp's q8_0 / q4_0 caches):
    the reference's 93 + 64 -> 96 + 64; none when the rope width is not a multiple of the block."""
    assert gguf_file.cache_block_rank(93, 64, 32) == 96
    assert gguf_file.cache_block_rank(96, 64, 32) == 96
    assert gguf_file.cache_block_rank(1, 32, 32) == 32
    assert gguf_file.cache_block_rank(93, 48, 32) is None
    assert gguf_file.cache_block_rank(93, 64, 1) == 93


def test_cache_block_padding_is_the_same_function(tiny_ckpt):
    """``--cache-block`` pads the latent with zero columns: the padded plan's attention tensors hold the unpadded
    ones and zeros elsewhere, so llama.cpp computes the same function (``attn_k_b`` / ``attn_v_b`` never weigh the
    padded latent, whose rows of ``attn_kv_a_mqa`` are zero)."""
    from mla_convert.engines.deepseek_v3.mapping import export_attention
    from mla_convert.mla.checkpoint import load_checkpoint

    model = load_checkpoint(tiny_ckpt).eval()
    c = model.config
    plain = gguf_file.gguf_plan(c, "float32", 1)
    d_r = 2 * len(plain.rope.inv_freq)
    # pad to the next multiple of the rope width (a block the tiny model's rope width divides)
    padded = gguf_file.gguf_plan(c, "float32", d_r)
    width = gguf_file.cache_block_rank(max(c.kv_lora_rank), d_r, d_r)
    assert padded.kv_lora_rank == width and width % d_r == 0 and padded.cache_values_per_token["deepseek_v3"] == width + d_r
    layer = model.model.layers[0]
    attn = {k: v.detach() for k, v in layer.self_attn.state_dict().items()}
    gamma = layer.input_layernorm.weight.detach()
    a, b = export_attention(plain, c, 0, attn, gamma), export_attention(padded, c, 0, attn, gamma)
    d = plain.kv_lora_rank
    kv_a = b["kv_a_proj_with_mqa.weight"]
    assert torch.equal(kv_a[width:], a["kv_a_proj_with_mqa.weight"][d:])  # the rope rows
    assert not kv_a[d:width].any() and not b["kv_b_proj.weight"][:, d:].any()
    # the latent's scale depends on its width: the products kv_b . kv_a (what attention reads) are equal
    torch.testing.assert_close(b["kv_b_proj.weight"] @ (kv_a[:width] * b["kv_a_layernorm.weight"][:, None]),
                               a["kv_b_proj.weight"] @ (a["kv_a_proj_with_mqa.weight"][:d] *
                                                        a["kv_a_layernorm.weight"][:, None]), rtol=1e-5, atol=1e-6)
    assert torch.equal(a["q_proj.weight"], b["q_proj.weight"]) and torch.equal(a["o_proj.weight"], b["o_proj.weight"])
    assert "refuses a quantized cache" in gguf_file.cache_block_note(plain, 1) or d % 32 == 0
    assert f"zero-padded {max(c.kv_lora_rank)} -> {width}" in gguf_file.cache_block_note(padded, d_r) or d_r % 32


def test_factor_and_recipe_write_the_gguf(bundled_tokenizer, tmp_path, monkeypatch):
    """``factor --export gguf`` writes OUT.gguf beside OUT, and a recipe's ``export: {format: gguf}`` writes
    ``<output>/export/model.gguf`` with its parent's canonical id. A second run of the recipe skips every stage,
    although its factor stage searched the RoPE pairs, strategy and refit on the source (the manifest records the
    search's winners, the recipe resolves the prior: recipes/plan.py ``searched_keys``). No llama.cpp here (an empty
    venv root): the file says why its parity was not measured; tests/export/test_llamacpp.py serves one."""
    import yaml

    monkeypatch.delenv("MLA_LLAMACPP_PYTHON", raising=False)
    monkeypatch.setenv("MLA_LLAMACPP_VENV_ROOT", str(tmp_path / "no-llamacpp"))
    src = write_tiny_llama(tmp_path / "src")
    copy_tokenizer(src)
    out = tmp_path / "mla"
    res = CliRunner().invoke(app, ["factor", str(src), str(out), *SMALL, "--cache-budget", "40", "--rope-pairs", "4",
                                   "--export", "gguf"])  # fmt: skip
    assert res.exit_code == 0, res.output + str(res.exception)
    assert f"wrote {tmp_path / 'mla.gguf'}: llama.cpp deepseek2 GGUF (float32)" in " ".join(res.output.split())
    keys, tensors = _read(tmp_path / "mla.gguf")
    ranks = json.loads((out / "config.json").read_text())["kv_lora_rank"]
    assert keys["general.architecture"] == "deepseek2" and len(tensors) == 3 + 2 * 11
    d_r = keys["deepseek2.rope.dimension_count"]  # --cache-block 32: padded where the K row can be whole blocks
    assert keys["deepseek2.attention.kv_lora_rank"] == (-(-max(ranks) // 32) * 32 if d_r % 32 == 0 else max(ranks))
    assert json.loads(keys["mla_convert.parity"])["not_measured"].startswith("parity in llama.cpp not measured: no llama.cpp")

    recipe = tmp_path / "job.yaml"
    recipe.write_text(yaml.safe_dump({
        "name": "gguf", "source": str(src), "output": str(tmp_path / "job"),
        "factor": {"calib_tokens": 128, "window": 64, "eval_windows": 1, "cache_budget": 40},
        "adapt": None, "validate": {"enabled": False}, "export": {"format": "gguf", "dtype": "float32"},
    }, sort_keys=False))  # fmt: skip
    res = CliRunner().invoke(app, ["run", str(recipe)])
    assert res.exit_code == 0, res.output + str(res.exception)
    job = tmp_path / "job"
    keys, _ = _read(job / "export" / "model.gguf")
    assert keys["general.architecture"] == "deepseek2" and keys["general.file_type"] == 0  # float32
    parent = json.loads((job / "export" / "mla_manifest.json").read_text())["parent"]["canonical_id"]
    assert parent == json.loads((job / "factor" / "mla_manifest.json").read_text())["canonical_id"]
    made = json.loads((job / "factor" / "mla_manifest.json").read_text())["choices"]
    assert made["rope_pairs"].startswith("measured on this source: the lowest held-out KL in a local search")
    res = CliRunner().invoke(app, ["run", str(recipe)])
    assert res.exit_code == 0, res.output + str(res.exception)
    assert "factor: skipped, up to date" in res.output and "export: skipped" in res.output, res.output


def test_gguf_refuses_attention_biases_in_gguf_words():
    """A Qwen2-style conversion's biases have no tensor in llama.cpp's deepseek2 graph: the GGUF export says so in
    GGUF's terms (what each bias it has does, and the lossy option), not with the DeepSeek-V3 export's message about
    vLLM and SGLang (issue 50)."""
    from types import SimpleNamespace

    from mla_convert.engines.deepseek_v3.mapping import ExportError
    from mla_convert.engines.llamacpp.gguf_file import gguf_plan

    config = SimpleNamespace(hidden_act="silu", q_bias=True, kv_a_bias=True, o_bias=False)
    with pytest.raises(ExportError) as refused:
        gguf_plan(config, "bfloat16")
    message = str(refused.value)
    assert "no GGUF export is exact" in message and "deepseek2" in message
    assert "q_proj.bias (the query bias" in message and "kv_a_proj_with_mqa.bias (the rope key's bias" in message
    assert "o_proj.bias" not in message  # the parts this config has, no other
    assert "--drop-attention-biases" in message  # the lossy route, named
    assert "SGLang" not in message and "DeepSeek-V3 export" not in message


def test_our_gguf_is_named_as_such_where_only_llamacpp_reads_it(tiny_ckpt, tmp_path, bundled_tokenizer):
    """Perplexity, ``--engine transformers`` and ``factor`` on an mla-convert GGUF export say that llama.cpp runs
    it and that everything else reads the MLA folder it came from (a fresh user got "unsupported GGUF architecture
    'deepseek2' ... the model already uses MLA", the message for converting a source)."""
    out = tmp_path / "m.gguf"
    _export(tiny_ckpt, out)
    (tmp_path / "he").mkdir()  # an earlier run's folder: the GGUF is named first, not "pass --overwrite"
    for args in (["eval", str(out)], ["eval", str(out), "--task", "humaneval", "--engine", "transformers", "--limit",
                 "1", "--out", str(tmp_path / "he")], ["factor", str(out), str(tmp_path / "again")]):
        res = CliRunner().invoke(app, args)
        text = " ".join(res.output.split())
        assert res.exit_code == 2 and "is an mla-convert GGUF export" in text and "--engine llama.cpp" in text, text
    assert sorted(p.name for p in tmp_path.iterdir()) == ["he", "m.gguf"] and not any((tmp_path / "he").iterdir())
