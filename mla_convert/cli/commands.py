"""``mla-convert`` command line (typer + rich).

Every user error is one line on stderr (``error: ...``) and exit code 2; nothing is written.
Progress bars appear only on a terminal and without ``--quiet``.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help="Convert MHA/GQA transformer checkpoints into Multi-Head Latent Attention (MLA) checkpoints.",
)
manifest_app = typer.Typer(no_args_is_help=True, help="Check conversion manifests.")
app.add_typer(manifest_app, name="manifest")
console = Console(soft_wrap=True)
err_console = Console(stderr=True, soft_wrap=True)
STATE: dict[str, bool] = {"quiet": False}

SOURCE_HELP = (
    "A HF folder (safetensors), a .gguf file, or 'smollm2-135m' (the bundled SmolLM2-135M-Instruct)."
)


@app.callback()
def _main(quiet: bool = typer.Option(False, "--quiet", "-q", help="Print only results and errors.")) -> None:
    STATE["quiet"] = quiet
    if quiet:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()


def fail(message: str) -> None:
    """Print ``error: message`` (one line) and exit 2."""
    err_console.print(f"[bold red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)
    raise typer.Exit(2)


@contextmanager
def user_errors() -> Iterator[None]:
    """Turn the package's input errors into one-line messages and exit code 2."""
    from mla_convert.artifacts.manifest import ManifestError
    from mla_convert.artifacts.output import OutputError
    from mla_convert.convert.factorize import FactorError
    from mla_convert.convert.rope import RopeError
    from mla_convert.kernels import KernelUnavailable
    from mla_convert.runtime.paged_cache import CacheError
    from mla_convert.sources.assets import AssetError
    from mla_convert.sources.checkpoint import SourceError
    from mla_convert.text.corpora import TextError
    from mla_convert.validate.ladder import ValidationError

    errors = (SourceError, RopeError, FactorError, OutputError, TextError, ManifestError, AssetError)
    try:
        yield
    except errors + (ValidationError, CacheError, KernelUnavailable) as exc:
        fail(str(exc))
    except KeyboardInterrupt:
        err_console.print("interrupted: nothing was written")
        raise typer.Exit(130) from None


@contextmanager
def progress_bar() -> Iterator[Callable[[str, int, int], None]]:
    """A ``(stage, advance, total)`` callback drawing one rich bar per stage (silent off-terminal)."""
    if STATE["quiet"]:
        yield lambda stage, n, total: None
        return
    if not console.is_terminal:  # plain lines, so a log shows progress instead of silence
        done: dict[str, int] = {}

        def plain(stage: str, n: int, total: int) -> None:
            if stage not in done:
                console.print(f"{stage}: started ({total} steps)", markup=False, highlight=False)
                done[stage] = 0
            done[stage] += n
            if done[stage] == total:
                console.print(f"{stage}: done", markup=False, highlight=False)

        yield plain
        return
    tasks: dict[str, Any] = {}
    with Progress(
        TextColumn("{task.description:>10}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total}"),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        console=console,
        transient=False,
    ) as prog:

        def cb(stage: str, n: int, total: int) -> None:
            if stage not in tasks:
                tasks[stage] = prog.add_task(stage, total=total)
            prog.advance(tasks[stage], n)

        yield cb


def say(*args: Any) -> None:
    if not STATE["quiet"]:
        console.print(*args, markup=False, highlight=False)


MEASURED_SPLITS = Path(__file__).parents[1] / "convert" / "measured_splits.json"


def measured_splits() -> dict[float, dict[str, Any]]:
    """Cache fraction -> the RoPE/latent split with the lowest held-out (dev) perplexity ratio, as written by
    ``benchmarks/perplexity.py --readme`` (``mla_convert/measured_splits.json``); empty when absent."""
    if not MEASURED_SPLITS.exists():
        return {}
    data = json.loads(MEASURED_SPLITS.read_text())
    return {float(s["cache_fraction"]): s for s in data["splits"]}


def measured_model() -> str:
    """The model the measured splits come from."""
    return str(json.loads(MEASURED_SPLITS.read_text())["model"]) if MEASURED_SPLITS.exists() else "no model"


