"""``export`` and the ``--export`` step of ``factor`` and ``adapt``: a converted checkpoint in a serving format."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer

from mla_convert.cli.defaults import SHARD_SIZE_DEFAULT, TARGET_DEFAULT
from mla_convert.cli.render import (
    console,
    err_console,
    fail,
    note,
    user_errors,
)
from mla_convert.convert.options.fields import shard_size_of
from mla_convert.engines.registry import export_target
from mla_convert.mla.checkpoint import read_checkpoint_config

EXPORT_HELP = (
    "Also write OUT in a serving format: deepseek-v3 (the sibling folder OUT-deepseek-v3) or gguf (llama.cpp "
    "deepseek2, the sibling file OUT.gguf)."
)
#: Formats ``export --format`` / ``--export`` write.
EXPORT_FORMATS = ("deepseek-v3", "gguf")
TARGET_HELP = (
    "engine shape of the export: transformers (the checkpoint's widths, per-layer ranks padded to the largest) | "
    "vllm (GPU and SGLang: kv_lora_rank 512 + rope 64 for FlashMLA, qk_nope/v_head 64/128, 128/128 or 192/256) | "
    "vllm-cpu (512 + 64, qk_nope and v_head 128, AMX_MLA)."
)


def check_target(target: str, shaping: bool = True) -> None:
    """``--target``: one of the shapes a conversion is made for (``shaping``: ``factor``, ``inspect``, ``adapt``
    ``--export``), or of a DeepSeek-V3 export's engine shapes (a light check: no torch)."""
    from mla_convert.engines.registry import SHAPE_TARGETS, TARGETS

    if not shaping and target == "llama.cpp":
        fail(
            "--target llama.cpp is served from a GGUF: use --format gguf (llama.cpp's own converter cannot make "
            "a loadable GGUF of a DeepSeek-V3 folder without a q_lora_rank; docs/serving.md)"
        )
    allowed = SHAPE_TARGETS if shaping else TARGETS
    if target not in allowed:
        fail(f"--target {target!r} is not one of {', '.join(allowed)} (SGLang takes the vllm shapes: --target vllm)")


def check_export(out: Path, fmt: str | None, overwrite: bool, target: str = TARGET_DEFAULT) -> None:
    """``--export``: a known format and target and a free OUT-FORMAT folder, before any work."""
    from mla_convert.artifacts.output import check_output

    if fmt is None:
        check_target(target)  # without --export it shapes the conversion alone
        return
    if fmt not in EXPORT_FORMATS:
        fail(f"--export {fmt!r} is not one of {', '.join(EXPORT_FORMATS)}")
    check_target(target)
    if fmt == "gguf":
        from mla_convert.engines.llamacpp.gguf_file import check_gguf_output

        check_gguf_target(target)
        check_gguf_output(gguf_sibling(out), overwrite)
        return
    check_output(out.with_name(f"{out.name}-{fmt}"), overwrite)


def check_gguf_target(target: str) -> None:
    """``--format gguf`` writes the checkpoint's widths (llama.cpp takes any): the vLLM shapes are refused."""
    if target not in ("transformers", "llama.cpp"):
        fail(f"--target {target} shapes a DeepSeek-V3 export for vLLM; --format gguf writes the checkpoint's own widths "
             "(llama.cpp's MLA takes any): drop --target")


def gguf_sibling(out: Path) -> Path:
    """Where ``factor/adapt --export gguf`` write the GGUF of OUT: the sibling file ``OUT.gguf``."""
    return out.with_name(f"{out.name}.gguf")


