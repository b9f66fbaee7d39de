"""``export`` and the ``--export`` step of ``factor`` and ``adapt``: a converted checkpoint in a serving format."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer

from mla_convert.cli.render import (
    console,
    fail,
    note,
    user_errors,
)
from mla_convert.convert.options import shard_size_of
from mla_convert.mla.checkpoint import read_checkpoint_config

EXPORT_HELP = "Also write OUT in a serving format (deepseek-v3) into the sibling folder OUT-FORMAT."


def check_export(out: Path, fmt: str | None, overwrite: bool) -> None:
    """``--export``: a known format and a free OUT-FORMAT folder, before any work."""
    from mla_convert.artifacts.output import check_output

    if fmt is None:
        return
    if fmt != "deepseek-v3":
        fail(f"--export {fmt!r} is not one of deepseek-v3")
    check_output(out.with_name(f"{out.name}-{fmt}"), overwrite)


def export_after(out: Path, fmt: str, overwrite: bool) -> None:
    """Export the finished OUT (``--export``) and print one line."""
    from mla_convert.export.write import export_checkpoint, export_folder

    dest = export_folder(out, fmt)
    with user_errors():
        manifest = export_checkpoint(out, dest, fmt, overwrite, note=note)
    console.print(export_line(dest, manifest), highlight=False, markup=False)


def export_line(dest: Path, manifest: dict[str, Any]) -> str:
    """The one line printed after an export: its mapping, cache per token and the parity measured (if any)."""
    e = manifest["export"]
    msg = (
        f"wrote {dest}: DeepseekV3ForCausalLM, kv_lora_rank {e['kv_lora_rank']}, rope {e['rope']['kind']} "
        f"({e['rope']['slots']} pairs), cache {e['cache_values_per_token_per_layer']['deepseek_v3']:.0f} values/token/layer "
        f"(MLA checkpoint {e['cache_values_per_token_per_layer']['mla']:.1f})"
    )
    p = e["parity"]
    if p:
        return msg + (
            f"; parity max |dlogit| {p['max_abs_logit_diff']:.2e} on {p['tokens']} tokens, "
            f"{p['greedy_tokens_equal']}/{p['greedy_tokens']} greedy tokens equal"
        )
    return msg + "; parity not measured (--no-check, or the model is over 2 GiB in float32)"


def export(
    ckpt: Path = typer.Argument(
        ..., help="A converted checkpoint folder (from 'mla-convert factor' or 'adapt')."
    ),
    out: Path = typer.Argument(
        ..., help="Output folder (built in a temporary sibling, renamed when complete)."
    ),
    format: str = typer.Option("deepseek-v3", "--format", help="Target format: deepseek-v3."),
    overwrite: bool = typer.Option(False, help="Replace a non-empty OUT."),
    max_shard_size: str = typer.Option("2GB", help="Largest output shard (e.g. 500MB, 5GB)."),
    check: bool = typer.Option(
        True,
        help="Measure parity against CKPT (float32 logits and greedy tokens on real text; models up to 2 GiB).",
    ),
    dtype: str = typer.Option(
        "auto", help="Written dtype: auto (the checkpoint's) | float32 | bfloat16 | float16."
    ),
) -> None:
    """Write CKPT in a format serving code loads: DeepSeek-V3 (stock transformers DeepseekV3ForCausalLM).

    The mapping is exact (docs/export.md); the parity measured is printed and recorded in OUT's manifest.

    Example: mla-convert export out/smollm2-mla out/smollm2-ds3 --format deepseek-v3
    """
    from mla_convert.artifacts.output import check_output

    with user_errors():  # wrong folders, before the model libraries are imported
        if format != "deepseek-v3":
            fail(f"--format {format!r} is not one of deepseek-v3")
        if dtype not in ("auto", "float32", "bfloat16", "float16"):
            fail(f"--dtype {dtype!r} is not one of auto, float32, bfloat16, float16")
        shard_size_of(max_shard_size)
        if read_checkpoint_config(ckpt, require_mla=True).get("model_type") != "mla":
            fail(f"{ckpt} is already a DeepSeek-V3 export; export the MLA checkpoint it came from")
        check_output(out, overwrite, source_dir=ckpt)
    from mla_convert.export.write import export_checkpoint

    with user_errors():
        manifest = export_checkpoint(
            ckpt, out, format, overwrite, max_shard_size, check, note=note, dtype=dtype
        )
    msg = export_line(out, manifest)
    console.print(msg, highlight=False, markup=False)