@app.command()
def inspect(source: str = typer.Argument(..., help=SOURCE_HELP)) -> None:
    """Show the architecture, the KV cache per token now, and what conversions would give.

    Example: mla-convert inspect smollm2-135m
    """
    from mla_convert.sources.checkpoint import open_source

    with user_errors():
        src = open_source(source)
    d = src.describe()
    t = Table(title=escape(source))
    t.add_column("field")
    t.add_column("value")
    for k, v in d.items():
        t.add_row(escape(k), escape(json.dumps(v) if isinstance(v, dict | list) else str(v)))
    console.print(t)
    w = Table(title="KV cache per token per layer (values)")
    for c in ("layout", "values", "bytes (float32)", "ratio to source", "suggested split"):
        w.add_column(c, justify="right")
    base = src.kv_cache_width
    w.add_row(
        "source K + V", str(base), str(4 * base), "1.000", f"{src.num_kv_heads} KV heads x {src.head_dim} x 2"
    )
    measured = measured_splits()
    for frac in (0.3125, 0.1875, 0.125):
        size = round(base * frac)
        m = measured.get(frac)
        if m is None:
            split = "not measured (benchmarks/perplexity.py --readme writes mla_convert/measured_splits.json)"
        else:
            pairs = min(src.head_dim // 2 * src.num_kv_heads, max(1, round(m["rope_share"] * size / 2)))
            split = (
                f"--cache-budget {size} --rope-pairs {pairs} (latent {size - 2 * pairs} + rope {2 * pairs}; "
                f"the rope share measured best on {measured_model()} at this fraction)"
            )
        w.add_row(
            escape(f"MLA [c_kv | k_rope] at {frac:.2%}"),
            str(size),
            str(4 * size),
            f"{frac:.4f}",
            escape(split),
        )
    console.print(w)


@app.command()
def factor(
    source: str = typer.Argument(..., help=SOURCE_HELP),
    out: Path = typer.Argument(
        ..., help="Output folder (built in a temporary sibling, renamed when complete)."
    ),
    rope_mode: str = typer.Option(
        "shared", help="per-head (one rope head per KV head) | shared (one PCA rope head)."
    ),
    rope_strategy: str = typer.Option("2-norm", help="high | low | uniform | 2-norm | rotation (ours)."),
    rope_pairs: int = typer.Option(24, help="RoPE pairs kept per rope head."),
    rope_basis: str = typer.Option("complex", help="complex | real basis of the shared-key PCA."),
    rope_context: int = typer.Option(2048, help="Context length T (tokens) for the rotation strategy."),
    factorization: str = typer.Option("joint", help="joint | split."),
    objective: str = typer.Option("output", help="weight | activation | output."),
    kv_balance: bool = typer.Option(True, help="Balance K and V energy before a joint factorization."),
    refit_o_proj: str = typer.Option(
        "teacher",
        help="none | teacher: least-squares refit of o_proj to the source's attention outputs (no cache cost).",
    ),
    kv_lora_rank: int = typer.Option(
        None, help="Latent width d_c for every layer (overrides --cache-budget)."
    ),
    cache_budget: float = typer.Option(
        120, help="Cache values per token per layer, averaged; ranks set per layer."
    ),
    text: str = typer.Option("wikipedia", help="wikipedia | news | comma-separated .txt files or folders."),
    calib_windows: int = typer.Option(16, help="Calibration windows."),
    window: int = typer.Option(512, help="Tokens per window."),
    eval_windows: int = typer.Option(8, help="Held-out evaluation windows."),
    overwrite: bool = typer.Option(False, help="Replace a non-empty OUT."),
) -> None:
    """Partial RoPE + low-rank K/V -> MLA checkpoint + report + manifest in OUT.

    Examples:

      mla-convert factor smollm2-135m out/smollm2-mla

      mla-convert factor ./Llama-3.2-1B out/l1b --rope-mode per-head --rope-strategy 2-norm --rope-pairs 4 --kv-lora-rank 256
    """
    from mla_convert.artifacts.output import check_output
    from mla_convert.artifacts.report import layer_table, summary_table
    from mla_convert.convert.build import ConvertOptions
    from mla_convert.convert.job import run_factor
    from mla_convert.sources.checkpoint import open_source

    with user_errors():
        options = ConvertOptions(
            rope_mode=rope_mode,
            rope_strategy=rope_strategy,
            rope_pairs=rope_pairs,
            rope_basis=rope_basis,
            rope_context=rope_context,
            factorization=factorization,
            objective=objective,
            kv_balance=kv_balance,
            refit_o_proj=refit_o_proj,
            kv_lora_rank=kv_lora_rank,
            cache_budget=None if kv_lora_rank else cache_budget,
            text=text,
            calib_windows=calib_windows,
            window=window,
            eval_windows=eval_windows,
        )
        check_output(out, overwrite)  # refuse an occupied OUT before the source is read (seconds)
        src = open_source(source)
        say(
            f"source: {src.origin} ({src.family.name}, {src.num_layers} layers, {src.num_heads}/{src.num_kv_heads} heads)"
        )
        with progress_bar() as cb:
            report = run_factor(src, out, options, overwrite=overwrite, progress=cb)
    if not STATE["quiet"]:
        console.print(layer_table(report))
        console.print(summary_table(report))
        sample = report["model"]["sample"]
        if sample["greedy_24_tokens"]:
            console.print(
                f"sample (greedy, latent cache): {sample['greedy_24_tokens']!r}",
                highlight=False,
                markup=False,
            )
    e = report["model"]["eval"]
    console.print(
        f"wrote {out}: perplexity {e['perplexity']:.3f} (source {e['reference_perplexity']:.3f}) on {e['tokens']} tokens, "
        f"cache {report['model']['cache']['converted']['values_per_token_per_layer']:.1f} values/token/layer "
        f"({report['model']['cache']['ratio']:.2%} of source), {report['run']['wall_s']:.0f} s, "
        f"peak {report['run']['peak_rss_mb']:.0f} MB",
        highlight=False,
    )


def _load_mla(ckpt: Path, require_mla: bool = False) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    import mla_convert  # noqa: F401 - registers the mla model type

    if not (ckpt / "config.json").exists():
        fail(f"{ckpt} has no config.json; pass a folder written by 'mla-convert factor'")
    kind = json.loads((ckpt / "config.json").read_text()).get("model_type")
    if require_mla and kind != "mla":
        fail(f"{ckpt} holds a {kind!r} model, not a converted MLA checkpoint; run 'mla-convert factor' first")
    try:
        return AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32).eval()
    except (OSError, ValueError) as exc:
        fail(f"{ckpt} cannot be loaded as a checkpoint: {str(exc).splitlines()[0]}")


