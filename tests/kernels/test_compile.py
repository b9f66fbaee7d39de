"""The kernels compile for Hopper (sm_90) and Ampere (sm_80) without a GPU, exactly as they launch, and a decode
never compiles a new variant mid-generation.

The compile check runs Triton's own compiler (``triton.compile`` on an ``ASTSource`` for a ``GPUTarget``) in a
process where the interpreter is off, down to a cubin per variant, and reads registers and stack (spill) bytes
from it with the bundled ``cuobjdump``; a compile error fails the test. ``benchmarks/compile_kernels.py`` runs the
whole tile grid and keeps the table in ``benchmarks/results/``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import mla_convert  # noqa: F401  (sets TRITON_INTERPRET=1 on CPU before triton is imported)
from mla_convert.kernels import launch as L
from mla_convert.kernels import load_kernel

K = load_kernel()


def test_product_variants_compile_for_sm90_and_sm80(tmp_path: Path) -> None:
    """Every distinct launch of the product set compiles for both architectures with its own specialisation key
    (FP8 rows on sm_90 only), and what compiled is what ``variants`` planned."""
    out = tmp_path / "compiled.json"
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_DEFAULT_FP_FUSION": "1"}
    res = subprocess.run(
        [sys.executable, "-m", "mla_convert.kernels.compile_check", "--arch", "90", "--arch", "80",
         "--json", str(out)],
        capture_output=True, text=True, env=env, timeout=900,
    )  # fmt: skip
    assert res.returncode == 0, res.stdout + res.stderr
    compiled = json.loads(out.read_text())
    from mla_convert.kernels.compile_check import variants

    planned = variants("product")
    split_fp8 = [v for v in planned if v.kernel == "split" and v.key.fp8_group]
    assert split_fp8  # FP8 caches (bfloat16 queries) compile for sm_90; sm_80 has no E4M3 and refuses them
    assert len(compiled) == 2 * len(planned) - len(split_fp8) and {c["arch"] for c in compiled} == {80, 90}
    specs = {json.dumps([v.kernel, v.spec]) for v in planned}
    assert {json.dumps([c["kernel"], c["spec"]]) for c in compiled} == specs
    splits = [c for c in compiled if c["kernel"] == "split"]
    assert {c["arch"] for c in splits if c["key"]["fp8_group"]} == {90}
    assert all(0 < c["registers"] <= 255 for c in compiled)
    assert {c["key"]["dtype"] for c in splits} == {"float16", "bfloat16", "float32"}
    # spills (a stack frame) are findings, recorded in benchmarks/results/kernel_compile.md, not failures
    assert all(c["stack_bytes"] >= 0 for c in compiled)
    # DeepSeek's width (d_c = 512) is among them, on 8 warps; the bundled ranks (18..92) are not multiples of 16
    wide = [c for c in splits if c["key"]["block_dc"] == 512]
    assert wide and all(c["num_warps"] == 8 for c in wide)
    assert {c["shape"]["d_c"] % 16 != 0 for c in splits} == {True, False}
    print(res.stdout)


def _meta_launches(config, monkeypatch: pytest.MonkeyPatch) -> set[str]:
    """The specialisation keys a GPU would launch for a model of ``config`` (prefill and decode steps, float32,
    float16 and bfloat16 caches, FP8 rows with bfloat16 queries), recorded on the meta device without running a
    kernel: the backend reads as ``triton-cuda`` (row blocks of 16, bfloat16 allowed), an H200's 132 SMs."""
    import mla_convert.kernels as kernels
    from mla_convert.kernels.variants import record_launches
    from mla_convert.mla.modeling import MLAForCausalLM
    from mla_convert.runtime.decode import generate

    monkeypatch.setattr(kernels, "kernel_backend", lambda: "triton-cuda")
    monkeypatch.setattr(K, "kernel_backend", lambda: "triton-cuda")  # its own import (kernels.backend)
    monkeypatch.setattr(K, "multiprocessor_count", lambda device: 132)
    keys: set[str] = set()
    for dtype, cache_dtype in (
        (torch.float32, "model"), (torch.float16, "model"), (torch.bfloat16, "model"), (torch.bfloat16, "fp8"),
    ):  # fmt: skip
        with torch.device("meta"):
            meta = MLAForCausalLM(config).eval().to(dtype)
        ids = torch.zeros(2, 5, dtype=torch.long, device="meta")
        with record_launches(K, launch=False) as seen:
            generate(meta, ids, 3, backend="triton", cache_dtype=cache_dtype)
        assert len(seen["_split_kernel"]) == 3 * config.num_hidden_layers
        keys |= {json.dumps(["split", k]) for k in seen["_split_kernel"]}
        keys |= {json.dumps(["merge", k]) for k in seen["_merge_kernel"]}
    return keys


