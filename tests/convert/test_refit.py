"""The sequential ``o_proj`` refit (``--refit-o-proj sequential``) against an oracle built from whole models.

The oracle never touches the streamed conversion's layers or streams: the source's attention outputs come from
transformers' own forward of the whole source model (a hook on every ``self_attn``), the converted model's
``o_proj`` inputs from the whole :class:`~mla_convert.mla.modeling.MLAForCausalLM` forward of the plain
(``--refit-o-proj none``) conversion, refitted layer after layer in place. Each ridge fit is solved here from
its definition (docs/math.md, "The o_proj refit"): ``W = argmin ‖Z Wᵀ - Y‖² + λ ‖W - W_0‖²`` with
``λ = 1e-4 · mean diag(ZᵀZ)``, or, where that fit's bfloat16 rounding sensitivity ``Σ_ij W_ij² E[z_j²]`` exceeds
``1.25²`` x ``W_0``'s, the smallest larger ``λ`` that meets it (found here by a plain bisection on ``log λ`` with a
fresh linear solve at every step).
"""

from __future__ import annotations

import copy
import tempfile
from pathlib import Path

import pytest
import torch

from mla_convert.mla.modeling import MLAForCausalLM

RIDGE = 1e-4  # docs/math.md: λ = 1e-4 · mean diag(ZᵀZ)
LIMIT = 1.25  # docs/math.md: the refit's rounding sensitivity at most 1.25 x the assembled o_proj's


def _ridge(gram: torch.Tensor, zy: torch.Tensor, w0: torch.Tensor, lam: float) -> torch.Tensor:
    return torch.linalg.solve(gram + lam * torch.eye(len(gram), dtype=torch.float64), zy + lam * w0)


def oracle_fit(z: torch.Tensor, y: torch.Tensor, w0: torch.Tensor) -> torch.Tensor:
    """The bounded ridge refit ``[in, out]`` from its definition (module docstring)."""
    gram, zy = z.T @ z, z.T @ y
    ms = (z * z).mean(0)[:, None]

    def sens(w: torch.Tensor) -> float:
        return float((w * w * ms).sum())

    lam = RIDGE * float(torch.diagonal(gram).mean())
    w = _ridge(gram, zy, w0, lam)
    if sens(w) <= LIMIT**2 * sens(w0):
        return w
    lo, hi = torch.tensor(lam).log(), torch.tensor(lam * 1e14).log()
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if sens(_ridge(gram, zy, w0, float(mid.exp()))) > LIMIT**2 * sens(w0) else (lo, mid)
    return _ridge(gram, zy, w0, float(hi.exp()))


