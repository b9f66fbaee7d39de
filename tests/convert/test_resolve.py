"""One resolution of the options for every caller (issue 34): the default keeps 31.25 % of *any* source's cache,
the library converts as the command line does, the measured split is a prior that says when it is stretched, and
the shapes users convert (8 KV heads, head_dim 128, Qwen2 biases at head_dim 128) run through factor, inspect and
validate with that default."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest
from typer.testing import CliRunner

from mla_convert.artifacts.manifest import canonical_id
from mla_convert.cli.commands import app
from mla_convert.convert.options.options import ConvertOptions, OptionsError, check_options
from mla_convert.convert.options.resolve import NOPE_BOUND, resolve_options


@dataclass(frozen=True)
class Shape:
    """A source's attention shape (what the resolution reads)."""

    head_dim: int
    num_kv_heads: int
    hidden_size: int
    num_layers: int


SMOLLM2 = Shape(64, 3, 576, 30)
LLAMA3_8B = Shape(128, 8, 4096, 32)
LLAMA32_1B = Shape(64, 8, 2048, 16)
QWEN25_15B = Shape(128, 2, 1536, 28)


@pytest.mark.parametrize(
    ("src", "values"), [(SMOLLM2, 120), (LLAMA3_8B, 640), (LLAMA32_1B, 320), (QWEN25_15B, 160)]
)
def test_the_default_keeps_31_25_percent_of_any_source(src, values):
    res = resolve_options(ConvertOptions(), src)
    assert res.options.cache_budget == values == 0.3125 * 2 * src.num_kv_heads * src.head_dim
    assert res.options.cache_fraction == 0.3125
    assert res.choices["cache_budget"].startswith("--cache-fraction 0.3125 (default)")
    check_options(res.options, src)
    # a fraction given explicitly is the same size, said to be given
    frac = resolve_options(ConvertOptions(cache_fraction=0.125), src, given={"cache_fraction"})
    assert frac.options.cache_budget == round(0.125 * 2 * src.num_kv_heads * src.head_dim)
    assert "(given)" in frac.choices["cache_budget"]


def test_the_library_converts_as_the_command_line():
    """``ConvertOptions(cache_budget=72)`` takes the split and levers measured at 72 values, as ``factor
    --cache-budget 72`` does (before issue 34 only the command line did)."""
    lib = resolve_options(ConvertOptions(cache_budget=72), SMOLLM2)
    cli = resolve_options(ConvertOptions.model_validate({"cache_budget": 72}), SMOLLM2, given={"cache_budget"})
    assert lib.options == cli.options
    assert (lib.options.rope_pairs, lib.options.refit_o_proj, lib.options.cache_fraction) == (16, "sequential", None)
    assert lib.choices["rope_pairs"].startswith("measured on this source: the lowest held-out KL in a local search over "
                                                "--rope-pairs ")
    assert "(the prior 16: measured best for the budget on another model" in lib.choices["rope_pairs"]
    assert lib.rope_candidates == cli.rope_candidates == (8, 12, 16, 20, 24)
    assert lib.choices["refit_o_proj"].startswith("measured on this source at the split chosen")  # the prior: 72's
    assert "(the prior sequential: measured best for the budget on another model" in lib.choices["refit_o_proj"]
    assert lib.refit_modes == ("teacher",)
    assert lib.rope_strategies == ("rotation",)  # the strategy is not given: the other one is measured too
    assert lib.choices["rope_strategy"].startswith("measured on this source at the pairs chosen: the lower held-out KL "
                                                   "of --rope-strategy 2-norm, rotation (the prior 2-norm: default)")
    # resolving resolved options changes nothing (run_factor may be handed either)
    assert resolve_options(lib.options, SMOLLM2, given={"cache_budget"}).options == lib.options


