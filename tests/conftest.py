"""Shared fixtures: the bundled real model (SmolLM2-135M-Instruct), its tokenizer and real text."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

# pytest-xdist's workers inherit COLUMNS=80 from it: the CLI would print its tables at 80 columns, not as in a log
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.pop("COLUMNS", None)

#: Torch threads of one test process: up to 2, the cores shared among pytest-xdist's workers (``-n N``).
THREADS = max(1, min(2, (os.cpu_count() or 1) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))))
torch.set_num_threads(THREADS)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Scheduling groups for pytest-xdist's ``--dist loadgroup``: every test that reads the reference conversion
    runs in one worker (converted once there, ~4.5 min), every other test with the rest of its module (module
    fixtures built once)."""
    for item in items:
        uses_reference = "reference_ckpt" in getattr(item, "fixturenames", ())
        group = "reference" if uses_reference else item.nodeid.split("::", 1)[0]
        item.add_marker(pytest.mark.xdist_group(group))


@pytest.fixture(scope="session")
def smol():
    from mla_convert.sources.checkpoint import open_source

    return open_source("smollm2-135m")


@pytest.fixture(scope="session")
def smol_model(smol):
    from mla_convert.sources.checkpoint import load_source_model

    return load_source_model(smol)


@pytest.fixture(scope="session")
def smol_tokenizer(smol):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(smol.path))


@pytest.fixture(scope="session")
def wiki_splits():
    from mla_convert.text.corpora import load_documents
    from mla_convert.text.windows import split_documents

    return split_documents(load_documents("wikipedia"))


@pytest.fixture(scope="session")
def calib_windows(smol_tokenizer, wiki_splits) -> torch.Tensor:
    """3 windows of 128 real calibration tokens (Wikipedia calibration split)."""
    from mla_convert.text.windows import token_windows

    return token_windows(smol_tokenizer, wiki_splits["calibration"], 128, 3, bos=False)


@pytest.fixture(scope="session")
def eval_ids(smol_tokenizer, wiki_splits) -> torch.Tensor:
    """One window of 192 real held-out tokens (Wikipedia evaluation split)."""
    from mla_convert.text.windows import token_windows

    return token_windows(smol_tokenizer, wiki_splits["evaluation"], 192, 1, bos=False)


@pytest.fixture(scope="session")
def smol_windows(calib_windows) -> tuple[torch.Tensor, torch.Tensor]:
    """``(calibration [2, 128], held-out [1, 128])`` real windows for in-memory conversions of SmolLM2
    (:func:`tiny.convert`, the passes ``factor`` runs)."""
    return calib_windows[:2], calib_windows[2:]


@pytest.fixture(scope="session")
def smol_st(smol, smol_model, tmp_path_factory):
    """SmolLM2 as a safetensors folder: the bundled GGUF's weights dequantized once (``smol_model``'s float32
    tensors, bit for bit), so the in-memory conversions of the tests read them in milliseconds instead of
    dequantizing the 4-bit GGUF blocks again (~2 s per conversion idle)."""
    from mla_convert.sources.checkpoint import open_source

    out = tmp_path_factory.mktemp("smol-st")
    cfg = smol_model.config.__class__.from_dict(smol_model.config.to_dict())
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.load_state_dict(smol_model.state_dict())
    model.tie_weights()
    model.save_pretrained(str(out))
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (out / f).write_bytes((smol.path / f).read_bytes())
    return open_source(out)


@pytest.fixture(scope="session")
def smol_default(smol_st, smol_windows):
    """The default conversion of SmolLM2 (float32 weights) on :func:`smol_windows`, with its calibration
    statistics (``keep_stats``): one :class:`~mla_convert.convert.build.Conversion` shared by the session."""
    from tiny import convert

    return convert(smol_st, *smol_windows, keep_stats=True)


