"""Every GGUF key and tensor that changes the model's function is read exactly or refused by name.

Tiny random Hugging Face models are written as GGUF files the way llama.cpp's ``convert_hf_to_gguf.py`` writes
them (its key set, its q/k row permutation, Llama-3.1's ``llama3`` RoPE scaling as the ``rope_freqs.weight``
divisors, linear/YaRN scaling as ``rope.scaling.*`` keys, biases as ``blk.N.attn_*.bias``). transformers' own
GGUF load drops the scaling and the llama biases, so the reference is the Hugging Face model the file was
written from: its frequencies, attention factor and logits.
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from gguf import GGUFWriter
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel
from transformers.convert_slow_tokenizer import bytes_to_unicode

from mla_convert.sources import gguf as gguf_source
from mla_convert.sources.checkpoint import load_source_model, open_source
from mla_convert.sources.locate import SourceError

#: Refusals come from the metadata and tensor table alone, before the file is hashed.
REFUSAL_SECONDS = 1.0
#: head_dim 64 with theta 500000: three RoPE pairs between llama3's two wavelength thresholds.
SHAPE: dict[str, Any] = dict(
    hidden_size=128,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    vocab_size=300,
    max_position_embeddings=65536,
)
LLAMA31 = {
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
HF_TO_GGUF = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def _model(model_type: str, seed: int = 0, **extra: Any) -> PreTrainedModel:
    torch.manual_seed(seed)
    config = AutoConfig.for_model(model_type, **{**SHAPE, **extra})
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.5)  # visible biases
    return model


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's q/k row permutation (rotate_half pairs -> interleaved pairs), weights and biases."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama_cpp_rope_factors(theta: float, dim: int, rope: dict[str, Any]) -> np.ndarray:
    """``rope_freqs.weight`` as llama.cpp's ``LlamaModel.generate_extra_tensors`` computes it (float32)."""
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old = rope["original_max_position_embeddings"]
    out: list[Any] = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            out.append(1)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return torch.tensor(out, dtype=torch.float32).numpy()


