"""GGUF sources are read tensor by tensor from the file: exactly what transformers' own GGUF loader gives,
without a float32 copy of the model; unsupported, truncated or corrupt files are refused in one line,
from the metadata, in well under a second.

The exactness test uses the bundled SmolLM2-135M-Instruct Q4_1 GGUF (Q4_1, Q8_0 and F32 tensors, GQA, tied
embeddings); the storage-type and refusal tests write tiny GGUF files with ``gguf.GGUFWriter``.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import quantize

from mla_convert.sources import gguf as gguf_source
from mla_convert.sources.checkpoint import SourceModel, load_source_model, open_source
from mla_convert.sources.locate import SourceError

#: The refusals must come from the metadata alone, before any hashing or transformers parsing.
REFUSAL_SECONDS = 1.0


def _write_gguf(
    path: Path,
    arch: str,
    tensors: dict[str, tuple[np.ndarray, GGMLQuantizationType]],
    vocab: int = 0,
    shape: tuple[int, int, int] | None = None,
) -> Path:
    """A GGUF file of ``arch`` holding ``tensors`` (name -> (float32 values, storage type)) and, when
    ``vocab``, a ``tokenizer.ggml.tokens`` array of that many strings (as a real model's header has);
    ``shape = (layers, hidden, heads)`` adds the keys llama.cpp always writes (and the reader requires)."""
    writer = GGUFWriter(str(path), arch=arch)
    writer.add_name("tiny")
    if shape is not None:
        writer.add_block_count(shape[0])
        writer.add_embedding_length(shape[1])
        writer.add_head_count(shape[2])
        writer.add_layer_norm_rms_eps(1e-5)
    if vocab:
        writer.add_token_list([f"tok{i}" for i in range(vocab)])
    for name, (values, qtype) in tensors.items():
        if qtype == GGMLQuantizationType.F32:
            writer.add_tensor(name, values.astype(np.float32))
        elif qtype == GGMLQuantizationType.F16:
            writer.add_tensor(name, values.astype(np.float16))
        else:
            writer.add_tensor(name, quantize(values.astype(np.float32), qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _one_line_error(spec: Path | str) -> tuple[str, float]:
    t0 = time.perf_counter()
    with pytest.raises(SourceError) as info:
        open_source(spec)
    seconds = time.perf_counter() - t0
    message = str(info.value)
    assert "\n" not in message and message, message
    return message, seconds


@pytest.fixture
def private_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    cache = tmp_path / "cache"
    monkeypatch.setenv("MLA_CONVERT_CACHE", str(cache))
    return cache


# ----------------------------------------------------------------------------------------------
# the bundled SmolLM2 GGUF: exact against transformers' full load
# ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def reference(smol: SourceModel) -> dict[str, torch.Tensor]:
    """transformers' own full GGUF load (all tensors dequantized at once), float32 state dict."""
    from transformers import AutoModelForCausalLM

    gguf = smol.gguf_file
    assert gguf is not None
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_every_tensor_equals_transformers_gguf_load(
    smol: SourceModel, reference: dict[str, torch.Tensor]
) -> None:
    names = smol.tensor_names()
    assert len(names) == len(set(names)) == 272 and set(names) == set(smol.weight_map)
    # tied lm_head: transformers' state dict has it (the embedding itself); the file, and weight_map, do not
    assert set(reference) - set(names) == {"lm_head.weight"}
    assert smol.config.tie_word_embeddings and not smol.has("lm_head.weight")
    assert smol.has("model.embed_tokens.weight")
    assert torch.equal(reference["lm_head.weight"], reference["model.embed_tokens.weight"])
    for name in names:
        got = smol.tensor(name, torch.float32)
        assert got.shape == reference[name].shape == smol.shape(name), name
        assert torch.equal(got, reference[name]), (name, (got - reference[name]).abs().max().item())
    # the default float64 read is the same values, widened
    q = "model.layers.7.self_attn.q_proj.weight"
    assert torch.equal(smol.tensor(q), reference[q].double())
    att = smol.attention_weights(3)
    assert set(att) == {"q", "k", "v", "o"} and att["k"].dtype == torch.float64
    assert torch.equal(att["k"], reference["model.layers.3.self_attn.k_proj.weight"].double())


def test_load_source_model_equals_transformers_gguf_load(
    smol: SourceModel, reference: dict[str, torch.Tensor]
) -> None:
    model = load_source_model(smol)
    state = model.state_dict()
    assert set(state) == set(reference)
    for name, value in reference.items():
        assert torch.equal(state[name], value), name
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()  # still tied
    assert getattr(model, "hf_quantizer", None) is None and not hasattr(model.config, "quantization_config")
    assert not model.training and model.config._attn_implementation == "eager"


def test_smollm2_source_facts(smol: SourceModel) -> None:
    gguf = smol.gguf_file
    assert gguf is not None and smol.origin_files == [gguf]
    assert smol.describe()["weights"] == f"GGUF file {gguf.name} (Q4_1), dequantized tensor by tensor"
    # the cached folder: config, generation config, tokenizer, origin; never weights
    files = sorted(p.name for p in smol.path.iterdir())
    assert files == sorted(
        [
            "chat_template.jinja",
            "config.json",
            "generation_config.json",
            gguf_source.ORIGIN_FILE,
            "tokenizer.json",
            "tokenizer_config.json",
        ]
    )
    assert smol.path.parent.name == gguf_source.CACHE_SUBDIR  # never the old float32 folders in models/
    origin = json.loads((smol.path / gguf_source.ORIGIN_FILE).read_text())
    assert origin["file"] == gguf.name and origin["architecture"] == "llama"
    assert set(smol.weight_map.values()) == {gguf.name}
    # file order, and storage as the file has it
    names = smol.tensor_names()
    assert names[:3] == [
        "model.embed_tokens.weight",
        "model.layers.0.input_layernorm.weight",
        "model.layers.0.mlp.down_proj.weight",
    ]
    reader = smol.reader
    assert isinstance(reader, gguf_source.GGUFTensors)
    assert reader.type_counts() == {"Q8_0": 1, "F32": 61, "Q4_1": 210} and reader.unmapped == []
    assert reader.ggml_type("model.embed_tokens.weight") == "Q8_0"
    assert reader.gguf_name("model.layers.0.self_attn.q_proj.weight") == "blk.0.attn_q.weight"
    for name in ("model.embed_tokens.weight", "model.norm.weight", "model.layers.0.self_attn.q_proj.weight"):
        assert smol.storage_dtype(name) == torch.float32
    assert smol.shape("model.layers.0.self_attn.k_proj.weight") == (192, 576)
    with pytest.raises(SourceError, match="missing"):
        smol.tensor("lm_head.weight")


def test_reopen_reads_no_weights_and_is_fast(smol: SourceModel) -> None:
    t0 = time.perf_counter()
    again = open_source("smollm2-135m")
    assert time.perf_counter() - t0 < 5.0  # metadata, tensor table and the cached folder only
    assert again.path == smol.path and again.weight_map == smol.weight_map


# ----------------------------------------------------------------------------------------------
# storage types and the q/k un-permutation, on a tiny file
# ----------------------------------------------------------------------------------------------


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf row permutation of q/k (rotate_half pairs -> interleaved pairs)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def test_storage_types_and_unpermute(tmp_path: Path) -> None:
    from transformers import LlamaConfig

    rng = np.random.default_rng(0)
    heads, kv_heads, head_dim, hidden = 4, 2, 8, 32
    q = rng.standard_normal((heads * head_dim, hidden)).astype(np.float32)
    k = rng.standard_normal((kv_heads * head_dim, hidden)).astype(np.float32)
    embed = rng.standard_normal((16, hidden)).astype(np.float16)
    norm = rng.standard_normal(hidden).astype(np.float32)
    bf16 = torch.randn(8, hidden, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    file = _write_gguf(
        tmp_path / "tiny.gguf",
        "llama",
        {
            "token_embd.weight": (embed.astype(np.float32), GGMLQuantizationType.F16),
            "output_norm.weight": (norm, GGMLQuantizationType.F32),
            "blk.0.attn_q.weight": (_llama_cpp_permute(q, heads), GGMLQuantizationType.F32),
            "blk.0.attn_k.weight": (_llama_cpp_permute(k, kv_heads), GGMLQuantizationType.F32),
            "blk.0.attn_v.weight": (bf16.float().numpy(), GGMLQuantizationType.BF16),
            "blk.0.ffn_up.weight": (
                rng.standard_normal((64, hidden)).astype(np.float32),
                GGMLQuantizationType.Q8_0,
            ),
        },
        shape=(1, hidden, heads),
    )
    header = gguf_source.read_header(file)
    metadata = gguf_source.read_metadata(file)
    assert gguf_source.check_architecture(file, metadata) == "llama"
    config = LlamaConfig(
        hidden_size=hidden,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        num_hidden_layers=1,
        vocab_size=16,
    )
    folder = tmp_path / "meta"
    folder.mkdir()
    names = gguf_source.hf_names(config, "llama")
    (folder / gguf_source.ORIGIN_FILE).write_text(json.dumps({"architecture": "llama", "gguf_to_hf": names}))
    reader = gguf_source.GGUFTensors(file, header, folder, config, metadata)

    assert reader.storage_dtype("model.embed_tokens.weight") == torch.float16
    assert reader.storage_dtype("model.layers.0.self_attn.v_proj.weight") == torch.bfloat16
    assert reader.storage_dtype("model.norm.weight") == torch.float32
    assert reader.storage_dtype("model.layers.0.mlp.up_proj.weight") == torch.float32  # Q8_0, dequantized
    assert torch.equal(reader.read("model.embed_tokens.weight"), torch.from_numpy(embed).float())
    assert torch.equal(reader.read("model.layers.0.self_attn.v_proj.weight"), bf16.float())
    assert torch.equal(reader.read("model.norm.weight"), torch.from_numpy(norm))
    # llama.cpp's q/k row permutation is undone: back to the Hugging Face (rotate_half) layout
    assert torch.equal(reader.read("model.layers.0.self_attn.q_proj.weight"), torch.from_numpy(q))
    assert torch.equal(reader.read("model.layers.0.self_attn.k_proj.weight"), torch.from_numpy(k))
    up = reader.read("model.layers.0.mlp.up_proj.weight")
    assert up.shape == (64, hidden) and up.dtype == torch.float32
    assert reader.shape("model.layers.0.mlp.up_proj.weight") == (64, hidden)
    assert reader.label == "F32"  # no general.file_type: the type holding the most bytes


# ----------------------------------------------------------------------------------------------
# refusals: one line, from the metadata, in under a second, nothing cached
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["bert", "gemma3", "qwen3"])
def test_unsupported_architecture_refused_from_metadata(
    tmp_path: Path, private_cache: Path, arch: str
) -> None:
    values = np.zeros((64, 32), dtype=np.float32)
    # a real model's vocabulary in the header: the refusal must not depend on its size
    file = _write_gguf(
        tmp_path / f"{arch}.gguf",
        arch,
        {"token_embd.weight": (values, GGMLQuantizationType.F32)},
        vocab=150_000,
    )
    message, seconds = _one_line_error(file)
    assert seconds < REFUSAL_SECONDS, seconds
    assert f"unsupported GGUF architecture {arch!r}" in message and str(file) in message
    assert "supported: llama, mistral, qwen2" in message
    if arch != "bert":  # a known refusal also says why
        assert "QK-norm" in message
    assert not (private_cache / gguf_source.CACHE_SUBDIR).exists()


def test_truncated_gguf_refused(tmp_path: Path, private_cache: Path, smol: SourceModel) -> None:
    gguf = smol.gguf_file
    assert gguf is not None
    data = gguf.read_bytes()
    half = tmp_path / "half.gguf"
    half.write_bytes(data[: len(data) // 2])
    message, seconds = _one_line_error(half)
    assert seconds < REFUSAL_SECONDS, seconds
    assert "truncated" in message and str(half) in message and "re-download" in message
    head = tmp_path / "head.gguf"  # cut inside the metadata
    head.write_bytes(data[:100_000])
    message, _ = _one_line_error(head)
    assert "truncated or not a valid GGUF file" in message and str(head) in message
    assert not (private_cache / gguf_source.CACHE_SUBDIR).exists()


@pytest.mark.parametrize("content", [b"", b"not a gguf file at all" * 10, b"GGUF" + b"\xff" * 60])
def test_corrupt_gguf_refused(tmp_path: Path, private_cache: Path, content: bytes) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(content)
    message, seconds = _one_line_error(bad)
    assert seconds < REFUSAL_SECONDS, seconds
    assert str(bad) in message and "GGUF" in message


# ----------------------------------------------------------------------------------------------
# safetensors sources: the same reader API
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_safetensors_reader(tmp_path: Path, dtype: torch.dtype) -> None:
    from tiny import TINY
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**{**TINY, "vocab_size": 256})).to(dtype)
    folder = tmp_path / "tiny"
    model.save_pretrained(str(folder))
    src = open_source(folder)
    assert src.gguf_file is None
    names = src.tensor_names()
    assert set(names) == set(src.weight_map) and "lm_head.weight" not in names  # tied
    state = model.state_dict()
    for name in names:
        assert src.storage_dtype(name) == dtype
        assert torch.equal(src.tensor(name, dtype), state[name])
    assert src.describe()["weights"] == "safetensors in tiny (1 file(s))"
