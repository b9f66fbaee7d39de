"""The conversion llama.cpp serves best at the row the user asked for (issue 35 item 4, ``--target llama.cpp``).

llama.cpp's ``deepseek2`` caches K only: one row of ``kv_lora_rank + qk_rope_head_dim`` values per token per layer,
with **one** ``kv_lora_rank`` for every layer (the GGUF pads per-layer ranks to the largest,
:mod:`mla_convert.engines.llamacpp.gguf_file`) and one rope head of the slots of one plain ``rope_theta`` table
(:func:`~mla_convert.engines.deepseek_v3.mapping.rope_slots`). So with ``--target llama.cpp`` the cache size asked
(``--cache-fraction``, ``--cache-budget``; default 31.25 % of the source's K + V) is the *served* row ``W``, and the
conversion spends it as

- one rope head of the ``r`` fastest pairs (``--rope-strategy high``: pairs ``0..r-1`` are themselves a plain table,
  so the rope head is exactly ``2 r`` values; a data-driven selection such as ``2-norm`` can span every slot of the
  table, 64 values on SmolLM2 for 24 pairs), and
- ``kv_lora_rank = W - 2 r`` in every layer (nothing padded),

with ``r`` from the rope share measured best at llama.cpp's row (``measured_splits.json``'s ``llamacpp``, written by
``benchmarks/engine_shape.py --readme``, where one rank was also measured against per-layer ranks of the same padded
width). The rank is moved to a multiple of 32 when the row allows it (the rest to the rope head): llama.cpp's
``q8_0`` cache quantizes in blocks of 32 and needs both ``kv_lora_rank`` and the row divisible by 32.

Refused before any work, with the reason and the fix: what llama.cpp cannot run exactly (attention or MLP biases, an
MLP activation other than SiLU, a RoPE scaling that leaves no pair at its plain frequency, a rope head per KV head).
A llama3/YaRN source keeps only the pairs its scaling leaves plain (:func:`~mla_convert.engines.precheck.plain_pairs`),
and the rank takes the rest of the row.
"""

from __future__ import annotations

import json
from collections.abc import Collection
from pathlib import Path
from typing import Any

from mla_convert.convert.options.options import ConvertOptions, OptionsError, geometry, source_width
from mla_convert.engines.llamacpp.spec import LLAMACPP, Q8_0_BLOCK

#: The rope share of the row when nothing is measured (the per-layer split measured at 31.25 %).
UNMEASURED_SHARE = 0.4


def measured_row(path: Path | None = None) -> dict[str, Any] | None:
    """The split measured best at llama.cpp's row (``measured_splits.json``'s ``llamacpp``), None when absent."""
    from mla_convert.convert.options.suggest import MEASURED_SPLITS

    path = path or MEASURED_SPLITS
    if not path.exists():
        return None
    entry = json.loads(path.read_text()).get("llamacpp")
    return dict(entry) if entry else None


