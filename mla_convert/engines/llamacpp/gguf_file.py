"""``mla-convert export CKPT OUT --format gguf``: a converted checkpoint -> one llama.cpp ``deepseek2`` GGUF file.

llama.cpp (``src/models/deepseek2.cpp``, llama-cpp-python 0.3.36) runs MLA at any width when
``attention.key_length_mla`` / ``value_length_mla`` are set and ``attn_k_b`` / ``attn_v_b`` replace ``attn_kv_b``: its
cache is K-only, ``kv_lora_rank + qk_rope_head_dim`` values per token per layer, the latent doubling as V. The
tensors are the DeepSeek-V3 export's (:func:`~mla_convert.engines.deepseek_v3.mapping.plan_export` with ``--target
transformers``: interleaved RoPE slots of one plain ``rope_theta``, the latent padded to one ``kv_lora_rank``, the
bias-free linear latent norm, the softmax-scale ratio folded into ``q_proj``, the residual scale that gives every
norm the source's epsilon) under llama.cpp's names, and ``kv_b_proj`` split the way llama.cpp's
``convert_hf_to_gguf.py`` (``DeepseekV2Model.modify_tensors``) splits it: per head ``[k_nope | v]`` rows, ``attn_k_b
[H, d_c, d_N]`` (k_b transposed) and ``attn_v_b [H, d_V, d_c]``. No Q permutation (DeepSeek's rope is already the
interleaved layout llama.cpp's ``LLAMA_ROPE_TYPE_NORM`` rotates). Metadata as its loader reads it
(``llama_model_deepseek2::load_arch_hparams``): every layer dense (``leading_dense_block_count`` = layers),
``attention.q_lora_rank`` 0, the two required expert keys (``expert_feed_forward_length``, ``expert_shared_count``
0) and no expert count (absent = 0; 1 aborts the loader), ``head_count_kv`` 1 (MQA over the latent),
``key_length`` = ``kv_lora_rank + rope``, ``value_length`` = ``kv_lora_rank``, one ``layer_norm_rms_epsilon``.

Tokenizer and chat template (:mod:`~mla_convert.engines.llamacpp.gguf_vocab`): the ``tokenizer.*`` keys of the GGUF the
checkpoint was converted from, else the checkpoint's Hugging Face tokenizer written by llama.cpp's own converter
(``--vocab-only``); the chat template is the checkpoint's ``chat_template.jinja`` where it has one. Types: ``float32``, ``float16``,
``bfloat16`` (``auto``: the checkpoint's); 1-D tensors are float32 and ``attn_kv_a_mqa`` keeps float32 in a float16
file (its scaled latent rows are subnormal in float16). Quantized types (``q8_0``, ``q4_k_m``...) go through
llama.cpp's own quantizer (:mod:`~mla_convert.engines.llamacpp.quantize`, run by the python of a llama.cpp venv)
with ``attn_kv_a_mqa`` kept float32 for the same reason. The file is written to a temporary sibling and renamed.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from mla_convert.engines.bias_free import attention_bias_parts, bias_free_config, bias_note
from mla_convert.engines.deepseek_v3.mapping import DS_NORM_EPS, ExportError, ExportPlan, plan_export
from mla_convert.engines.llamacpp.env import GGUF_QUANTS, KEEP_F32, find_llamacpp, quantize
from mla_convert.engines.llamacpp.gguf_vocab import tokenizer_fields
from mla_convert.engines.llamacpp.parity import PARITY_BYTES, PARITY_KEY, fill_parity, measure_parity
from mla_convert.engines.llamacpp.spec import cache_block_rank

#: Float types a GGUF export writes directly, and their ggml type ids (F32 0, F16 1, BF16 30).
GGUF_FLOATS = {"float32": 0, "float16": 1, "bfloat16": 30}
#: ``--dtype`` values of ``--format gguf``.
GGUF_DTYPES = ("auto", *GGUF_FLOATS, *GGUF_QUANTS)
#: ``llama_ftype`` of the float files (``general.file_type``).
_FILE_TYPES = {"float32": 0, "float16": 1, "bfloat16": 32}
#: Default ``cache_block``: the block of every quantized KV cache type llama.cpp takes (q8_0, q4_0, q4_1, q5_0,
#: q5_1, iq4_nl hold 32 values a block); f16 / bf16 / f32 caches take any width.
CACHE_BLOCK = 32
#: DeepSeek-V3 tensor name suffix -> llama.cpp ``deepseek2`` name (``gguf.MODEL_TENSORS[DEEPSEEK2]``).
_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.kv_a_proj_with_mqa.weight": "attn_kv_a_mqa.weight",
    "self_attn.kv_a_layernorm.weight": "attn_kv_a_norm.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
_TOP_NAMES = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
              "lm_head.weight": "output.weight"}


def gguf_name(name: str) -> str:
    """llama.cpp's name of a DeepSeek-V3 tensor (``model.layers.3.self_attn.q_proj.weight`` -> ``blk.3.attn_q.weight``).

    Raises:
        ExportError: a tensor llama.cpp's deepseek2 has no place for (``kv_b_proj`` is split, not renamed).
    """
    if name in _TOP_NAMES:
        return _TOP_NAMES[name]
    parts = name.split(".", 3)
    if len(parts) == 4 and parts[:2] == ["model", "layers"] and parts[3] in _LAYER_NAMES:
        return f"blk.{parts[2]}.{_LAYER_NAMES[parts[3]]}"
    raise ExportError(f"tensor {name!r} has no place in llama.cpp's deepseek2 model; this is a bug, please report it")


def split_kv_b(kv_b: torch.Tensor, heads: int, d_nope: int, d_v: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``kv_b_proj.weight [H (d_N + d_V), d_c]`` -> ``(attn_k_b [H, d_c, d_N], attn_v_b [H, d_V, d_c])`` (torch order;
    ggml's ``{d_N, d_c, H}`` and ``{d_c, d_V, H}``), as llama.cpp's ``convert_hf_to_gguf.py`` splits it."""
    kv = kv_b.view(heads, d_nope + d_v, kv_b.shape[-1])
    k_b, v_b = torch.split(kv, [d_nope, d_v], dim=1)
    return k_b.transpose(1, 2).contiguous(), v_b.contiguous()


