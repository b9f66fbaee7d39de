"""Bad inputs through the real CLI: exit code 2, one ``error: ...`` line naming the problem, nothing written.

Every ``factor`` case runs ``mla-convert factor`` (typer's ``CliRunner`` on :data:`mla_convert.cli.commands`)
on a tiny random Llama saved by transformers, with the bundled SmolLM2 tokenizer next to it. The
conversion itself is replaced by a tripwire (:class:`ConversionStarted`), so a check that stops
working fails the test instead of starting a conversion; :func:`test_control_reaches_conversion`
proves the same arguments with only good inputs do get that far.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import Result
from tiny import (
    TINY,
    copy_tokenizer,
    drop_tensor,
    edit_config,
    leftovers,
    tree_digest,
    truncate_half,
    write_config,
    write_tiny_llama,
)
from typer.testing import CliRunner

from mla_convert.cli.commands import app

RUNNER = CliRunner()

PROSE = (
    "The river runs through the old town, past the mill and the church, and on toward the sea. "
    "Every spring the water rises and the fishermen pull their boats higher onto the stones. "
    "Children walk along the bank after school, counting herons and throwing sticks into the current. "
    "In the evening the lamps come on one by one along the quay, and the bakery sells the last bread. "
)


class ConversionStarted(AssertionError):
    """Raised by the tripwire that replaces the heavy conversion step."""


@pytest.fixture(autouse=True)
def tripwire(monkeypatch: pytest.MonkeyPatch) -> None:
    """Bad inputs must fail before calibration/conversion: make reaching it an error."""
    import mla_convert.convert.pipeline.job as pipeline

    def convert(*args: Any, **kwargs: Any) -> Any:
        raise ConversionStarted("conversion started: the bad input was not caught before heavy work")

    monkeypatch.setattr(pipeline, "StreamedConversion", convert)


@pytest.fixture(scope="module")
def base_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("base") / "tiny-llama"
    folder.mkdir()
    write_tiny_llama(folder)
    assert copy_tokenizer(folder)[:2] == ["tokenizer.json", "tokenizer_config.json"]
    return folder


@pytest.fixture(scope="module")
def good_text(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Three documents, each with far more than the tokens the base arguments need."""
    folder = tmp_path_factory.mktemp("text")
    for i, word in enumerate(("north", "south", "west")):
        (folder / f"doc{i}.txt").write_text(f"A story from the {word}. " + PROSE * 3, encoding="utf-8")
    return folder


@pytest.fixture
def src(base_model: Path, tmp_path: Path) -> Path:
    """A private copy of the tiny model that a test may damage."""
    return Path(shutil.copytree(base_model, tmp_path / "src"))


def factor_args(source: Path | str, out: Path, text: Path | str, *extra: str) -> list[str]:
    """Small, otherwise valid ``factor`` arguments (ranks possible for the tiny model, short windows)."""
    return [
        "factor", str(source), str(out), "--text", str(text),
        "--window", "16", "--calib-tokens", "32", "--eval-windows", "1",
        "--rope-pairs", "2", "--kv-lora-rank", "8", *extra,
    ]  # fmt: skip


def invoke(args: list[str]) -> Result:
    return RUNNER.invoke(app, args)


def assert_user_error(result: Result, *needles: str) -> str:
    """Exit 2, no traceback, stderr is exactly one ``error: ...`` line containing every needle."""
    assert not isinstance(result.exception, ConversionStarted), "the bad input reached the conversion"
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    assert result.exit_code == 2, (result.exit_code, result.stdout, result.stderr)
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    line = lines[0]
    assert line.startswith("error: "), line
    for needle in needles:
        assert needle in line, f"{needle!r} not in {line!r}"
    assert "Traceback" not in result.output
    return line


def assert_nothing_written(out: Path, before: dict[str, str] | None = None) -> None:
    """OUT absent (or byte-identical to ``before``) and no temporary sibling left behind."""
    if before is None:
        assert not out.exists(), sorted(p.name for p in out.iterdir()) if out.is_dir() else out
    else:
        assert tree_digest(out) == before
    assert leftovers(out) == []


