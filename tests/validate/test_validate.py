"""``mla-convert validate`` on the README's reference conversion, and on deliberately broken copies of a
tiny converted Llama (the faults show on any conversion; the real model's ladder runs once, on the reference).

A broken copy shares the checkpoint's files through symlinks except the one file it corrupts:
``config.json`` (softmax scale, RoPE pair indices) or ``model.safetensors`` (the RoPE frequency buffer
the model actually computes with). Each must fail, naming the rung that catches it.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from mla_convert.cli.commands import app
from mla_convert.kernels import kernel_backend
from mla_convert.validate.spec import matrix_tolerances

# the failing-rung tests need the faults found, not the product backend: the torch decode path and short prompts
SMALL = ["--windows", "2", "--window", "128", "--new-tokens", "4", "--matrix-max-history", "129", "--backend", "absorbed",
         "--prompt-tokens", "24"]  # fmt: skip


#: the layer a broken copy corrupts (the tiny checkpoint has 3)
BROKEN_LAYER = 1


@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama (3 layers) converted by ``factor`` with partial RoPE and a low-rank latent."""
    from tiny import copy_tokenizer, write_tiny_llama

    from mla_convert.convert.options.options import ConvertOptions
    from mla_convert.convert.pipeline.job import run_factor
    from mla_convert.sources.checkpoint import open_source

    root = tmp_path_factory.mktemp("tiny-validate")
    src = write_tiny_llama(root / "src", num_hidden_layers=3)
    copy_tokenizer(src)
    opts = ConvertOptions(window=32, calib_windows=4, eval_windows=2, text="news", rope_pairs=4, cache_budget=28.0,
                          dtype="float32")  # fmt: skip
    run_factor(open_source(src), root / "mla", opts, sample_prompt=None)
    return root / "mla"


def broken_copy(ref: Path, dest: Path, corrupt: str) -> Path:
    dest.mkdir()
    for f in ref.iterdir():
        if f.name.startswith("validation."):
            continue
        (dest / f.name).symlink_to(f)
    cfg = json.loads((ref / "config.json").read_text())
    if corrupt == "scale":
        # the classic bug: scale from the latent query width instead of the source's 1/sqrt(head_dim)
        cfg["softmax_scale"] = 1 / math.sqrt(cfg["kv_lora_rank"][0] + cfg["qk_rope_head_dim"])
    elif corrupt == "pair-indices":
        cfg["rope_pair_origin"][BROKEN_LAYER][0] = cfg["rope_pair_origin"][BROKEN_LAYER][0][::-1]
    elif corrupt == "frequencies":
        name = f"model.layers.{BROKEN_LAYER}.self_attn.rope_inv_freq"
        index = ref / "model.safetensors.index.json"
        shard = json.loads(index.read_text())["weight_map"][name] if index.exists() else "model.safetensors"
        (dest / shard).unlink()
        state = load_file(ref / shard)
        state[name] = state[name].flip(-1).contiguous()  # pairs rotate at each other's frequencies
        save_file(state, dest / shard, metadata={"format": "pt"})
    if corrupt == "scale-no-source":
        cfg["softmax_scale"] = 0.1
        cfg["source"]["origin"] = "/nonexistent/source"
    (dest / "config.json").unlink()
    (dest / "config.json").write_text(json.dumps(cfg, indent=2))
    return dest


def expected_kernel_backend() -> str:
    """The backend the ladder must record: :func:`~mla_convert.kernels.kernel_backend`, the function the product
    records from, checked against the machine (native Triton on a CUDA GPU unless ``TRITON_INTERPRET`` is set)."""
    interpret = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
    backend = kernel_backend()
    assert backend == ("triton-cuda" if torch.cuda.is_available() and not interpret else "triton-interpreter")
    return backend