def gguf_destination(out: Path) -> Path:
    """The file ``export --format gguf`` writes: OUT itself when it ends in ``.gguf``, else ``OUT/model.gguf``."""
    return out if out.suffix == ".gguf" else out / "model.gguf"


def check_gguf_output(path: Path, overwrite: bool, ckpt: Path | None = None) -> Path:
    """Refuse a GGUF destination before any work: an existing file without ``overwrite``, a folder in its place,
    a file inside the checkpoint folder.

    Raises:
        OutputError: one line naming the path and the fix.
    """
    from mla_convert.artifacts.output import OutputError, check_writable

    path = path.expanduser().resolve()
    if path.is_dir():
        raise OutputError(f"output {path} is a folder; give a file path ending in .gguf")
    if path.exists() and not overwrite:
        raise OutputError(f"output {path} exists; pass --overwrite to replace it")
    if ckpt is not None and ckpt.expanduser().resolve() in path.parents:
        raise OutputError(f"output {path} is inside the checkpoint folder {ckpt}; write it somewhere else")
    check_writable(path)
    return path


# ------------------------------------------------------------------------------------------------ plan
def gguf_plan(config: Any, dtype: str, cache_block: int = CACHE_BLOCK, drop_attention_biases: bool = False) -> ExportPlan:
    """The DeepSeek-V3 plan (``--target transformers``) the GGUF of ``dtype`` is written from: bfloat16 for a
    bfloat16 file, float32 for every other (float16 and the quantized types are rounded from float32), with the
    latent zero-padded to :func:`cache_block_rank` of ``cache_block`` (the same function: the padded latent rows of
    ``attn_kv_a_mqa`` are zero and ``attn_k_b`` / ``attn_v_b`` give them zero weight; ``plan.kv_lora_rank`` the
    padded width, ``plan.ranks`` the checkpoint's). A rope width the block does not divide keeps the unpadded latent
    (its cache runs in f16 / bf16 / f32 only: :func:`quant_cache_block` 1). ``drop_attention_biases``: plan a
    biased conversion without its attention biases (:mod:`~mla_convert.engines.bias_free`; lossy, measured by the
    export's check).

    Raises:
        ExportError: attention biases without ``drop_attention_biases`` (no tensor for them in llama.cpp's deepseek2
            graph; the message names GGUF, what each bias does and the lossy option), what
            :func:`~mla_convert.engines.deepseek_v3.mapping.plan_export` refuses, or an MLP activation llama.cpp's
            deepseek2 does not compute (it hard-codes SiLU).
    """
    if getattr(config, "hidden_act", "silu") != "silu":
        raise ExportError(f"the MLP activation is {config.hidden_act!r}; llama.cpp's deepseek2 computes SiLU only, so "
                          "no GGUF export is exact: export --format deepseek-v3 --target transformers")
    parts = attention_bias_parts(config)
    if parts and not drop_attention_biases:
        raise ExportError(
            f"the converted attention has biases llama.cpp's deepseek2 graph has no tensor for: {bias_note(parts)}; "
            "the key bias's NoPE part, the only one the softmax removes, was already dropped at conversion, so no GGUF "
            "export is exact (on Qwen2.5-Coder-1.5B, dropping any one of them multiplies the conversion's perplexity "
            "by over 100: docs/export.md); serve this checkpoint through transformers (mla-convert generate / eval) or vLLM with "
            "our plugin, or write the lossy file with `mla-convert export CKPT OUT.gguf --format gguf "
            "--drop-attention-biases`, which prints what it costs, measured in llama.cpp"
        )
    if parts:
        config = bias_free_config(config)
    plan = plan_export(config, torch.bfloat16 if dtype == "bfloat16" else torch.float32, "transformers")
    d_r = 2 * len(plan.rope.inv_freq)
    width = cache_block_rank(plan.kv_lora_rank, d_r, cache_block)
    width = plan.kv_lora_rank if width is None else width
    cache = {**plan.cache_values_per_token, "deepseek_v3": float(width + d_r)}
    return replace(plan, kv_lora_rank=width, config={**plan.config, "kv_lora_rank": width}, cache_values_per_token=cache)