def run_bad_factor(
    source: Path | str, out: Path, text: Path | str, *extra: str, needles: tuple[str, ...]
) -> str:
    """Run a failing ``factor``; check the error line, OUT, and that the source folder is untouched."""
    source_before = tree_digest(Path(source)) if Path(source).is_dir() else None
    out_before = tree_digest(out) if out.exists() else None
    line = assert_user_error(invoke(factor_args(source, out, text, *extra)), *needles)
    assert_nothing_written(out, out_before)
    if source_before is not None:
        assert tree_digest(Path(source)) == source_before, "the source folder was modified"
    return line


# ----------------------------------------------------------------------------------------------
# control: the same arguments with good inputs get past every check
# ----------------------------------------------------------------------------------------------


def test_control_reaches_conversion(
    src: Path, good_text: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import mla_convert.convert.pipeline.device as dev

    monkeypatch.setattr(dev, "native_bfloat16", lambda device: True)  # no bfloat16 note on a GPU host without it
    out = tmp_path / "out"
    result = invoke(factor_args(src, out, good_text))
    assert isinstance(result.exception, ConversionStarted), (
        result.exit_code,
        result.stderr,
        result.exception,
    )
    # the tiny text's warnings are said before the work (as every warning known then is); no error, no speed note
    assert all(line.startswith("warning: only 32 calibration tokens") for line in result.stderr.splitlines())
    assert_nothing_written(out)


def test_bfloat16_calibration_on_a_cpu_without_it_is_not_warned(
    src: Path, good_text: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a CPU without AVX512-BF16 or AMX the default bfloat16 calibration runs at float32 speed
    (``bfloat16_autocast``): no speed note before the conversion starts."""
    import mla_convert.convert.pipeline.device as dev

    monkeypatch.setattr(dev, "native_bfloat16", lambda device: False)
    result = invoke(factor_args(src, tmp_path / "out", good_text, "--device", "cpu"))  # cpu: GPU hosts too
    assert isinstance(result.exception, ConversionStarted), (result.exit_code, result.stderr)
    assert "emulated" not in result.stderr and "--calib-precision" not in result.stderr


# ----------------------------------------------------------------------------------------------
# 1-3: damaged checkpoints
# ----------------------------------------------------------------------------------------------


def test_missing_tensor(src: Path, good_text: Path, tmp_path: Path) -> None:
    drop_tensor(src / "model.safetensors", "model.layers.1.self_attn.k_proj.weight")
    run_bad_factor(
        src,
        tmp_path / "out",
        good_text,
        needles=("tensor 'model.layers.1.self_attn.k_proj.weight' is missing from", str(src)),
    )


def test_shape_mismatch_more_heads_in_config(src: Path, good_text: Path, tmp_path: Path) -> None:
    cfg = edit_config(src, num_attention_heads=8)
    assert cfg["head_dim"] == 16  # so q_proj should be 8 * 16 = 128 rows; the weights have 64
    run_bad_factor(
        src,
        tmp_path / "out",
        good_text,
        needles=(
            "tensor 'model.layers.0.self_attn.q_proj.weight'",
            "has shape [64, 64], expected [128, 64] from config.json",
            "does not match the weights",
        ),
    )


def test_truncated_safetensors(src: Path, good_text: Path, tmp_path: Path) -> None:
    file = src / "model.safetensors"
    full = file.stat().st_size
    assert truncate_half(file) == full // 2
    run_bad_factor(
        src,
        tmp_path / "out",
        good_text,
        needles=(f"{file} is truncated or corrupt", "re-download or re-save it"),
    )


# ----------------------------------------------------------------------------------------------
# 4: unsupported architectures
# ----------------------------------------------------------------------------------------------


def _qwen3(folder: Path) -> None:
    from transformers import Qwen3Config

    write_config(folder, Qwen3Config(**TINY, head_dim=16))


def _unknown(folder: Path) -> None:
    edit_config(folder, model_type="mystery_lm", architectures=["MysteryForCausalLM"])


def _mistral_sliding(folder: Path) -> None:
    from transformers import MistralConfig

    write_config(
        folder, MistralConfig(**TINY, head_dim=16, sliding_window=64)
    )  # < max_position_embeddings 256


def _dynamic_rope(folder: Path) -> None:
    from transformers import LlamaConfig

    params = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
    write_config(folder, LlamaConfig(**TINY, rope_parameters=params))


@pytest.mark.parametrize(
    ("make", "needles"),
    [
        (_qwen3, ("unsupported architecture 'qwen3'", "QK-norm")),
        (_unknown, ("unsupported architecture 'mystery_lm'", "supported: llama, mistral, qwen2")),
        (_mistral_sliding, ("sliding-window attention (sliding_window=64) is not supported",)),
        (_dynamic_rope, ("RoPE scaling 'dynamic' changes frequencies with sequence length",)),
    ],
    ids=["qwen3-qk-norm", "unknown-model-type", "mistral-sliding-window", "rope-dynamic"],
)
def test_unsupported_architecture(
    make: Any, needles: tuple[str, ...], src: Path, good_text: Path, tmp_path: Path
) -> None:
    make(src)
    line = run_bad_factor(src, tmp_path / "out", good_text, needles=needles)
    assert str(src / "config.json") in line


# ----------------------------------------------------------------------------------------------
# 5-6: impossible options
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("rank", [61, 4096])
def test_kv_lora_rank_too_large(rank: int, src: Path, good_text: Path, tmp_path: Path) -> None:
    # shared rope head with 2 pairs: K keeps 2*16 - 4 = 28 non-rope dims, V 2*16 = 32 -> at most 60.
    args = factor_args(src, tmp_path / "out", good_text)
    args[args.index("--kv-lora-rank") + 1] = str(rank)
    assert_user_error(invoke(args), f"--kv-lora-rank {rank} is impossible for this source: allowed 1..60")
    assert_nothing_written(tmp_path / "out")


def test_rope_pairs_above_half_head_dim(src: Path, good_text: Path, tmp_path: Path) -> None:
    args = factor_args(src, tmp_path / "out", good_text, "--rope-strategy", "2-norm")
    args[args.index("--rope-pairs") + 1] = "9"  # head_dim 16 -> 8 frequencies for the shared rope head
    assert_user_error(
        # one wording for the CLI and recipes (mla_convert.convert.options.options.problems)
        invoke(args), "--rope-pairs 9 is impossible for shared/2-norm on this source: allowed 0..8 (head_dim 16 has 8 RoPE pairs)"
    )
    assert_nothing_written(tmp_path / "out")


# ----------------------------------------------------------------------------------------------
# 7: calibration text
# ----------------------------------------------------------------------------------------------


def test_empty_text_file(src: Path, tmp_path: Path) -> None:
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    run_bad_factor(src, tmp_path / "out", empty, needles=(f"{empty}: file is empty",))


def _short_texts(folder: Path) -> Path:
    """Three documents of 43 tokens each (SmolLM2 tokenizer): one 32-token window per document."""
    folder.mkdir()
    two_sentences = ". ".join(PROSE.split(". ")[:2]) + "."
    for i, word in enumerate(("north", "south", "west")):
        (folder / f"short{i}.txt").write_text(f"A story from the {word}. {two_sentences}", encoding="utf-8")
    return folder


def test_text_too_short_for_two_calibration_windows(src: Path, tmp_path: Path) -> None:
    texts = _short_texts(tmp_path / "short")
    files = ",".join(str(p) for p in sorted(texts.iterdir()))
    args = factor_args(src, tmp_path / "out", files)
    args[args.index("--window") + 1] = "32"
    assert_user_error(
        invoke(args), "calibration text gives 1 window(s) of 32 tokens; need at least 2", "shorter --window"
    )
    assert_nothing_written(tmp_path / "out")


def test_text_too_short_for_one_window(src: Path, tmp_path: Path) -> None:
    texts = _short_texts(tmp_path / "short")
    args = factor_args(src, tmp_path / "out", texts)
    args[args.index("--window") + 1] = "512"
    assert_user_error(invoke(args), "need at least 512 for one 512-token window")
    assert_nothing_written(tmp_path / "out")


# ----------------------------------------------------------------------------------------------
# 8-10: output and source locations
# ----------------------------------------------------------------------------------------------


def test_non_empty_out_without_overwrite(src: Path, good_text: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("precious results\n")
    run_bad_factor(src, out, good_text, needles=(f"output folder {out} is not empty; pass --overwrite",))
    assert (out / "keep.txt").read_text() == "precious results\n"
    assert sorted(p.name for p in out.iterdir()) == ["keep.txt"]


def test_occupied_out_is_refused_before_the_source_is_read(good_text: Path, tmp_path: Path) -> None:
    """The OUT check comes first: a missing source is not even looked at when OUT is occupied."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("precious results\n")
    missing = tmp_path / "no-such-model"
    run_bad_factor(missing, out, good_text, needles=(f"output folder {out} is not empty",))
    assert (out / "keep.txt").read_text() == "precious results\n"


def test_out_is_a_file(src: Path, good_text: Path, tmp_path: Path) -> None:
    out = tmp_path / "out.bin"
    out.write_bytes(b"\x00\x01")
    run_bad_factor(src, out, good_text, "--overwrite", needles=(f"output {out} exists and is a file",))
    assert out.read_bytes() == b"\x00\x01"


def test_out_that_cannot_be_created(src: Path, good_text: Path, tmp_path: Path) -> None:
    """A parent that is a file, or a folder that takes no new entries: one line, before any work."""
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    assert_user_error(invoke(factor_args(src, blocker / "out", good_text)), f"{blocker} is a file, not a folder")
    assert blocker.read_text() == "x"
    assert_user_error(invoke(factor_args(src, Path("/proc/mla-out"), good_text)), "/proc does not take new files")
    res = CliRunner().invoke(app, ["init-recipe", "smollm2-135m-quickstart", str(blocker / "r.yaml")])
    assert res.exit_code == 2 and "is a file, not a folder" in res.output, res.output
    res = CliRunner().invoke(app, ["eval", str(src), "--windows", "0"])
    assert res.exit_code == 2 and "--windows 0" in res.output, res.output


@pytest.mark.parametrize("where", ["subfolder", "source-itself"])
def test_out_inside_source(where: str, src: Path, good_text: Path) -> None:
    out = src / "mla" if where == "subfolder" else src
    # --overwrite: even when allowed to replace OUT, the source folder must never be the target
    run_bad_factor(src, out, good_text, "--overwrite", needles=(f"is inside the source folder {src}",))
    assert leftovers(src / "mla") == []


def test_out_containing_the_source_is_refused_even_with_overwrite(src: Path, good_text: Path) -> None:
    """OUT a parent of SOURCE: replacing OUT would delete the source (found by a new user, who lost a folder)."""
    before = sorted(p.name for p in src.iterdir())
    run_bad_factor(src, src.parent, good_text, "--overwrite", needles=(f"contains the source folder {src}",))
    assert sorted(p.name for p in src.iterdir()) == before


def test_out_inside_source_without_overwrite(src: Path, good_text: Path) -> None:
    run_bad_factor(
        src, src / "mla", good_text, needles=(f"output {src / 'mla'} is inside the source folder {src}",)
    )


def test_source_does_not_exist(good_text: Path, tmp_path: Path) -> None:
    missing = tmp_path / "no-such-model"
    out = tmp_path / "out"
    run_bad_factor(missing, out, good_text, needles=(f"source '{missing}' not found",))
    assert not missing.exists()


@pytest.mark.parametrize("name", ["run[v2]", "run[/v2]"])
def test_source_path_with_brackets_is_named_verbatim(name: str, good_text: Path, tmp_path: Path) -> None:
    missing = tmp_path / name
    run_bad_factor(missing, tmp_path / "out", good_text, needles=(f"source '{missing}' not found",))


# ----------------------------------------------------------------------------------------------
# 11: manifest verify
# ----------------------------------------------------------------------------------------------


def test_manifest_verify_names_modified_file(tmp_path: Path) -> None:
    from mla_convert.artifacts.manifest import MANIFEST, write_manifest

    folder = tmp_path / "converted"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(bytes(range(256)) * 4)
    (folder / "config.json").write_text('{"model_type": "mla"}\n')
    (folder / "README.md").write_text("not listed\n")
    written = write_manifest(folder, {"tool": {"name": "mla-convert"}}, ["model.safetensors", "config.json"])
    assert sorted(written["outputs"]) == ["config.json", "model.safetensors"]

    ok = invoke(["manifest", "verify", str(folder)])
    assert ok.exit_code == 0, ok.output
    # rich wraps stdout at 80 columns off-terminal, so compare with whitespace collapsed
    assert f"ok: 2 files match; canonical id {written['canonical_id']}" in " ".join(ok.stdout.split())

    data = bytearray((folder / "model.safetensors").read_bytes())
    data[100] ^= 0xFF  # same size, one byte changed
    (folder / "model.safetensors").write_bytes(bytes(data))
    before = tree_digest(folder)
    line = assert_user_error(
        invoke(["manifest", "verify", str(folder)]),
        f"model.safetensors in {folder} does not match its sha256 in the manifest",
    )
    assert "config.json" not in line
    assert tree_digest(folder) == before  # verify writes nothing, not even the manifest
    assert (folder / MANIFEST).exists()


def test_bad_calibration_mixture(src: Path, good_text: Path, tmp_path: Path) -> None:
    """``--calib-data`` specs are checked with the other flags, before the source is read: every bad one in one
    line, nothing written."""
    run_bad_factor(
        src, tmp_path / "out", good_text, "--calib-data", "wikipedia,weight=-1", "--calib-data", "code,loss=assistant",
        needles=("--calib-data 'wikipedia,weight=-1': weight=-1 is not a positive number",
                 "--calib-data 'code,loss=assistant'"),
    )  # fmt: skip
    run_bad_factor(src, tmp_path / "out", good_text, "--calib-data", str(tmp_path / "missing.txt"),
                   needles=("missing.txt: no such file or folder",))  # fmt: skip


def test_a_full_disk_is_one_line_that_says_how_to_go_on(
    src: Path, good_text: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A write that runs out of space mid-conversion (``ENOSPC``; torch.save's bare "iostream error" on a nearly full
    disk) is one ``error:`` line naming the full disk and ``--resume``, not a traceback; other errors still raise."""
    import errno

    import mla_convert.cli.render as render
    import mla_convert.convert.pipeline.job as pipeline

    def full(*args: Any, **kwargs: Any) -> Any:
        raise OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "work" / "state.pt"))

    monkeypatch.setattr(pipeline, "StreamedConversion", full)
    result = invoke(factor_args(src, tmp_path / "out", good_text))
    assert result.exit_code == 2 and "Traceback" not in result.output
    errors = [line for line in result.stderr.splitlines() if not line.startswith("warning: ")]
    assert len(errors) == 1 and errors[0].startswith("error: no space left on the disk of"), result.stderr
    assert "state.pt (OSError)" in errors[0] and "--resume" in errors[0]
    assert render.disk_full(RuntimeError("basic_ios::clear: iostream error")) is None  # this disk has room
    monkeypatch.setattr(render, "NEARLY_FULL", 2**62)  # every disk "nearly full": torch's message is then read as such
    assert render.disk_full(RuntimeError("basic_ios::clear: iostream error")) is not None
    assert render.disk_full(RuntimeError("a real bug")) is None


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine without a CUDA GPU")
@pytest.mark.parametrize("command", ["factor", "inspect"])
def test_a_cuda_device_this_machine_lacks_is_refused_first(command: str, tmp_path: Path) -> None:
    """``--device cuda`` without a GPU: one line before the source is read (``factor`` printed its choices, the GPU
    reconstruction among them, and read the source first; ``inspect`` ended in a traceback)."""
    args = [command, "smollm2-135m", *([str(tmp_path / "out")] if command == "factor" else []), "--device", "cuda"]
    result = invoke(args)
    assert result.exit_code == 2, result.output
    assert result.output.strip() == "error: --device cuda: this torch build or machine has no CUDA GPU; use --device cpu or auto"
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("resume", [False, True], ids=["fresh", "resume"])
def test_a_second_factor_on_the_same_out_is_refused(resume: bool, src: Path, good_text: Path, tmp_path: Path) -> None:
    """While one ``factor`` converts into OUT (it holds OUT's job lock), a second one on the same OUT, with or without
    ``--resume``, is one error line naming the running job's pid, and touches neither OUT nor the work folder (before,
    it said "pass --resume", and --resume started a second writer in the same work folder). The lock goes with
    the job: once released, its file is gone."""
    import os

    from mla_convert.convert.pipeline.workdir import job_lock, lock_path, work_dir

    out = tmp_path / "out"
    work = work_dir(out)
    work.mkdir()
    (work / "progress.json").write_text('{"pass": 1, "layer": 0}')  # the running job's state, as it writes it
    with job_lock(out):
        run_bad_factor(src, out, good_text, *(["--resume"] if resume else []),
                       needles=(f"another mla-convert factor (pid {os.getpid()}) is converting into {out}",))
        assert (work / "progress.json").read_text() == '{"pass": 1, "layer": 0}'
    assert not lock_path(out).exists()
