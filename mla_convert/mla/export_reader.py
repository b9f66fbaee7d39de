"""A DeepSeek-V3 export read back as our MLA model, so that ``validate`` (kernel, decode, cache ledger) and the
paged/Triton decode run on exactly the geometry the export serves.

The inverse of :mod:`mla_convert.engines.deepseek_v3.mapping` (here, in the model layer, so that
:func:`~mla_convert.mla.checkpoint.load_checkpoint` reads exports too), for folders it wrote (their manifest has ``export``):
``kv_a_layernorm`` becomes our latent norm (``latent_norm: true``, same weights); the interleaved rope rows go
back to rotate_half; the query scale ``rho`` is divided out of the query rows so ``softmax_scale`` is the source
model's again. Exports written before the bias-free mapping (a constant latent channel held by biases, a query
path ``q_a -> q_a_layernorm -> q_b``) are still read: that query path folds into ``q_proj`` with a
bias (its RMS is constant to < 1e-6 by construction). ``kv_b_proj``'s per-query-head blocks fold back into the
fewest KV heads whose repeats reproduce them exactly (the source's, for a GQA source).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch

from mla_convert.errors import ExportError
from mla_convert.mla.algebra import transformers_inv_freq

#: The epsilon every exported norm uses (``rms_norm_eps``): transformers' ``DeepseekV3RMSNorm`` default, which
#: its ``kv_a_layernorm`` always applies; vLLM and SGLang apply ``rms_norm_eps`` to every norm.
DS_NORM_EPS = 1e-6


def export_record(folder: Path) -> dict[str, Any] | None:
    """The ``export`` record of ``folder``'s manifest, or None when the folder is not an mla-convert export."""
    path = folder / "mla_manifest.json"
    if not path.is_file():
        return None
    try:
        record = json.loads(path.read_text()).get("export")
    except ValueError:
        return None
    return record if isinstance(record, dict) else None


def _half_rows(rows: torch.Tensor, n: int) -> torch.Tensor:
    """Interleaved rope rows ``[2n, ...]`` (pair j = rows 2j, 2j+1) -> rotate_half ``[2n, ...]``."""
    return torch.cat([rows[0 : 2 * n : 2], rows[1 : 2 * n : 2]])


def _kv_groups(kv_b: list[torch.Tensor], heads: int) -> int:
    """The fewest KV heads ``G`` whose blocks, each repeated ``heads / G`` times, give every layer's ``kv_b``."""
    for g in range(1, heads + 1):
        if heads % g:
            continue
        rep = heads // g
        if all(
            torch.equal(w.view(heads, -1, w.shape[-1]), w.view(heads, -1, w.shape[-1])[::rep].repeat_interleave(rep, 0))
            for w in kv_b
        ):
            return g
    return heads