@pytest.fixture(scope="session")
def mha_folder(smol, smol_model, tmp_path_factory) -> Path:
    """The exact MHA expansion of SmolLM2: each K/V head's rows repeated (repeat_kv order) to 9 KV heads."""
    from transformers import AutoModelForCausalLM

    out = tmp_path_factory.mktemp("smol-mha")
    cfg = smol_model.config.__class__.from_dict(smol_model.config.to_dict())
    rep = cfg.num_attention_heads // cfg.num_key_value_heads
    cfg.num_key_value_heads = cfg.num_attention_heads
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    state = smol_model.state_dict()
    d = smol.head_dim
    for i in range(cfg.num_hidden_layers):
        for p in ("k_proj", "v_proj"):
            key = f"model.layers.{i}.self_attn.{p}.weight"
            w = state[key].view(-1, d, state[key].shape[1])
            state[key] = w.repeat_interleave(rep, dim=0).reshape(-1, w.shape[-1])
    model.load_state_dict(state, strict=False)
    model.tie_weights()
    model.save_pretrained(str(out))
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (out / f).write_bytes((smol.path / f).read_bytes())
    return out


#: The reference conversions the suite can pin (``MLA_CONVERT_TEST_PIN`` picks one; CI runs ``ci``):
#: ``default`` is the README's quick-start job (default options, 16,384 calibration tokens, ~10 min idle on 2
#: cores); ``ci`` is the same command with 4,096 calibration tokens (every default stage, RoPE split search
#: included, in ~4.5 min), each with its own pinned manifest under ``manifests/``.
REFERENCE_RUNS: dict[str, list[str]] = {
    "ci": ["--calib-tokens", "4096"],
    "default": [],
}


def reference_run() -> str:
    """The pin the session converts and checks: ``MLA_CONVERT_TEST_PIN`` (``ci`` when unset).

    Raises:
        ValueError: an unknown name."""
    name = os.environ.get("MLA_CONVERT_TEST_PIN", "ci")
    if name not in REFERENCE_RUNS:
        raise ValueError(f"MLA_CONVERT_TEST_PIN={name!r}: use one of {', '.join(REFERENCE_RUNS)}")
    return name


def run_reference(out: Path, run: str | None = None) -> dict:
    """The reference conversion ``run`` (:data:`REFERENCE_RUNS`; :func:`reference_run` when None) through the
    CLI; returns its manifest."""
    import json

    from typer.testing import CliRunner

    from mla_convert.cli.commands import app

    args = REFERENCE_RUNS[run or reference_run()]
    cmd = ["--quiet", "factor", "smollm2-135m", str(out), "--device", "cpu", *args]  # cpu: GPU hosts too
    before = torch.get_num_threads()
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))  # as pinned: float sums may split by thread
    try:
        res = CliRunner().invoke(app, cmd)
    finally:
        torch.set_num_threads(before)
    assert res.exit_code == 0, res.output + str(res.exception)
    return json.loads((out / "mla_manifest.json").read_text())


@pytest.fixture(scope="session")
def reference_ckpt(tmp_path_factory) -> Path:
    """The reference conversion (:func:`run_reference`) once per session: ``mla-convert factor smollm2-135m OUT``
    with :data:`REFERENCE_RUNS`'s options (CI: 4,096 calibration tokens, ~4.5 min, streamed).

    For quick local iteration ``MLA_CONVERT_TEST_REFERENCE=DIR`` reuses an existing conversion of the same run
    (CI never sets it, so CI always converts afresh)."""
    reuse = os.environ.get("MLA_CONVERT_TEST_REFERENCE")
    if reuse:
        return Path(reuse)
    out = tmp_path_factory.mktemp("ref") / "smollm2-mla"
    run_reference(out)
    return out


@pytest.fixture(scope="module")
def tiny_src(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama of 3 layers with SmolLM2's tokenizer (one per test module; modules may override it)."""
    from tiny import copy_tokenizer, write_tiny_llama

    folder = tmp_path_factory.mktemp("tiny") / "src"
    write_tiny_llama(folder, num_hidden_layers=3)
    copy_tokenizer(folder)
    return folder
