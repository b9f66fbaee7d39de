"""The fitted reconstruction step (issue 50, Required 4), measured on SmolLM2-135M before it becomes a default.

The default conversion (``factor``'s options with the split and levers its search chose for SmolLM2, given) is made in memory with its calibration statistics;
then, layer after layer, each converted attention block is fitted by gradient to the source block's attention outputs
(:func:`mla_convert.convert.layer.reconstruct.reconstruct_attention`) on the refit windows the conversion kept, its
inputs the converted model's own (``sequential``: the layers below already fitted) or the source's (``teacher``),
the last quarter of those windows held out to keep or drop each layer's fit. Scored on text no conversion read: the
dev windows (Wikipedia adaptation split), the Wikipedia evaluation split and the news evaluation split.

    .venv/bin/python benchmarks/reconstruct.py [--mode sequential|teacher] [--steps 200] [--lr 2e-3] [--layers N]

Prints a table and merges the row into ``benchmarks/results/reconstruct.json``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import protocol
import torch

from mla_convert.convert.layer.reconstruct import reconstruct_attention
from mla_convert.convert.options.options import ConvertOptions, refit_stride
from mla_convert.convert.pipeline.build import convert_windows
from mla_convert.metrics import evaluate
from mla_convert.mla.algebra import causal_mask

RESULTS = Path(__file__).parent / "results" / "reconstruct.json"


@torch.no_grad()
def run_layer(layer: torch.nn.Module, h: torch.Tensor) -> torch.Tensor:
    """A decoder layer on hidden states ``h [N, T, D]`` (window by window), absolute positions from 0."""
    t = h.shape[1]
    pos, mask = torch.arange(t)[None], causal_mask(1, t)
    out = []
    for row in h:
        x = row[None]
        a = layer.self_attn(layer.input_layernorm(x), pos, mask, None)
        x = x + a
        out.append(x + layer.mlp(layer.post_attention_layernorm(x)))
    return torch.cat(out)


def block() -> str:
    """The docs/results.md ``reconstruct`` block from :data:`RESULTS` (``benchmarks/collect.py``): per stored run its
    perplexities and KL on the dev, Wikipedia and news windows before and after the fit, and what the fit cost."""
    out = ["| run | text | source | closed form | reconstructed | KL closed form | KL reconstructed |",
           "|---|---|---:|---:|---:|---:|---:|"]
    notes = []
    for name, r in json.loads(RESULTS.read_text()).items():
        for k, p in r["perplexity"].items():
            out.append(f"| {name} | {k} ({p['tokens']:,} tokens) | {p['source']:.2f} | {p['closed_form']:.2f} "
                       f"(x{p['closed_form'] / p['source']:.3f}) | {p['reconstructed']:.2f} "
                       f"(x{p['reconstructed'] / p['source']:.3f}) | {p['kl_closed_form']:.4f} | "
                       f"{p['kl_reconstructed']:.4f} |")
        kept = sum(bool(row["kept"]) for row in r["layers"])
        notes.append(f"{name}: fit {r['fit_s']:.0f} s for {len(r['layers'])} layers ({kept} kept; the conversion "
                     f"itself {r['convert_s']:.0f} s), {r['mode']} inputs, {r['steps']} Adam steps at lr {r['lr']:g}.")
    return "\n".join([*out, "", *notes, "SmolLM2-135M, the searched reference's levers given (24 pairs, 2-norm, "
                       "teacher refit), calibrated on Wikipedia (the protocol's windows); one thread beside other "
                       "jobs. Written by `python benchmarks/reconstruct.py --steps 50`."])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mode", default="sequential", choices=("sequential", "teacher"))
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--layers", type=int, default=0, help="fit only the first N layers (0: all)")
    args = ap.parse_args()
    started = time.perf_counter()
    proto = protocol.load(None, 8, {"wiki@512": 16, "news@512": 8})
    # the searched default's choice for SmolLM2 (manifests/smollm2-135m-reference.json), given: no search to rerun
    options = ConvertOptions(rope_pairs=24, rope_strategy="2-norm", refit_o_proj="teacher", reconstruct_steps=0)
    conv = convert_windows(proto.src, options, proto.calibration, proto.held_out, keep_stats=True)
    mla, stats = conv.model, conv.stats
    convert_s = time.perf_counter() - started
    texts = {"dev": proto.dev, **proto.evals}
    before = {k: evaluate(mla, v, proto.model) for k, v in texts.items()}
    first = stats[0]
    assert first.x is not None and first.out is not None, "the default conversion keeps its refit windows"
    n = first.x.shape[0]
    fit, held = slice(0, n - max(1, n // 4)), slice(n - max(1, n // 4), n)
    # the refit windows' hidden states entering layer 0 (the source's inputs are stats[i].x, already normalised)
    ids = proto.calibration[:: refit_stride(*proto.calibration.shape)]
    assert ids.shape[0] == n, (ids.shape, n)
    h = mla.model.embed_tokens(ids).detach()
    rows = []
    last = len(mla.model.layers) if args.layers <= 0 else args.layers
    for i, layer in enumerate(mla.model.layers[:last]):
        st = stats[i]
        assert st.x is not None and st.out is not None
        x = layer.input_layernorm(h).detach() if args.mode == "sequential" else st.x
        r = reconstruct_attention(
            layer.self_attn, x[fit], st.out[fit], x[held], st.out[held], args.steps, args.lr
        )
        rows.append({"layer": i, **r.__dict__})
        print(
            f"layer {i}: held-out error {r.before:.4f} -> {r.after:.4f} kept {r.kept} ({r.seconds:.1f} s)",
            flush=True,
        )
        h = run_layer(layer, h)
    after = {k: evaluate(mla, v, proto.model) for k, v in texts.items()}
    record = {
        "mode": args.mode,
        "steps": args.steps,
        "lr": args.lr,
        "options": conv.options.model_dump(mode="json") if conv.options is not None else None,
        "cache": conv.config.kv_lora_rank,
        "convert_s": round(convert_s, 1),
        "fit_s": round(sum(r["seconds"] for r in rows), 1),
        "layers": rows,
        "perplexity": {
            k: {
                "source": before[k].reference_perplexity,
                "closed_form": before[k].perplexity,
                "reconstructed": after[k].perplexity,
                "kl_closed_form": before[k].kl,
                "kl_reconstructed": after[k].kl,
                "tokens": before[k].tokens,
            }
            for k in texts
        },
    }
    print("| text | source | closed form | reconstructed | KL closed form | KL reconstructed |")
    print("|---|---:|---:|---:|---:|---:|")
    for k, p in record["perplexity"].items():
        print(
            f"| {k} | {p['source']:.2f} | {p['closed_form']:.2f} (x{p['closed_form'] / p['source']:.3f}) | "
            f"{p['reconstructed']:.2f} (x{p['reconstructed'] / p['source']:.3f}) | {p['kl_closed_form']:.4f} | "
            f"{p['kl_reconstructed']:.4f} |"
        )
    print(f"fit: {record['fit_s']} s for {len(rows)} layers ({args.mode}, {args.steps} steps, lr {args.lr})")
    old = json.loads(RESULTS.read_text()) if RESULTS.is_file() else {}
    old[f"smollm2-135m {args.mode} {args.steps}x{args.lr}"] = record
    RESULTS.write_text(json.dumps(old, indent=1) + "\n")


if __name__ == "__main__":
    main()
