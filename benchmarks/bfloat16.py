"""The same function in bfloat16 (issue 48): a conversion's bfloat16-vs-float32 deviation against its source's, where
the precision goes, and each attention term's dynamic range against the source's.

For CKPT (a converted ``mla`` folder) and its source (recorded in CKPT's config, or ``--source``):

1. **The gate** (:mod:`mla_convert.precision`): ``|d log p|`` of bfloat16 against float32, converted and source, on
   ``--windows`` x ``--window`` tokens of the Wikipedia evaluation split (text no conversion calibrated on) and on
   the short prompts (chat, code, prose), with first-token agreement after each.
2. ``--where``: **where the precision goes**: the float32 model with one class of tensors (a weight, or a module's
   output activation) rounded to bfloat16 and everything else float32; the mean ``|d log p|`` on the short prompts
   and the long text, for the converted model and the source's corresponding terms.
3. ``--where``: **dynamic range** of each term: max ``|x|`` and max over rows of ``max|x| / rms(x)`` (weights per
   output row; activations per token), the worst layer, converted and source.

    .venv/bin/python benchmarks/bfloat16.py --ckpt CKPT [--source SRC] [--where] [--name NAME] [--results]

Rows are merged into ``benchmarks/results/bfloat16.json`` under NAME; ``--results`` writes the tables between
``docs/results.md``'s ``<!-- bfloat16:start -->`` / ``<!-- bfloat16:end -->`` markers (``benchmarks/collect.py bfloat16`` too).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "bfloat16.json"
DOC = ROOT / "docs" / "results.md"

#: Attention terms of the converted model: (name, module suffix, what) — ``weight``/``bias`` of a module, or
#: ``out`` (its output activation) / ``in`` (its input activation).
MLA_TERMS = (
    ("q_proj.weight", "self_attn.q_proj", "weight"),
    ("q_proj.bias", "self_attn.q_proj", "bias"),
    ("kv_a_proj_with_mqa.weight", "self_attn.kv_a_proj_with_mqa", "weight"),
    ("kv_a_proj_with_mqa.bias", "self_attn.kv_a_proj_with_mqa", "bias"),
    ("kv_a_layernorm.weight", "self_attn.kv_a_layernorm", "weight"),
    ("kv_b_proj.weight", "self_attn.kv_b_proj", "weight"),
    ("o_proj.weight", "self_attn.o_proj", "weight"),
    ("o_proj.bias", "self_attn.o_proj", "bias"),
    ("query [q_nope | q_rope]", "self_attn.q_proj", "out"),
    ("latent row [c_kv | k_rope] before the norm", "self_attn.kv_a_proj_with_mqa", "out"),
    ("c_kv before the norm", "self_attn.kv_a_proj_with_mqa", "out:latent"),
    ("k_rope", "self_attn.kv_a_proj_with_mqa", "out:rope"),
    ("c_kv after the norm", "self_attn.kv_a_layernorm", "out"),
    ("attention output (o_proj input)", "self_attn.o_proj", "in"),
    ("attention layer output", "self_attn.o_proj", "out"),
)
SOURCE_TERMS = (
    ("q_proj.weight", "self_attn.q_proj", "weight"),
    ("q_proj.bias", "self_attn.q_proj", "bias"),
    ("k_proj.weight", "self_attn.k_proj", "weight"),
    ("k_proj.bias", "self_attn.k_proj", "bias"),
    ("v_proj.weight", "self_attn.v_proj", "weight"),
    ("v_proj.bias", "self_attn.v_proj", "bias"),
    ("o_proj.weight", "self_attn.o_proj", "weight"),
    ("query", "self_attn.q_proj", "out"),
    ("key", "self_attn.k_proj", "out"),
    ("value", "self_attn.v_proj", "out"),
    ("attention output (o_proj input)", "self_attn.o_proj", "in"),
    ("attention layer output", "self_attn.o_proj", "out"),
)


def _modules(model: Any, suffix: str) -> list[torch.nn.Module]:
    return [m for n, m in model.named_modules() if n.endswith(suffix) and ".layers." in f".{n}"]


def _rope_width(model: Any) -> int:
    return int(model.config.num_rope_heads * model.config.qk_rope_head_dim)


def _bf_slice(x: torch.Tensor, sl: slice) -> torch.Tensor:
    y = x.clone()
    y[..., sl] = _bf(x[..., sl])
    return y


def _bf(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.bfloat16).to(x.dtype)


@contextlib.contextmanager
def rounded(model: Any, suffix: str, what: str) -> Iterator[bool]:
    """The float32 ``model`` with one term of every layer rounded to bfloat16 (restored on exit); yields whether
    the term exists."""
    mods = _modules(model, suffix)
    saved: list[tuple[torch.nn.Parameter, torch.Tensor]] = []
    hooks = []
    found = False
    for m in mods:
        if what in ("weight", "bias"):
            p = getattr(m, what, None)
            if p is None:
                continue
            found = True
            saved.append((p, p.data.clone()))
            p.data.copy_(_bf(p.data))
        elif what == "out":
            found = True
            hooks.append(m.register_forward_hook(lambda _m, _i, o: _bf(o)))
        elif what.startswith("out:"):
            found = True
            d_c = m.out_features - _rope_width(model)
            sl = slice(0, d_c) if what == "out:latent" else slice(d_c, None)
            hooks.append(m.register_forward_hook(lambda _m, _i, o, sl=sl: _bf_slice(o, sl)))
        else:
            found = True
            hooks.append(m.register_forward_pre_hook(lambda _m, i: (_bf(i[0]), *i[1:])))
    try:
        yield found
    finally:
        for p, data in saved:
            p.data.copy_(data)
        for h in hooks:
            h.remove()


def _deviation(model: Any, ref: dict[str, list[torch.Tensor]], tokens: dict[str, Any]) -> dict[str, float]:
    """Mean |d log p| of ``model`` against the float32 ``ref`` log-probs on each set."""
    from mla_convert.precision import _logprobs

    out = {}
    for part in ("short", "long"):
        d = []
        for ids, a in zip(tokens[part], ref[part], strict=True):
            b = _logprobs(model, ids)
            y = torch.tensor([*ids[1:], int(a[-1].argmax())])
            pos = torch.arange(len(ids))
            d.append((a[pos, y] - b[pos, y]).abs())
        out[part] = float(torch.cat(d).mean())
    return out


@torch.no_grad()
def where(model: Any, terms: tuple[tuple[str, str, str], ...], tokens: dict[str, Any]) -> list[dict[str, Any]]:
    """Per term: the deviation with that term alone in bfloat16, and its dynamic range (worst layer)."""
    from mla_convert.precision import _logprobs

    ref = {part: [_logprobs(model, ids) for ids in tokens[part]] for part in ("short", "long")}
    rows = []
    for name, suffix, what in terms:
        rng = dynamic_range(model, suffix, what, tokens)
        if rng is None:
            continue
        with rounded(model, suffix, what):
            dev = _deviation(model, ref, tokens)
        rows.append({"term": name, **dev, **rng})
    return rows


@torch.no_grad()
def dynamic_range(model: Any, suffix: str, what: str, tokens: dict[str, Any]) -> dict[str, Any] | None:
    """``max_abs`` and ``peak_to_rms`` (max over rows of max|x| / rms(x)) of a term, worst layer, with that layer."""
    mods = _modules(model, suffix)
    stats: list[tuple[float, float]] = []
    if not mods:
        return None
    if what in ("weight", "bias"):
        for m in mods:
            p = getattr(m, what, None)
            if p is None:
                return None
            x = p.detach().double().reshape(p.shape[0], -1) if what == "weight" else p.detach().double()[None]
            stats.append((float(x.abs().max()), _peak_to_rms(x)))
    else:
        seen: dict[int, list[torch.Tensor]] = {}
        hooks = []
        for i, m in enumerate(mods):
            if what.startswith("out"):
                sl = slice(None)
                if what != "out":
                    d_c = m.out_features - _rope_width(model)
                    sl = slice(0, d_c) if what == "out:latent" else slice(d_c, None)
                hooks.append(m.register_forward_hook(
                    lambda _m, _i, o, i=i, sl=sl: seen.setdefault(i, []).append(o.detach()[..., sl])))
            else:
                hooks.append(m.register_forward_pre_hook(lambda _m, a, i=i: seen.setdefault(i, []).append(a[0].detach())))
        try:
            for ids in tokens["short"] + tokens["long"][:1]:
                model(input_ids=torch.tensor([ids]), use_cache=False)
        finally:
            for h in hooks:
                h.remove()
        for i in range(len(mods)):
            x = torch.cat([t.double().reshape(-1, t.shape[-1]) for t in seen[i]])
            stats.append((float(x.abs().max()), _peak_to_rms(x)))
    worst = max(range(len(stats)), key=lambda i: stats[i][0])
    return {"max_abs": stats[worst][0], "max_abs_layer": worst, "peak_to_rms": max(s[1] for s in stats)}


def _peak_to_rms(x: torch.Tensor) -> float:
    rms = x.pow(2).mean(-1).sqrt().clamp_min(1e-30)
    return float((x.abs().amax(-1) / rms).max())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ckpt", type=Path)
    ap.add_argument("--source", default=None)
    ap.add_argument("--name", default=None)
    ap.add_argument("--windows", type=int, default=4)
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--where", action="store_true")
    ap.add_argument("--results", action="store_true")
    ap.add_argument("--source-o-proj", action="store_true",
                    help="put the source's o_proj weights back into the converted model (the refit's share)")
    args = ap.parse_args()
    if args.ckpt is not None:
        record = measure(args.ckpt, args.source, args.windows, args.window, args.where, args.source_o_proj)
        data = json.loads(RESULTS.read_text()) if RESULTS.is_file() else {}
        data[args.name or args.ckpt.name] = record
        RESULTS.parent.mkdir(parents=True, exist_ok=True)
        RESULTS.write_text(json.dumps(data, indent=1) + "\n")
        print(json.dumps({k: v for k, v in record.items() if k != "where"}, indent=1))
        for side in ("converted", "source"):
            for row in record.get("where", {}).get(side, []):
                print(side, row)
    if args.results:
        write_results()


def measure(
    ckpt: Path, source: str | None, windows: int, window: int, with_where: bool, source_o_proj: bool = False
) -> dict[str, Any]:
    """The record of one conversion: the gate, and with ``with_where`` the term tables; ``source_o_proj``: the
    converted model with every layer's ``o_proj.weight`` replaced by the source's (no longer the same function in
    float32: it measures how much of the deviation the refitted ``o_proj`` carries)."""
    from transformers import AutoTokenizer

    from mla_convert.mla.checkpoint import load_checkpoint, read_checkpoint_config
    from mla_convert.precision import gate_line, precision_gate, probe, probe_tokens
    from mla_convert.sources.checkpoint import load_source_model, open_source
    from mla_convert.text.corpora import load_documents
    from mla_convert.text.windows import adds_bos, split_documents, token_windows

    origin = source or read_checkpoint_config(ckpt)["source"]["origin"]
    tok = AutoTokenizer.from_pretrained(str(ckpt))
    docs = split_documents(load_documents("wikipedia"))["evaluation"]
    ids = token_windows(tok, docs, window, windows, bos=adds_bos(tok))
    tokens = probe_tokens(tok, ids)
    t0 = time.time()
    src_model = load_source_model(open_source(origin), torch.float32)
    src_model.set_attn_implementation("sdpa")
    src_where = where(src_model, SOURCE_TERMS, tokens) if with_where else []  # float32 first: probe casts in place
    src_probe = probe(src_model, tokens)
    del src_model
    model = load_checkpoint(ckpt).float().eval()
    if source_o_proj:
        src = open_source(origin)
        with torch.no_grad():
            for i, layer in enumerate(model.model.layers):
                w = src.tensor(src.family.attn("o_proj", i), torch.float32)
                layer.self_attn.o_proj.weight.copy_(w)
    conv_where = where(model, MLA_TERMS, tokens) if with_where else []
    conv_probe = probe(model, tokens)
    gate = precision_gate(conv_probe, src_probe)
    print(gate_line(gate), flush=True)
    rec: dict[str, Any] = {
        "ckpt": str(ckpt),
        "source": origin,
        "text": f"wikipedia evaluation split, {ids.shape[0]} x {ids.shape[1]} tokens; {len(tokens['short'])} short prompts",
        "gate": gate,
        "first_tokens": {"converted": [conv_probe.first_f32, conv_probe.first_bf16],
                         "source": [src_probe.first_f32, src_probe.first_bf16]},
        "seconds": round(time.time() - t0, 1),
        "torch": torch.__version__,
    }
    if with_where:
        rec["where"] = {"converted": conv_where, "source": src_where}
    return rec


def block() -> str:
    """The tables between docs/results.md's bfloat16 markers, from results/bfloat16.json."""
    data = json.loads(RESULTS.read_text())
    lines = [
        "Written by `python benchmarks/bfloat16.py --results` from `benchmarks/results/bfloat16.json`; each row measured by "
        "`python benchmarks/bfloat16.py --ckpt CKPT --name NAME [--where]` (float32 model against `model.to(torch.bfloat16)`, "
        "source in SDPA attention; mean |d log p| in nats).",
        "",
        "| conversion | text | long text: converted / source (ratio) | short prompts: converted / source (ratio) "
        "| first token as float32: converted / source | passed |",
        "|---|---|---|---|---|---|",
    ]
    for name, r in data.items():
        g = r["gate"]
        lo, sh, ft = g["long"], g["short"], g["first_token"]
        lines.append(
            f"| {name} | {r['text']} | {lo['converted']['mean']:.4f} / {lo['source']['mean']:.4f} (x{lo['ratio']:.2f}) "
            f"| {sh['converted']['mean']:.4f} / {sh['source']['mean']:.4f} (x{sh['ratio']:.2f}) "
            f"| {ft['converted_equal']}/{ft['prompts']} / {ft['source_equal']}/{ft['prompts']} "
            f"| {'yes' if g['passed'] else '**no**'} |"
        )
    for name, r in data.items():
        if "where" not in r:
            continue
        lines += ["", f"Where the precision goes, {name}: one term of every layer in bfloat16, the rest float32; "
                  "mean |d log p| (short prompts / long text) and the term's dynamic range (worst layer).", "",
                  "| model | term | short | long | max abs (layer) | max peak / rms |", "|---|---|---:|---:|---:|---:|"]
        for side in ("source", "converted"):
            for row in r["where"][side]:
                lines.append(
                    f"| {side} | {row['term']} | {row['short']:.4f} | {row['long']:.4f} | "
                    f"{row['max_abs']:.3g} ({row['max_abs_layer']}) | {row['peak_to_rms']:.3g} |"
                )
    return "\n".join(lines) + "\n"


def write_results() -> None:
    """Write :func:`block` into docs/results.md."""
    from blocks import replace_block

    print(f"bfloat16: {replace_block('bfloat16', block(), ROOT)}")


if __name__ == "__main__":
    main()
