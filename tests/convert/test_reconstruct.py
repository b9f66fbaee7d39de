"""The fitted reconstruction step's oracle (issue 50, Required 4), on SmolLM2's first layers (real weights, real
text): the source block's attention inputs and outputs come from transformers' own attention modules (hooks), never
from our statistics code.

* On an exact conversion (every RoPE pair, full rank) there is nothing to fit: no step is taken, no weight moves.
* On the default lossy conversion the fitted block's held-out error is below the closed form's, and the fit is kept.
* The keep-if-better rule: a fit that cannot help (a learning rate far too large) is dropped and every weight is
  restored bit for bit.
"""

from __future__ import annotations

import copy

import pytest
import torch
from tiny import convert

from mla_convert.convert.layer.reconstruct import reconstruct_attention, relative_error


def source_attention_pairs(
    source: torch.nn.Module, ids: torch.Tensor
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Every layer's attention ``(input, output)`` ``[N, T, hidden]`` in transformers' own model on ``ids [N, T]``:
    the normalised hidden states its attention module receives and the output it returns."""
    pairs: list[tuple[list[torch.Tensor], list[torch.Tensor]]] = [([], []) for _ in source.model.layers]

    def hook(i: int):  # noqa: ANN202
        def capture(_m, args, kwargs, out):  # noqa: ANN001, ANN202
            pairs[i][0].append(kwargs.get("hidden_states", args[0] if args else None).detach())
            pairs[i][1].append(out[0].detach())

        return capture

    handles = [
        layer.self_attn.register_forward_hook(hook(i), with_kwargs=True)
        for i, layer in enumerate(source.model.layers)
    ]
    try:
        with torch.no_grad():
            for row in ids:
                source(input_ids=row[None], use_cache=False)
    finally:
        for h in handles:
            h.remove()
    return [(torch.cat(x), torch.cat(y)) for x, y in pairs]


@pytest.fixture(scope="module")
def pairs(smol_head, smol_tokenizer, wiki_splits):
    """Layer 0's source attention pairs on 8 x 128 calibration-split tokens (fit) and on 4 x 128 tokens of the
    adaptation split (decide; no conversion reads it)."""
    from mla_convert.text.windows import token_windows

    model = smol_head[1]
    fit = token_windows(smol_tokenizer, wiki_splits["calibration"], 128, 8, bos=False)
    held = token_windows(smol_tokenizer, wiki_splits["adaptation"], 128, 4, bos=False)
    return source_attention_pairs(model, fit)[0], source_attention_pairs(model, held)[0]


def test_an_exact_layer_is_not_touched(smol_head, smol_windows, pairs):
    exact = convert(smol_head[0], *smol_windows, rope_mode="per-head", rope_strategy="high", rope_pairs=32,
                    cache_budget=None, kv_lora_rank=192)  # fmt: skip
    attn = exact.model.model.layers[0].self_attn
    before = copy.deepcopy(attn.state_dict())
    (x, y), (hx, hy) = pairs
    assert relative_error(attn, x, y) < 1e-5  # the closed form is the source's function: zero loss
    r = reconstruct_attention(attn, x, y, hx, hy)
    assert r.steps == 0 and not r.kept
    assert all(torch.equal(before[k], v) for k, v in attn.state_dict().items())


def test_a_lossy_layer_fits_below_its_closed_form(smol_default, pairs):
    attn = copy.deepcopy(smol_default.model.model.layers[0].self_attn)
    (x, y), (hx, hy) = pairs
    closed = relative_error(attn, hx, hy)
    assert closed > 1e-3  # the default conversion drops information here
    r = reconstruct_attention(attn, x, y, hx, hy, steps=60)
    assert r.kept and r.before == pytest.approx(closed, rel=1e-6)
    assert r.after < 0.95 * closed
    assert relative_error(attn, hx, hy) == pytest.approx(
        r.after, rel=1e-5
    )  # the kept weights are the fitted ones
    # what it may not touch: the RoPE frequencies and the shapes (the cache width)
    ref = smol_default.model.model.layers[0].self_attn
    assert torch.equal(attn.rope_inv_freq, ref.rope_inv_freq)
    assert {k: v.shape for k, v in attn.state_dict().items()} == {
        k: v.shape for k, v in ref.state_dict().items()
    }


def test_a_fit_that_does_not_help_is_dropped(smol_default, pairs):
    attn = copy.deepcopy(smol_default.model.model.layers[0].self_attn)
    before = copy.deepcopy(attn.state_dict())
    (x, y), (hx, hy) = pairs
    r = reconstruct_attention(attn, x, y, hx, hy, steps=5, lr=10.0)
    assert not r.kept and r.after == r.before
    assert all(torch.equal(before[k], v) for k, v in attn.state_dict().items())


def _held_errors(conv) -> list[float]:
    """Each layer's held-out attention error with the assembled ``o_proj`` (the record's plain variant)."""
    return [r.attn_rel_error_no_refit if r.attn_rel_error_no_refit is not None else r.attn_rel_error for r in conv.layers]


#: Llama-3.1's scaled RoPE (rope_type llama3), as its config has it.
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}  # fmt: skip


@pytest.mark.parametrize(
    ("family", "extra"),
    [("qwen2", {}), ("llama", {"rope_parameters": LLAMA3_ROPE, "max_position_embeddings": 131072})],
    ids=["qwen2-biases", "llama3-rope-g8"],
)
def test_the_conversion_runs_the_step_and_keeps_only_what_helps(family, extra, tmp_path, monkeypatch):
    """``reconstruct_steps`` through the passes ``factor`` runs (one line in the per-layer converter), on tiny sources
    with the shapes users convert (8 KV heads, head_dim 128; Qwen2's q/k/v biases; Llama-3.1's scaled RoPE): the step
    runs on every lossy layer,
    no layer's held-out attention error rises above the closed form's (random weights and tokens give a fit nothing
    to learn: it is dropped), and the cache width does not change. The real-weight oracle above shows the gain."""
    from tiny import write_tiny_family

    import mla_convert.convert.layer.converter as converter
    from mla_convert.sources.checkpoint import open_source

    folder = write_tiny_family(tmp_path / family, family, hidden_size=256, num_attention_heads=16,
                               num_key_value_heads=8, head_dim=128, **extra)  # fmt: skip
    src = open_source(folder)
    gen = torch.Generator().manual_seed(0)
    calib, held = torch.randint(0, 49152, (4, 64), generator=gen), torch.randint(0, 49152, (2, 64), generator=gen)
    options = dict(rope_pairs=16, rope_strategy="2-norm", refit_o_proj="teacher", cache_budget=160)
    closed = convert(src, calib, held, **options)
    ran = []

    def spy(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        ran.append(converter_fit(*args, **kwargs))
        return ran[-1]

    converter_fit = converter.reconstruct_attention
    monkeypatch.setattr(converter, "reconstruct_attention", spy)
    fitted = convert(src, calib, held, **options, reconstruct_steps=10)
    assert len(ran) == len(closed.layers) and all(r.steps == 10 for r in ran)
    before, after = _held_errors(closed), _held_errors(fitted)
    assert all(a <= b * (1 + 1e-6) for a, b in zip(after, before, strict=True)), (before, after)
    assert [r.before for r in ran] == pytest.approx(before, rel=1e-4)  # it decided on the record's held-out pairs
    # each layer's report row says what the fit did; a conversion without it has none
    assert [(r.reconstruct or {}).get("kept") for r in fitted.layers] == [r.kept for r in ran]
    assert [(r.reconstruct or {}).get("after") for r in fitted.layers] == pytest.approx([r.after for r in ran], rel=1e-5)
    assert all(r.reconstruct is None for r in closed.layers)
    assert fitted.config.kv_lora_rank == closed.config.kv_lora_rank


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (scripts/gpu_check.sh runs it there)")
def test_factor_on_a_gpu_fits_by_default(tmp_path):
    """``factor --device cuda`` at its defaults fits every lossy layer on the GPU (8 KV heads, head_dim 128): the
    manifest records 50 steps and their origin; ``--reconstruct-steps 0`` turns it off."""
    import json

    from tiny import copy_tokenizer, write_tiny_family
    from typer.testing import CliRunner

    from mla_convert.cli.commands import app

    src = write_tiny_family(tmp_path / "src", "llama", hidden_size=256, num_attention_heads=16,
                            num_key_value_heads=8, head_dim=128)  # fmt: skip
    copy_tokenizer(src)
    runs = {}
    for name, extra in (("fitted", []), ("closed", ["--reconstruct-steps", "0"])):
        out = tmp_path / name
        res = CliRunner().invoke(app, ["factor", str(src), str(out), "--device", "cuda", "--calib-tokens", "512",
                                       "--window", "128", "--eval-windows", "2", "--dtype", "float32", "--text",
                                       "news", "--cache-budget", "160", "--rope-pairs", "16", "--refit-o-proj", "teacher",
                                       *extra])  # fmt: skip
        assert res.exit_code == 0, res.output
        runs[name] = json.loads((out / "mla_manifest.json").read_text())
    assert runs["fitted"]["options"]["reconstruct_steps"] == 50
    assert runs["fitted"]["choices"]["reconstruct_steps"].startswith("default on a GPU")
    assert runs["closed"]["options"].get("reconstruct_steps", 0) == 0  # 0 is left out, as before the step existed


def test_factor_records_the_fit_in_the_report_and_manifest(tmp_path):
    """``factor --reconstruct-steps N`` on a CPU: each layer's row in report.json, a line in report.md and the
    manifest's ``reconstruction.fitted`` say how many layers kept their fit and the held-out error before and after
    (at the CPU default none of them appear: ``tests/convert/test_reference.py`` checks the reference conversion)."""
    import json

    from tiny import copy_tokenizer, write_tiny_family
    from typer.testing import CliRunner

    from mla_convert.cli.commands import app

    src = write_tiny_family(tmp_path / "src", "qwen2", hidden_size=256, num_attention_heads=16,
                            num_key_value_heads=8, head_dim=128)  # fmt: skip
    copy_tokenizer(src)
    args = ["--device", "cpu", "--calib-tokens", "512", "--window", "128", "--eval-windows", "2", "--dtype", "float32",
            "--text", "news", "--cache-budget", "160", "--rope-pairs", "16", "--refit-o-proj", "teacher"]  # fmt: skip
    res = CliRunner().invoke(app, ["factor", str(src), str(tmp_path / "fitted"), *args, "--reconstruct-steps", "5"])
    assert res.exit_code == 0, res.output
    report = json.loads((tmp_path / "fitted" / "report.json").read_text())
    fits = [r["reconstruct"] for r in report["layers"]]
    assert fits and all(f["steps"] == 5 and f["after"] <= f["before"] for f in fits), fits
    manifest = json.loads((tmp_path / "fitted" / "mla_manifest.json").read_text())
    assert manifest["reconstruction"]["fitted"] == {
        "steps": 5, "layers_fitted": len(fits), "layers_kept": sum(f["kept"] for f in fits),
        "mean_before": round(sum(f["before"] for f in fits) / len(fits), 5),
        "mean_after": round(sum(f["after"] for f in fits) / len(fits), 5),
    }  # fmt: skip
    assert manifest["choices"]["reconstruct_steps"] == "given"
    kept = sum(f["kept"] for f in fits)
    assert f"Fitted reconstruction (5 Adam steps per lossy layer): {kept} of {len(fits)} layers kept" in (
        (tmp_path / "fitted" / "report.md").read_text()
    )