def test_the_measured_split_says_when_it_is_a_prior_stretched_or_clipped():
    """On Llama-3-8B's shape the 31.25 % row holds 640 values: the measured 0.40 RoPE share asks for 128 pairs of
    one rope head that holds 64; the message says it is clipped, what share results, and that SmolLM2's
    measurement is a prior for head_dim 128 with 8 KV heads. Below 12.5 % it says the size is outside the
    measured ones."""
    res = resolve_options(ConvertOptions(), LLAMA3_8B)
    assert res.options.rope_pairs == 64
    assert res.why is not None
    assert "the share asks for 128 pairs; clipped to 64, all a rope head holds here" in res.why
    assert "so the RoPE part is 0.20 of the row, not 0.40" in res.why
    assert "a prior for this source's head_dim 128 with 8" in res.why
    small = resolve_options(ConvertOptions(cache_fraction=0.0625), SMOLLM2, given={"cache_fraction"})
    assert small.why is not None and "outside the measured sizes (12.50-31.25 %)" in small.why
    same = resolve_options(ConvertOptions(), SMOLLM2)
    assert same.why is not None and "prior" not in same.why and "clipped" not in same.why


def test_contradicting_sizes_are_refused_in_one_line():
    with pytest.raises(OptionsError, match="--cache-fraction and --cache-budget 72 both given"):
        resolve_options(ConvertOptions(cache_budget=72, cache_fraction=0.2), SMOLLM2)
    with pytest.raises(OptionsError, match="--cache-fraction and --kv-lora-rank 64 both given"):
        resolve_options(ConvertOptions(kv_lora_rank=64), SMOLLM2, given={"kv_lora_rank", "cache_fraction"})
    with pytest.raises(OptionsError, match="--cache-fraction 1.5 is outside"):
        check_options(ConvertOptions(cache_fraction=1.5), None)
    res = CliRunner().invoke(app, ["inspect", "smollm2-135m", "--cache-fraction", "0.2", "--cache-budget", "72"])
    assert res.exit_code == 2 and "error: --cache-fraction and --cache-budget 72 both given" in res.output


def test_an_engine_target_or_a_fraction_given_keeps_its_shape():
    """``--target vllm`` fills the engine row unless a cache size was given (the fraction too)."""
    shaped = resolve_options(ConvertOptions(), SMOLLM2, "vllm-cpu", given=())
    assert (shaped.options.kv_lora_rank, shaped.options.cache_budget, shaped.options.cache_fraction) == (320, None, None)
    assert shaped.choices["kv_lora_rank"] == "--target vllm-cpu (the engine's row)"
    own = resolve_options(ConvertOptions(cache_fraction=0.1875), SMOLLM2, "vllm", given={"cache_fraction"})
    assert own.options.cache_budget == 72 and own.options.kv_lora_rank is None
    assert own.why is not None and "converted as asked" in own.why


def test_the_bundled_recipes_take_the_resolved_split(tmp_path):
    """The bundled recipes give a fraction and leave the split and levers to the resolution (no pinned pairs)."""
    from mla_convert.recipes.load import load_recipe

    res = load_recipe(Path(__file__).resolve().parents[2] / "recipes" / "smollm2-135m-quickstart.yaml",
                      [f"output={tmp_path / 'out'}", "factor.cache_fraction=0.1875"])  # fmt: skip
    assert res.recipe.factor.cache_budget == 72 and res.recipe.factor.rope_pairs == 16
    assert res.recipe.factor.refit_o_proj == "sequential"
    assert res.resolution is not None and res.resolution.choices["rope_pairs"].startswith("measured")


