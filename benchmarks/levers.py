"""Training-free quality levers for the lossy conversion, measured on dev windows only (issue 10).

Each row converts SmolLM2-135M with the default options except one change, and scores perplexity on
8 dev windows: 512-token windows spread across the Wikipedia *adaptation* split, which no conversion reads
(``benchmarks/protocol.py``). Evaluation windows are never looked at here, so these rows can choose defaults
without tuning on what docs/results.md reports.

    .venv/bin/python benchmarks/levers.py [--sizes 72:20,120:24] [--only a,b] [--readme]

Rows:
  none            no o_proj refit
  teacher         the default: ridge refit of o_proj to the source attention output on source inputs
  seq-a           o_proj refit on the *converted* model's own layer inputs (the refit's windows), layer after layer; target =
                  source attention output + a x (source residual - converted residual), a in {0, 0.5, 1}
  sequential      factor's own ``--refit-o-proj sequential`` (seq-0 inside the streamed conversion, with the held-out
                  keep decision; seq-0 above is its independent cross-check)
  rotation-seq    rotation RoPE strategy and the sequential refit together
  q-refit         default + least-squares refit of the NoPE queries on the reconstructed keys
                  (k ~ P k_hat with P = E[k k_hatᵀ] E[k_hat k_hatᵀ]⁻¹; queries become Pᵀ q)
  uniform-ranks   one latent width for every layer instead of the marginal-error allocation
  rotation        RoPE components chosen by the rotation strategy instead of 2-norm
  activation      activation-weighted SVD instead of output-aware
  no-kv-balance   joint SVD without the K/V energy balance
  calib-32k       32,768 calibration tokens (spread the same way) instead of the default 16,384
  calib-fp32      the source's forward over the calibration windows in float32 instead of bfloat16 autocast

A row that beats the default on the dev windows is also scored on the held-out Wikipedia evaluation windows
(``wiki@512``, 40 x 512 tokens, the figure docs/results.md reports) next to the default, and is kept only if it wins there too.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path

import protocol
import torch
from blocks import replace_block

from mla_convert.convert.layer.assemble import pad_plan
from mla_convert.convert.layer.rope import RopePlan
from mla_convert.convert.options.options import ConvertOptions, refit_stride
from mla_convert.convert.pipeline.build import convert_windows
from mla_convert.convert.stats.calibration import LayerStats
from mla_convert.metrics import evaluate
from mla_convert.mla.algebra import causal_mask
from mla_convert.mla.modeling import MLAForCausalLM
from mla_convert.sources.checkpoint import SourceModel

DEV = 8  # dev windows (adaptation split)
SPLITS = Path(__file__).resolve().parents[1] / "mla_convert" / "convert" / "measured_splits.json"


@torch.no_grad()
def sequential_refit(
    mla: MLAForCausalLM, source, stats: list[LayerStats], ids: torch.Tensor, alpha: float
) -> None:
    """Refit each layer's ``o_proj`` on the converted model's own inputs (layers 0..l-1 already converted)."""
    t = ids.shape[1]
    pos, mask = torch.arange(t)[None], causal_mask(1, t)
    h = torch.cat([mla.model.embed_tokens(r[None]) for r in ids])
    h_src = h.clone()
    for layer, src_layer, st in zip(mla.model.layers, source.model.layers, stats, strict=True):
        attn = layer.self_attn
        assert st.out is not None
        x = layer.input_layernorm(h)
        captured: list[torch.Tensor] = []
        hook = attn.o_proj.register_forward_pre_hook(lambda _m, a, c=captured: c.append(a[0].detach()))
        for i in range(x.shape[0]):
            attn(x[i : i + 1], pos, mask, None)
        hook.remove()
        z = torch.cat(captured).reshape(-1, captured[0].shape[-1]).double()
        y = (st.out + alpha * (h_src - h)).reshape(-1, h.shape[-1]).double()
        gram = z.T @ z
        lam = 1e-4 * float(torch.diagonal(gram).mean())
        w = torch.linalg.solve(
            gram + lam * torch.eye(gram.shape[0], dtype=gram.dtype),
            z.T @ y + lam * attn.o_proj.weight.double().T,
        )
        attn.o_proj.weight.copy_(w.T.float())
        h = h + torch.cat([attn(x[i : i + 1], pos, mask, None) for i in range(x.shape[0])])
        h = h + layer.mlp(layer.post_attention_layernorm(h))
        h_src = h_src + st.out
        h_src = h_src + src_layer.mlp(src_layer.post_attention_layernorm(h_src))


@torch.no_grad()
def query_refit(
    mla: MLAForCausalLM, src: SourceModel, plans: list[RopePlan], stats: list[LayerStats]
) -> float:
    """Map each NoPE query through the regression of the true NoPE keys on the reconstructed ones; returns
    the largest ``‖(P - I) k_hat‖ / ‖k_hat‖`` over layers and KV heads (on the calibration keys)."""
    worst = 0.0
    for i, layer in enumerate(mla.model.layers):
        attn, st = layer.self_attn, stats[i]
        assert st.x is not None
        w = src.attention_weights(i)
        plan = pad_plan(plans[i], attn.qk_nope_head_dim)
        x = st.x.reshape(-1, st.x.shape[-1]).double()
        d_n, r, g, h = attn.qk_nope_head_dim, attn.kv_lora_rank, attn.num_kv_heads, attn.num_heads
        key_nope = torch.cat([plan.key_nope, torch.zeros(1, plan.key_nope.shape[1], dtype=torch.float64)])
        k_true = x @ (key_nope @ w["k"]).T
        c = x @ attn.kv_a_proj_with_mqa.weight[:r].double().T
        kv = (c @ attn.kv_b_proj.weight.double().T).view(-1, g, d_n + attn.v_head_dim)
        qw = attn.q_proj.weight.view(h, d_n + attn.qk_rope_head_dim, -1)
        for gi in range(g):
            kt, kh = k_true[:, plan.nope_index[gi]], kv[:, gi, :d_n]
            b = kh.T @ kh
            b = b + 1e-9 * float(torch.diagonal(b).mean()) * torch.eye(d_n, dtype=torch.float64)
            p = (kt.T @ kh) @ torch.linalg.inv(b)
            # P acts on reconstructed keys only: measure how much it moves them (0 = the refit is the identity)
            worst = max(worst, float((kh @ p.T - kh).norm() / kh.norm().clamp_min(1e-30)))
            for hi in range(gi * (h // g), (gi + 1) * (h // g)):
                qw[hi, :d_n] = (p.T @ qw[hi, :d_n].double()).float()
    return worst


def merge(lines: list[str], previous: Path) -> list[str]:
    """Rows of an earlier run (``previous``) that this run did not redo are kept, in their order, and rows
    this run measured replace theirs; the header is this run's (same dev windows, same source figure)."""
    if not previous.exists():
        return lines

    def key(line: str) -> tuple[str, ...]:
        return tuple(c.strip() for c in line.strip("|").split("|")[:3])

    new = {key(x): x for x in lines if x.startswith("| ") and x[2:3].isdigit()}
    old = [x for x in previous.read_text().splitlines() if x.startswith("| ") and x[2:3].isdigit()]
    rows = [new.pop(key(x), x) for x in old] + list(new.values())
    return [x for x in lines if not (x.startswith("| ") and x[2:3].isdigit())] + rows