def test_product_set_covers_the_bundled_conversion(reference_ckpt: Path, monkeypatch) -> None:
    """Every specialisation key the bundled default conversion launches on a GPU (its per-layer ranks 18..92, its
    rope head; float32, float16 and bfloat16 caches, FP8 rows with bfloat16 queries; prefill and decode) is one
    the compile check compiles (before: the check compiled ``d_c`` as an unspecialised integer and the product
    set's latent widths were multiples of 16, which Triton specialises, so none of the bundled layers' keys was
    compiled)."""
    from mla_convert.kernels.compile_check import variants
    from mla_convert.mla.configuration import MLAConfig

    config = MLAConfig.from_pretrained(str(reference_ckpt))
    launched = _meta_launches(config, monkeypatch)
    compiled = {json.dumps([v.kernel, v.spec]) for v in variants("product")}
    assert launched <= compiled, sorted(launched - compiled)


def test_compile_check_refuses_the_interpreter() -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    res = subprocess.run(
        [sys.executable, "-m", "mla_convert.kernels.compile_check"], capture_output=True, text=True, env=env
    )
    assert res.returncode == 2 and "TRITON_INTERPRET" in res.stderr


def test_a_64_step_decode_compiles_no_variant_mid_generation(monkeypatch: pytest.MonkeyPatch) -> None:
    """Prefill and 64 greedy decode steps of a 2-layer model launch one split and one merge variant per layer
    (Triton's specialisation key of every launch, :mod:`mla_convert.kernels.variants`: the same on the CPU
    interpreter, which compiles nothing, and on a GPU). Over the run the block table's row stride grows from 2
    to 18 pages (16 on the way: divisible by 16) and the split count from 1 to 2 (an H200's 132 SMs), with the
    GPU's row blocks of 16. Before: each of those values is an integer Triton specialised (1, divisible by 16,
    other), so new variants compiled mid-generation. On a CUDA host the kernel's own JIT cache is read as well:
    it must not grow after the prefill."""
    from mla_convert.kernels.variants import compiled_variants, record_launches
    from mla_convert.runtime.decode import generate
    from tests.runtime.test_paged_cache import DEVICE, tiny_mla

    model = tiny_mla()
    real_split, real_merge, real_plan = K._split_kernel, K._merge_kernel, K.plan_launch
    planned: list[tuple[int, int, int | None, int | None]] = []

    def plan(*args, **kw):
        p = real_plan(*args, **kw)
        cached = (compiled_variants(real_split), compiled_variants(real_merge))
        planned.append((p.split_grid[1], p.split_args[3].stride(0), *cached))
        return p

    monkeypatch.setattr(K, "plan_launch", plan)
    monkeypatch.setattr(K, "multiprocessor_count", lambda device: 132)
    monkeypatch.setattr(L, "default_block_m", lambda rows, backend: L.BLOCK_M)
    prompt = torch.randint(0, 97, (2, 7), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    with record_launches(K) as seen:
        res = generate(model, prompt, 65, backend="triton", page_size=4)
    layers = model.config.num_hidden_layers
    assert res.tokens.shape == (2, 72) and len(seen["_split_kernel"]) == 65 * layers == len(planned)
    splits, strides = {p[0] for p in planned}, {p[1] for p in planned}
    assert splits == {1, 2} and (min(strides), max(strides)) == (2, 18) and 16 in strides  # they did change
    for name in ("_split_kernel", "_merge_kernel"):
        per_layer = [set(seen[name][layer::layers]) for layer in range(layers)]
        assert [len(keys) for keys in per_layer] == [1] * layers, per_layer
    if DEVICE == "cuda":  # the JIT's own cache: nothing compiled after the prefill's launches
        after_prefill = planned[layers][2:]
        assert all(p[2:] == after_prefill for p in planned[layers:]), planned
        assert (compiled_variants(real_split), compiled_variants(real_merge)) == after_prefill


def test_specialisation_key_is_the_jits() -> None:
    """The key :func:`launch_specialization` computes follows Triton's rules: an integer 1 is a constant, a
    multiple of 16 gets the divisibility attribute, an unspecialised one neither, whatever its value."""
    from mla_convert.kernels.variants import launch_specialization

    case = [torch.zeros(4, 1, 2, 16), torch.zeros(4, 1, 2, 16), torch.zeros(2, 16, 32)]
    names = list(K._split_kernel.arg_names)
    base = K.plan_launch(
        *case, torch.zeros(4, 3, dtype=torch.int32), torch.ones(4, dtype=torch.int32),
        torch.zeros(2, dtype=torch.int32), 0.1, num_splits=1, block_m=16,
    )  # fmt: skip
    entries, options = launch_specialization(K._split_kernel, base.split_args, base.split_kwargs)
    spec = dict(zip(names, entries, strict=True))
    assert options == (("num_warps", 4),)
    assert (
        spec["d_c"] == ("i32", "D") and spec["d_r"] == ("i32", "D") and spec["BLOCK_DC"] == ("constexpr", 16)
    )
    assert spec["stride_btb"] == ("i32", None) and spec["num_splits"] == ("i32", None)  # never specialised
    assert spec["stride_cs"] == ("i32", "D") and spec["cache_ptr"] == ("*fp32", "D")
    odd = list(base.split_args)
    odd[names.index("d_r")] = 1  # an integer 1 becomes a constant, 17 an unaligned integer
    odd[names.index("d_c")] = 17
    spec = dict(
        zip(names, launch_specialization(K._split_kernel, tuple(odd), base.split_kwargs)[0], strict=True)
    )
    assert spec["d_r"] == ("constexpr", 1) and spec["d_c"] == ("i32", "")