def quant_cache_block(plan: ExportPlan) -> int:
    """:data:`CACHE_BLOCK` when llama.cpp can hold the plan's cache in its quantized types (the latent and the K
    row whole blocks), else 1 (f16 / bf16 / f32 caches only)."""
    d_r = 2 * len(plan.rope.inv_freq)
    ok = plan.kv_lora_rank % CACHE_BLOCK == 0 and (plan.kv_lora_rank + d_r) % CACHE_BLOCK == 0
    return CACHE_BLOCK if ok else 1


def metadata(plan: ExportPlan, config: Any, name: str) -> list[tuple[str, Any, str]]:
    """The model keys of the file: ``(key, value, GGUFWriter method writing it)``; ``key`` is the GGUF key without
    its ``deepseek2.`` prefix (``general.name`` in full). Keys llama.cpp's ``llama_model_deepseek2`` loader requires
    are all here (``q_lora_rank`` 0 for a model without q-LoRA, the two expert keys); expert counts are left out (0)."""
    c = config
    d_r = 2 * len(plan.rope.inv_freq)
    return [
        ("general.name", name, "add_name"),
        ("context_length", int(c.max_position_embeddings), "add_context_length"),
        ("embedding_length", int(c.hidden_size), "add_embedding_length"),
        ("feed_forward_length", int(c.intermediate_size), "add_feed_forward_length"),
        ("block_count", int(c.num_hidden_layers), "add_block_count"),
        ("attention.head_count", int(c.num_attention_heads), "add_head_count"),
        ("attention.head_count_kv", 1, "add_head_count_kv"),
        ("rope.freq_base", float(plan.rope.parameters["rope_theta"]), "add_rope_freq_base"),
        ("rope.dimension_count", d_r, "add_rope_dimension_count"),
        ("attention.layer_norm_rms_epsilon", DS_NORM_EPS, "add_layer_norm_rms_eps"),
        ("vocab_size", int(c.vocab_size), "add_vocab_size"),
        ("leading_dense_block_count", int(c.num_hidden_layers), "add_leading_dense_block_count"),
        ("attention.q_lora_rank", 0, "add_q_lora_rank"),
        ("attention.kv_lora_rank", plan.kv_lora_rank, "add_kv_lora_rank"),
        ("attention.key_length", plan.kv_lora_rank + d_r, "add_key_length"),
        ("attention.value_length", plan.kv_lora_rank, "add_value_length"),
        ("attention.key_length_mla", plan.qk_nope_head_dim + d_r, "add_key_length_mla"),
        ("attention.value_length_mla", plan.v_head_dim, "add_value_length_mla"),
        ("expert_feed_forward_length", int(c.intermediate_size), "add_expert_feed_forward_length"),
        ("expert_shared_count", 0, "add_expert_shared_count"),
    ]


