"""The kernels compile for Hopper (sm_90) and Ampere (sm_80) without a GPU, and a growing context never adds a
compiled variant.

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
from mla_convert.kernels import load_kernel

K = load_kernel()


def test_product_variants_compile_for_sm90_and_sm80(tmp_path: Path) -> None:
    out = tmp_path / "compiled.json"
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_DEFAULT_FP_FUSION": "1"}
    res = subprocess.run(
        [sys.executable, "-m", "mla_convert.kernels.compile_check", "--arch", "90", "--arch", "80",
         "--json", str(out)],
        capture_output=True, text=True, env=env, timeout=600,
    )  # fmt: skip
    assert res.returncode == 0, res.stdout + res.stderr
    compiled = json.loads(out.read_text())
    from mla_convert.kernels.compile_check import variants

    keys = variants("product")
    splits = [c for c in compiled if c["kernel"] == "split"]
    fp8 = [k for k in keys if k.fp8_group]
    assert (
        fp8
    )  # FP8 caches (bfloat16 queries) compile for sm_90; sm_80 has no E4M3 and refuses them at launch
    assert len(splits) == 2 * len(keys) - len(fp8) and {c["arch"] for c in compiled} == {80, 90}
    assert {c["arch"] for c in splits if c["key"]["fp8_group"]} == {90}
    assert all(0 < c["registers"] <= 255 for c in compiled)
    dtypes = {c["key"]["dtype"] for c in splits}
    assert dtypes == {"float16", "bfloat16", "float32"}
    # spills (a stack frame) are findings, recorded in benchmarks/results/kernel_compile.md, not failures
    assert all(c["stack_bytes"] >= 0 for c in compiled)
    # DeepSeek's width (d_c = 512) is among them, on 8 warps
    wide = [c for c in splits if c["key"]["block_dc"] == 512]
    assert wide and all(c["num_warps"] == 8 for c in wide)
    print(res.stdout)


def test_product_set_covers_the_bundled_conversion(reference_ckpt: Path) -> None:
    """Every variant the bundled default conversion launches (its per-layer ranks, its rope head; float32,
    float16 and bfloat16 caches, FP8 with bfloat16 queries) is in the compiled product set."""
    from mla_convert.kernels import fp8
    from mla_convert.kernels.compile_check import variants

    config = json.loads((reference_ckpt / "config.json").read_text())
    d_r = config["qk_rope_head_dim"]
    launched = {K.launch_key(dt, d_c, d_r) for d_c in config["kv_lora_rank"] for dt in K.DTYPES}
    launched |= {
        K.launch_key(torch.bfloat16, d_c, d_r, fp8_group=fp8.default_group(d_c))
        for d_c in config["kv_lora_rank"]
    }
    assert launched <= set(variants("product")), launched - set(variants("product"))


def test_compile_check_refuses_the_interpreter() -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    res = subprocess.run(
        [sys.executable, "-m", "mla_convert.kernels.compile_check"], capture_output=True, text=True, env=env
    )
    assert res.returncode == 2 and "TRITON_INTERPRET" in res.stderr


def test_context_growth_never_adds_a_variant(monkeypatch: pytest.MonkeyPatch) -> None:
    """What Triton compiles a variant for: the constexpr arguments (and integer specialisation, off for the
    arguments that change per step). Over contexts 1..3000, batches 1..4, 1..3 query tokens and explicit split
    counts, one layer launches one split variant and one merge variant (before: ``NUM_SPLITS`` was a
    constexpr, so the splits chosen as the context grew each compiled anew)."""
    seen: dict[str, set[tuple]] = {"split": set(), "merge": set()}

    class Record:
        def __init__(self, name: str) -> None:
            self.name = name

        def __getitem__(self, grid):
            def launch(*args, **kw):
                seen[self.name].add(tuple(sorted(kw.items())))

            return launch

    monkeypatch.setattr(K, "_split_kernel", Record("split"))
    monkeypatch.setattr(K, "_merge_kernel", Record("merge"))
    h, d_c, d_r, page = 9, 96, 16, 16
    for batch in (1, 4):
        for s_q in (1, 3):
            for length in (1, 3, 64, 65, 255, 513, 1000, 3000):
                pages = -(-length // page) * batch
                args = (
                    torch.zeros(batch, s_q, h, d_c), torch.zeros(batch, s_q, h, d_r),
                    torch.zeros(pages, page, d_c + 2 * d_r), torch.zeros(batch, pages, dtype=torch.int32),
                    torch.full((batch,), max(length, s_q), dtype=torch.int32),
                    (torch.arange(h) // 5).int(),
                )  # fmt: skip
                for num_splits in (None, 1, 7):  # the GPU's row blocks (the interpreter compiles nothing)
                    K.latent_decode(
                        *args, softmax_scale=0.1, num_splits=num_splits, max_seq_len=length, block_m=K.BLOCK_M
                    )
    assert len(seen["split"]) == 1 and len(seen["merge"]) == 1, seen
    # and Triton's integer specialisation is off for the arguments that change per step
    src = Path(K.__file__).read_text()
    assert '@triton.jit(do_not_specialize=["num_heads", "s_q", "num_splits"])' in src
    assert '@triton.jit(do_not_specialize=["rows", "num_splits"])' in src
