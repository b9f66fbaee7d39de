"""``validate`` on half-precision checkpoints: a bfloat16 (and float16) conversion of a tiny random Llama passes
with the float32 checks at float32 tolerances plus checks in its own dtype at that dtype's tolerances
(``spec.TOLERANCES``), and ``validation.json``/``.md`` name the dtype and the tolerance set; a float32
conversion keeps the float32 set and nothing else. ``eval`` and ``generate`` load the bfloat16 checkpoint.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from mla_convert.cli.commands import app
from mla_convert.convert.options.options import ConvertOptions
from mla_convert.convert.pipeline.job import run_factor
from mla_convert.mla.checkpoint import CheckpointError, checkpoint_dtype, load_checkpoint
from mla_convert.sources.checkpoint import open_source
from mla_convert.validate.spec import TOLERANCES, tol

#: A lossy conversion (4 of 8 RoPE pairs, a latent below full rank) whose windows fit rung 3's prompt.
LOSSY = {
    "window": 64,
    "calib_windows": 4,
    "eval_windows": 2,
    "text": "news",
    "rope_pairs": 4,
    "cache_budget": 28.0,
}
#: Ladder settings that fit the 64-token windows.
SMALL = ["--prompt-tokens", "40", "--new-tokens", "8", "--matrix-max-history", "129"]


@pytest.fixture(scope="module")
def converted(tiny_src: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The tiny model converted once per dtype (the same options, so the same plan)."""
    root = tmp_path_factory.mktemp("dtypes")
    out = {}
    for dtype in ("float32", "bfloat16", "float16"):
        run_factor(
            open_source(tiny_src), root / dtype, ConvertOptions(**LOSSY, dtype=dtype), sample_prompt=None
        )
        out[dtype] = root / dtype
    return out


def _validate(ckpt: Path, src: Path) -> dict[str, Any]:
    res = CliRunner().invoke(app, ["validate", str(ckpt), "--source", str(src), *SMALL])
    assert res.exit_code == 0, res.stdout + res.stderr
    assert "validation passed" in res.stdout
    return json.loads((ckpt / "validation.json").read_text())


def _checks(report: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["name"]: {**c, "rung": r["number"]} for r in report["rungs"] for c in r["checks"]}


def test_checkpoint_dtype_reads_the_headers(converted: dict[str, Path], tmp_path: Path) -> None:
    for dtype, ckpt in converted.items():
        assert checkpoint_dtype(ckpt) == dtype
    # one float32 weight among bfloat16 ones: only float32 holds every weight exactly
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    state = load_file(converted["bfloat16"] / "model.safetensors")
    state["model.norm.weight"] = state["model.norm.weight"].float()
    save_file(state, mixed / "model.safetensors", metadata={"format": "pt"})
    assert checkpoint_dtype(mixed) == "float32"
    with pytest.raises(CheckpointError, match="no \\*.safetensors"):
        checkpoint_dtype(tmp_path)


def test_bf16_checkpoint_passes_with_bf16_tolerances(converted: dict[str, Path], tiny_src: Path) -> None:
    ckpt = converted["bfloat16"]
    report = _validate(ckpt, tiny_src)
    assert report["passed"] and report["failed_rungs"] == []
    d = report["dtype"]
    assert d["checkpoint"] == "bfloat16" and d["tolerance_set"] == "bfloat16"
    assert d["tolerances"] == TOLERANCES["bfloat16"].as_dict()
    checks = _checks(report)
    bf16 = TOLERANCES["bfloat16"]
    # float32 checks: the float32 tolerances, unchanged
    assert checks["step logits vs full recomputation, max rel. error"]["tolerance"] == "<= 0.0001"
    assert checks["latent_out vs float64 oracle, max rel. error over layers"]["tolerance"] == "<= 1e-05"
    assert checks["greedy tokens differing from full recomputation"]["value"] == 0
    # rung 3 again in bfloat16, at the bfloat16 tolerances
    logits = checks["bfloat16: step logits vs full recomputation in bfloat16, max rel. error"]
    assert logits["rung"] == 3 and logits["passed"] and logits["tolerance"] == f"<= {bf16.logits:g}"
    rows = next(c for n, c in checks.items() if n.startswith("bfloat16: cache rows k_rope"))
    assert rows["passed"] and rows["tolerance"] == f"<= {bf16.rows:g}"
    assert checks["bfloat16: committed cache length (tokens)"]["passed"]
    drift = checks["bfloat16: step logits vs float32 recomputation of the same tokens, max rel. difference"]
    assert 0 < drift["value"] < bf16.logits  # bfloat16 rounding shows, within its tolerance
    if checks["kernel backend"]["value"] == "triton-interpreter":
        # no bfloat16 in the interpreter: the kernel ran in float32, the bfloat16 decode on absorbed, said so
        assert "ran in float32 only" in checks["bfloat16: kernel"]["value"]
        assert "absorbed (torch)" in checks["bfloat16: decode backend"]["value"]
        assert checks["bfloat16: decode attention calls on absorbed (want 21)"]["passed"]
    else:
        kernel = checks["bfloat16: latent_out vs float64 oracle, max rel. error over layers"]
        assert kernel["passed"] and kernel["tolerance"] == f"<= {bf16.kernel:g}"
    # rung 5 measured the bfloat16 cache: 2 bytes a value; the ratio to the source compares values
    payload = next(c for n, c in checks.items() if n.startswith("payload bytes/token/layer"))
    assert payload["value"] == 0 and "x 2 B" in payload["name"]
    assert checks["cache ratio (converted payload / source measured)"]["value"] == pytest.approx(28 / 64)
    md = (ckpt / "validation.md").read_text()
    assert "Checkpoint dtype: bfloat16" in md and "use the bfloat16 tolerance set" in md
    assert f"decode step logits rel. {tol(bf16.logits)}" in md and "| bfloat16 |" in md
    assert "In bfloat16: the decode again" in md
    assert CliRunner().invoke(app, ["manifest", "verify", str(ckpt)]).exit_code == 0