def write_gguf(
    model: PreTrainedModel,
    path: Path,
    keys: dict[str, Any] | None = None,
    tensors: dict[str, np.ndarray] | None = None,
    name: str = "tiny",
    drop: tuple[str, ...] = (),
    skip_keys: tuple[str, ...] = (),
) -> Path:
    """``model`` as llama.cpp writes it: arch ``llama`` (Llama, Mistral) or ``qwen2``, its metadata keys, a
    byte-level BPE vocabulary of ``vocab_size`` tokens, the q/k rows permuted for ``llama``, then ``keys``
    (full names, added as is) and ``tensors``; tensors named in ``drop`` and keys in ``skip_keys`` are left out."""
    c = model.config
    arch = "qwen2" if c.model_type == "qwen2" else "llama"
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    w = GGUFWriter(str(path), arch=arch)
    w.add_name(name)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_block_count(c.num_hidden_layers)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    if "llama.attention.layer_norm_rms_epsilon" not in skip_keys:
        w.add_layer_norm_rms_eps(c.rms_norm_eps)
    if arch == "llama":
        w.add_vocab_size(c.vocab_size)
        w.add_rope_dimension_count(head_dim)
    tokens = list(bytes_to_unicode().values())
    tokens += ["Ġt"] + [f"<x{i}>" for i in range(c.vocab_size - len(tokens) - 1)]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_merges(["Ġ t"])
    w.add_bos_token_id(0)
    w.add_eos_token_id(1)
    for key, value in (keys or {}).items():
        if isinstance(value, bool):
            w.add_bool(key, value)
        elif isinstance(value, int):
            w.add_uint32(key, value)
        elif isinstance(value, float):
            w.add_float32(key, value)
        else:
            w.add_string(key, value)
    state = model.state_dict()
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}
    if not c.tie_word_embeddings:
        names["lm_head.weight"] = "output.weight"
    for i in range(c.num_hidden_layers):
        for hf, gg in HF_TO_GGUF.items():
            for kind in ("weight", "bias"):
                if f"model.layers.{i}.{hf}.{kind}" in state:
                    names[f"model.layers.{i}.{hf}.{kind}"] = f"blk.{i}.{gg}.{kind}"
    for hf, gg in names.items():
        if gg in drop:
            continue
        t = state[hf].float().numpy()
        if arch == "llama" and ".attn_q." in gg:
            t = _permute(t, c.num_attention_heads)
        if arch == "llama" and ".attn_k." in gg:
            t = _permute(t, c.num_key_value_heads)
        w.add_tensor(gg, t)
    for gg, t in (tensors or {}).items():
        w.add_tensor(gg, t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(autouse=True)
def private_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    cache = tmp_path / "cache"
    monkeypatch.setenv("MLA_CONVERT_CACHE", str(cache))
    return cache


def _hf_rope(model: PreTrainedModel) -> tuple[torch.Tensor, float]:
    rot = model.model.rotary_emb
    return rot.inv_freq.detach().double(), float(rot.attention_scaling)


def _logits(model: PreTrainedModel, start: int) -> torch.Tensor:
    """Logits of 16 tokens at positions ``start..start+15`` (long positions make the RoPE scaling visible)."""
    ids = torch.arange(2, 18).unsqueeze(0)
    with torch.no_grad():
        return model(ids, position_ids=torch.arange(start, start + 16).unsqueeze(0)).logits


# ----------------------------------------------------------------------------------------------
# read exactly
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "rope",
    [
        LLAMA31,  # Llama-3.1
        {**LLAMA31, "factor": 32.0},  # Llama-3.2
        {
            "factor": 16.0,
            "low_freq_factor": 2.0,
            "high_freq_factor": 6.0,
            "original_max_position_embeddings": 4096,
        },
    ],
    ids=["llama3.1", "llama3.2", "other"],
)
def test_rope_freqs_tensor_read_as_llama3_scaling(tmp_path: Path, rope: dict[str, Any]) -> None:
    theta = 500000.0
    model = _model("llama", rope_parameters={"rope_type": "llama3", "rope_theta": theta, **rope})
    factors = llama_cpp_rope_factors(theta, 64, rope)
    assert 1.0 < factors.max() and 2 <= int(((factors > 1) & (factors < factors.max())).sum())
    file = write_gguf(model, tmp_path / "llama3.gguf", tensors={"rope_freqs.weight": factors})
    src = open_source(file)
    want, scaling = _hf_rope(model)
    assert src.config.rope_parameters["rope_type"] == "llama3" and src.attention_scaling == scaling == 1.0
    assert torch.allclose(src.inv_freq.double(), want, rtol=1e-6, atol=0)
    # the frequencies the file means: llama.cpp's theta^(-2k/d) / factor, whatever the fitted parameters
    base = 1.0 / (theta ** (torch.arange(0, 64, 2, dtype=torch.float64) / 64))
    assert torch.allclose(src.inv_freq.double(), base / torch.from_numpy(factors).double(), rtol=1e-6, atol=0)
    assert src.reader.unmapped == ["rope_freqs.weight"]  # type: ignore[attr-defined]
    got = _logits(load_source_model(src), 60000)
    ref = _logits(model, 60000)
    assert (got - ref).abs().max().item() < 1e-4, (got - ref).abs().max().item()