def cache_block_note(plan: ExportPlan, cache_block: int) -> str:
    """The line saying what the latent padding for llama.cpp's quantized caches costs, or why there is none."""
    d_r, top = 2 * len(plan.rope.inv_freq), max(plan.ranks)
    row = f"K row {plan.kv_lora_rank} + {d_r} = {plan.kv_lora_rank + d_r}"
    if quant_cache_block(plan) == 1:
        why = ("--cache-block 1" if cache_block <= 1 else
               f"the rope width {d_r} is not a multiple of {CACHE_BLOCK}, so no latent width makes the row one")
        return (f"{row} values/token/layer: llama.cpp refuses a quantized cache (type_k q8_0 ...) for it ({why}); "
                "f16 / bf16 / f32 caches run it")
    pad = plan.kv_lora_rank - top
    cost = (f"the latent zero-padded {top} -> {plan.kv_lora_rank} (+{pad} values/token/layer, the same function)"
            if pad else "no padding needed")
    return f"{row} values/token/layer, whole blocks of {CACHE_BLOCK}: q8_0 / q4_0 caches run it; {cost}"


def gguf_record(plan: ExportPlan, dtype: str) -> dict[str, Any]:
    """The mapping record of a GGUF export (``mla_convert.export`` key of the file, the CLI's line); ``cache_block``:
    :func:`quant_cache_block`, ``cache_block_padding``: the latent values per token per layer added for it."""
    record = plan.record()
    record.update(format="gguf", target="llama.cpp", backend="llama.cpp deepseek2 (MLA, K-only cache)", dtype=dtype,
                  cache_block=quant_cache_block(plan), cache_block_padding=plan.kv_lora_rank - max(plan.ranks))
    record["cache_values_per_token_per_layer"]["llama_cpp"] = record["cache_values_per_token_per_layer"].pop("deepseek_v3")
    return record


def _tensor_plan(plan: ExportPlan, config: Any, tensors: Any) -> list[tuple[str, str, tuple[int, ...]]]:
    """``(gguf name, DeepSeek-V3 source name, torch shape)`` of every tensor, in file order."""
    from mla_convert.engines.deepseek_v3.write import layout_of

    h = int(config.num_attention_heads)
    out: list[tuple[str, str, tuple[int, ...]]] = []
    for name, meta in layout_of(plan, config, tensors).items():
        if name.endswith("kv_b_proj.weight"):
            blk = f"blk.{name.split('.')[2]}."
            out.append((blk + "attn_k_b.weight", name, (h, plan.kv_lora_rank, plan.qk_nope_head_dim)))
            out.append((blk + "attn_v_b.weight", name, (h, plan.v_head_dim, plan.kv_lora_rank)))
        else:
            out.append((gguf_name(name), name, tuple(meta.shape)))
    return out


def _ggml_type(name: str, shape: tuple[int, ...], dtype: str) -> int:
    """The ggml type a tensor is stored in: float32 for 1-D tensors and, in a float16 file, ``attn_kv_a_mqa``."""
    if len(shape) == 1 or dtype == "float32" or (dtype == "float16" and KEEP_F32 in name):
        return GGUF_FLOATS["float32"]
    return GGUF_FLOATS[dtype]


def _array(t: torch.Tensor, ggml_type: int, name: str) -> np.ndarray:
    """``t`` as the numpy array the GGUF stores (bfloat16 as its raw 16 bits).

    Raises:
        ExportError: a value float16 cannot hold.
    """
    if ggml_type == GGUF_FLOATS["float32"]:
        return t.float().numpy()
    if ggml_type == GGUF_FLOATS["bfloat16"]:
        return t.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    h = t.to(torch.float16)
    if not torch.isfinite(h).all():
        raise ExportError(f"tensor {name} has values float16 cannot hold (over 65504); export --dtype bfloat16 or "
                          "float32")
    return h.numpy()