@torch.no_grad()
def _source_attention_outputs(source: torch.nn.Module, ids: torch.Tensor) -> list[torch.Tensor]:
    """Every layer's attention output ``[N, T, hidden]`` of the whole source model on ``ids [N, T]``."""
    outs: list[list[torch.Tensor]] = [[] for _ in source.model.layers]
    hooks = [
        layer.self_attn.register_forward_hook(lambda _m, _a, out, i=i: outs[i].append(out[0]))
        for i, layer in enumerate(source.model.layers)
    ]
    try:
        for row in ids:
            source(input_ids=row[None], use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    return [torch.cat(o) for o in outs]


@torch.no_grad()
def sequential_oracle(plain: MLAForCausalLM, source: torch.nn.Module, ids: torch.Tensor) -> MLAForCausalLM:
    """``plain`` with every layer's ``o_proj`` refitted on the converted model's own inputs, layer after layer
    (layers before ``l`` already refitted when layer ``l``'s inputs are captured)."""
    model = copy.deepcopy(plain)
    targets = _source_attention_outputs(source, ids)
    for i, layer in enumerate(model.model.layers):
        o_proj = layer.self_attn.o_proj
        z_rows: list[torch.Tensor] = []
        hook = o_proj.register_forward_pre_hook(lambda _m, a, z=z_rows: z.append(a[0]))
        try:
            for row in ids:
                model(input_ids=row[None], use_cache=False)
        finally:
            hook.remove()
        z = torch.cat(z_rows).reshape(-1, o_proj.in_features).double()
        y = targets[i].reshape(-1, o_proj.out_features).double()
        if o_proj.bias is not None:
            y = y - o_proj.bias.double()
        o_proj.weight.copy_(oracle_fit(z, y, o_proj.weight.double().T).T.float())
    return model


@pytest.fixture(scope="module")
def windows(smol_tokenizer, wiki_splits) -> torch.Tensor:
    """``[8, 128]`` real calibration windows: more tokens than ``o_proj``'s 576 inputs, so a refit is not an
    interpolation of its windows."""
    from mla_convert.text.windows import token_windows

    return token_windows(smol_tokenizer, wiki_splits["calibration"], 128, 8, bos=False)


def _variants(src, ids: torch.Tensor, refit: str) -> dict[str, MLAForCausalLM]:
    """The passes ``factor`` runs at 72 values (float32 calibration, so the oracle's float32 source is the same
    function), read back with the plain ``o_proj`` and with the refitted one (no keep decision: it needs an LM
    loss, which a truncated model does not have)."""
    from mla_convert.convert.options.options import ConvertOptions, check_options
    from mla_convert.convert.pipeline.build import _load
    from mla_convert.convert.pipeline.records import Texts
    from mla_convert.convert.pipeline.stream import StreamedConversion

    opts = ConvertOptions(dtype="float32", cache_budget=72, rope_pairs=16, calib_precision="float32", refit_o_proj=refit)
    check_options(opts, src)
    with tempfile.TemporaryDirectory() as tmp:
        conv = StreamedConversion(src, opts, Texts(ids, ids[:0], ids[:0], ids[:1]), Path(tmp), trim=False, resumable=False)
        conv.pass_one(0)
        config = conv.ranks_and_config()
        conv.pass_two(config, 0)
        out = {}
        for name, variant in (("plain", ""), ("fit", "fit")):
            conv.state["variant"] = variant
            out[name] = _load(copy.deepcopy(config), conv)
    return out


def test_sequential_refit_equals_the_whole_model_oracle(smol_head, windows, eval_ids, monkeypatch):
    """The sequential refit the streamed conversion writes gives the oracle's logits (to float tolerance); the
    teacher-forced refit differs from the oracle by far more (so the comparison tells them apart). One window per
    forward call, so ``ZᵀZ`` and ``ZᵀY`` are summed over several chunks (dropping all but the first fails here)."""
    from mla_convert.convert.layer import refit

    monkeypatch.setattr(refit, "SCORES_PER_CALL", 1)
    assert windows.shape[0] > 1
    src, source = smol_head
    seq, teacher = _variants(src, windows, "sequential"), _variants(src, windows, "teacher")
    oracle = sequential_oracle(seq["plain"], source, windows)

    def logits(m: MLAForCausalLM) -> torch.Tensor:
        with torch.no_grad():
            return m(input_ids=eval_ids, use_cache=False).logits

    want = logits(oracle)
    scale = want.abs().max().item()
    err_plain = (logits(seq["plain"]) - logits(teacher["plain"])).abs().max().item() / scale
    err_seq = (logits(seq["fit"]) - want).abs().max().item() / scale
    err_teacher = (logits(teacher["fit"]) - want).abs().max().item() / scale
    print(f"max |Δ logits| / max |logit| vs the oracle: sequential {err_seq:.1e}, teacher-forced {err_teacher:.1e}")
    assert err_plain == 0.0  # the refit changes o_proj only
    assert err_seq <= 1e-4, (err_seq, err_teacher)
    assert err_teacher > 100 * err_seq, (err_seq, err_teacher)
    # the first layer's inputs are the source's own: both refits solve the same problem there
    w0 = [v["fit"].model.layers[0].self_attn.o_proj.weight for v in (seq, teacher)]
    assert torch.allclose(w0[0], w0[1], rtol=0, atol=1e-5)


@pytest.fixture(scope="module")
def smol_head_biased(smol, smol_head, tmp_path_factory):
    """``(source, model)``: :func:`smol_head`'s real weights as a Qwen2 with Qwen2.5-Coder-1.5B's q/k/v bias
    magnitudes (tests/magnitudes.py: up to 456 on the key's slow pairs, scaled to the bias-to-signal ratio of the
    real model): trained weights and real-magnitude biases together."""
    from magnitudes import add_real_biases
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from mla_convert.sources.checkpoint import open_source

    head = smol_head[1]
    keep = {k: v for k, v in head.config.to_dict().items() if k in Qwen2Config().to_dict() and k != "model_type"}
    model = Qwen2ForCausalLM(Qwen2Config(**keep)).float()
    missing, unexpected = model.load_state_dict(head.state_dict(), strict=False)
    assert not unexpected and all(k.endswith(".bias") for k in missing), (missing, unexpected)
    model.tie_weights()
    add_real_biases(model)
    out = tmp_path_factory.mktemp("smol-head-qwen2")
    model.save_pretrained(str(out))
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (out / f).write_bytes((smol.path / f).read_bytes())
    return open_source(out), model.eval()


@pytest.mark.parametrize("biased", [False, True], ids=["smollm2", "smollm2-qwen2-biases"])
def test_refit_keeps_the_source_bfloat16_precision(biased, request, windows, monkeypatch):
    """On SmolLM2's real layers (72 values, teacher refit) the refit fitted freely (main before issue 48: no
    sensitivity bound) moves the converted model in bfloat16 1.15x (long text) and 1.6x (short prompts) as much as
    bfloat16 moves the source; bounded (the default) 0.95x / 0.94x: within the refit's own 1.25 limit on each set.
    With Qwen2.5-Coder-1.5B's bias magnitudes on the same weights the free fit fails the precision check outright
    (x3.10 long, x0.88 short; the first greedy token moves on 1 of 8 prompts, within the near-tie allowance), as
    main's default conversion of the real Qwen2.5-Coder-1.5B did (x2.91); bounded x0.91 / x0.41."""
    from mla_convert.convert.layer import refit
    from mla_convert.precision import precision_gate, probe, probe_tokens

    src, source = request.getfixturevalue("smol_head_biased" if biased else "smol_head")
    from transformers import AutoTokenizer

    tokens = probe_tokens(AutoTokenizer.from_pretrained(str(src.path)), windows[:2])
    source_copy = copy.deepcopy(source)
    source_copy.set_attn_implementation("sdpa")
    src_probe = probe(source_copy, tokens)
    bounded = precision_gate(probe(_variants(src, windows, "teacher")["fit"], tokens), src_probe)
    monkeypatch.setattr(refit, "SENSITIVITY_LIMIT", float("inf"))
    free = precision_gate(probe(_variants(src, windows, "teacher")["fit"], tokens), src_probe)
    print({k: (bounded[k]["ratio"], free[k]["ratio"]) for k in ("long", "short")})
    assert bounded["passed"], bounded
    worst_bounded = max(bounded[k]["ratio"] for k in ("long", "short"))
    assert worst_bounded <= LIMIT  # fails with the free fit (1.6 on the short prompts)
    assert max(free[k]["ratio"] for k in ("long", "short")) > 1.25 * worst_bounded
    if biased:
        assert not free["passed"], free  # main's refit: the check fails on real-magnitude biases


def test_the_sensitivity_curve_is_the_fits_sensitivity():
    """The bisection's O(n²) sensitivity (refit.sensitivity_curve) against the fit solved directly at each λ
    (``torch.linalg.solve``, not the eigenvectors) and measured by ``rounding_sensitivity``."""
    from mla_convert.convert.layer.refit import rounding_sensitivity, sensitivity_curve

    g = torch.Generator().manual_seed(3)
    z = torch.randn(300, 40, generator=g, dtype=torch.float64) * torch.logspace(0, -3, 40, dtype=torch.float64)
    gram = z.T @ z
    rhs = z.T @ torch.randn(300, 24, generator=g, dtype=torch.float64)
    w0 = torch.randn(40, 24, generator=g, dtype=torch.float64)
    ms = torch.diagonal(gram) / 300
    evals, evecs = torch.linalg.eigh(gram)
    curve = sensitivity_curve(evals.clamp_min(0), evecs, rhs, w0, ms)
    eye = torch.eye(40, dtype=torch.float64)
    values = []
    for lam in (1e-6, 1e-3, 0.1, 3.0, 1e3):
        oracle = rounding_sensitivity(torch.linalg.solve(gram + lam * eye, rhs + lam * w0), ms)
        assert curve(lam) == pytest.approx(oracle, rel=1e-9)
        values.append(oracle)
    assert values[-1] > 3 * values[0]  # from the plain fit's toward W0's as λ grows: a curve, not a constant