@app.command("eval")
def eval_cmd(
    ckpt: Path = typer.Argument(..., help="A converted checkpoint folder (or any supported source)."),
    against: str = typer.Option(None, help="Source model to compare with: perplexity delta, KL, top-1."),
    text: str = typer.Option("wikipedia", help="wikipedia | news | comma-separated .txt files or folders."),
    window: int = typer.Option(512, help="Tokens per window."),
    windows: int = typer.Option(8, help="Number of evaluation windows."),
) -> None:
    """Perplexity on held-out text (the evaluation split); with --against, delta, KL and top-1 agreement.

    Example: mla-convert eval out/smollm2-mla --against smollm2-135m --window 2048 --windows 4
    """
    from transformers import AutoTokenizer

    from mla_convert.sources.checkpoint import load_source_model, open_source
    from mla_convert.text.corpora import load_documents, split_documents, token_windows
    from mla_convert.validate.metrics import evaluate

    with user_errors():
        model = _load_mla(ckpt)
        ref = load_source_model(open_source(against)) if against else None
        tok = AutoTokenizer.from_pretrained(str(ckpt))
        spec: Any = text if text in ("wikipedia", "news") else [Path(p) for p in text.split(",")]
        docs = split_documents(load_documents(spec))["evaluation"]
        ids = token_windows(tok, docs, window, windows, bos=False)
        with progress_bar() as cb:
            res = evaluate(model, ids, ref, progress=lambda n: cb("evaluate", n, len(ids)))
    msg = f"perplexity {res.perplexity:.3f} on {res.tokens} tokens ({res.windows} x {res.window}, {text} evaluation split)"
    if ref is not None:
        msg += (
            f"; source {res.reference_perplexity:.3f} (x{res.perplexity / (res.reference_perplexity or 1):.3f}), "
            f"KL {res.kl:.4f} nats/token, top-1 agreement {res.top1:.4f}"
        )
    console.print(msg, highlight=False, markup=False)
    if not sys.stdout.isatty():
        console.print(json.dumps(res.as_dict()), highlight=False)