def export_after(out: Path, fmt: str, overwrite: bool, target: str = TARGET_DEFAULT) -> None:
    """Export the finished OUT (``--export``) and print what was written and how to serve it. Interrupted, it says
    that OUT is complete and gives the ``export`` command that finishes the job (exit 130).

    Raises:
        typer.Exit: 2 on a refused export, 130 when interrupted.
    """
    from mla_convert.engines.deepseek_v3.write import export_checkpoint, export_folder

    try:
        if fmt == "gguf":
            run_gguf_export(out, gguf_sibling(out), "auto", overwrite, True)
            return
        dest = export_folder(out, fmt)
        with user_errors():
            manifest = export_checkpoint(out, dest, fmt, overwrite, note=note, target=export_target(target))
    except typer.Exit as exc:
        if exc.exit_code == 130:  # user_errors' interrupt: OUT itself is complete, only the export is missing
            rest = (
                f"{gguf_sibling(out)} --format gguf"
                if fmt == "gguf"
                else f"{export_folder(out, fmt)} --target {export_target(target)}"
            )
            err_console.print(
                f"{out} is complete; the export was not written: mla-convert export {out} {rest}",
                highlight=False,
                markup=False,
            )
        raise
    print_export(dest, manifest)


def print_export(dest: Path, manifest: dict[str, Any]) -> None:
    """The export line, its cache against the checkpoint and the source, and the serve commands."""
    from mla_convert.engines.deepseek_v3.commands import serve_commands

    console.print(export_line(dest, manifest), highlight=False, markup=False)
    for line in serve_commands(str(dest), manifest["export"]):
        console.print("  " + line, highlight=False, markup=False)


def run_gguf_export(
    ckpt: Path, out: Path, dtype: str, overwrite: bool, check: bool, cache_block: int = 32, drop_biases: bool = False
) -> None:
    """Write the GGUF of ``ckpt`` (:func:`~mla_convert.engines.llamacpp.gguf_file.export_gguf`) and print what was written, its
    cache, the parity llama.cpp measured (when it is installed) and how to run it."""
    from mla_convert.engines.llamacpp.gguf_file import export_gguf

    with user_errors():
        path, record = export_gguf(ckpt, out, dtype, overwrite, note=note, check=check, cache_block=cache_block,
                                   drop_attention_biases=drop_biases)
    if drop_biases and "dropped_attention_biases" not in record:
        note(f"note: --drop-attention-biases dropped nothing: {ckpt} has no attention biases (the file is exact)")
    cache = record["cache_values_per_token_per_layer"]
    msg = (f"wrote {path}: llama.cpp deepseek2 GGUF ({record['dtype']}), kv_lora_rank {record['kv_lora_rank']}, "
           f"rope_theta {record['rope']['parameters']['rope_theta']:.6g} ({record['rope']['slots']} pairs), K-only cache "
           f"{cache['llama_cpp']:.0f} values/token/layer (MLA checkpoint {cache['mla']:.1f}, source {cache['source']:.0f})")
    p = record.get("parity")
    if isinstance(p, dict):
        d, g = p["logprob_abs_diff"], p["greedy"]
        msg += (f"; llama.cpp parity: log-prob mean/max |d| {d['mean']:.4f} / {d['max']:.4f} on {p['tokens_scored']} tokens, "
                f"{g['argmax_equal']}/{g['count']} greedy tokens our argmax")
        if "against_the_conversion" in p:
            c, cg = p["against_the_conversion"], p["against_the_conversion"]["greedy"]
            msg += (f" (ours without the dropped {', '.join(c['dropped_attention_biases'])} biases); LOSSY against "
                    f"the conversion: mean/max |d| {c['logprob_abs_diff']['mean']:.4f} / "
                    f"{c['logprob_abs_diff']['max']:.4f}, {cg['argmax_equal']}/{cg['count']} greedy tokens its argmax")
    elif "dropped_attention_biases" in record:
        msg += f"; {p}; LOSSY: the {', '.join(record['dropped_attention_biases'])} biases were left out, cost not measured"
    else:
        msg += f"; {p}"
    console.print(msg, highlight=False, markup=False)
    from mla_convert.engines.llamacpp.env import find_llamacpp

    with user_errors():
        python = find_llamacpp()
    runner = python or "$(bash scripts/llamacpp_env.sh)"  # the command builds (once) and prints it, from the repo
    for line in (f"  {runner} -c \"from llama_cpp import Llama; Llama('{path}')\"  # the "
                 "llama.cpp venv's python (llama-cpp-python; MLA_LLAMACPP_PYTHON)",
                 f"  llama-cli -m {path}  # a llama.cpp build of your own (deepseek2 with MLA)"):
        console.print(line, highlight=False, markup=False)


