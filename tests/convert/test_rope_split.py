"""The RoPE split measured on the source (issue 34 item 2): candidates around the prior, the held-out KL of each
candidate's converted model, and a choice that converts exactly as if it had been given.

The oracle for the measurement is the written checkpoint itself: the KL the search recorded for the chosen
candidate (with the ``o_proj`` refit where the conversion keeps it) is the KL of the model read back from OUT (a whole-model forward through
:func:`mla_convert.metrics.evaluate`, not the search's layer-by-layer streams) on the same held-out windows.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
from test_resolve import LLAMA3_8B, QWEN25_15B, SMOLLM2
from test_stream import _convert  # run_factor with the options split from the run's keywords

from mla_convert.convert.options.options import ConvertOptions
from mla_convert.convert.options.resolve import expected_measurements, resolve_options
from mla_convert.convert.pipeline.split_report import outcome
from mla_convert.convert.pipeline.text import prepare_text
from mla_convert.convert.pipeline.workdir import work_dir
from mla_convert.metrics import evaluate
from mla_convert.mla.checkpoint import load_checkpoint
from mla_convert.sources.checkpoint import load_source_model, open_source

SMALL = {"window": 32, "calib_windows": 4, "eval_windows": 2, "text": "news", "dtype": "float32"}


def _digest(out: Path) -> str:
    return hashlib.sha256(b"".join(f.read_bytes() for f in sorted(out.glob("*.safetensors")))).hexdigest()


@pytest.mark.parametrize(
    ("src", "candidates"),
    [(SMOLLM2, (12, 18, 24, 30)), (LLAMA3_8B, (32, 48, 64)), (QWEN25_15B, (16, 24, 32))],
)
def test_candidates_surround_the_prior(src, candidates):
    """Half to one and a half times the prior's pairs, as many as a rope head holds (2-norm: head_dim / 2), and no
    wider than vLLM's 64 rope values when the prior fits them (Qwen2.5-1.5B's prior 32 pairs: 40 and 48 are not
    tried, so its default conversion stays servable by the vLLM plugin, its only vLLM route; Llama-3-8B's prior 64
    pairs is already wider, so the search goes on around it)."""
    res = resolve_options(ConvertOptions(), src)
    assert res.rope_candidates == candidates
    assert res.options.rope_pairs in candidates
    assert res.choices["rope_pairs"].startswith(
        "measured on this source: the lowest held-out KL in a local search over --rope-pairs "
        f"{', '.join(map(str, candidates))} from the prior"
    )
    assert "measured_splits.json" in res.choices["rope_pairs"]  # the prior says where it came from
    # the strategy is not given either: the other measured one is tried at the pairs chosen
    assert res.options.rope_strategy == "2-norm" and res.rope_strategies == ("rotation",)
    assert res.choices["rope_strategy"].startswith("measured on this source at the pairs chosen")
    # and the refit mode: the prior at 31.25 % is the teacher-forced refit; the sequential one is measured too
    assert res.options.refit_o_proj == "teacher" and res.refit_modes == ("sequential",)
    assert res.choices["refit_o_proj"].startswith("measured on this source at the split chosen: the lower held-out "
                                                  "KL of --refit-o-proj teacher, sequential (the prior teacher")
    around = {24: 3, 64: 2, 32: 2}[res.options.rope_pairs]  # the prior and its neighbours (the prior at the edge: one)
    assert expected_measurements(res) == around + 1 + 1  # then the other strategy, then the other refit mode


@pytest.mark.parametrize(
    ("options", "given", "target"),
    [
        (ConvertOptions(rope_pairs=16), {"rope_pairs"}, "transformers"),  # given
        (ConvertOptions(kv_lora_rank=64), {"kv_lora_rank"}, "transformers"),  # the split is moot
        (ConvertOptions(), set(), "vllm-cpu"),  # the engine's row fixes it
    ],
)
def test_nothing_is_measured_where_the_pairs_are_fixed(options, given, target):
    res = resolve_options(options, SMOLLM2, target, given)
    assert res.rope_candidates == () and res.rope_strategies == () and res.refit_modes == ()
    assert not res.choices["rope_pairs"].startswith("measured on this source")
    assert not res.choices["rope_strategy"].startswith("measured on this source")


@pytest.mark.parametrize(("width", "candidates"), [(64, (12, 18, 24, 30)), (100, (18, 24, 30))])
def test_a_reduced_nope_width_is_searched_under(width, candidates):
    """A NoPE-width reduction (given, or the default bound of 4 or more KV heads) leaves the pairs to the search,
    among the splits whose query NoPE width (SmolLM2: 64 + 2r) reaches the width."""
    res = resolve_options(ConvertOptions(qk_nope_head_dim=width), SMOLLM2, given={"qk_nope_head_dim"})
    assert res.rope_candidates == candidates and res.options.qk_nope_head_dim == width
    assert res.choices["rope_pairs"].startswith("measured on this source")


def test_a_given_lever_is_not_measured():
    res = resolve_options(ConvertOptions(rope_strategy="rotation"), SMOLLM2, given={"rope_strategy"})
    assert res.rope_candidates and res.rope_strategies == () and res.refit_modes == ("sequential",)
    assert res.choices["rope_strategy"] == "given"
    res = resolve_options(ConvertOptions(refit_o_proj="teacher"), SMOLLM2, given={"refit_o_proj"})
    assert res.rope_candidates and res.rope_strategies == ("rotation",) and res.refit_modes == ()
    assert res.choices["refit_o_proj"] == "given"
    none = resolve_options(ConvertOptions(refit_o_proj="none"), SMOLLM2, given={"refit_o_proj"})
    assert none.refit_modes == ()  # no refit asked for: none measured


def _written_kl(src_dir: Path, out: Path) -> float:
    """The oracle: the written checkpoint's KL on the held-out windows, read back and run whole."""
    from transformers import AutoTokenizer

    src = open_source(src_dir)
    text = prepare_text(AutoTokenizer.from_pretrained(str(src.path)), ConvertOptions(**SMALL))
    return evaluate(load_checkpoint(out), text.held_out, load_source_model(src)).kl