def write_gguf(
    ckpt: Path, path: Path, dtype: str, name: str, say: Callable[[str], None], final: str | None = None,
    cache_block: int = CACHE_BLOCK,
    drop_attention_biases: bool = False,
) -> dict[str, Any]:
    """Write the float GGUF (``dtype`` in :data:`GGUF_FLOATS`) of ``ckpt`` to ``path`` (created or replaced),
    one tensor at a time (one layer's attention in memory). Returns the mapping record (its ``dtype``: ``final``,
    the quantized type the file is for, when given; ``dropped_attention_biases``: the parts of
    :data:`~mla_convert.engines.bias_free.BIAS_PARTS` left out, with ``drop_attention_biases``).

    Raises:
        ExportError: a checkpoint llama.cpp cannot run exactly (:func:`gguf_plan`), a tokenizer that cannot be
            carried (:func:`~mla_convert.engines.llamacpp.gguf_vocab.tokenizer_fields`), a vocabulary that does not match the embedding.
    """
    import gguf

    from mla_convert.engines.deepseek_v3.write import attention_loader, weights_reader
    from mla_convert.mla.configuration import MLAConfig

    config = MLAConfig.from_pretrained(str(ckpt))
    plan = gguf_plan(config, dtype, cache_block, drop_attention_biases)
    tok, origin = tokenizer_fields(ckpt, config)
    n_vocab = next((len(v) for k, v, *_ in tok if k == "tokenizer.ggml.tokens"), None)
    if n_vocab != config.vocab_size:
        raise ExportError(f"{origin} has {n_vocab} tokens and the checkpoint's embedding {config.vocab_size} rows; "
                          "export --format deepseek-v3 instead")
    say(f"tokenizer: {origin}")
    tensors = weights_reader(ckpt)
    order = _tensor_plan(plan, config, tensors)
    load = attention_loader(plan, config, tensors)
    record = gguf_record(plan, final or dtype)
    record["tokenizer"] = origin
    if dropped := attention_bias_parts(config):
        record["dropped_attention_biases"] = dropped
        say(f"left out (--drop-attention-biases, lossy): {bias_note(dropped)}")
    writer = gguf.GGUFWriter(str(path), "deepseek2")
    for _key, value, method in metadata(plan, config, name):
        getattr(writer, method)(value)
    writer.add_file_type(_FILE_TYPES[dtype])
    writer.add_string(PARITY_KEY, " " * PARITY_BYTES)  # filled by fill_parity after the check; before the vocabulary
    template = ckpt / "chat_template.jinja"
    for key, value, vtype, sub in tok:
        if key != "tokenizer.chat_template" or not template.is_file():
            writer.add_key_value(key, value, vtype, sub)
    if template.is_file():  # the checkpoint's own template (the source's, carried at conversion)
        writer.add_key_value("tokenizer.chat_template", template.read_text(), gguf.GGUFValueType.STRING)
    writer.add_string("mla_convert.export", json.dumps(record))
    m = ckpt / "mla_manifest.json"
    if m.is_file():
        writer.add_string("mla_convert.parent", str(json.loads(m.read_text()).get("canonical_id")))
    types = {g: _ggml_type(g, shape, dtype) for g, _, shape in order}
    for g, _, shape in order:
        item = 4 if types[g] == 0 else 2
        np_dtype = np.float32 if types[g] == 0 else (np.float16 if types[g] == 1 else np.uint16)
        raw = gguf.GGMLQuantizationType(types[g])
        writer.add_tensor_info(g, shape, np.dtype(np_dtype), int(np.prod(shape)) * item, raw_dtype=raw)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    say(f"writing {len(order)} tensors ({dtype}) for llama.cpp deepseek2")
    say(cache_block_note(plan, cache_block))
    h = config.num_attention_heads
    for g, src, _ in order:
        t = load(src)
        if src.endswith("kv_b_proj.weight"):
            k_b, v_b = split_kv_b(t, h, plan.qk_nope_head_dim, plan.v_head_dim)
            t = k_b if g.endswith("attn_k_b.weight") else v_b
        writer.write_tensor_data(_array(t, types[g], g))
    writer.close()
    tensors.release()
    return record