@app.command()
def generate(
    ckpt: Path = typer.Argument(..., help="A converted checkpoint folder."),
    prompt: str = typer.Argument(..., help="Prompt text."),
    max_new_tokens: int = typer.Option(48, help="Tokens to generate (greedy)."),
    backend: str = typer.Option(
        "absorbed",
        help="absorbed (torch, transformers generate) | triton (paged latent cache, the bundled kernel; "
        "runs in the Triton interpreter without a GPU) | paged (paged latent cache, torch).",
    ),
) -> None:
    """Greedy text through the latent cache (never expanded K/V); the backend that ran is printed.

    Example: mla-convert generate out/smollm2-mla "The capital of France is" --backend triton
    """
    from transformers import AutoTokenizer

    from mla_convert.runtime.decode import generate as paged_generate
    from mla_convert.validate.metrics import greedy

    if backend not in ("absorbed", "triton", "paged"):
        fail(f"--backend {backend!r} is not one of absorbed, triton, paged")
    if max_new_tokens < 1:
        fail("--max-new-tokens must be at least 1")
    with user_errors():
        model = _load_mla(ckpt, require_mla=True)
        tok = AutoTokenizer.from_pretrained(str(ckpt))
        ids = tok(prompt, return_tensors="pt").input_ids
        if backend == "absorbed":
            model.set_attention_path("absorbed")
            out = greedy(model, ids, max_new_tokens)
            ran = "absorbed-torch (transformers DynamicCache holding [c_kv | k_rope])"
        else:
            res = paged_generate(
                model, ids, max_new_tokens, backend="triton" if backend == "triton" else "absorbed"
            )
            log = ", ".join(f"{k} x{v}" for k, v in sorted(res.backend_log.items()))
            out, ran = res.tokens, f"paged latent cache: {log}"
    console.print(tok.decode(out[0], skip_special_tokens=True), highlight=False, markup=False)
    if not STATE["quiet"]:
        err_console.print(f"backend: {ran}", highlight=False, markup=False)


@app.command()
def validate(
    ckpt: Path = typer.Argument(..., help="A converted checkpoint folder (written by 'mla-convert factor')."),
    source: str = typer.Option(None, help="Source model; default: the one recorded in the checkpoint."),
    text: str = typer.Option(None, help="Held-out text (evaluation split); default: the conversion's."),
    window: int = typer.Option(None, help="Tokens per evaluation window; default: the conversion's."),
    windows: int = typer.Option(None, help="Evaluation windows for rung 4; default: the conversion's."),
    prompt_tokens: int = typer.Option(61, help="Prefill tokens of rungs 2-3."),
    new_tokens: int = typer.Option(16, help="Decode steps of rung 3."),
    page_size: int = typer.Option(16, help="Paged-cache page size, 1..128."),
    backend: str = typer.Option("triton", help="Decode backend of rung 3: triton | absorbed."),
) -> None:
    """Run the validation ladder; write validation.json and validation.md into CKPT.

    Rungs: 1 naive vs absorbed, 2 kernel vs float64 reference, 3 decode vs full recomputation (logits and
    every cache row), 4 converted vs source (perplexity, KL, top-1, softmax scale), 5 cache ledger.
    Exits 1 when any rung fails, naming it.

    Example: mla-convert validate out/smollm2-mla
    """
    from mla_convert.validate.ladder import format_value, write_validation
    from mla_convert.validate.ladder import validate as run_validate

    if backend not in ("triton", "absorbed"):
        fail(f"--backend {backend!r} is not one of triton, absorbed")
    with user_errors():
        say = (
            (lambda m: None)
            if STATE["quiet"]
            else (lambda m: err_console.print(m, highlight=False, markup=False))
        )
        res = run_validate(
            ckpt, source, text, window, windows, prompt_tokens, new_tokens, page_size, backend, progress=say
        )
        write_validation(ckpt, res)
    table = Table(title=f"validation of {ckpt}")
    for col in ("rung", "check", "value", "tolerance", "result"):
        table.add_column(col)
    for r in res.rungs:
        if r.skipped:
            table.add_row(f"{r.number} {r.name}", "skipped", escape(r.skipped), "", "")
        for i, c in enumerate(r.checks):
            val = format_value(c.value)
            verdict = "" if c.passed is None else ("pass" if c.passed else "[bold red]FAIL[/]")
            table.add_row(
                f"{r.number} {r.name}" if i == 0 else "", escape(c.name), escape(val), c.tolerance, verdict
            )
    console.print(table)
    console.print(
        f"wrote {ckpt / 'validation.json'} and {ckpt / 'validation.md'}", highlight=False, markup=False
    )
    if res.passed and res.partial:
        console.print(f"validation passed, but {res.partial}", highlight=False, markup=False)
        return
    if not res.passed:
        first = res.failed[0]
        bad = next(c for c in first.checks if c.passed is False)
        names = ", ".join(f"{r.number} ({r.name})" for r in res.failed)
        fail_msg = f"validation failed at rung {names}: {bad.name} = {format_value(bad.value)} (tolerance {bad.tolerance})"
        err_console.print(f"[bold red]error:[/] {escape(fail_msg)}", highlight=False)
        raise typer.Exit(1)
    console.print("validation passed: all rungs within tolerance", highlight=False, markup=False)