@pytest.mark.parametrize("refit", ["none", "teacher", "sequential"])
def test_the_measured_split_converts_as_if_given(tiny_src: Path, tmp_path: Path, refit: str) -> None:
    """The search picks one split by held-out KL; ``--rope-pairs`` and ``--rope-strategy`` of that split give the
    same weights bit for bit, and the search's KL of it (with the refit where the conversion keeps it) is the KL
    of the written model on the held-out windows. The pairs are a local minimum of what was measured: the prior
    and its neighbours first, then further only while the best is at the edge."""
    report = _convert(tiny_src, tmp_path / "out", **SMALL, refit_o_proj=refit)
    split = report["run"]["rope_split"]
    assert split["candidates"] == [2, 3, 4, 5, 6] and split["prior"] == 4
    chosen = split["chosen"]
    kl = {int(r): v for r, v in split["kl_nats_per_token"].items()}
    assert {3, 4, 5} <= set(kl) and len(set(kl.values())) == len(kl)  # measured, not equal
    assert chosen == min(kl, key=lambda r: kl[r])
    ladder = split["candidates"]
    at = ladder.index(chosen)
    assert all(ladder[j] in kl for j in (at - 1, at + 1) if 0 <= j < len(ladder))  # a local minimum
    assert split["refit_mode"] is None  # given
    strategy = split["strategy"]
    assert strategy["prior"] == "2-norm" and set(strategy["kl_nats_per_token"]) == {"2-norm", "rotation"}
    assert strategy["kl_nats_per_token"]["2-norm"] == split["kl_nats_per_token"][str(chosen)]
    picked = strategy["chosen"]
    assert picked == min(strategy["kl_nats_per_token"], key=lambda k: strategy["kl_nats_per_token"][k])
    assert report["options"]["rope_pairs"] == chosen and report["options"]["rope_strategy"] == picked
    assert all(len(layer["rope_pairs"][0]) == chosen for layer in report["layers"])
    assert f"--rope-pairs {chosen} measured best on this source" in report["run"]["rope_pairs_chosen_by"]
    assert f"--rope-strategy {picked} measured best at {chosen} pairs" in report["run"]["rope_pairs_chosen_by"]
    given = _convert(tiny_src, tmp_path / "given", **SMALL, refit_o_proj=refit, rope_pairs=chosen,
                     rope_strategy=picked)  # fmt: skip
    kept = (report["model"]["o_proj_refit"] or {}).get("kept", False)
    assert strategy["o_proj_refit_kept"][picked] == kept
    assert given["run"]["rope_split"] is None
    assert _digest(tmp_path / "out") == _digest(tmp_path / "given")
    assert strategy["kl_nats_per_token"][picked] == pytest.approx(_written_kl(tiny_src, tmp_path / "out"),
                                                                  rel=1e-3, abs=1e-5)  # fmt: skip