def test_validate_passes_on_reference(reference_ckpt):
    backend = expected_kernel_backend()
    on_gpu = backend == "triton-cuda"
    res = CliRunner().invoke(app, ["validate", str(reference_ckpt)])
    assert res.exit_code == 0, res.stdout + res.stderr
    assert "validation passed" in res.stdout
    report = json.loads((reference_ckpt / "validation.json").read_text())
    assert report["passed"] and report["failed_rungs"] == []
    rungs = {r["name"]: r for r in report["rungs"]}
    assert list(rungs) == [
        "naive-vs-absorbed",
        "kernel-vs-reference",
        "decode-vs-recompute",
        "converted-vs-source",
        "cache-ledger",
        "kernel-matrix",
        "bfloat16-vs-source",
    ]
    assert all(r["passed"] and r["skipped"] is None for r in report["rungs"])
    checks = {c["name"]: c for r in report["rungs"] for c in r["checks"]}
    kernel = next(c for n, c in checks.items() if n.startswith("latent_out vs float64"))
    assert kernel["value"] < 1e-5
    assert checks["kernel backend"]["value"] == backend
    assert json.loads(checks["backends that ran"]["value"]) == {
        f"{backend}:prefill": 30,
        f"{backend}:decode": 30 * 15,
    }
    recorded = json.loads((reference_ckpt / "report.json").read_text())["model"]["eval"]
    assert checks["perplexity (converted)"]["value"] == pytest.approx(recorded["perplexity"], rel=1e-3)
    payload = next(c for n, c in checks.items() if n.startswith("payload bytes/token/layer"))
    assert payload["value"] == 0 and "480.0" in payload["name"]  # 120 float32 values
    assert checks["cache ratio (converted payload / source measured)"]["value"] == pytest.approx(0.3125)
    # rung 6: phase x cache x history on layer 0's real rows; the interpreter runs float32 and FP8 (float32
    # queries), bfloat16 goes through the oracle alone; a GPU runs bfloat16 and (sm_89+) FP8 rows with bfloat16
    # queries; every cell says which, and is held to its queries' tolerances
    fp8_runs = not on_gpu or torch.cuda.get_device_capability() >= (8, 9)
    runs = {"float32": True, "bfloat16": on_gpu, "fp8": fp8_runs}
    queries = {"float32": "float32", "bfloat16": "bfloat16" if on_gpu else "float32"}
    queries["fp8"] = queries["bfloat16"]
    cells = rungs["kernel-matrix"]["cells"]
    assert len(cells) == 3 * 3 * 5
    assert {c["history"] for c in cells} == {1, 127, 128, 129, 4096}
    assert {(c["phase"], c["s_q"]) for c in cells if c["history"] == 4096} == {
        ("prefill", 16),
        ("decode", 1),
        ("verify", 4),
    }
    for c in cells:
        assert c["queries"] == queries[c["cache"]], c
        if not runs[c["cache"]]:
            assert c["backend"].startswith("float64 oracle only") and c["kernel_out_rel"] is None
            continue
        tol_out, tol_lse = matrix_tolerances(c["queries"])
        assert c["backend"] == backend and c["kernel_out_rel"] < tol_out and c["kernel_lse_rel"] < tol_lse, c
        if c["queries"] == "float32":
            assert c["kernel_out_rel"] < 1e-5 and c["kernel_lse_rel"] < 1e-5
    fp8 = [c["format_rel_vs_float32"] for c in cells if c["cache"] == "fp8"]
    bf16 = [c["format_rel_vs_float32"] for c in cells if c["cache"] == "bfloat16"]
    assert 0 < max(bf16) < max(fp8) < 0.1  # E4M3 costs more than bfloat16 rows, measured, bounded
    md = (reference_ckpt / "validation.md").read_text()
    assert (
        md.startswith(f"# Validation of `{reference_ckpt.name}`: PASSED") and "## 5. cache-ledger: pass" in md
    )
    fp8_backend = backend if fp8_runs else "float64 oracle only"
    assert (
        "## 6. kernel-matrix: pass" in md
        and f"| verify | fp8 | 4096 | 4 | {queries['fp8']} | {fp8_backend}" in md
    )
    assert "kernel-matrix: phase x cache x history" in res.stdout  # the CLI prints the matrix
    # validation files are not outputs of the conversion: the manifest still verifies
    assert CliRunner().invoke(app, ["manifest", "verify", str(reference_ckpt)]).exit_code == 0