def export_gguf(
    ckpt: Path,
    out: Path,
    dtype: str = "auto",
    overwrite: bool = False,
    note: Callable[[str], None] | None = None,
    llamacpp_python: str | None = None,
    check: bool = True,
    cache_block: int = CACHE_BLOCK,
    drop_attention_biases: bool = False,
) -> tuple[Path, dict[str, Any]]:
    """Write the llama.cpp ``deepseek2`` GGUF of the converted checkpoint ``ckpt`` (module docstring).

    Args:
        ckpt: a folder written by ``mla-convert factor`` or ``adapt``.
        out: a file path ending in ``.gguf``, or a folder that gets ``model.gguf``.
        dtype: one of :data:`GGUF_DTYPES` (``auto``: the checkpoint's float type).
        overwrite: replace an existing file.
        note: called with progress lines.
        llamacpp_python: the python of a llama.cpp venv, for the quantized types and the check (None:
            :func:`find_llamacpp`).
        check: serve the file in llama.cpp before it is renamed into place and compare with ``ckpt``
            (:func:`~mla_convert.engines.llamacpp.check.check_llamacpp`) when llama.cpp is installed; a float file
            over the thresholds is refused. ``record["parity"]`` holds the record, or why it was not measured.
        cache_block: pad the latent with zero columns to whole blocks of this many values
            (:func:`cache_block_rank`; default 32, the block of llama.cpp's quantized caches: without it a
            ``type_k=q8_0`` cache is refused for a row like 93 + 64 = 157); 1 keeps the checkpoint's largest rank.
        drop_attention_biases: write a biased (Qwen2-style) conversion without the attention biases llama.cpp's
            deepseek2 has no tensor for (:mod:`~mla_convert.engines.bias_free`): lossy; the check holds the file to
            the conversion with those biases zeroed and records what dropping them costs against the conversion.

    Returns:
        ``(the file written, the mapping record)``.

    Raises:
        ExportError: an unknown dtype, a checkpoint llama.cpp cannot run exactly, no llama.cpp for a quantized
            type (the command that installs it), a failed quantization, a float file llama.cpp does not run as
            ``ckpt`` computes — nothing written.
        OutputError: an existing file without ``overwrite``.
    """
    from mla_convert.mla.checkpoint import checkpoint_dtype, read_checkpoint_config
    from mla_convert.precision import bfloat16_refusal

    say = note or (lambda _: None)
    if dtype not in GGUF_DTYPES:
        raise ExportError(f"--dtype {dtype!r} is not one of {', '.join(GGUF_DTYPES)} for --format gguf")
    if cache_block < 1:
        raise ExportError(f"--cache-block {cache_block} must be 1 (no padding) or more (32: llama.cpp's quantized caches)")
    if read_checkpoint_config(ckpt, require_mla=True).get("model_type") != "mla":
        raise ExportError(f"{ckpt} is already a DeepSeek-V3 export; export the MLA checkpoint it came from")
    path = check_gguf_output(gguf_destination(out), overwrite, ckpt)
    quant = dtype in GGUF_QUANTS
    python = llamacpp_python or find_llamacpp()
    if quant:
        if python is None:
            raise ExportError(f"--dtype {dtype} goes through llama.cpp's own quantizer and no llama.cpp was found: run "
                              "`bash scripts/llamacpp_env.sh` (or pip install llama-cpp-python==0.3.36) and set "
                              "MLA_LLAMACPP_PYTHON to that python, or export --dtype float32 / float16 / bfloat16")
    base = "float32" if quant else (checkpoint_dtype(ckpt) if dtype == "auto" else dtype)
    if base == "bfloat16" and (why := bfloat16_refusal(ckpt)):
        raise ExportError(why)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        record = write_gguf(ckpt, tmp, base, ckpt.name, say, dtype if quant else None, cache_block,
                            drop_attention_biases)
        if quant:
            assert python is not None
            say(f"quantizing to {dtype} with llama.cpp's quantizer ({KEEP_F32} kept float32)")
            final = tmp.with_name(tmp.name + ".q")
            try:
                quantize(python, tmp, final, dtype)
                os.replace(final, tmp)
            finally:
                final.unlink(missing_ok=True)
        record["parity"] = (measure_parity(ckpt, tmp, python, say, "dropped_attention_biases" in record) if check
                            else "parity not measured (--no-check)")
        fill_parity(tmp, record["parity"])
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path, record