#: Rows whose options ``factor`` takes per cache size when they win (``measured_splits.json`` ``levers``): what
#: each sets of :data:`mla_convert.convert.options.suggest.LEVER_OPTIONS`.
LEVER_ROWS: dict[str, dict[str, str]] = {
    "teacher": {"rope_strategy": "2-norm", "refit_o_proj": "teacher"},
    "sequential": {"rope_strategy": "2-norm", "refit_o_proj": "sequential"},
    "rotation": {"rope_strategy": "rotation", "refit_o_proj": "teacher"},
    "rotation-seq": {"rope_strategy": "rotation", "refit_o_proj": "sequential"},
}


def choose_levers(lines: list[str]) -> dict[int, tuple[int, dict[str, str], str]]:
    """Per cache size in the table ``lines``: the rope pairs, the :data:`LEVER_ROWS` options ``factor`` takes and
    the evidence. The row with the lowest dev ratio among those that also beat ``teacher`` on the held-out
    windows wins (dev decides, held-out only confirms); ``teacher`` when none does."""
    rows: dict[int, dict[str, tuple[int, float, float | None]]] = {}
    for line in lines:
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 7 and cells[0].isdigit() and cells[2] in LEVER_ROWS:
            held = float(cells[5]) if cells[5] else None
            rows.setdefault(int(cells[0]), {})[cells[2]] = (int(cells[1]), float(cells[4]), held)
    out = {}
    for size, got in rows.items():
        if "teacher" not in got:
            continue
        pairs, dev0, held0 = got["teacher"]
        wins = [(dev, n) for n, (p, dev, held) in got.items() if n != "teacher" and p == pairs and held is not None
                and held0 is not None and held < held0]  # fmt: skip
        name = min(wins)[1] if wins else "teacher"
        dev, held = got[name][1], got[name][2]
        if name == "teacher":
            tried = ", ".join(f"{n} x{d:.2f}" for n, (p, d, _) in got.items() if n != "teacher" and p == pairs)
            why = f"benchmarks/levers.py at r={pairs}: no row beat it on dev (teacher x{dev0:.2f}; {tried})"
        else:
            why = (f"benchmarks/levers.py at r={pairs}: row {name} x{dev:.2f} dev / x{held:.2f} held-out wiki@512 "
                   f"vs teacher x{dev0:.2f} / x{held0:.2f}")
        out[size] = (pairs, LEVER_ROWS[name], why)
    return out