@app.command()
def adapt(
    ckpt: Path = typer.Argument(..., help="A converted checkpoint folder (from 'mla-convert factor')."),
    out: Path = typer.Argument(..., help="Output folder for the adapted checkpoint."),
    source: str = typer.Option(None, help="Teacher/reference model; default: the checkpoint's source."),
    text: str = typer.Option("wikipedia", help="wikipedia | news | comma-separated .txt files or folders."),
    tokens: int = typer.Option(100_000, help="Training token budget (all processes)."),
    seq_len: int = typer.Option(512, help="Tokens per training sequence and validation window."),
    batch_size: int = typer.Option(4, help="Sequences per micro-batch per process."),
    grad_accum: int = typer.Option(1, help="Micro-batches per optimizer step."),
    objective: str = typer.Option(
        "distill",
        help="lm | distill (KL to the source) | mix | attention-transfer (each MLA attention block fit to the "
        "source attention's output on the source's layer inputs; --trainable attention, one process).",
    ),
    temperature: float = typer.Option(1.0, help="Distillation temperature."),
    mix_weight: float = typer.Option(0.5, help="Weight of distillation in 'mix'."),
    hidden_weight: float = typer.Option(
        0.0,
        help="Add this weight x the per-layer hidden-state error to the source (RMS-normalised per token: "
        "0 same direction, 2 orthogonal; 5 measured well) to lm/distill/mix; runs the source too (0: off).",
    ),
    trainable: str = typer.Option("attention", help="attention | attention+norms | all."),
    lr: float = typer.Option(1e-4, help="Peak learning rate (AdamW)."),
    schedule: str = typer.Option("cosine", help="cosine | constant-decay."),
    warmup: float = typer.Option(0.05, help="Fraction of steps of linear warmup."),
    min_lr_ratio: float = typer.Option(0.1, help="Final learning rate / peak."),
    decay_fraction: float = typer.Option(0.2, help="constant-decay: final fraction of steps that decays."),
    beta1: float = typer.Option(0.9, help="AdamW beta1."),
    beta2: float = typer.Option(0.95, help="AdamW beta2."),
    weight_decay: float = typer.Option(0.0, help="AdamW weight decay."),
    clip: float = typer.Option(1.0, help="Gradient-norm clip."),
    eval_every: int = typer.Option(0, help="Steps between evaluations (0: start and end only)."),
    eval_windows: int = typer.Option(8, help="Validation windows of seq-len tokens."),
    also_eval: str = typer.Option(None, help="A second held-out text evaluated alongside (e.g. news)."),
    checkpoint_every: int = typer.Option(25, help="Steps between resumable checkpoints (0: none)."),
    seed: int = typer.Option(0, help="Seed of the data order."),
    mixed_precision: str = typer.Option("no", help="no | bf16 | fp16 (where the hardware has it)."),
    gradient_checkpointing: bool = typer.Option(False, help="Recompute activations in backward."),
    resume: bool = typer.Option(
        False,
        help="Continue the stopped run for OUT from its newest checkpoint; repeat the stopped run's options "
        "(they are checked against .OUT.adapt/options.json).",
    ),
    stop_after: int = typer.Option(None, help="Stop (resumably) after this many steps of this invocation."),
    overwrite: bool = typer.Option(False, help="Replace a non-empty OUT."),
) -> None:
    """Fine-tune a converted checkpoint (LM loss, distillation from the source, a mix, or attention transfer).

    Runs on one CPU as is, or on several processes/machines with `accelerate launch -m mla_convert adapt ...`.
    Checkpoints go to .OUT.adapt/ next to OUT; OUT appears complete at the end with metrics.jsonl,
    training.png, adapt_report.json and a manifest whose parent is the input's canonical id.

    Example: mla-convert adapt out/smollm2-mla out/smollm2-mla-adapted --tokens 100000 --objective distill
    """
    import pydantic

    from mla_convert.adapt.train import AdaptError, AdaptOptions, run_adapt

    try:
        options = AdaptOptions.model_validate(dict(
            source=source, text=text, tokens=tokens, seq_len=seq_len, batch_size=batch_size,
            grad_accum=grad_accum, objective=objective, temperature=temperature, mix_weight=mix_weight,
            hidden_weight=hidden_weight,
            trainable=trainable, lr=lr, schedule=schedule, warmup=warmup, min_lr_ratio=min_lr_ratio,
            decay_fraction=decay_fraction, beta1=beta1, beta2=beta2,
            weight_decay=weight_decay, clip=clip, eval_every=eval_every, eval_windows=eval_windows,
            also_eval=also_eval, checkpoint_every=checkpoint_every, seed=seed, mixed_precision=mixed_precision,
            gradient_checkpointing=gradient_checkpointing,
        ))  # fmt: skip
    except pydantic.ValidationError as exc:
        fail(options_error(exc))
    if stop_after is not None and stop_after < 1:
        fail("--stop-after must be at least 1")
    last = {"t": 0.0}

    def show(entry: dict[str, Any]) -> None:
        import time as _time

        now = _time.perf_counter()
        if STATE["quiet"] or (now - last["t"] < 10 and entry["step"] < entry["steps"]):
            return
        last["t"] = now
        console.print(
            f"step {entry['step']}/{entry['steps']}  tokens {entry['tokens']}  loss {entry['loss']:.4f}  "
            f"{entry['tokens_per_s']:.0f} tok/s  ETA {entry['eta_s'] / 60:.1f} min",
            highlight=False,
            markup=False,
        )

    with user_errors():
        try:
            report = run_adapt(ckpt, out, options, overwrite, resume, stop_after, progress=show)
        except AdaptError as exc:
            fail(str(exc))
    if report is None:
        console.print(
            f"stopped after {stop_after} steps; continue with --resume", highlight=False, markup=False
        )
        return
    if "before" not in report:  # a non-main process of a multi-process run: the main one reports
        return
    b, a = report["before"], report["after"]
    console.print(
        f"wrote {out}: perplexity {b['perplexity']:.3f} -> {a['perplexity']:.3f} (source {a['source_perplexity']:.3f}) "
        f"on {a['eval_tokens']} held-out tokens; KL {b['kl']:.4f} -> {a['kl']:.4f}; "
        f"{report['tokens_trained']} tokens at {report['tokens_per_s']:.0f} tok/s",
        highlight=False,
        markup=False,
    )