def load_export_as_mla(folder: Path) -> Any:
    """Our :class:`~mla_convert.mla.modeling.MLAForCausalLM` (float32, eval mode) computing the export in ``folder``.

    Raises:
        ExportError: the folder is not an mla-convert DeepSeek-V3 export, or uses a rope type this mapping does
            not read back.
    """
    from safetensors import safe_open
    from transformers import DeepseekV3Config

    from mla_convert.mla.configuration import MLAConfig
    from mla_convert.mla.modeling import MLAForCausalLM
    from mla_convert.sources.weights import weight_map

    record = export_record(folder)
    if record is None or record.get("format") != "deepseek-v3":
        raise ExportError(f"{folder} is not a DeepSeek-V3 export written by 'mla-convert export'")
    ds = DeepseekV3Config.from_pretrained(str(folder))
    rope: dict[str, Any] = dict(ds.rope_parameters or {})
    if rope.get("rope_type") not in ("default", "longrope"):
        raise ExportError(f"{folder} has rope type {rope.get('rope_type')!r}; exports use default or longrope")
    n_pairs = ds.qk_rope_head_dim // 2
    table = transformers_inv_freq(rope, n_pairs).tolist()
    h, dim, d_n, d_r, d_v = (
        ds.num_attention_heads, ds.hidden_size, ds.qk_nope_head_dim, ds.qk_rope_head_dim, int(ds.v_head_dim or 0)
    )
    rho = float(record["query_scale"])
    wmap = weight_map(folder)
    biased = "model.layers.0.self_attn.kv_a_proj_with_mqa.bias" in wmap  # exports before the bias-free norm
    cfg = MLAConfig(
        vocab_size=ds.vocab_size,
        hidden_size=dim,
        intermediate_size=ds.intermediate_size,
        num_hidden_layers=ds.num_hidden_layers,
        num_attention_heads=h,
        num_key_value_heads=h,
        hidden_act=ds.hidden_act,
        max_position_embeddings=ds.max_position_embeddings,
        rms_norm_eps=ds.rms_norm_eps,
        bos_token_id=ds.bos_token_id,
        eos_token_id=ds.eos_token_id,
        pad_token_id=ds.pad_token_id,
        tie_word_embeddings=ds.tie_word_embeddings,
        kv_lora_rank=ds.kv_lora_rank,
        qk_rope_head_dim=d_r,
        qk_nope_head_dim=d_n,
        v_head_dim=d_v,
        num_rope_heads=1,
        rope_inv_freq=[[table] for _ in range(ds.num_hidden_layers)],
        softmax_scale=(d_n + d_r) ** -0.5 * rho,
        latent_norm=True,
        q_bias=ds.q_lora_rank is not None,
        kv_a_bias=biased,
        o_bias=biased,
        source={"exported_from": str(folder)},
    )
    handles: dict[str, Any] = {}

    def read(name: str) -> torch.Tensor:
        file = wmap[name]
        if file not in handles:
            handles[file] = safe_open(str(folder / file), framework="pt")
        return handles[file].get_tensor(name).double()

    def q_rows(w: torch.Tensor) -> torch.Tensor:
        per_head = w.view(h, d_n + d_r, *w.shape[1:])
        heads = [torch.cat([per_head[i, :d_n], _half_rows(per_head[i, d_n:], n_pairs)]) for i in range(h)]
        return torch.cat(heads) / rho

    state: dict[str, torch.Tensor] = {}
    for name in wmap:
        if ".self_attn." not in name:
            state[name] = read(name).float()
    for i in range(ds.num_hidden_layers):
        p = f"model.layers.{i}.self_attn."
        if ds.q_lora_rank is None:
            state[p + "q_proj.weight"] = q_rows(read(p + "q_proj.weight")).float()
            state[p + "q_proj.bias"] = torch.zeros(h * (d_n + d_r))
        else:  # constant-channel query path: the norm's RMS is the constant one
            a, b_a, w_q, q_b = (read(p + n) for n in (
                "q_a_proj.weight", "q_a_proj.bias", "q_a_layernorm.weight", "q_b_proj.weight"))
            rms = math.sqrt(float(b_a.pow(2).mean()) + DS_NORM_EPS)
            state[p + "q_proj.weight"] = q_rows(q_b @ (w_q[:, None] * a) / rms).float()
            state[p + "q_proj.bias"] = q_rows((q_b @ (w_q * b_a) / rms)[:, None])[:, 0].float()
        d_lat = ds.kv_lora_rank
        kv_a = read(p + "kv_a_proj_with_mqa.weight")
        state[p + "kv_a_proj_with_mqa.weight"] = torch.cat([kv_a[:d_lat], _half_rows(kv_a[d_lat:], n_pairs)]).float()
        if biased:
            kv_b_a = read(p + "kv_a_proj_with_mqa.bias")
            state[p + "kv_a_proj_with_mqa.bias"] = torch.cat([kv_b_a[:d_lat], _half_rows(kv_b_a[d_lat:], n_pairs)]).float()
            state[p + "o_proj.bias"] = read(p + "o_proj.bias").float()
        state[p + "kv_a_layernorm.weight"] = read(p + "kv_a_layernorm.weight").float()
        state[p + "kv_b_proj.weight"] = read(p + "kv_b_proj.weight").float()
        state[p + "o_proj.weight"] = read(p + "o_proj.weight").float()
        state[p + "rope_inv_freq"] = torch.tensor([table], dtype=torch.float32)
    handles.clear()
    # DeepSeek repeats a GQA source's [k_nope | v] block for each query head: fold the repeats back into KV heads
    g = _kv_groups([state[f"model.layers.{i}.self_attn.kv_b_proj.weight"] for i in range(ds.num_hidden_layers)], h)
    if g < h:
        cfg.num_key_value_heads = g
        for i in range(ds.num_hidden_layers):
            name = f"model.layers.{i}.self_attn.kv_b_proj.weight"
            w = state[name].view(h, -1, state[name].shape[-1])
            state[name] = w[:: h // g].reshape(-1, w.shape[-1]).contiguous()
    with torch.device("meta"):
        model = MLAForCausalLM(cfg)
    model.load_state_dict(state, strict=False, assign=True)
    if cfg.tie_word_embeddings:
        model.tie_weights()
    missing = [n for n, t in model.state_dict().items() if t.is_meta]
    if missing:
        raise ExportError(f"{folder} lacks tensors the MLA model needs: {', '.join(missing[:3])}")
    return model.float().eval()
