"""What every engine check shares: the request an engine runs (real text windows, short prompts, greedy
continuations), running a probe script in the engine's own venv, and the comparison with our model (``|d log p|``
of every scored token, greedy margins, the bfloat16 rounding floors and the thresholds they set).

:mod:`mla_convert.engines.vllm.check` and :mod:`mla_convert.engines.mlx.check` hold vLLM and MLX-LM to these,
:mod:`mla_convert.engines.llamacpp.check` llama.cpp; the probes (each engine folder's ``probe.py``) are the scripts
the engines run. The thresholds and how they were measured: :mod:`mla_convert.engines.vllm.check`'s docstring.
"""

from __future__ import annotations

import json
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import torch

WINDOW = 128
WINDOWS = 2
PROMPTS = ("The capital of France is", "def fibonacci(n):")
NEW_TOKENS = 16
MEAN_MAX = 0.1
ABS_MAX = 0.6
#: the max allowed is at least this times our own bfloat16 model's max |d log p| against float32 (the rounding floor)
FLOOR_FACTOR = 2.0
GREEDY_MARGIN = 0.1
#: Wall-clock limit of the vLLM process (seconds): import, load, two generate calls.
TIMEOUT_S = 600
#: Seconds more for each further checkpoint one process serves (:func:`run_probes`).
JOB_S = 300


def build_request(
    tokenizer: Any, window: int = WINDOW, windows: int = WINDOWS, new_tokens: int = NEW_TOKENS,
    dtype: str | None = "bfloat16",
) -> dict[str, Any]:
    """The token ids an engine scores (``windows`` x ``window`` tokens of real text, then the short chat, code and
    prose prompts of :data:`~mla_convert.precision.SHORT_PROMPTS`, where one bad position is not diluted) and
    continues (:data:`PROMPTS`, ``new_tokens`` greedy tokens each), in ``dtype`` (None: the export's own)."""
    from mla_convert.precision import probe_tokens
    from mla_convert.text.corpora import load_documents
    from mla_convert.text.windows import adds_bos, split_documents, token_windows

    docs = split_documents(load_documents("wikipedia"))["evaluation"]
    ids = token_windows(tokenizer, docs, window, windows, bos=adds_bos(tokenizer))
    short = [s for s in probe_tokens(tokenizer, ids[:0])["short"] if len(s) >= 2]
    return {
        "score": ids.tolist() + short,
        "windows": int(ids.shape[0]),
        "greedy": [tokenizer(p).input_ids for p in PROMPTS],
        "new_tokens": new_tokens,
        "dtype": dtype,
        "custom_ops": False,
    }


def scored_text(request: dict[str, Any]) -> str:
    """What a request scores, in words (for records)."""
    n = int(request.get("windows", len(request["score"])))
    return (f"wikipedia evaluation split, {n} x {len(request['score'][0])} tokens, and {len(request['score']) - n} "
            "short prompts (chat, code, prose)")


def run_probe(
    python: str, probe: Path, export: Path, request: dict[str, Any], engine: str, this_package: bool = False
) -> tuple[dict[str, Any], str]:
    """Run the probe script ``probe`` (an engine folder's ``probe.py``) with ``python`` on ``export``; returns (its result,
    its log). ``this_package``: the engine imports this very ``mla_convert`` (its folder alone on ``PYTHONPATH``,
    ahead of any copy installed there): the vLLM plugin as this checkout has it.

    Raises:
        RuntimeError: the ``engine`` process failed or timed out (the message ends with its last log lines).
    """
    results, log = run_probes(python, probe, [(export, request)], engine, this_package)
    return results[0], log