@pytest.mark.parametrize(
    "corrupt, rung",
    [
        ("scale", "4 (converted-vs-source)"),
        ("pair-indices", "3 (decode-vs-recompute)"),
        ("frequencies", "3 (decode-vs-recompute)"),
    ],
)
def test_validate_names_the_failing_rung(tiny_ckpt, tmp_path, corrupt, rung):
    bad = broken_copy(tiny_ckpt, tmp_path / "bad", corrupt)
    res = CliRunner().invoke(app, ["validate", str(bad), *SMALL])
    assert res.exit_code == 1, res.stdout + res.stderr
    assert f"validation failed at rung {rung}" in res.stderr
    report = json.loads((bad / "validation.json").read_text())
    assert not report["passed"]
    assert report["failed_rungs"][0] == rung.replace(" (", ":").rstrip(")")
    by_name = {r["name"]: r for r in report["rungs"]}
    # the paths agree with each other whatever the corruption: only the source-anchored rungs catch it
    assert by_name["naive-vs-absorbed"]["passed"] and by_name["kernel-vs-reference"]["passed"]
    if corrupt == "scale":
        assert by_name["decode-vs-recompute"]["passed"]
        scale = next(
            c for c in by_name["converted-vs-source"]["checks"] if c["name"].startswith("softmax_scale")
        )
        assert scale["passed"] is False
    else:
        rows = next(
            c for c in by_name["decode-vs-recompute"]["checks"] if c["name"].startswith("cache rows k_rope")
        )
        assert rows["passed"] is False and rows["value"] > 1e-2


def test_cache_rows_are_checked_against_the_inputs_that_wrote_them(tiny_ckpt, monkeypatch):
    """Rung 3 recomputes each cache row from the layer input the decode wrote it from (captured during the decode),
    so the check measures the cache, not float rounding carried through the layers below (a 30-pair SmolLM2
    conversion: 3.8e-5 at the first positions against a full pass's inputs, 9e-7 against the decode's own). A cache
    that stores one decode row 0.1 % off still fails it."""
    from mla_convert.runtime.paged_cache import PagedLatentCache
    from mla_convert.validate.ladder import validate

    def rows_named(result, prefix: str) -> dict[str, float]:
        (decode,) = [r for r in result.rungs if r.name == "decode-vs-recompute"]
        return {c.name: c.value for c in decode.checks if c.name.startswith(prefix)}

    settings = dict(windows=2, window=128, new_tokens=4, matrix_max_history=129, backend="absorbed", prompt_tokens=24)
    clean = rows_named(validate(tiny_ckpt, **settings), "cache rows")
    assert len(clean) == 2 and max(clean.values()) < 1e-6, clean

    real_write = PagedLatentCache.write

    def off_by_a_little(self, layer, rows):  # every decode step's row of one layer, 0.1 % of its largest value off
        if layer == BROKEN_LAYER and rows.shape[1] == 1:
            rows = rows + 1e-3 * rows.abs().max()
        real_write(self, layer, rows)

    monkeypatch.setattr(PagedLatentCache, "write", off_by_a_little)
    broken = rows_named(validate(tiny_ckpt, **settings), "cache rows c_kv")
    assert 5e-4 < next(iter(broken.values())) < 5e-3, broken