def options_error(exc: Any) -> str:
    """One line listing every invalid option of a pydantic ValidationError."""
    parts = []
    for e in exc.errors():
        msg = str(e["msg"]).removeprefix("Value error, ")
        if not e["loc"]:  # a rule across several options
            parts.append(msg)
            continue
        name = "--" + "-".join(str(x) for x in e["loc"]).replace("_", "-")
        parts.append(f"{name}: {msg}")
    return "; ".join(parts)


@manifest_app.command("verify")
def manifest_verify(out: Path = typer.Argument(..., help="An mla-convert output folder.")) -> None:
    """Re-hash the output files and recompute the canonical id.

    Example: mla-convert manifest verify out/smollm2-mla
    """
    from mla_convert.artifacts.manifest import verify

    with user_errors():
        res = verify(out)
    console.print(f"ok: {res['files']} files match; canonical id {res['canonical_id']}", highlight=False)
    if res["uncovered"]:
        console.print(
            f"not covered by the manifest (not verified): {', '.join(res['uncovered'])}", highlight=False
        )


# --------------------------------------------------------------------------------------------- recipes
def _recipe_fail(exc: Any) -> None:
    """Print a RecipeError (one line, or a count and one indented line per problem) and exit 2."""
    lines = exc.lines()
    err_console.print(f"[bold red]error:[/] {escape(lines[0])}", highlight=False, soft_wrap=True)
    for line in lines[1:]:
        err_console.print(line, markup=False, highlight=False, soft_wrap=True)
    raise typer.Exit(2)