@pytest.mark.parametrize(
    "rope, keys",
    [
        ({"rope_type": "linear", "factor": 4.0}, {"rope.scaling.type": "linear", "rope.scaling.factor": 4.0}),
        ({"rope_type": "linear", "factor": 2.0}, {"rope.scaling.factor": 2.0}),  # llama.cpp's default type
        (
            {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8192},
            {
                "rope.scaling.type": "yarn",
                "rope.scaling.factor": 4.0,
                "rope.scaling.original_context_length": 8192,
            },
        ),
        (
            {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8192, "beta_fast": 16.0},
            {
                "rope.scaling.type": "yarn",
                "rope.scaling.factor": 4.0,
                "rope.scaling.original_context_length": 8192,
                "rope.scaling.yarn_beta_fast": 16.0,
            },
        ),
    ],
    ids=["linear", "linear-untyped", "yarn", "yarn-beta"],
)
@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
def test_rope_scaling_keys_read(
    tmp_path: Path, model_type: str, rope: dict[str, Any], keys: dict[str, Any]
) -> None:
    model = _model(model_type, rope_parameters={"rope_theta": 10000.0, **rope})
    arch = "qwen2" if model_type == "qwen2" else "llama"
    file = write_gguf(model, tmp_path / "scaled.gguf", keys={f"{arch}.{k}": v for k, v in keys.items()})
    src = open_source(file)
    want, scaling = _hf_rope(model)
    assert src.config.rope_parameters["rope_type"] == rope["rope_type"]
    assert torch.equal(src.inv_freq.double(), want) and src.attention_scaling == pytest.approx(
        scaling, rel=1e-7
    )
    got = _logits(load_source_model(src), 30000)
    assert (got - _logits(model, 30000)).abs().max().item() < 1e-4


def test_llama_attention_biases_read(tmp_path: Path) -> None:
    model = _model(
        "llama", attention_bias=True, rope_parameters={"rope_type": "default", "rope_theta": 10000.0}
    )
    file = write_gguf(model, tmp_path / "bias.gguf")
    src = open_source(file)
    assert src.config.attention_bias and all(src.family.has_bias(p, src.config) for p in "qkvo")
    assert src.has("model.layers.1.self_attn.k_proj.bias")
    for name, value in model.state_dict().items():
        if name.endswith("bias"):
            assert torch.equal(src.tensor(name, torch.float32), value), name  # q/k biases un-permuted
    got = _logits(load_source_model(src), 0)
    assert (got - _logits(model, 0)).abs().max().item() < 1e-5


def test_mistral_file_runs_full_attention(tmp_path: Path) -> None:
    """llama.cpp runs a Mistral file with full attention; MistralConfig's default window (4096) must not
    come in (it used to refuse every Mistral GGUF with a context over 4096)."""
    model = _model(
        "mistral", sliding_window=None, rope_parameters={"rope_type": "default", "rope_theta": 1e6}
    )
    file = write_gguf(model, tmp_path / "mistral.gguf", name="mistral")
    src = open_source(file)
    assert src.config.model_type == "mistral" and src.config.sliding_window is None
    got = _logits(load_source_model(src), 0)
    assert (got - _logits(model, 0)).abs().max().item() < 1e-5