def test_validate_without_the_source_still_checks_the_scale(tiny_ckpt, tmp_path):
    bad = broken_copy(tiny_ckpt, tmp_path / "bad", "scale-no-source")
    res = CliRunner().invoke(app, ["validate", str(bad), *SMALL])
    assert (
        res.exit_code == 1
        and "rung 4 (converted-vs-source): softmax_scale 0.1 vs 1/sqrt(head_dim)" in res.stderr
    )
    report = json.loads((bad / "validation.json").read_text())
    assert "source not available" in report["not_measured"]


def test_validate_bad_inputs(tmp_path, reference_ckpt):
    runner = CliRunner()
    res = runner.invoke(app, ["validate", str(reference_ckpt), "--source", str(tmp_path / "typo")])
    assert res.exit_code == 2 and "error:" in res.stderr and "typo" in res.stderr
    res = runner.invoke(app, ["validate", str(tmp_path)])
    assert res.exit_code == 2 and "has no config.json" in res.stderr
    (tmp_path / "llama").mkdir()
    (tmp_path / "llama" / "config.json").write_text('{"model_type": "llama"}')
    for cmd in (["validate"], ["generate"], ["generate", "--backend", "triton"]):
        args = [cmd[0], str(tmp_path / "llama")] + (["hi"] if cmd[0] == "generate" else []) + cmd[1:]
        res = runner.invoke(app, args)
        assert res.exit_code == 2 and "not a converted MLA checkpoint" in res.stderr, (args, res.stderr)
    res = runner.invoke(app, ["validate", str(reference_ckpt), "--page-size", "0"])
    assert res.exit_code == 2 and "outside 1..128" in res.stderr
    res = runner.invoke(app, ["validate", str(reference_ckpt), "--backend", "flash"])
    assert res.exit_code == 2 and "--backend" in res.stderr


def test_readme_rung_table_comes_from_the_spec():
    """The documented rung table (docs/decoding.md) is ``benchmarks/readme.py rungs``'s rendering of
    mla_convert/validate/spec.py."""
    import sys

    root = Path(__file__).resolve().parents[2]
    sys.path.insert(0, str(root / "benchmarks"))  # readme.py imports the shared blocks helper
    loader = importlib.util.spec_from_file_location("readme_blocks", root / "benchmarks" / "readme.py")
    assert loader is not None and loader.loader is not None
    readme = importlib.util.module_from_spec(loader)
    loader.loader.exec_module(readme)
    text = (root / "docs" / "decoding.md").read_text()
    block = text.split("<!-- rungs:start -->\n", 1)[1].split("\n<!-- rungs:end -->", 1)[0]
    assert block == readme.rungs_block()


def test_capture_layer_inputs_is_the_request_in_order(tiny_ckpt):
    """The inputs captured during a paged prefill + decode are, per layer, ``[1, T + new - 1, hidden]``: the prefill's
    rows equal a plain pass's over the prompt, the hooks are gone afterwards, and an error inside the block removes
    them too."""
    from mla_convert.mla.checkpoint import load_checkpoint
    from mla_convert.validate.measure import capture_attention_inputs, capture_layer_inputs, generate

    model = load_checkpoint(tiny_ckpt)
    prompt = torch.randint(0, 1000, (1, 9), generator=torch.Generator().manual_seed(0))
    with capture_layer_inputs(model) as inputs:
        generate(model, prompt, 4, backend="absorbed", page_size=4, shuffle_pages=True)
    hidden = model.config.hidden_size
    assert [tuple(x.shape) for x in inputs] == [(1, 9 + 4 - 1, hidden)] * model.config.num_hidden_layers
    plain, _ = capture_attention_inputs(model, prompt)
    for got, want in zip(inputs, plain, strict=True):
        torch.testing.assert_close(got[:, :9], want, rtol=1e-5, atol=1e-5)
    assert not any(layer.self_attn._forward_pre_hooks for layer in model.model.layers)
    with pytest.raises(RuntimeError, match="stop"), capture_layer_inputs(model):
        raise RuntimeError("stop")
    assert not any(layer.self_attn._forward_pre_hooks for layer in model.model.layers)