def run_probes(
    python: str, probe: Path, jobs: list[tuple[Path, dict[str, Any]]], engine: str, this_package: bool = False
) -> tuple[list[dict[str, Any]], str]:
    """:func:`run_probe` for several ``(folder, request)`` jobs; more than one runs in one process (the probe's
    ``--jobs`` form: one engine import for all); returns their results in order and the process's log.

    Raises:
        RuntimeError: the ``engine`` process failed or timed out (the message ends with its last log lines).
    """
    import os

    limit = TIMEOUT_S + JOB_S * (len(jobs) - 1)
    with tempfile.TemporaryDirectory(prefix=f"mla-{engine.lower().replace(' ', '-')}-") as tmp:
        files = []
        for i, (folder, request) in enumerate(jobs):
            req, res = Path(tmp) / f"request-{i}.json", Path(tmp) / f"result-{i}.json"
            req.write_text(json.dumps(request))
            files.append([str(folder), str(req), str(res)])
        (Path(tmp) / "jobs.json").write_text(json.dumps(files))
        env = dict(os.environ)
        if this_package:
            (Path(tmp) / "path").mkdir()
            (Path(tmp) / "path" / "mla_convert").symlink_to(Path(__file__).resolve().parents[1])
            env["PYTHONPATH"] = str(Path(tmp) / "path")
        args = files[0] if len(files) == 1 else ["--jobs", str(Path(tmp) / "jobs.json")]
        try:
            done = subprocess.run([python, str(probe), *args], capture_output=True, text=True, timeout=limit,
                                  cwd=tmp, env=env)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"{engine} did not finish within {limit} s") from None
        log = done.stdout + done.stderr
        if done.returncode != 0 or not all(Path(f[2]).is_file() for f in files):
            tail = "\n".join(log.strip().splitlines()[-15:])
            names = ", ".join(f[0] for f in files)
            raise RuntimeError(f"{engine} exited with {done.returncode} on {names}:\n{tail}")
        return [json.loads(Path(f[2]).read_text()) for f in files], log


def _token_logprobs(model: Any, ids: list[int]) -> torch.Tensor:
    """``[T - 1]`` log-probability of each token after the first (float64)."""
    x = torch.tensor([ids])
    with torch.no_grad():
        logits = model(input_ids=x).logits[0].double()
    return torch.log_softmax(logits, -1)[torch.arange(len(ids) - 1), x[0, 1:]]


def agreement(ours: Any, request: dict[str, Any], result: dict[str, Any]) -> tuple[torch.Tensor, list[list[float]]]:
    """An engine's ``result`` against our model ``ours`` (float32) on ``request``: ``|d log p|`` of every scored token
    (``[N]`` float64, nats) and, per greedy prompt, how many logits each token the engine picked is below our argmax
    (0 where it is our argmax)."""
    d = []
    for ids, theirs in zip(request["score"], result["prompt_logprobs"], strict=True):
        d.append((_token_logprobs(ours, ids) - torch.tensor(theirs, dtype=torch.float64)).abs())
    margins = []
    with torch.no_grad():
        for prompt, gen in zip(request["greedy"], result["greedy"], strict=True):
            seq = prompt + gen["tokens"]
            logits = ours(input_ids=torch.tensor([seq])).logits[0, len(prompt) - 1 : -1].double()
            picked = logits[torch.arange(len(gen["tokens"])), torch.tensor(gen["tokens"])]
            margins.append((logits.max(-1).values - picked).tolist())
    return torch.cat(d), margins


def agreement_record(
    request: dict[str, Any], result: dict[str, Any], diff: torch.Tensor, margins: list[list[float]], worst: float
) -> dict[str, Any]:
    """The part of every engine check's record that compares tokens: the scored text, ``|d log p|`` (nats; mean and
    max over ``diff [N]``) and the greedy continuations with their worst margin (``worst``) and how many of the
    engine's tokens are our argmax."""
    return {
        "text": scored_text(request),
        "tokens_scored": int(diff.numel()),
        "logprob_abs_diff": abs_diff_stats(diff),
        "greedy": {
            "prompts": list(PROMPTS),
            "tokens": [g["tokens"] for g in result["greedy"]],
            "max_margin": worst,
            "argmax_equal": sum(m == 0.0 for row in margins for m in row),
            "count": sum(len(row) for row in margins),
        },
    }


