"""The FP8 latent cache row: E4M3 latent values with float32 scales per group, bfloat16 rope part.

The layout of DeepSeek's / FlashMLA's "FP8 with scale" KV cache, one row per token per layer, in bytes::

    [ c_kv as float8_e4m3fn (d_c bytes) | scales float32 (d_c / group x 4 bytes) | k_rope bfloat16 (R d_R x 2 bytes) | pad ]

At DeepSeek-V3's shape (d_c = 512, group 128, one rope head of 64) that is 512 + 16 + 128 = 656 bytes against
1152 for a bfloat16 row. Each group of ``group`` latent values of a row is scaled by ``amax / 448`` (448 is E4M3's
largest finite value) and rounded to E4M3 (3 mantissa bits: a relative error up to 2^-4 per value); the rope
part keeps bfloat16 because it carries the positions. Rows are padded to a multiple of 16 bytes.

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
        scale_offset: byte offset of the scales (``d_c``); rope_offset: byte offset of the bfloat16 rope part.
        row_bytes: bytes of payload and scales (no padding); stride_bytes: the padded row stride.
    """

    d_c: int
    rope_width: int
    group: int

    @property
    def groups(self) -> int:
        return self.d_c // self.group

    @property
    def scale_offset(self) -> int:
        return self.d_c

    @property
    def rope_offset(self) -> int:
        return self.d_c + 4 * self.groups

    @property
    def row_bytes(self) -> int:
        return self.rope_offset + 2 * self.rope_width

    @property
    def stride_bytes(self) -> int:
        return -(-self.row_bytes // ROW_ALIGN_BYTES) * ROW_ALIGN_BYTES

    def ledger(self) -> dict[str, int]:
        """Bytes per row by part: ``latent`` (E4M3), ``scales``, ``rope`` (bfloat16), ``padding``."""
        return {
            "latent": self.d_c,
            "scales": 4 * self.groups,
            "rope": 2 * self.rope_width,
            "padding": self.stride_bytes - self.row_bytes,
        }


def default_group(d_c: int) -> int:
    """Latent values per scale: 128 (DeepSeek's) or the largest of 64, 32, 16 dividing ``d_c``.

    Raises:
        ValueError: ``d_c`` is not a multiple of 16.
    """
    for group in (128, 64, 32, 16):
        if d_c % group == 0:
            return group
    raise ValueError(f"an FP8 cache needs a latent width that is a multiple of 16; d_c = {d_c}")


def layout(d_c: int, rope_width: int, group: int | None = None) -> Fp8Layout:
    """The :class:`Fp8Layout` of rows with ``d_c`` latent and ``rope_width`` rope values.

    Raises:
        ValueError: ``group`` does not divide ``d_c``, or is not a multiple of 4 (scales must stay aligned).
    """
    group = group or default_group(d_c)
    if d_c % group or group % 4:
        raise ValueError(f"FP8 scale group {group} must be a multiple of 4 dividing d_c = {d_c}")
    return Fp8Layout(d_c, rope_width, group)


def quantize_rows(rows: torch.Tensor, lay: Fp8Layout) -> torch.Tensor:
    """``[..., d_c + rope_width]`` float rows -> ``[..., stride_bytes]`` uint8 FP8 rows (padding zero)."""
    lead = rows.shape[:-1]
    latent = rows[..., : lay.d_c].float().reshape(*lead, lay.groups, lay.group)
    scale = (latent.abs().amax(-1) / FP8_MAX).clamp_min(torch.finfo(torch.float32).tiny)  # [..., groups]
    q = (latent / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).reshape(*lead, lay.d_c)
    out = torch.zeros(*lead, lay.stride_bytes, dtype=torch.uint8, device=rows.device)
    out[..., : lay.d_c] = q.view(torch.uint8)
    out[..., lay.scale_offset : lay.rope_offset] = scale.contiguous().view(torch.uint8).reshape(*lead, -1)
    rope = rows[..., lay.d_c :].to(torch.bfloat16).contiguous()
    out[..., lay.rope_offset : lay.row_bytes] = rope.view(torch.uint8).reshape(*lead, -1)
    return out


def dequantize_rows(packed: torch.Tensor, lay: Fp8Layout) -> torch.Tensor:
    """``[..., >= row_bytes]`` uint8 FP8 rows -> ``[..., d_c + rope_width]`` float32 (what the kernel computes with)."""
    lead = packed.shape[:-1]
    raw = packed[..., : lay.row_bytes].contiguous()
    latent = raw[..., : lay.d_c].view(torch.float8_e4m3fn).float().reshape(*lead, lay.groups, lay.group)
    scale = raw[..., lay.scale_offset : lay.rope_offset].view(torch.float32)
    rope = raw[..., lay.rope_offset : lay.row_bytes].view(torch.bfloat16).float()
    return torch.cat([(latent * scale[..., None]).reshape(*lead, lay.d_c), rope], dim=-1)