def test_float32_checkpoint_keeps_the_float32_set(converted: dict[str, Path], tiny_src: Path) -> None:
    ckpt = converted["float32"]
    report = _validate(ckpt, tiny_src)
    d = report["dtype"]
    assert d["checkpoint"] == "float32" and d["tolerance_set"] == "float32" and d["loaded_as"] == "float32"
    assert d["tolerances"] == TOLERANCES["float32"].as_dict()
    checks = _checks(report)
    assert not any(":" in n.split(" ")[0] for n in checks)  # no checks in another dtype
    assert checks["step logits vs full recomputation, max rel. error"]["tolerance"] == "<= 0.0001"
    payload = next(c for n, c in checks.items() if n.startswith("payload bytes/token/layer"))
    assert "x 4 B" in payload["name"]
    assert checks["cache ratio (converted payload / source measured)"]["value"] == pytest.approx(28 / 64)
    md = (ckpt / "validation.md").read_text()
    assert "Checkpoint dtype: float32. Every check computes in float32; tolerance set: float32." in md
    assert "In float32" not in md and "| dtype | kernel" not in md  # no tolerance table of the other dtypes


def test_fp16_checkpoint_runs_the_kernel_in_fp16(converted: dict[str, Path], tiny_src: Path) -> None:
    report = _validate(converted["float16"], tiny_src)
    assert report["dtype"]["tolerance_set"] == "float16"
    checks = _checks(report)
    fp16 = TOLERANCES["float16"]
    kernel = checks["float16: latent_out vs float64 oracle, max rel. error over layers"]
    assert kernel["rung"] == 2 and kernel["passed"] and kernel["tolerance"] == f"<= {fp16.kernel:g}"
    assert kernel["value"] > 1e-5  # really ran in float16 (float32 stays below 1e-5)
    assert checks["float16: decode attention calls on triton (want 21)"]["passed"]
    assert checks["float16: step logits vs full recomputation in float16, max rel. error"]["passed"]


def test_in_dtype_round_trips_the_weights(converted: dict[str, Path]) -> None:
    from mla_convert.validate.measure import in_dtype

    model = load_checkpoint(converted["bfloat16"])
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with in_dtype(model, "bfloat16"):
        assert model.dtype == torch.bfloat16
        assert model.model.layers[0].self_attn.rope_inv_freq.dtype == torch.float32
    after = model.state_dict()
    assert all(after[k].dtype == torch.float32 and torch.equal(after[k], v) for k, v in before.items())