def export_line(dest: Path, manifest: dict[str, Any]) -> str:
    """The one line printed after an export: its mapping, cache per token and the parity measured (if any)."""
    e = manifest["export"]
    cache = e["cache_values_per_token_per_layer"]
    msg = (
        f"wrote {dest}: DeepseekV3ForCausalLM for {e['target']} ({e['backend']}), kv_lora_rank {e['kv_lora_rank']}, "
        f"rope_theta {e['rope']['parameters']['rope_theta']:.6g} ({e['rope']['slots']} pairs), cache "
        f"{cache['deepseek_v3']:.0f} values/token/layer (MLA checkpoint {cache['mla']:.1f}, source {cache['source']:.0f})"
    )
    p = e["parity"]
    if not p:
        return msg + "; parity not measured (--no-check)"
    msg += f"; parity max |dlogit| {p['max_abs_logit_diff']:.2e} on {p['tokens']} tokens"
    if "greedy_tokens_equal" in p:
        return msg + f", {p['greedy_tokens_equal']}/{p['greedy_tokens']} greedy tokens equal"
    worst = max(p["layers"], key=lambda r: r["relative"])
    return msg + (
        f" (layer by layer: largest layer difference {worst['relative']:.1e} of its output at layer {worst['layer']}; "
        "no greedy tokens at this size)"
    )