def _recipe_path(recipe: str) -> Path:
    """RECIPE as a file, or the bundled recipe of that name when no such file exists."""
    from mla_convert.recipes.recipe import bundled_path

    p = Path(recipe).expanduser()
    if not p.exists():
        bundled = bundled_path(recipe)
        if bundled is not None:
            return bundled
    return p


def _plain(text: str) -> None:
    console.print(text, markup=False, highlight=False, soft_wrap=True)


@app.command("run")
def run_recipe_cmd(
    recipe: str = typer.Argument(..., help="A recipe YAML file (or the name of a bundled recipe)."),
    overrides: list[str] = typer.Argument(
        None, help="key=value / section.key=value, values read as YAML (factor.rope_pairs=16, adapt=null)."
    ),
    dry_run: bool = typer.Option(
        False,
        "--dry-run",
        help="Check the recipe, source architecture, shapes and memory estimate without loading weights; "
        "print the plan; write nothing.",
    ),
    overwrite: bool = typer.Option(
        False,
        help="Replace stage folders (OUTPUT/factor, OUTPUT/adapt) whose outputs do not match the recipe.",
    ),
) -> None:
    """Run a recipe: factor -> adapt -> validate, skipping stages whose outputs already match.

    Prints the resolved recipe and the plan, saves OUTPUT/recipe.resolved.yaml, runs the stages into
    OUTPUT/factor and OUTPUT/adapt (a stage whose manifest matches the recipe is skipped), and ends with the
    validation ladder (exit 1 naming the failing rung). Every recipe problem is listed at once with its
    YAML path (exit 2, nothing written).

    Examples:

      mla-convert run smollm2-135m-quickstart.yaml --dry-run

      mla-convert run smollm2-135m-quickstart.yaml factor.rope_pairs=20 adapt=null
    """
    from mla_convert.adapt.train import AdaptError
    from mla_convert.recipes.recipe import (
        RecipeError,
        blocked,
        load_recipe,
        make_plan,
        memory_lines,
        plan_lines,
        resolved_yaml,
        run_recipe,
        shape_lines,
    )
    from mla_convert.validate.ladder import format_value

    path = _recipe_path(recipe)
    try:
        res = load_recipe(path, overrides or [])
    except RecipeError as exc:
        _recipe_fail(exc)
    r, src = res.recipe, res.src
    assert src is not None
    plan = make_plan(r)
    show = dry_run or not STATE["quiet"]
    if show:
        _plain(f"# recipe {path}" + (f" with {' '.join(overrides)}" if overrides else "") + ", resolved:")
        _plain(resolved_yaml(res).rstrip())
        _plain(
            f"\nsource {r.source}: {src.family.name}"
            + (f" ({src.config.model_type})" if src.config.model_type != src.family.name else "")
            + f", {src.num_layers} layers, "
            f"{src.num_heads} query / {src.num_kv_heads} KV heads, head_dim {src.head_dim}, hidden {src.hidden_size}"
        )
        _plain(f"\nplan (output {r.out}):")
        for line in plan_lines(plan, overwrite):
            _plain(line)
    if dry_run:
        _plain("\nshapes per layer (from the config; no weights loaded):")
        for line in shape_lines(r, src):
            _plain(line)
        _plain("\nmemory (rough estimate, float32, GB):")
        for line in memory_lines(r, src):
            _plain(line)
    stop = blocked(plan)
    if stop and not overwrite:
        _recipe_fail(
            RecipeError(
                res.file,
                [
                    f"{s.name} stage: {s.folder} is not empty ({s.why}); pass --overwrite to replace it"
                    for s in stop
                ],
            )
        )
    if dry_run:
        _plain(
            f"\ndry run: recipe, source and options check out; nothing was loaded or written "
            f"(the run writes {r.out / 'recipe.resolved.yaml'} and the stage folders)"
        )
        return

    last = {"t": 0.0}

    def adapt_progress(entry: dict[str, Any]) -> None:
        import time as _time

        now = _time.perf_counter()
        if STATE["quiet"] or (now - last["t"] < 10 and entry["step"] < entry["steps"]):
            return
        last["t"] = now
        _plain(
            f"step {entry['step']}/{entry['steps']}  tokens {entry['tokens']}  loss {entry['loss']:.4f}  "
            f"{entry['tokens_per_s']:.0f} tok/s  ETA {entry['eta_s'] / 60:.1f} min"
        )

    def note(msg: str) -> None:
        if not STATE["quiet"]:
            err_console.print(msg, highlight=False, markup=False)

    with user_errors():
        try:
            result = run_recipe(
                res,
                overwrite=overwrite,
                say=note,
                factor_progress=progress_bar,
                adapt_progress=adapt_progress,
                validate_progress=note,
            )
        except RecipeError as exc:
            _recipe_fail(exc)
        except AdaptError as exc:
            fail(str(exc))
    summary = ", ".join(f"{k} {v}" for k, v in result.stages.items())
    vres = result.validation
    if vres is not None and not STATE["quiet"]:
        for rung in vres.rungs:
            verdict = f"skipped ({rung.skipped})" if rung.skipped else ("pass" if rung.passed else "FAIL")
            _plain(f"  rung {rung.number} {rung.name}: {verdict}")
    where = f"; report {result.target / 'validation.md'}" if vres is not None else ""
    _plain(f"recipe {r.name}: {summary}; checkpoint {result.target}{where}")
    if vres is not None and not vres.passed:
        first = vres.failed[0]
        bad = next((c for c in first.checks if c.passed is False), None)
        names = ", ".join(f"{x.number} ({x.name})" for x in vres.failed)
        detail = f": {bad.name} = {format_value(bad.value)} (tolerance {bad.tolerance})" if bad else ""
        err_console.print(
            f"[bold red]error:[/] {escape(f'validation failed at rung {names}{detail}')}", highlight=False
        )
        raise typer.Exit(1)


