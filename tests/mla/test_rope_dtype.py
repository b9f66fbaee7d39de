"""The RoPE frequencies stay float32 whatever dtype the model runs in (issue 25, fault 1).

``rope_inv_freq`` rounded to bfloat16 (~2^-9 relative) shifts the RoPE angle by ~position x 2^-9 x frequency,
which perplexity on short text does not show: these tests compare the buffers and the angles at positions
4096..8191 with the float32 ones, for ``.to(bfloat16)`` / ``.half()`` / ``.bfloat16()`` of a model or one
attention module, for ``load_checkpoint(..., dtype=bfloat16)`` (an MLA folder and its DeepSeek-V3 export) and
for ``mla-convert generate --dtype bfloat16``.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from tiny import copy_tokenizer
from typer.testing import CliRunner

import mla_convert  # noqa: F401  (sets TRITON_INTERPRET=1 on CPU before triton is imported)
from mla_convert.cli.commands import app
from mla_convert.mla.algebra import rope_angles
from mla_convert.mla.checkpoint import load_checkpoint
from mla_convert.mla.configuration import MLAConfig
from mla_convert.mla.modeling import MLAForCausalLM

PAIRS = 4
#: Long positions: here a frequency rounded to bfloat16 is off by radians.
POSITIONS = torch.arange(4096, 8192)[None]


def _config() -> MLAConfig:
    """2 layers, one rope head of 4 pairs (exportable), frequencies that bfloat16 does not hold exactly."""
    return MLAConfig(
        vocab_size=49152,  # the bundled tokenizer's
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=8192,
        kv_lora_rank=[16, 12],
        qk_rope_head_dim=2 * PAIRS,
        qk_nope_head_dim=8,
        v_head_dim=8,
        num_rope_heads=1,
        rope_inv_freq=[[[10000.0 ** (-p / PAIRS) for p in range(PAIRS)]] for _ in range(2)],
        softmax_scale=0.25,
        tie_word_embeddings=True,
    )


def _model() -> MLAForCausalLM:
    torch.manual_seed(0)
    return MLAForCausalLM(_config()).eval()


def _want(config: MLAConfig, layer: int) -> torch.Tensor:
    """The float32 frequencies ``[R, P]`` of ``layer`` as config.json records them."""
    return torch.tensor(config.rope_inv_freq[layer], dtype=torch.float32)


def _check_rope_float32(model: MLAForCausalLM) -> None:
    """Every layer's buffer is the float32 config table, and so are the angles (cos, sin) at long positions."""
    for i, layer in enumerate(model.model.layers):
        inv = layer.self_attn.rope_inv_freq
        want = _want(model.config, i)
        assert inv.dtype == torch.float32, (i, inv.dtype)
        assert torch.equal(inv.cpu(), want), (i, (inv.cpu().float() - want).abs().max())
        cos, sin = rope_angles(POSITIONS, inv.cpu())
        cos_want, sin_want = rope_angles(POSITIONS, want)
        assert torch.equal(cos, cos_want) and torch.equal(sin, sin_want), i


def test_a_bfloat16_rounded_table_is_visible_at_long_positions() -> None:
    """What the checks below catch: the table rounded to bfloat16 moves the angle by > 0.5 rad by 8k tokens."""
    want = _want(_config(), 0)
    angle = POSITIONS[..., None, None].float() * want
    rounded = POSITIONS[..., None, None].float() * want.bfloat16().float()
    assert (rounded - angle).abs().max() > 0.5


CASTS: dict[str, Callable[[MLAForCausalLM], Any]] = {
    "to(bfloat16)": lambda m: m.to(torch.bfloat16),
    "to(cpu, bfloat16)": lambda m: m.to("cpu", torch.bfloat16),
    "to(dtype=float16)": lambda m: m.to(dtype=torch.float16),
    "half()": lambda m: m.half(),
    "bfloat16()": lambda m: m.bfloat16(),
    "bfloat16() then double()": lambda m: m.bfloat16().double(),
    "attention module .to(bfloat16)": lambda m: [
        layer.self_attn.to(torch.bfloat16) for layer in m.model.layers
    ],
}