# The shapes users convert, tiny: Llama-3-8B's attention (8 KV heads, head_dim 128) and Qwen2.5's (q/k/v biases,
# head_dim 128, 2 KV heads); SmolLM2's vocabulary so the bundled tokenizer fits.
USER_SHAPES = {
    "llama-g8-hd128": ("llama", dict(hidden_size=640, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                                     rope_theta=500000.0)),
    "qwen2-bias-hd128": ("qwen2", dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=128,
                                       rope_theta=1000000.0)),
}  # fmt: skip
#: The 8-KV-head shape's converted attention against its source's, bounded (measured: see the test).
ATTENTION_RATIO_G8 = 2.0
FAST = ["--calib-tokens", "512", "--window", "128", "--eval-windows", "2", "--dtype", "float32", "--text", "news"]


def _user_shape(folder: Path, name: str) -> Path:
    import torch
    from tiny import TINY, copy_tokenizer
    from transformers import AutoConfig, AutoModelForCausalLM

    family, shape = USER_SHAPES[name]
    torch.manual_seed(0)
    cfg = AutoConfig.for_model(family, **{**TINY, "intermediate_size": 256, "num_hidden_layers": 1, **shape})
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("bias"):
                p.normal_(0, 0.5)  # transformers initialises them to zero: make them carry something
    model.save_pretrained(str(folder))
    copy_tokenizer(folder)
    return folder


@pytest.mark.parametrize("name", sorted(USER_SHAPES))
def test_user_shapes_convert_at_the_default_fraction(tmp_path, name):
    """``inspect`` and ``factor`` with no size option keep 31.25 % of the source's cache (640 of 2048 values for the
    8-KV-head source, 160 of 512 for the Qwen2 one), record where each choice came from, and ``validate`` passes."""
    src = _user_shape(tmp_path / "src", name)
    width = 2 * USER_SHAPES[name][1]["num_key_value_heads"] * 128
    runner = CliRunner()
    res = runner.invoke(app, ["inspect", str(src), *FAST], env={"COLUMNS": "400"})
    assert res.exit_code == 0, res.output
    assert f"MLA [c_kv | k_rope] at 31.25% │ {round(0.3125 * width):>6}" in res.output
    plugin = next(line for line in res.output.splitlines() if line.startswith("  vLLM plugin"))
    if name == "llama-g8-hd128":  # 64 rope pairs at 31.25 %: a rope key wider than vLLM's 64 values
        assert "not served on vLLM's CPU build: 1 rope head(s) of 128 need 128 rope values" in plugin, plugin
        assert "--rope-pairs 32 or fewer" in plugin
    else:  # biases and scaled RoPE are the plugin's to serve
        assert "exact on vLLM's CPU build; engine cache 576 values/token/layer" in plugin, plugin
    out = tmp_path / "mla"
    res = runner.invoke(app, ["factor", str(src), str(out), *FAST])
    assert res.exit_code == 0, res.output
    report = json.loads((out / "report.json").read_text())
    assert report["model"]["cache"]["ratio"] == pytest.approx(0.3125)
    manifest = json.loads((out / "mla_manifest.json").read_text())
    assert manifest["options"]["cache_budget"] == 0.3125 * width and manifest["options"]["cache_fraction"] == 0.3125
    assert manifest["choices"]["cache_budget"] == f"--cache-fraction 0.3125 (default) of the source's {width} values"
    assert manifest["choices"]["rope_pairs"].startswith("measured on this source: the lowest held-out KL in a local")
    split = report["run"]["rope_split"]  # measured on this source: the prior among the candidates, the best kept
    assert split["prior"] in split["candidates"] and manifest["options"]["rope_pairs"] == split["chosen"]
    kl = split["kl_nats_per_token"]
    assert kl[str(split["chosen"])] == min(kl.values())
    config = json.loads((out / "config.json").read_text())
    ledger = report["weights"]["places"]["mla"]
    assert manifest["weights"]["places"]["mla"] == ledger  # the ledger in the manifest, outside the canonical id
    assert canonical_id({k: v for k, v in manifest.items() if k != "weights"}) == manifest["canonical_id"]
    if name == "llama-g8-hd128":  # 8 KV heads: the query's NoPE width (128 + 2r x 6) bounded at head_dim, exactly
        assert manifest["choices"]["qk_nope_head_dim"] == NOPE_BOUND
        assert config["qk_nope_head_dim"] == 128 and config["num_key_value_heads"] == 16  # one key map per head
        rope = config["qk_rope_head_dim"]
        unbounded_q = 16 * (128 + rope * (8 - 2) + rope) * 640  # q_proj without the bound: d + 2r(G-2) NoPE dims
        attention = ledger["attention_params"][0]
        assert 16 * (128 + rope) * 640 + 640 * 16 * 128 < attention < unbounded_q  # q and o, less than q was
        assert ledger["attention_ratio"] < ATTENTION_RATIO_G8
    else:  # 2 KV heads: the query's NoPE width is head_dim already
        assert manifest["choices"]["qk_nope_head_dim"] == "default" and config["num_key_value_heads"] == 2
    card = (out / "README.md").read_text()  # the model card says where the checkpoint serves, per engine
    rows = {r.split(" | ")[0]: r for r in card.split("## Where it serves", 1)[1].splitlines() if r.startswith("| ")}
    assert rows["| transformers"].split(" | ")[2] == "exact (this checkpoint)"
    if name == "qwen2-bias-hd128":  # biases: no DeepSeek file holds them, the plugin serves them
        assert "not exact: the source has attention biases" in rows["| vLLM (DeepSeek-V3 export)"]
        assert "plugin" not in rows["| vLLM (DeepSeek-V3 export)"].split(" | ")[2]  # said once, in its own row
        assert "not exact: the source has attention biases" in rows["| llama.cpp (GGUF export)"]
        assert rows["| vLLM (mla-convert plugin)"].split(" | ")[2].startswith("exact on vLLM's CPU build")
        assert rows["| vLLM (mla-convert plugin)"].endswith(" | 576 |")
    if name != "llama-g8-hd128":
        return  # validate once: the 8-KV-head source (its kernel rungs at 64 rope pairs and a 512-wide latent)
    res = runner.invoke(app, ["validate", str(out), "--source", str(src), "--windows", "2", "--window", "128",
                              "--new-tokens", "4", "--matrix-max-history", "129", "--prompt-tokens", "24"])  # fmt: skip
    assert res.exit_code == 0, res.output