def split_row(row: int, share: float, pairs_max: int, rank_max: int) -> tuple[int, int]:
    """``(kv_lora_rank, rope_pairs)`` filling a llama.cpp row of ``row`` values.

    ``r = round(share * row / 2)`` pairs (1..``pairs_max``) and the rest as the rank; then, when the row is a multiple
    of :data:`Q8_0_BLOCK` and some rank that is one leaves 1..``pairs_max`` pairs, the nearest such rank (ties: the
    larger), so llama.cpp's q8_0 cache takes the row as it is (the GGUF export can pad the latent, never the rope). The rank is at most ``rank_max`` (the widest useful latent); a row wider than ``rank_max + 2
    pairs_max`` is not filled.

    Raises:
        OptionsError: a row under 3 values (one pair and a rank of 1).
    """
    if row < 3:
        raise OptionsError(
            f"--target {LLAMACPP}: a row of {row} values holds no rope pair and latent; ask for at least 3"
        )
    pairs = min(pairs_max, max(1, round(share * row / 2)), (row - 1) // 2)
    rank = min(rank_max, row - 2 * pairs)
    if rank < row - 2 * pairs:  # the latent is capped: the rope head takes what it can of the rest
        pairs = min(pairs_max, (row - rank) // 2)
    # A row that is not whole blocks has no q8_0 split: the rope width would need padding too
    fits = [
        k
        for k in range(Q8_0_BLOCK, min(row, rank_max) + 1, Q8_0_BLOCK)
        if row % Q8_0_BLOCK == 0 and 1 <= (row - k) // 2 <= pairs_max
    ]
    if fits:
        best = min(fits, key=lambda k: (abs(k - rank), -k))
        return best, (row - best) // 2
    return rank, pairs


def shape_for_llamacpp(
    options: ConvertOptions, src: Any, given: Collection[str], budget_origin: str, path: Path | None = None
) -> tuple[ConvertOptions, str, dict[str, str]]:
    """``options`` shaped for llama.cpp's served row, why (one sentence), and the origin of each option it set.

    Args:
        options: the options after the cache size was fixed (``cache_budget`` in values per token per layer, or
            ``kv_lora_rank`` given).
        src: the :class:`~mla_convert.sources.checkpoint.SourceModel` (config, ``inv_freq``; no weights).
        given: the option names the user gave: ``--rope-pairs`` and ``--kv-lora-rank`` are kept (the row is then
            their sum); ``--rope-strategy`` other than ``high`` is refused (its rope head can span more slots than
            it keeps pairs).
        budget_origin: where the cache size came from (for the sentence).
        path: ``measured_splits.json`` (tests).

    Raises:
        OptionsError: what llama.cpp cannot run exactly, or options that contradict one row; the fix in the message.
    """
    from mla_convert.engines.precheck import export_problems, plain_pairs, rope_type

    if options.rope_mode != "shared":
        raise OptionsError(
            f"--target {LLAMACPP}: llama.cpp's deepseek2 has one rope head shared by every head; --rope-mode "
            f"{options.rope_mode} gives one per KV head: use --rope-mode shared (or --target transformers for the MLA "
            "checkpoint alone)"
        )
    if "rope_strategy" in given and options.rope_strategy != "high":
        raise OptionsError(
            f"--target {LLAMACPP} keeps the row it is given exactly with --rope-strategy high (r pairs = 2 r cached "
            f"values); --rope-strategy {options.rope_strategy} can keep pairs spread over all {src.head_dim // 2} slots "
            "of the rope table, which llama.cpp caches whole: drop --rope-strategy (or use --target transformers)"
        )
    plain = plain_pairs(src)
    kind = rope_type(src)
    if plain == 0:
        raise OptionsError(
            f"--target {LLAMACPP}: the source's RoPE is {kind}-scaled and no pair keeps its plain frequency "
            "rope_theta^(-2k/d); llama.cpp's deepseek2 applies one plain rope_theta table, so no conversion runs "
            "exactly there: use --target transformers and serve the MLA checkpoint"
        )
    half = src.head_dim // 2
    pairs_max = min(half, plain)
    rank_max = geometry(options.model_copy(update={"rope_pairs": 1}), src).max_rank
    if "rope_pairs" in given and options.rope_pairs > pairs_max:
        why = f" ({kind} leaves pairs 0..{plain - 1} plain)" if plain < half else ""
        raise OptionsError(
            f"--target {LLAMACPP}: --rope-pairs {options.rope_pairs} is more than the {pairs_max} pairs one plain rope "
            f"table holds here{why}: use --rope-pairs {pairs_max} or fewer"
        )
    measured = measured_row(path)
    share = float(measured["rope_share"]) if measured else UNMEASURED_SHARE
    origin = (
        f"--target {LLAMACPP}: rope share {share:.2f} of the row, measured best at llama.cpp's row "
        f"({measured['evidence']}; measured_splits.json), the rank then moved to a multiple of {Q8_0_BLOCK} where the "
        "row is one"
        if measured
        else f"--target {LLAMACPP}: rope share {UNMEASURED_SHARE} of the row (not measured at llama.cpp's row)"
    )
    choices: dict[str, str] = {"rope_mode": "given" if "rope_mode" in given else f"--target {LLAMACPP}"}
    if "rope_strategy" not in given:
        choices["rope_strategy"] = f"--target {LLAMACPP} (pairs 0..r-1: a rope head of exactly 2 r values)"
    if options.kv_lora_rank is not None:  # --kv-lora-rank given: the row is the rank plus the rope head
        rank = options.kv_lora_rank
        pairs = (
            options.rope_pairs
            if "rope_pairs" in given
            else min(pairs_max, max(1, round(share * rank / (2 - 2 * share))))
        )
        row = rank + 2 * pairs
        if "rope_pairs" not in given:
            choices["rope_pairs"] = origin
        asked = f"kv_lora_rank {rank} given: a row of {row} values"
    else:
        row = round(options.cache_budget or 0)
        if "rope_pairs" in given:
            pairs = options.rope_pairs
            rank = row - 2 * pairs
            if rank < 1:
                raise OptionsError(
                    f"--target {LLAMACPP}: --rope-pairs {pairs} takes {2 * pairs} values of the {row}-value row and "
                    "leaves no latent: use fewer --rope-pairs or a larger --cache-budget"
                )
            rank = min(rank, rank_max)
        else:
            rank, pairs = split_row(row, share, pairs_max, rank_max)
            choices["rope_pairs"] = origin
        choices["kv_lora_rank"] = origin
        choices["cache_budget"] = f"{budget_origin}: llama.cpp's served row"
        asked = f"the {row}-value row asked ({budget_origin})"
    shaped = options.model_copy(
        update={
            "rope_mode": "shared",
            "rope_strategy": "high",
            "rope_pairs": pairs,
            "kv_lora_rank": rank,
            "cache_budget": None,
            "cache_fraction": None,
        }
    )
    problems = [p for p in export_problems(src, shaped, "transformers", "gguf") if "--target" not in p]
    if problems:
        raise OptionsError(
            f"--target {LLAMACPP}: llama.cpp would not run this conversion exactly: " + "; ".join(problems)
        )
    served = rank + 2 * pairs
    ready = rank % Q8_0_BLOCK == 0 and served % Q8_0_BLOCK == 0
    q8 = (
        f"kv_lora_rank and the row multiples of {Q8_0_BLOCK}, as llama.cpp's q8_0 cache blocks need"
        if ready
        else (
            f"the row is not whole blocks of {Q8_0_BLOCK} (llama.cpp's q8_0 cache block): the GGUF export pads the "
            f"latent to them for a q8_0 cache, since the rope head's {2 * pairs} values are"
            if (2 * pairs) % Q8_0_BLOCK == 0
            else f"the row is not whole blocks of {Q8_0_BLOCK} and the rope head's {2 * pairs} values cannot be "
            "padded: llama.cpp runs it with an f16 / bf16 / f32 cache, not q8_0; ask for a row that is a multiple of "
            f"{Q8_0_BLOCK} for one"
        )
    )
    scaled = f" ({kind} leaves pairs 0..{plain - 1} at their plain frequency)" if plain < half else ""
    why = (
        f"--target {LLAMACPP}: llama.cpp caches one kv_lora_rank + rope head per token per layer for every layer (K "
        f"only), so {asked} is spent as kv_lora_rank {rank} in every layer and a rope head of the {pairs} fastest "
        f"pairs (--rope-strategy high: exactly {2 * pairs} values){scaled}: {served} values per token per layer "
        f"({served / source_width(src):.2%} of the source's {source_width(src)}), nothing padded; {q8}"
    )
    if served < row:
        why += (
            f"; the row is wider than this source can use ({rank_max} latent + {2 * pairs_max} rope at most)"
        )
    return shaped, why, choices