def test_the_search_converts_its_choice_as_if_given(tiny_src: Path, tmp_path: Path) -> None:
    """Nothing given: the pairs, the strategy and the refit mode are measured; the three given give the same
    weights bit for bit, and the search's KL of its choice is the written model's."""
    report = _convert(tiny_src, tmp_path / "out", **SMALL)
    split = report["run"]["rope_split"]
    strategy, mode = split["strategy"], split["refit_mode"]
    assert (strategy["prior"], mode["prior"]) == ("2-norm", "teacher")
    assert set(mode["kl_nats_per_token"]) == {"teacher", "sequential"}
    # the refit modes are measured at the split chosen: the prior mode's figure is the strategy's there
    assert mode["kl_nats_per_token"]["teacher"] == strategy["kl_nats_per_token"][strategy["chosen"]]
    picked = (split["chosen"], strategy["chosen"], mode["chosen"])
    kls = mode["kl_nats_per_token"]
    assert mode["chosen"] == min(kls, key=lambda k: kls[k])
    opts = report["options"]
    assert (opts["rope_pairs"], opts["rope_strategy"], opts["refit_o_proj"]) == picked
    said = report["run"]["rope_pairs_chosen_by"]
    if len(set(kls.values())) == 1:  # a tie keeps the prior and says so
        assert f"--refit-o-proj {mode['prior']} kept, the prior: every value measured the same there" in said
    else:
        assert f"--refit-o-proj {mode['chosen']} measured best there" in said
    _convert(tiny_src, tmp_path / "given", **SMALL, rope_pairs=picked[0], rope_strategy=picked[1],
             refit_o_proj=picked[2])  # fmt: skip
    assert _digest(tmp_path / "out") == _digest(tmp_path / "given")
    assert kls[mode["chosen"]] == pytest.approx(_written_kl(tiny_src, tmp_path / "out"), rel=1e-3, abs=1e-5)


@pytest.mark.parametrize("lever", ["strategy", "refit_mode"])
def test_the_lever_not_chosen_was_measured_as_converted(tiny_src: Path, tmp_path: Path, lever: str) -> None:
    """The oracle for the value the search did not keep: converting with it given, at the point of the search where
    it was measured (the strategy at the best pairs and the prior refit mode; the refit mode at the chosen pairs
    and strategy), writes a checkpoint whose held-out KL is the one the search recorded for it."""
    # at 12.5 % a refit is kept on this tiny (at 31.25 % neither mode's is, and both score the same)
    opts = {**SMALL, "cache_fraction": 0.125} if lever == "refit_mode" else SMALL
    report = _convert(tiny_src, tmp_path / "out", **opts)
    split = report["run"]["rope_split"]
    rec = split[lever]
    assert len(set(rec["kl_nats_per_token"].values())) == 2  # the two values convert differently
    other = next(v for v in rec["kl_nats_per_token"] if v != rec["chosen"])
    if lever == "strategy":
        given = {"rope_strategy": other, "refit_o_proj": split["refit_mode"]["prior"]}
    else:
        given = {"rope_strategy": split["strategy"]["chosen"], "refit_o_proj": other}
    _convert(tiny_src, tmp_path / "other", **opts, rope_pairs=split["chosen"], **given)
    assert rec["kl_nats_per_token"][other] == pytest.approx(_written_kl(tiny_src, tmp_path / "other"), rel=1e-3,
                                                            abs=1e-5)  # fmt: skip


class Stop(Exception):
    pass


@pytest.mark.parametrize("stage", ["rope split", "convert"])
def test_resume_keeps_the_measured_split(tiny_src: Path, tmp_path: Path, stage: str) -> None:
    """Stopped while measuring or after it, ``--resume`` finishes with the uninterrupted result."""
    whole = _convert(tiny_src, tmp_path / "whole", **SMALL)
    out = tmp_path / "out"
    seen = {"n": 0}

    def stop(name: str, n: int, total: int) -> None:
        if name == stage:
            seen["n"] += n
            if seen["n"] == 1:
                raise Stop

    with pytest.raises(Stop):
        _convert(tiny_src, out, **SMALL, progress=stop)
    assert (work_dir(out) / "progress.json").is_file()
    report = _convert(tiny_src, out, **SMALL, resume=True)
    assert report["run"]["rope_split"]["chosen"] == whole["run"]["rope_split"]["chosen"]
    assert report["run"]["rope_split"]["kl_nats_per_token"] == whole["run"]["rope_split"]["kl_nats_per_token"]
    assert report["run"]["rope_split"]["strategy"] == whole["run"]["rope_split"]["strategy"]
    assert report["run"]["rope_split"]["refit_mode"] == whole["run"]["rope_split"]["refit_mode"]
    assert _digest(out) == _digest(tmp_path / "whole")


