"""The conversion on a GPU is the CPU's code path on another device (issue 51, Required 3): with ``--device cuda`` the
statistics accumulate on the GPU and every decomposition (``mla_convert.convert.layer.linalg``: the statistics'
square root, the weighted K/V SVD, the RoPE-pair eigenvectors, the refit's solves) runs there in float64; the
converted model equals the CPU conversion's. Runs wherever CUDA exists (``scripts/gpu_check.sh`` runs it)."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (scripts/gpu_check.sh)")


def test_a_gpu_conversion_decomposes_there_and_equals_the_cpu_one(tmp_path, monkeypatch):
    """8 KV heads, head_dim 128 (Llama-3-8B's attention shape, tiny width), a fixed rank so both allocate alike:
    the decompositions ran on CUDA in float64, and the two conversions' logits agree to 1e-3 of the largest."""
    from tiny import convert, write_tiny_family

    from mla_convert.sources.checkpoint import open_source

    src = open_source(write_tiny_family(tmp_path / "src", "llama", hidden_size=256, num_attention_heads=16,
                                        num_key_value_heads=8, head_dim=128))  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    calib, held = torch.randint(0, 49152, (4, 64), generator=gen), torch.randint(0, 49152, (2, 64), generator=gen)
    options = dict(rope_pairs=16, rope_strategy="2-norm", refit_o_proj="teacher", kv_lora_rank=96)
    cpu = convert(src, calib, held, device="cpu", **options)
    seen: list[tuple[str, torch.dtype]] = []
    for name in ("eigh", "svd", "svdvals"):
        real = getattr(torch.linalg, name)

        def spy(m, *args, _real=real, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
            seen.append((m.device.type, m.dtype))
            return _real(m, *args, **kwargs)

        monkeypatch.setattr(torch.linalg, name, spy)
    gpu = convert(src, calib, held, device="cuda", **options)
    assert seen and all(device == "cuda" for device, _ in seen), seen
    assert {dtype for _, dtype in seen} <= {torch.float64, torch.complex128}, seen
    ids = calib[:1]
    with torch.no_grad():
        a = cpu.model.float().cpu()(input_ids=ids).logits
        b = gpu.model.float().cpu()(input_ids=ids).logits
    assert float((a - b).abs().max()) <= 1e-3 * float(a.abs().max())