@pytest.mark.parametrize(
    ("device", "given", "steps", "origin"),
    [
        ("cpu", {}, 0, None),  # off on a CPU: absent from choices, as before the step existed
        ("cuda", {}, 50, "default on a GPU"),
        ("cuda:1", {"reconstruct_steps": 0}, 0, None),  # turned off on a GPU
        ("cpu", {"reconstruct_steps": 20}, 20, "given"),
    ],
)
def test_the_reconstruction_is_on_by_default_on_a_gpu_only(device, given, steps, origin):
    """``--reconstruct-steps`` not given: 50 steps where the conversion runs on a GPU, off on a CPU (where it costs
    as much as the rest of the conversion or more: ``factor_time``), and the user is told either way; a given value is kept.
    On the Llama-3-8B shape (8 KV heads, head_dim 128) as on SmolLM2 (config only, nothing converted)."""
    from mla_convert.convert.options.options import RECONSTRUCT_STEPS

    assert RECONSTRUCT_STEPS == 50
    for src in (SMOLLM2, LLAMA3_8B, QWEN25_15B):
        res = resolve_options(ConvertOptions(device=device, **given), src)
        assert res.options.reconstruct_steps == steps
        got = res.choices.get("reconstruct_steps")
        assert (got is None) if origin is None else got.startswith(origin), got
        said = res.reconstruction
        if not given:
            assert said.startswith("on: 50 Adam steps" if steps else "off: the conversion runs on the CPU"), said
            assert ("--reconstruct-steps 0 turns it off" if steps else "On a GPU it runs by default") in said, said
        else:
            assert said == "", said
        assert "reconstruct" not in (res.why or "")