def record_levers(lines: list[str], path: Path = SPLITS) -> None:
    """Write :func:`choose_levers`' choices into ``measured_splits.json`` (``levers``, ``levers_evidence``) of the
    cache sizes measured at their recorded split; the other keys stay as ``benchmarks/perplexity.py`` wrote them."""
    data = json.loads(path.read_text())
    chosen = choose_levers(lines)
    for entry in data["splits"]:
        got = chosen.get(int(entry["cache_budget"]))
        if got is not None and got[0] == entry["rope_pairs"]:
            entry["levers"], entry["levers_evidence"] = got[1], got[2]
    path.write_text(json.dumps(data, indent=2) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="72:16", help="cache budget:rope pairs, comma separated")
    ap.add_argument("--only", default="", help="comma-separated row names")
    ap.add_argument("--readme", action="store_true", help="also replace its block (docs/results.md)")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "levers.md")
    ap.add_argument("--publish", nargs="*", type=Path, metavar="TABLE",
                    help="measure nothing: merge these tables' rows (runs written elsewhere with --out) into --out, "
                    "then write its block (docs/results.md) (with --readme) and the levers into measured_splits.json")  # fmt: skip
    args = ap.parse_args()
    if args.publish is not None:
        lines = args.out.read_text().splitlines()
        for table in args.publish:
            lines = merge(table.read_text().splitlines(), args.out)
            args.out.write_text("\n".join(lines) + "\n")
        publish(lines, args.out, args.readme)
        return
    proto = protocol.load(None, DEV, {"wiki@512": 40})
    src, model, calib, held, dev = proto.src, proto.model, proto.calibration, proto.held_out, proto.dev
    refit_ids = calib[:: refit_stride(*calib.shape)]  # the windows the refit fits on (stats.x / stats.out)
    # the source's calibration statistics with its layer inputs/outputs (the sequential and query refits)
    stats = convert_windows(src, ConvertOptions(dtype="float32", kv_lora_rank=8, cache_budget=None, refit_o_proj="teacher"),
                            calib, keep_stats=True).stats  # fmt: skip
    base = evaluate(model, dev).perplexity
    held_base = evaluate(model, proto.evals["wiki@512"]).perplexity
    rows: dict[str, tuple[dict, Callable | None]] = {
        "teacher": ({}, None),
        "none": ({"refit_o_proj": "none"}, None),
        "seq-0": ({"refit_o_proj": "none"}, lambda m, p: sequential_refit(m, model, stats, refit_ids, 0.0)),
        "seq-0.5": ({"refit_o_proj": "none"}, lambda m, p: sequential_refit(m, model, stats, refit_ids, 0.5)),
        "seq-1": ({"refit_o_proj": "none"}, lambda m, p: sequential_refit(m, model, stats, refit_ids, 1.0)),
        "sequential": ({"refit_o_proj": "sequential"}, None),
        "rotation-seq": ({"rope_strategy": "rotation", "refit_o_proj": "sequential"}, None),
        "q-refit": ({}, lambda m, p: query_refit(m, src, p, stats)),
        "uniform-ranks": ({"uniform": True}, None),
        "rotation": ({"rope_strategy": "rotation"}, None),
        "activation": ({"objective": "activation"}, None),
        "no-kv-balance": ({"kv_balance": False}, None),
        "calib-32k": ({"calib32k": True}, None),
        "calib-fp32": ({"calib_precision": "float32"}, None),
    }
    only = [x for x in args.only.split(",") if x]
    lines = [
        f"SmolLM2-135M-Instruct, default conversion with one change per row; perplexity on {dev.shape[0]} dev "
        f"windows of 512 tokens (Wikipedia adaptation split, read by no conversion; source {base:.2f}). "
        "Written by `python benchmarks/levers.py --readme`.",
        "",
        "| cache | rope pairs | row | dev ppl | x source | x source, held-out wiki@512 | note |",
        "|---|---:|---|---:|---:|---:|---|",
    ]
    lines[0] += (
        f" A row that beats `teacher` (the default) on dev is scored on the 40 held-out wiki@512 evaluation windows "
        f"too (source {held_base:.2f}), and `teacher` with it; a lever is kept only if it wins there."
    )
    for spec in args.sizes.split(","):
        budget, pairs = (int(v) for v in spec.split(":"))
        default_dev: float | None = None
        winners: list[str] = []
        for name, (kw, post) in rows.items():
            if only and name not in only:
                continue
            kw = dict(kw)
            opts = dict(cache_budget=budget, rope_pairs=pairs)
            if kw.pop("uniform", False):
                opts = dict(cache_budget=None, kv_lora_rank=budget - 2 * pairs, rope_pairs=pairs)
            use = protocol.calibration(proto, 32768) if kw.pop("calib32k", False) else calib
            t0 = time.perf_counter()
            conv = convert_windows(src, ConvertOptions(dtype="float32", **opts, **kw), use, held)
            mla, cfg, plans = conv.model, conv.config, conv.plans
            note = ""
            if post is not None:
                res = post(mla, plans)
                if isinstance(res, float):
                    note = f"max ‖(P - I) k_hat‖ / ‖k_hat‖ = {res:.1e}"
            refit = cfg.source.get("o_proj_refit")
            if refit is not None:
                note = (note + "; " if note else "") + f"refit {'kept' if refit['kept'] else 'reverted'}"
            ppl = evaluate(mla, dev).perplexity
            if name == "teacher":
                default_dev, default_model = ppl, mla
            held_cell = ""
            if default_dev is not None and name != "teacher" and ppl < default_dev:
                held_cell = f"{evaluate(mla, proto.evals['wiki@512']).perplexity / held_base:.2f}"
                winners.append(name)
            line = f"| {budget} | {pairs} | {name} | {ppl:.2f} | {ppl / base:.2f} | {held_cell} | {note} |"
            print(line, f"({time.perf_counter() - t0:.0f} s)", flush=True)
            lines.append(line)
        if winners and default_dev is not None:  # the default's held-out figure next to the dev winners'
            held_default = evaluate(default_model, proto.evals["wiki@512"]).perplexity / held_base
            for k, line in enumerate(lines):
                cells = [c.strip() for c in line.strip("|").split("|")]
                if cells[:3] == [str(budget), str(pairs), "teacher"]:
                    cells[5] = f"{held_default:.2f}"
                    lines[k] = "| " + " | ".join(cells) + " |"
    lines = merge(lines, args.out)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines) + "\n")
    publish(lines, args.out, args.readme)


def block(lines: list[str]) -> str:
    """The ``levers`` block: the stored table (``results/levers.md``, rows merged by ``--publish``) as it is."""
    return "\n".join(lines).strip("\n")


def publish(lines: list[str], out: Path, readme: bool) -> None:
    """Print the table; with ``readme``, write its block (docs/results.md) and the levers ``factor`` takes per cache size."""
    print("\n".join(lines))
    for size, (pairs, levers, why) in sorted(choose_levers(lines).items()):
        print(f"{size} values, r={pairs}: {levers} ({why})")
    if readme:
        replace_block("levers", block(lines))
        record_levers(lines)


if __name__ == "__main__":
    main()