def export(
    ckpt: Path = typer.Argument(
        ..., help="A converted checkpoint folder (from 'mla-convert factor' or 'adapt')."
    ),
    out: Path = typer.Argument(
        ..., help="Output: a folder (--format deepseek-v3), or a .gguf file (--format gguf); built in a temporary "
        "sibling and renamed when complete."
    ),
    format: str = typer.Option(
        "deepseek-v3", "--format",
        help="Target format: deepseek-v3 (a folder) | gguf (one llama.cpp deepseek2 file: OUT ending in .gguf, or "
        "OUT/model.gguf).",
    ),
    overwrite: bool = typer.Option(False, help="Replace a non-empty OUT."),
    max_shard_size: str = typer.Option(SHARD_SIZE_DEFAULT, help="Largest output shard (e.g. 500MB, 5GB); a GGUF is one file."),
    check: bool = typer.Option(
        True,
        help="Measure parity against CKPT on real text, float32: the whole model (logits, greedy tokens) up to 2 GiB, "
        "layer by layer (each layer, then the logits) above; --format gguf: the file served in llama.cpp, when it is "
        "installed (MLA_LLAMACPP_PYTHON or scripts/llamacpp_env.sh's venv).",
    ),
    dtype: str = typer.Option(
        "auto",
        help="Written dtype: auto (the checkpoint's; bfloat16 for --target vllm/vllm-cpu) | float32 | bfloat16 "
        "(float16 cannot hold the latent norm). --format gguf also takes float16 and llama.cpp's quantized types "
        "(q8_0, q4_k_m, q5_k_m, q6_k, ...: through llama.cpp's own quantizer, which must be installed).",
    ),
    target: str = typer.Option(TARGET_DEFAULT, "--target", help=TARGET_HELP[0].upper() + TARGET_HELP[1:]),
    drop_attention_biases: bool = typer.Option(
        False, "--drop-attention-biases",
        help="--format gguf of a biased (Qwen2-style) conversion: leave out the query, rope-key and output biases "
        "llama.cpp's deepseek2 has no tensor for. Lossy: the check holds the file to the conversion without them and "
        "prints what dropping them costs against the conversion (docs/export.md).",
    ),
    cache_block: int = typer.Option(
        32, "--cache-block",
        help="--format gguf: 32 zero-pads the latent so it and the K row (latent + rope) are whole blocks of 32 values, "
        "as llama.cpp's quantized caches (q8_0, q4_0, ...) store them (e.g. 93 + 64 -> 96 + 64; the same function, a "
        "few more cached values); 1 keeps the checkpoint's largest rank (f16/bf16/f32 caches only). Only 32 or 1.",
    ),
) -> None:
    """Write CKPT in a format serving engines load: DeepSeek-V3 (transformers and vLLM, both checked; SGLang not run)
    or a llama.cpp GGUF (--format gguf: deepseek2, K-only latent cache of the largest layer rank plus the rope table's
    slots; factor --target llama.cpp makes that row the size asked).

    No attention bias, rope_type default, lm_head written: the mapping is exact (docs/export.md); --target pads
    to the shapes an engine's MLA kernels take. The parity measured is printed with the serve commands; a folder's
    manifest records it too (a GGUF records its mapping in its mla_convert.export metadata, written before the check).

    Example: mla-convert export out/smollm2-mla out/smollm2-ds3 --target vllm-cpu
    Example: mla-convert export out/smollm2-mla out/smollm2-mla.gguf --format gguf --dtype q8_0
    """
    from mla_convert.artifacts.output import check_output

    with user_errors():  # wrong folders, before the model libraries are imported
        if format not in EXPORT_FORMATS:
            fail(f"--format {format!r} is not one of {', '.join(EXPORT_FORMATS)}")
        if format == "gguf":
            from mla_convert.engines.llamacpp.gguf_file import (
                GGUF_DTYPES,
                check_gguf_output,
                gguf_destination,
            )

            if dtype not in GGUF_DTYPES:
                fail(f"--dtype {dtype!r} is not one of {', '.join(GGUF_DTYPES)} for --format gguf")
            if cache_block not in (1, 32):
                fail(f"--cache-block {cache_block} is neither 32 (whole blocks of llama.cpp's quantized caches, q8_0 to "
                     "iq4_nl: all use 32) nor 1 (no padding: f16/bf16/f32 caches); give 32 or 1")
            check_gguf_target(target)
            if read_checkpoint_config(ckpt, require_mla=True).get("model_type") != "mla":
                fail(f"{ckpt} is already a DeepSeek-V3 export; export the MLA checkpoint it came from")
            check_gguf_output(gguf_destination(out), overwrite, ckpt)
        elif drop_attention_biases:
            fail("--drop-attention-biases applies to --format gguf (llama.cpp); a DeepSeek-V3 export of a biased "
                 "conversion is refused instead: serve it through transformers or vLLM with our plugin")
    if format == "gguf":
        run_gguf_export(ckpt, out, dtype, overwrite, check, cache_block, drop_attention_biases)
        return
    with user_errors():
        if cache_block != 32:
            fail(f"--cache-block is for --format gguf (llama.cpp's quantized caches); --format {format} takes none")
    with user_errors():
        if out.suffix.lower() == ".gguf":
            fail(f"OUT {out} ends in .gguf but --format {format} writes a folder: for llama.cpp give --format gguf")
        if dtype not in ("auto", "float32", "bfloat16", "float16"):
            quantized = " (quantized types are for --format gguf)" if dtype.lower().startswith("q") else ""
            fail(f"--dtype {dtype!r} is not one of auto, float32, bfloat16, float16{quantized}")
        check_target(target, shaping=False)
        shard_size_of(max_shard_size)
        if read_checkpoint_config(ckpt, require_mla=True).get("model_type") != "mla":
            fail(f"{ckpt} is already a DeepSeek-V3 export; export the MLA checkpoint it came from")
        check_output(out, overwrite, source_dir=ckpt)
    from mla_convert.engines.deepseek_v3.write import export_checkpoint

    with user_errors():
        manifest = export_checkpoint(
            ckpt, out, format, overwrite, max_shard_size, check, note=note, dtype=dtype, target=target
        )
    print_export(out, manifest)