def test_a_stopped_search_goes_on_where_it_stopped(tiny_src: Path, tmp_path: Path, monkeypatch) -> None:
    """Stopped in a later round (the other strategy's) after its first layer, ``--resume`` measures no candidate layer
    twice and skips none: the work folder's checkpoint carries the finished rounds' measurements, the spectra and the
    round under way (each candidate's streams after its last finished layer). The result is the uninterrupted one,
    byte for byte, and its time counts both runs."""
    from mla_convert.convert.pipeline import rope_split

    calls = {"n": 0}
    layer = rope_split._Candidate.layer

    def counted(self, *args):
        calls["n"] += 1
        return layer(self, *args)

    monkeypatch.setattr(rope_split._Candidate, "layer", counted)
    whole = _convert(tiny_src, tmp_path / "whole", **SMALL)
    uninterrupted, calls["n"] = calls["n"], 0
    out, seen, stages = tmp_path / "out", {"n": 0}, []

    def stop(name: str, n: int, total: int) -> None:
        if name == "rope strategy: rotation":
            seen["n"] += n
            if seen["n"] == 1:  # its first layer measured and checkpointed
                raise Stop

    with pytest.raises(Stop):
        _convert(tiny_src, out, **SMALL, progress=stop)
    before, calls["n"] = calls["n"], 0
    report = _convert(tiny_src, out, **SMALL, resume=True, progress=lambda name, n, total: stages.append(name))
    assert before + calls["n"] == uninterrupted and before > 1 and calls["n"] > 0
    assert "rope split" not in stages and "rope strategy: rotation spectra" not in stages  # kept, not measured again
    assert report["run"]["rope_split"] == {**whole["run"]["rope_split"], "seconds": report["run"]["rope_split"]["seconds"]}
    assert _digest(out) == _digest(tmp_path / "whole")


def test_the_outcome_says_when_the_best_is_at_the_edge():
    """A best at the smallest or largest candidate may lie beyond the range tried: the sentence says so."""
    record = {"candidates": [32, 48, 64], "prior": 64, "chosen": 32,
              "kl_nats_per_token": {"32": 0.0122, "48": 0.023, "64": 0.0317}}  # fmt: skip
    said = outcome(record)
    assert said.startswith("--rope-pairs 32 measured best on this source (KL nats/token on the held-out windows: "
                           "32: 0.0122, 48: 0.0230, 64: 0.0317; the prior was 64")
    assert "the smallest candidate tried: fewer pairs may do better still" in said
    assert "candidate tried" not in outcome({**record, "chosen": 48})
    assert "largest candidate tried: more pairs" in outcome({**record, "chosen": 64})


def test_progress_counts_every_step_of_the_search(tiny_src: Path, tmp_path: Path) -> None:
    """Each stage of the search ends when its work does: per measurement round each layer, then each split scored
    through the head (a bar that said "done" before the scoring under-reported the search's time); the other
    strategy's spectra are a pass over the layers of their own; then the other refit mode."""
    seen: dict[str, list[tuple[int, int]]] = {}

    def record(name: str, n: int, total: int) -> None:
        if name.startswith(("rope ", "o_proj refit: ")):
            seen.setdefault(name, []).append((n, total))

    report = _convert(tiny_src, tmp_path / "out", **SMALL, progress=record)
    split = report["run"]["rope_split"]
    for name, steps in seen.items():
        (total,) = {t for _, t in steps}
        assert sum(n for n, _ in steps) == total, name
    assert seen["rope split"][0][1] == 3 + 3  # 3 layers, then the prior and its two neighbours
    assert seen["rope strategy: rotation spectra"][0][1] == 3
    assert seen["rope strategy: rotation"][0][1] == 3 + 1
    assert seen["o_proj refit: sequential"][0][1] == 3 + 1
    more = [n for n in seen if n.startswith("rope split: ")]
    assert len(split["kl_nats_per_token"]) == 3 + len(more)


def test_the_search_parks_the_streams_it_does_not_read(tiny_src: Path, tmp_path: Path) -> None:
    """While the candidates are measured, the evaluation and probe streams and the refit windows wait in the work
    folder (384 MB off the search's peak at Llama-3-8B's width); a sequential candidate reads the refit windows from
    there, pass 2 has every stream back (the conversion equals the one given the split, the as-given test), and no
    parked file is left."""
    out, parked = tmp_path / "out", set()

    def progress(name: str, n: int, total: int) -> None:
        if name.startswith("rope split"):
            parked.update(p.name for p in work_dir(out).glob("parked-*.pt"))

    report = _convert(tiny_src, out, **SMALL, refit_o_proj="sequential", progress=progress)
    assert parked == {f"parked-{k}.pt" for k in ("src_eval", "mla_eval", "mla_probe", "mla_refit")}
    assert report["run"]["rope_split"]["refit_mode"] is None  # given: every candidate refits on the parked windows
    assert report["model"]["o_proj_refit"] is not None and not work_dir(out).exists()