def against_ours(
    ckpt: Path, request: dict[str, Any], result: dict[str, Any]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, list[list[float]]]:
    """Our model (``ckpt``, float32) against an engine's ``result`` on ``request`` (any probe's JSON).

    Returns:
        ``diff [N]``: |our log p - the engine's| of every scored token (float64); ``ours_bf16 [N]``: the same for our
        own model in bfloat16 against float32 (recorded); ``source_bf16 [N]``: the same for the *source* in
        bfloat16 against float32 (:func:`source_floor`, the rounding floor a bf16 engine is allowed: a conversion that
        is not bfloat16-safe must not widen its own), or None when the source is not available; ``margins``: for each
        greedy prompt, our max logit minus our logit of each token the engine picked (0 where it is our argmax).
    """
    from mla_convert.mla.checkpoint import load_checkpoint
    from mla_convert.precision import to_bfloat16

    ours = load_checkpoint(ckpt).float().eval()
    diff, margins = agreement(ours, request, result)
    f32 = [_token_logprobs(ours, ids) for ids in request["score"]]
    to_bfloat16(ours)  # RoPE frequencies stay float32
    ours_bf16 = torch.cat([(a - _token_logprobs(ours, ids)).abs() for a, ids in zip(f32, request["score"], strict=True)])
    del ours
    return diff, ours_bf16, source_floor(ckpt, request), margins


def source_floor(ckpt: Path, request: dict[str, Any]) -> torch.Tensor | None:
    """``[N]`` |log p| of every scored token of ``request``: the source of ``ckpt`` (its config's ``source.origin``,
    when that is the bundled model or a path that exists) in bfloat16 against float32, SDPA attention, RoPE
    frequencies float32; None when the source is not available."""
    from mla_convert.mla.checkpoint import read_checkpoint_config
    from mla_convert.precision import to_bfloat16
    from mla_convert.sources.checkpoint import load_source_model, open_source
    from mla_convert.sources.locate import BUILTIN_MODELS

    origin = read_checkpoint_config(ckpt).get("source", {}).get("origin")
    if not origin or (origin not in BUILTIN_MODELS and not Path(origin).exists()):
        return None
    model = load_source_model(open_source(origin), torch.float32)
    model.set_attn_implementation("sdpa")
    f32 = [_token_logprobs(model, ids) for ids in request["score"]]
    to_bfloat16(model)
    out = torch.cat([(a - _token_logprobs(model, ids)).abs() for a, ids in zip(f32, request["score"], strict=True)])
    del model
    return out