@pytest.mark.parametrize("cast", list(CASTS))
def test_casts_keep_the_frequencies_float32(cast: str) -> None:
    model = _model()
    CASTS[cast](model)
    q = model.model.layers[0].self_attn.q_proj.weight
    assert q.dtype != torch.float32  # the parameters were cast
    _check_rope_float32(model)


def test_device_moves_still_move_the_frequencies() -> None:
    model = _model().to(torch.bfloat16).to("meta")
    inv = model.model.layers[0].self_attn.rope_inv_freq
    assert inv.is_meta and inv.dtype == torch.float32
    if torch.cuda.is_available():
        model = _model().to("cuda", torch.bfloat16)
        assert model.model.layers[0].self_attn.rope_inv_freq.device.type == "cuda"
        _check_rope_float32(model)


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The tiny model saved as an MLA checkpoint (float32, with the bundled tokenizer) and its DeepSeek-V3 export."""
    from mla_convert.engines.deepseek_v3.write import export_checkpoint

    root = tmp_path_factory.mktemp("rope")
    mla = root / "mla"
    _model().save_pretrained(str(mla))
    copy_tokenizer(mla)
    export_checkpoint(mla, root / "ds3", check=False)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if not (root / "ds3" / name).exists():
            shutil.copy2(mla / name, root / "ds3" / name)
    return {"mla": mla, "export": root / "ds3"}


@pytest.mark.parametrize("kind", ["mla", "export"])
def test_load_checkpoint_in_bfloat16_keeps_the_frequencies(folders: dict[str, Path], kind: str) -> None:
    """``load_checkpoint(..., dtype=bfloat16)``: bfloat16 parameters, float32 frequencies (an export is read back
    as MLA through ``load_export_as_mla``, which used to be cast whole with ``.to(dtype)``)."""
    model = load_checkpoint(folders[kind], dtype=torch.bfloat16)
    assert isinstance(model, MLAForCausalLM)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    _check_rope_float32(model)


def _angles(buffer: torch.Tensor) -> torch.Tensor:
    """Angles ``[T, n]`` at :data:`POSITIONS` of any inverse-frequency buffer, computed in float32."""
    return POSITIONS[0, :, None].float() * buffer.detach().cpu().float().reshape(1, -1)


@pytest.mark.parametrize(
    "kind,backend", [("mla", "absorbed"), ("mla", "paged"), ("export", "absorbed"), ("export", "paged")]
)
def test_generate_in_bfloat16_keeps_the_frequencies(
    folders: dict[str, Path], kind: str, backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``mla-convert generate --dtype bfloat16``: the model that generates has bfloat16 parameters and every
    floating buffer (our ``rope_inv_freq``; the stock DeepSeek-V3 rotary ``inv_freq``) exactly as the float32
    load has it, so the same angles at 4096..8191."""
    from mla_convert.runtime import decode

    seen: list[Any] = []

    def spy(real: Callable[..., Any]) -> Callable[..., Any]:
        def run(model: Any, *args: Any, **kwargs: Any) -> Any:
            seen.append(model)
            return real(model, *args, **kwargs)

        return run

    monkeypatch.setattr(decode, "greedy", spy(decode.greedy))
    monkeypatch.setattr(decode, "generate", spy(decode.generate))
    args = ["generate", str(folders[kind]), "The capital", "--max-new-tokens", "2", "--backend", backend]
    res = CliRunner().invoke(app, [*args, "--dtype", "bfloat16", "--device", "cpu"])
    assert res.exit_code == 0, res.stdout + res.stderr
    assert res.stdout.startswith("The capital") and "in bfloat16" in res.stderr
    (model,) = seen
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    stock = kind == "export" and backend == "absorbed"
    assert type(model).__name__ == ("DeepseekV3ForCausalLM" if stock else "MLAForCausalLM")
    reference = load_checkpoint(folders[kind], require_mla=not stock)  # float32
    want = {n: b for n, b in reference.named_buffers() if b.is_floating_point()}
    got = {n: b for n, b in model.named_buffers() if b.is_floating_point()}
    assert got.keys() == want.keys() and any("inv_freq" in n for n in got)
    for name, buffer in got.items():
        assert buffer.dtype == torch.float32 and torch.equal(buffer, want[name]), name
        if "inv_freq" in name:
            assert torch.equal(_angles(buffer), _angles(want[name])), name
    if not stock:
        _check_rope_float32(model)
