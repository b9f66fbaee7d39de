"""Where a low-budget conversion's long-window loss goes: per 256-position block, long context vs 512-token cuts,
and how the window's first token changes it (issue 27: the 48-value default's x478 on wiki@2048).

Converts SmolLM2-135M with the default options at ``--budget``/``--pairs`` (``benchmarks/protocol.py``'s
calibration), then for each wiki@2048 evaluation window prints the mean next-token loss (nats) of the source and the
conversion per 256-position block, once with the whole 2048-token context and once with the same tokens cut into
512-token windows; then the loss of the first 512 tokens of each window (positions 16 and later) as is, with its
first token dropped, and with ``"The"`` in place of it.

    .venv/bin/python benchmarks/window_start.py [--budget 48] [--pairs 12]
"""

from __future__ import annotations

import argparse

import protocol
import torch
import torch.nn.functional as F

from mla_convert.convert.options.options import ConvertOptions
from mla_convert.convert.pipeline.build import convert_windows


@torch.no_grad()
def losses(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """Next-token loss (nats) at each position of one window ``ids [T]`` -> ``[T - 1]``."""
    logits = model(input_ids=ids[None], use_cache=False).logits[0, :-1].double()
    return F.cross_entropy(logits, ids[1:], reduction="none")


def cut(model: torch.nn.Module, ids: torch.Tensor, width: int = 512) -> torch.Tensor:
    """:func:`losses` of ``ids`` cut into ``width``-token windows, NaN where a cut has no prediction."""
    parts = [torch.cat([losses(model, ids[i : i + width]), torch.tensor([float("nan")], dtype=torch.float64)])
             for i in range(0, ids.numel(), width)]  # fmt: skip
    return torch.cat(parts)[: ids.numel() - 1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budget", type=float, default=48)
    ap.add_argument("--pairs", type=int, default=12)
    args = ap.parse_args()
    proto = protocol.load(None, 8, {"wiki@2048": 2})
    options = ConvertOptions(dtype="float32", cache_budget=args.budget, rope_pairs=args.pairs)
    mla = convert_windows(proto.src, options, proto.calibration, proto.held_out).model
    src, tok = proto.model, proto.tokenizer
    print(f"SmolLM2-135M, cache {args.budget:g} with {args.pairs} rope pairs; loss in nats per 256-position block")
    print("| window | positions | source, 2048 ctx | MLA, 2048 ctx | source, 512 cuts | MLA, 512 cuts |")
    print("|---:|---|---:|---:|---:|---:|")
    for w, row in enumerate(proto.evals["wiki@2048"]):
        long_s, long_m, cut_s, cut_m = losses(src, row), losses(mla, row), cut(src, row), cut(mla, row)
        for b in range(0, row.numel() - 1, 256):
            sl = slice(b, b + 256)
            print(f"| {w} | {b}-{b + 255} | {long_s[sl].mean():.2f} | {long_m[sl].mean():.2f} | "
                  f"{cut_s[sl].nanmean():.2f} | {cut_m[sl].nanmean():.2f} |")  # fmt: skip
    the = torch.tensor(tok("The", add_special_tokens=False).input_ids)
    print("\n| window | first tokens | variant | source | MLA |")
    print("|---:|---|---|---:|---:|")
    for w, row in enumerate(proto.evals["wiki@2048"]):
        first = repr(tok.decode(row[:2].tolist()))
        for name, ids in (("as is", row[:512]), ("first token dropped", row[1:512]),
                          ("'The' instead", torch.cat([the, row[1:512]]))):  # fmt: skip
            print(f"| {w} | {first} | {name} | {losses(src, ids)[16:].mean():.2f} | {losses(mla, ids)[16:].mean():.2f} |")


if __name__ == "__main__":
    main()