def test_unscaled_file_unchanged(tmp_path: Path) -> None:
    model = _model("llama", rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    ones = np.ones(32, dtype=np.float32)  # an all-ones rope_freqs is no scaling
    src = open_source(write_gguf(model, tmp_path / "plain.gguf", tensors={"rope_freqs.weight": ones}))
    assert src.config.rope_parameters == {"rope_type": "default", "rope_theta": 10000.0}
    assert torch.equal(src.inv_freq.double(), _hf_rope(model)[0])


# ----------------------------------------------------------------------------------------------
# refused by name: one line, before hashing, nothing cached
# ----------------------------------------------------------------------------------------------


def _refused(file: Path, cache: Path) -> str:
    t0 = time.perf_counter()
    with pytest.raises(SourceError) as info:
        open_source(file)
    assert time.perf_counter() - t0 < REFUSAL_SECONDS
    message = str(info.value)
    assert "\n" not in message and str(file) in message, message
    assert not (cache / gguf_source.CACHE_SUBDIR).exists()
    return message


@pytest.mark.parametrize(
    "key, value, said",
    [
        ("llama.expert_count", 8, "mixture of experts"),
        ("llama.attention.causal", False, "non-causal"),
        ("llama.attn_logit_softcapping", 50.0, "soft-capping"),
        ("llama.final_logit_softcapping", 30.0, "soft-capping"),
        ("llama.logit_scale", 0.5, "scaled output logits"),
        ("llama.embedding_scale", 12.0, "scaled input embeddings"),
        ("llama.attention.sliding_window", 4096, "sliding-window"),
        ("llama.rope.scaling.type", "longrope", "not supported"),
        ("llama.rope.dimension_count_swa", 32, "not one mla-convert reads"),
        ("llama.attention.scale", 0.1, "not one mla-convert reads"),
        ("llama.rope.scaling.alpha", 1000.0, "not one mla-convert reads"),
        ("llama.attention.key_length", 128, "head width"),
        ("general.type", "adapter", "merge it"),
        ("split.count", 2, "llama-gguf-split --merge"),
    ],
)
def test_function_keys_refused(tmp_path: Path, private_cache: Path, key: str, value: Any, said: str) -> None:
    model = _model("llama")
    file = write_gguf(model, tmp_path / "bad.gguf", keys={key: value})
    message = _refused(file, private_cache)
    assert key in message and said in message, message


def test_missing_norm_epsilon_refused(tmp_path: Path, private_cache: Path) -> None:
    """Without the key transformers would use LlamaConfig's 1e-6 where the model was trained with another."""
    model = _model("llama", rms_norm_eps=1e-5)
    file = write_gguf(model, tmp_path / "no-eps.gguf", skip_keys=("llama.attention.layer_norm_rms_epsilon",))
    message = _refused(file, private_cache)
    assert "has no llama.attention.layer_norm_rms_epsilon" in message


def test_partial_rotary_refused(tmp_path: Path, private_cache: Path) -> None:
    file = write_gguf(_model("qwen2"), tmp_path / "partial.gguf", keys={"qwen2.rope.dimension_count": 32})
    message = _refused(file, private_cache)
    assert "qwen2.rope.dimension_count = 32" in message and "partial rotary" in message


@pytest.mark.parametrize(
    "model_type, extra, drop, said",
    [
        ("llama", {"blk.0.ffn_up.bias": np.ones(96, np.float32)}, (), "'blk.0.ffn_up.bias' (a bias)"),
        ("llama", {"blk.0.ffn_gate_inp.weight": np.ones((4, 128), np.float32)}, (), "an MoE router"),
        ("llama", {"blk.0.attn_qkv.weight": np.ones((256, 128), np.float32)}, (), "a fused QKV projection"),
        (
            "llama",
            {"blk.0.attn_rot_embd.weight": np.ones(32, np.float32)},
            (),
            "'blk.0.attn_rot_embd.weight'",
        ),
        ("llama", {"token_embd_norm.weight": np.ones(128, np.float32)}, (), "'token_embd_norm.weight'"),
        ("qwen2", {"blk.1.attn_output.bias": np.ones(128, np.float32)}, (), "'blk.1.attn_output.bias'"),
        ("qwen2", {"rope_freqs.weight": np.full(32, 2.0, np.float32)}, (), "not read by llama.cpp"),
    ],
)
def test_unused_tensors_refused(
    tmp_path: Path,
    private_cache: Path,
    model_type: str,
    extra: dict[str, np.ndarray],
    drop: tuple[str, ...],
    said: str,
) -> None:
    file = write_gguf(_model(model_type), tmp_path / "extra.gguf", tensors=extra, drop=drop)
    message = _refused(file, private_cache)
    assert said in message and "convert the original Hugging Face checkpoint" in message, message


def test_partial_llama_biases_refused(tmp_path: Path, private_cache: Path) -> None:
    model = _model("llama", attention_bias=True)
    file = write_gguf(
        model, tmp_path / "qkv-bias.gguf", drop=("blk.0.attn_output.bias", "blk.1.attn_output.bias")
    )
    message = _refused(file, private_cache)
    assert "'blk.0.attn_output.bias' is not" in message and "all of q/k/v/o or on none" in message


def test_unreproducible_rope_freqs_refused(tmp_path: Path, private_cache: Path) -> None:
    factors = np.linspace(1.0, 3.0, 32).astype(np.float32)[::-1].copy()  # decreasing: no llama3 scaling
    file = write_gguf(_model("llama"), tmp_path / "odd.gguf", tensors={"rope_freqs.weight": factors})
    with pytest.raises(SourceError, match="'rope_freqs.weight' scales the RoPE frequencies") as info:
        open_source(file)
    assert "\n" not in str(info.value)