def export_logprobs(export: Path, request: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """``([N], [N])``: the log-probability of every scored token of ``request`` (float64) from the export itself in
    its format's reference implementation (stock transformers' ``AutoModelForCausalLM``: ``DeepseekV3ForCausalLM``
    for a DeepSeek-V3 export, no code of ours), in float32 and in bfloat16.

    An engine serving the export in bfloat16 computes this form, whose rounding differs from our model's (the latent
    norm, the scale folded into the query, the padded heads): at a token where the conversion is chaotic the two
    forms' bfloat16 floors differ by several times (the reference conversion on an AVX-512-BF16 EPYC: our copy
    0.95, this form 3.24, vLLM 4.74 on the same token; vLLM against this form in bfloat16 max 1.33)."""
    from transformers import AutoModelForCausalLM

    out = []
    for dtype in (torch.float32, torch.bfloat16):
        model = AutoModelForCausalLM.from_pretrained(str(export), dtype=dtype).eval()
        out.append(torch.cat([_token_logprobs(model, ids) for ids in request["score"]]))
        del model
    return out[0], out[1]


def engine_logprobs(result: dict[str, Any]) -> torch.Tensor:
    """``[N]`` float64: an engine's log-probability of every scored token (a probe's ``prompt_logprobs``, concatenated
    in the order :func:`agreement` reads them)."""
    return torch.cat([torch.tensor(row, dtype=torch.float64) for row in result["prompt_logprobs"]])


def allowed_max(
    source_bf16: torch.Tensor | None, ours_bf16: torch.Tensor | None = None, export_bf16: torch.Tensor | None = None
) -> float:
    """The max |d log p| a bfloat16 engine may show: :data:`ABS_MAX`, or :data:`FLOOR_FACTOR` x the source's own
    bfloat16 max on the same tokens when larger; or :data:`FLOOR_FACTOR` x our own bfloat16 copy's max, but only where
    that copy is as sound as the source on average (its mean within :data:`FLOOR_FACTOR` x the source's): then one
    token's larger move is bfloat16 rounding of a sound conversion (the reference conversion calibrated on the default
    mixture: our bf16 copy mean 0.050 / max 1.03 against the source's 0.043 / 0.39, vLLM through the plugin 0.050 /
    1.19), while a conversion that bfloat16 breaks moves on average and does not widen the limit. ``export_bf16``
    (the export's own form in bfloat16 against float32, :func:`export_logprobs`) widens it the same way, under the
    same condition."""
    limit = ABS_MAX if source_bf16 is None else max(ABS_MAX, FLOOR_FACTOR * float(source_bf16.max()))
    for floor in (ours_bf16, export_bf16):
        if floor is not None and source_bf16 is not None and (
            float(floor.mean()) <= FLOOR_FACTOR * float(source_bf16.mean())
        ):
            limit = max(limit, FLOOR_FACTOR * float(floor.max()))
    return limit


def allowed_mean(source_bf16: torch.Tensor | None) -> float:
    """The mean |d log p| a bfloat16 engine may show: :data:`MEAN_MAX`, or :data:`FLOOR_FACTOR` x the source's own
    bfloat16 mean on the same tokens when larger (a source whose biases bfloat16 cannot hold moves that much itself)."""
    return MEAN_MAX if source_bf16 is None else max(MEAN_MAX, FLOOR_FACTOR * float(source_bf16.mean()))


def allowed_margin(source_bf16: torch.Tensor | None) -> float:
    """How far below our argmax (logits) an engine's greedy token may be: :data:`GREEDY_MARGIN`, or
    :data:`FLOOR_FACTOR` x the source's own largest bfloat16 |d log p| on the scored tokens when larger (bfloat16
    moves the source's log-probs that much, so it flips near ties that close in any copy)."""
    return GREEDY_MARGIN if source_bf16 is None else max(GREEDY_MARGIN, FLOOR_FACTOR * float(source_bf16.max()))


def floor_record(
    ours_bf16: torch.Tensor, source_bf16: torch.Tensor | None, export_bf16: torch.Tensor | None = None
) -> dict[str, Any]:
    """The bfloat16 floors of a record: ours, the source's and, for an export, the export's own form's
    (:func:`allowed_max` reads them)."""
    out = {"ours_bf16_abs_diff": abs_diff_stats(ours_bf16), "source_bf16_abs_diff": abs_diff_stats(source_bf16)}
    return out if export_bf16 is None else {**out, "export_bf16_abs_diff": abs_diff_stats(export_bf16)}


def abs_diff_stats(diff: torch.Tensor | None) -> dict[str, float] | None:
    """``{"mean", "max"}`` of ``diff [N]`` (|d log p| in nats) as records keep them; None for None."""
    return None if diff is None else {"mean": float(diff.mean()), "max": float(diff.max())}


def floor_text(record: dict[str, Any]) -> str:
    """The source's bfloat16 rounding floor of a check's record, as its parity table shows it (mean / max |d log p|,
    or why there is none)."""
    if "source_bf16_abs_diff" not in record:
        return "not measured (a record from before the source's floor)"
    f = record["source_bf16_abs_diff"]
    return "source not available (the max allowed is the fixed one)" if f is None else f"{f['mean']:.3f} / {f['max']:.3f}"


def report(record: dict[str, Any], text: str, json_path: Path | None, table_path: Path | None) -> int:
    """A check's command-line ending: ``record`` written as JSON to ``json_path`` and its table ``text`` to
    ``table_path`` (each when given), the table printed; the exit status, 0 when the record passed, else 1."""
    if json_path:
        json_path.write_text(json.dumps(record, indent=1) + "\n")
    if table_path:
        table_path.write_text(text)
    print(text)
    return 0 if record["passed"] else 1
