"""The FP8 latent cache row: E4M3 latent values with float32 scales per group, bfloat16 rope part.

The layout of DeepSeek's / FlashMLA's "FP8 with scale" KV cache, one row per token per layer, in bytes::

    [ c_kv as float8_e4m3fn (d_c bytes, zero-padded to a multiple of 16) | scales float32 (4 bytes per group)
      | k_rope bfloat16 (R d_R x 2 bytes) | pad ]

At DeepSeek-V3's shape (d_c = 512, group 128, one rope head of 64) that is 512 + 16 + 128 = 656 bytes against
1152 for a bfloat16 row. Each group of ``group`` latent values of a row is scaled by ``amax / 448`` (448 is E4M3's
largest finite value) and rounded to E4M3 (3 mantissa bits: a relative error up to 2^-4 per value); the rope
part keeps bfloat16 because it carries the positions. A latent width that is not a multiple of 16 (a per-layer
rank of a converted model, e.g. 18) is zero-padded to one, so the scales stay 16-byte aligned; the kernel never
reads the padding. Rows are padded to a multiple of 16 bytes.

The kernel dequantizes in registers; the reference dequantizes with :func:`dequantize_rows` and computes in
float64, so a kernel-vs-reference comparison measures the kernel, and :func:`dequantize_rows` vs the unquantized
rows measures the format.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

FP8_MAX = 448.0  # largest finite float8_e4m3fn
ROW_ALIGN_BYTES = 16


@dataclass(frozen=True)
class Fp8Layout:
    """Byte layout of one FP8 row.

    Attributes:
        d_c: latent values; rope_width: rope values (``R x d_R``); group: latent values per float32 scale.
        latent_bytes: ``d_c`` rounded up to a multiple of 16 (the E4M3 part, zero-padded).
        scale_offset: byte offset of the scales (``latent_bytes``); rope_offset: byte offset of the bfloat16 rope.
        row_bytes: bytes of payload and scales (no padding); stride_bytes: the padded row stride.
    """

    d_c: int
    rope_width: int
    group: int

    @property
    def latent_bytes(self) -> int:
        return -(-self.d_c // ROW_ALIGN_BYTES) * ROW_ALIGN_BYTES

    @property
    def groups(self) -> int:
        return self.latent_bytes // self.group

    @property
    def scale_offset(self) -> int:
        return self.latent_bytes

    @property
    def rope_offset(self) -> int:
        return self.latent_bytes + 4 * self.groups

    @property
    def row_bytes(self) -> int:
        return self.rope_offset + 2 * self.rope_width

    @property
    def stride_bytes(self) -> int:
        return -(-self.row_bytes // ROW_ALIGN_BYTES) * ROW_ALIGN_BYTES

    def ledger(self) -> dict[str, int]:
        """Bytes per row by part: ``latent`` (E4M3), ``scales``, ``rope`` (bfloat16), ``padding`` (of the latent
        part and of the row stride)."""
        return {
            "latent": self.d_c,
            "scales": 4 * self.groups,
            "rope": 2 * self.rope_width,
            "padding": self.stride_bytes - self.d_c - 4 * self.groups - 2 * self.rope_width,
        }


def default_group(d_c: int) -> int:
    """Latent values per scale: 128 (DeepSeek's) or the largest of 64, 32, 16 dividing ``d_c`` rounded up to 16.

    Raises:
        ValueError: ``d_c`` is not positive.
    """
    if d_c < 1:
        raise ValueError(f"an FP8 cache needs a positive latent width; d_c = {d_c}")
    padded = -(-d_c // ROW_ALIGN_BYTES) * ROW_ALIGN_BYTES
    return next(group for group in (128, 64, 32, 16) if padded % group == 0)


def layout(d_c: int, rope_width: int, group: int | None = None) -> Fp8Layout:
    """The :class:`Fp8Layout` of rows with ``d_c`` latent and ``rope_width`` rope values.

    Raises:
        ValueError: ``group`` is not a power of two from 16 to 128 dividing ``d_c`` rounded up to 16.
    """
    group = group or default_group(d_c)
    lay = Fp8Layout(d_c, rope_width, group)
    if group not in (16, 32, 64, 128) or lay.latent_bytes % group:
        raise ValueError(
            f"FP8 scale group {group} must be 16, 32, 64 or 128 and divide d_c = {d_c} rounded up to 16 "
            f"({lay.latent_bytes})"
        )
    return lay


def quantize_rows(rows: torch.Tensor, lay: Fp8Layout) -> torch.Tensor:
    """``[..., d_c + rope_width]`` float rows -> ``[..., stride_bytes]`` uint8 FP8 rows (padding zero)."""
    lead = rows.shape[:-1]
    latent = torch.nn.functional.pad(rows[..., : lay.d_c].float(), (0, lay.latent_bytes - lay.d_c))
    latent = latent.reshape(*lead, lay.groups, lay.group)
    scale = (latent.abs().amax(-1) / FP8_MAX).clamp_min(torch.finfo(torch.float32).tiny)  # [..., groups]
    q = (latent / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    out = torch.zeros(*lead, lay.stride_bytes, dtype=torch.uint8, device=rows.device)
    out[..., : lay.latent_bytes] = q.reshape(*lead, lay.latent_bytes).view(torch.uint8)
    out[..., lay.scale_offset : lay.rope_offset] = scale.contiguous().view(torch.uint8).reshape(*lead, -1)
    rope = rows[..., lay.d_c :].to(torch.bfloat16).contiguous()
    out[..., lay.rope_offset : lay.row_bytes] = rope.view(torch.uint8).reshape(*lead, -1)
    return out


def dequantize_rows(packed: torch.Tensor, lay: Fp8Layout) -> torch.Tensor:
    """``[..., >= row_bytes]`` uint8 FP8 rows -> ``[..., d_c + rope_width]`` float32 (what the kernel computes with)."""
    lead = packed.shape[:-1]
    raw = packed[..., : lay.row_bytes].contiguous()
    latent = (
        raw[..., : lay.latent_bytes].view(torch.float8_e4m3fn).float().reshape(*lead, lay.groups, lay.group)
    )
    scale = raw[..., lay.scale_offset : lay.rope_offset].view(torch.float32)
    rope = raw[..., lay.rope_offset : lay.row_bytes].view(torch.bfloat16).float()
    latent = (latent * scale[..., None]).reshape(*lead, lay.latent_bytes)[..., : lay.d_c]
    return torch.cat([latent, rope], dim=-1)