@pytest.mark.parametrize("backend", ["absorbed", "triton", "paged"])
def test_generate_loads_bf16(
    converted: dict[str, Path], backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``generate --dtype bfloat16`` on the bfloat16 checkpoint generates with a bfloat16 model (float32 RoPE
    frequencies, exactly config.json's), prints the prompt and the tokens it chose, and each chosen token is the
    argmax (within bfloat16 rounding) of a full recomputation by the same model; the float32 model's logits differ."""
    if backend == "triton" and not torch.cuda.is_available():
        pytest.skip(
            "the Triton interpreter reads bfloat16 as integers: refused on the CPU (see the refusals below)"
        )
    from mla_convert.runtime import decode

    seen: list[tuple[Any, torch.Tensor]] = []

    def spy(real: Any) -> Any:
        def run(model: Any, *args: Any, **kwargs: Any) -> Any:
            out = real(model, *args, **kwargs)
            seen.append((model, out if isinstance(out, torch.Tensor) else out.tokens))
            return out

        return run

    monkeypatch.setattr(decode, "greedy", spy(decode.greedy))
    monkeypatch.setattr(decode, "generate", spy(decode.generate))
    ckpt = converted["bfloat16"]
    args = ["generate", str(ckpt), "The capital", "--max-new-tokens", "3", "--backend", backend]
    res = CliRunner().invoke(app, [*args, "--dtype", "bfloat16"])
    assert res.exit_code == 0, res.stdout + res.stderr
    assert "in bfloat16" in res.stderr
    ((model, tokens),) = seen
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    config = json.loads((ckpt / "config.json").read_text())
    for i, layer in enumerate(model.model.layers):
        inv = layer.self_attn.rope_inv_freq
        assert inv.dtype == torch.float32
        assert torch.equal(inv.cpu(), torch.tensor(config["rope_inv_freq"][i], dtype=torch.float32))
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(ckpt))
    prompt = tok("The capital", return_tensors="pt").input_ids.shape[1]
    assert tokens.shape == (1, prompt + 3)
    assert res.stdout.rstrip("\n") == tok.decode(tokens[0].cpu(), skip_special_tokens=True)
    with torch.no_grad():
        full = model(input_ids=tokens, use_cache=False).logits[0, prompt - 1 : -1].float()  # [3, vocab]
        ref = load_checkpoint(ckpt)(input_ids=tokens.cpu(), use_cache=False).logits[0, prompt - 1 : -1]
    chosen = full.gather(-1, tokens[0, prompt:, None]).squeeze(-1)
    scale = full.abs().max()
    assert torch.all(full.max(-1).values - chosen <= 2**-7 * scale), (full.max(-1).values - chosen, scale)
    drift = float((full.cpu() - ref).abs().max() / ref.abs().max())
    assert 0 < drift < TOLERANCES["bfloat16"].logits  # computed in bfloat16, and close to float32


def test_eval_loads_bf16(converted: dict[str, Path], tiny_src: Path) -> None:
    args = ["eval", str(converted["bfloat16"]), "--against", str(tiny_src), "--text", "news"]
    res = CliRunner().invoke(app, [*args, "--window", "64", "--windows", "2"])
    assert res.exit_code == 0, res.stdout + res.stderr
    recorded = json.loads((converted["bfloat16"] / "report.json").read_text())["model"]["eval"]
    measured = json.loads(res.stdout.strip().splitlines()[-1])
    assert measured["perplexity"] == pytest.approx(recorded["perplexity"], rel=1e-4)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU host's answers")
@pytest.mark.parametrize(
    "flags,message",
    [
        (["--backend", "triton", "--dtype", "bfloat16"], "Triton interpreter reads bfloat16"),
        (["--device", "cuda"], "has no CUDA GPU; use --device cpu or auto"),
        (["--device", "gpu0"], "--device 'gpu0' is not one of"),
        (["--dtype", "int8"], "--dtype 'int8' is not one of"),
    ],
)
def test_generate_device_and_dtype_refusals(
    converted: dict[str, Path], flags: list[str], message: str
) -> None:
    """A bfloat16 model on the triton path on the CPU would get garbage from the interpreter: refused; a CUDA
    device on a CPU host is one line, not a failed launch with CPU pointers."""
    res = CliRunner().invoke(app, ["generate", str(converted["bfloat16"]), "The capital", *flags])
    assert res.exit_code == 2, res.stdout + res.stderr
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and message in lines[0], res.stderr


def test_generate_float16_on_the_kernel(converted: dict[str, Path]) -> None:
    res = CliRunner().invoke(
        app,
        ["generate", str(converted["bfloat16"]), "The capital", "--max-new-tokens", "3", "--backend", "triton",
         "--dtype", "float16"],
    )  # fmt: skip
    assert res.exit_code == 0, res.stdout + res.stderr
    assert "float16" in res.stderr and "decode x" in res.stderr


@pytest.mark.parametrize(
    "prompt,flags,message",
    [
        ("", [], "the prompt is empty"),
        ("   ", ["--backend", "triton"], "the prompt is empty"),
        ("The capital", ["--max-new-tokens", "100000"], "pass the model's"),
    ],
)
def test_generate_prompt_refusals(
    converted: dict[str, Path], prompt: str, flags: list[str], message: str
) -> None:
    """An empty prompt or a request past the model's positions is one line and exit 2, not a traceback."""
    res = CliRunner().invoke(app, ["generate", str(converted["bfloat16"]), prompt, *flags])
    assert res.exit_code == 2, res.stdout + res.stderr
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and message in lines[0], res.stderr


def test_eval_on_one_long_file_says_it_was_cut_by_position(
    converted: dict[str, Path], tmp_path: Path
) -> None:
    """One book is normal user text: eval measures its evaluation part (the first 20 % of its characters) and
    says so; a two-word file is refused in one line before the model loads."""
    from mla_convert.text.corpora import wikipedia_documents

    book = tmp_path / "book.txt"
    book.write_text("\n\n".join(d.text for d in wikipedia_documents()[:3]))
    res = CliRunner().invoke(
        app, ["eval", str(converted["bfloat16"]), "--text", str(book), "--window", "64", "--windows", "1"]
    )
    assert res.exit_code == 0, res.stdout + res.stderr
    assert "cut by position: book (characters 0-" in res.stdout
    record = json.loads(res.stdout.strip().splitlines()[-1])  # the JSON line says it too
    assert record["text"] == str(book) and [c.split(" (")[0] for c in record["cut_by_position"]] == ["book"]
    (tmp_path / "tiny.txt").write_text("two words")
    res = CliRunner().invoke(app, ["eval", str(converted["bfloat16"]), "--text", str(tmp_path / "tiny.txt")])
    assert res.exit_code == 2 and "too short to cut into" in res.stderr