@app.command("init-recipe")
def init_recipe_cmd(
    name: str = typer.Argument(None, help="A bundled recipe; omit it to list them."),
    dest: Path = typer.Argument(
        None, help="Where to write it (default ./NAME.yaml; a folder gets NAME.yaml)."
    ),
    overwrite: bool = typer.Option(False, help="Replace an existing DEST."),
) -> None:
    """Copy a bundled recipe to edit and run.

    Example: mla-convert init-recipe smollm2-135m-quickstart && mla-convert run smollm2-135m-quickstart.yaml --dry-run
    """
    from mla_convert.recipes.recipe import bundled_description, bundled_names, bundled_path, write_atomic

    names = bundled_names()
    if name is None:
        for n in names:
            _plain(f"{n:<26} {bundled_description(n)}")
        return
    src = bundled_path(name)
    if src is None:
        hint = ""
        if name.endswith((".yaml", ".yml")) or "/" in name:  # a destination given as the first argument
            example = "smollm2-135m-quickstart" if "smollm2-135m-quickstart" in names else names[0]
            hint = f"; NAME comes first, then DEST: mla-convert init-recipe {example} {name}"
        fail(f"no bundled recipe {name!r}; bundled: {', '.join(names)}{hint}")
    assert src is not None
    target = dest if dest is not None else Path(f"{src.stem}.yaml")
    if target.is_dir():
        target = target / f"{src.stem}.yaml"
    if target.exists() and not overwrite:
        fail(f"{target} exists; pass --overwrite to replace it")
    write_atomic(target, src.read_text())
    _plain(f"wrote {target}; edit it, then: mla-convert run {target} --dry-run")


def main() -> None:
    """Console-script entry point."""
    app()


if __name__ == "__main__":
    main()
