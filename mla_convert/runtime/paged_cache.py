"""A paged KV cache that holds only MLA latent rows ``[c_kv | rotated k_rope]`` (docs/formats.md).

Layout per layer ``l``: ``pages[l]`` is ``[num_pages, page_size, d_c[l] + R * d_R]``, a view of storage whose
row stride is padded to a multiple of :data:`ROW_ALIGN` elements (so the kernel's row loads are aligned vector
loads; the ledger counts the padding). A request owns a list of page ids (its block table, shared by all
layers) and a committed length. A forward pass of
``T`` new tokens for the bound requests (see :meth:`PagedLatentCache.bind`) writes each layer's rows at
positions ``committed .. committed + T - 1`` and then :meth:`commit` advances the lengths, so a
half-finished step never becomes visible. Unused slots hold NaN: a reader that touches a slot past a
request's length poisons its result instead of silently reading stale data.

The cache also records which attention backend read it (``backend_log``), so a decode that was meant
to run on the Triton kernel can be proven to have done so.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

import torch

from mla_convert.errors import UserError
from mla_convert.kernels.fp8 import Fp8Layout, dequantize_rows, quantize_rows
from mla_convert.kernels.fp8 import layout as fp8_layout

ROW_ALIGN = (
    16  # elements: a padded row stride keeps every row start 32-byte (fp16/bf16) or 64-byte (fp32) aligned
)


class CacheError(UserError):
    """Out of pages, unknown request, or a write that does not match the cache layout."""


@dataclass(frozen=True)
class StepMetadata:
    """Everything the layers of one forward pass need from the cache, built once per step on the cache's device.

    Built by :meth:`PagedLatentCache.begin_step` from the host-side page lists (one host-to-device copy each,
    never a device-to-host read), so no layer synchronises with the device.

    Attributes:
        new_tokens: ``T``, rows each bound request gets in this step.
        lengths: committed rows per bound request before the step (host ints).
        seq_lens: ``[B]`` int32 rows per request including the ``T`` new ones (device).
        block_table: ``[B, max_pages]`` int32 page ids (device; unused entries 0).
        slots: ``[B, T]`` int64 flat row index (``page * page_size + offset``) of each new row (device).
        positions: ``[B, T]`` int64 absolute positions of the new tokens (device).
        max_seq_len: the longest request after the step (host int: the kernel's split choice reads no device value).
    """

    new_tokens: int
    lengths: tuple[int, ...]
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    slots: torch.Tensor
    positions: torch.Tensor
    max_seq_len: int

    @property
    def uniform(self) -> bool:
        """Whether every bound request has the same committed length (host-side; no device read)."""
        return len(set(self.lengths)) <= 1


class PagedLatentCache:
    """Paged storage of ``[c_kv | k_rope]`` rows for several requests and all layers of one model.

    Args:
        row_widths: values per cached row per layer, ``d_c[l] + R * d_R``.
        page_size: tokens per page (1..128).
        num_pages: pages allocated up front per layer.
        dtype, device: storage dtype and device of the rows.
        shuffle_pages: hand out pages in a random order (seeded), so page ids of a request are not
            contiguous; used by tests and ``validate`` to prove addressing goes through the block table.
        seed: seed of that order.
        fp8: one :class:`~mla_convert.kernels.fp8.Fp8Layout` per layer for an FP8 cache (``dtype`` is then
            ignored): rows are stored as uint8 ``[E4M3 c_kv | float32 scales | bfloat16 k_rope]``, quantized on
            write; readers other than the kernel get them dequantized to float32. Free slots hold 0xFF bytes
            (NaN in all three parts).

    Raises:
        CacheError: a page size outside 1..128 or no pages.
    """

    def __init__(
        self,
        row_widths: list[int],
        page_size: int,
        num_pages: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        shuffle_pages: bool = False,
        seed: int = 0,
        fp8: list[Fp8Layout] | None = None,
    ) -> None:
        if not 1 <= page_size <= 128:
            raise CacheError(f"page_size {page_size} is outside 1..128")
        if num_pages < 1:
            raise CacheError("num_pages must be at least 1")
        self.row_widths = list(row_widths)
        self.page_size = page_size
        self.num_pages = num_pages
        self.fp8 = list(fp8) if fp8 is not None else None
        if self.fp8 is not None:
            if [lay.d_c + lay.rope_width for lay in self.fp8] != self.row_widths:
                raise CacheError("the FP8 layouts do not match the row widths")
            self.dtype = torch.uint8
            self.row_bytes = [lay.row_bytes for lay in self.fp8]
            self.row_strides = [lay.stride_bytes for lay in self.fp8]
        else:
            self.dtype = dtype
            self.row_bytes = list(self.row_widths)  # elements, for the views below
            self.row_strides = [-(-w // ROW_ALIGN) * ROW_ALIGN for w in self.row_widths]
        self.storage = [
            torch.full((num_pages, page_size, s), self._free_fill, dtype=self.dtype, device=device)
            for s in self.row_strides
        ]
        self.pages = [st[..., :w] for st, w in zip(self.storage, self.row_bytes, strict=True)]
        self.step: StepMetadata | None = None
        order = list(range(num_pages))
        if shuffle_pages:
            order = torch.randperm(num_pages, generator=torch.Generator().manual_seed(seed)).tolist()
        self._free = order[::-1]  # pop() hands out order[0] first
        self.tables: dict[int, list[int]] = {}
        self.lengths: dict[int, int] = {}
        self._next_id = 0
        self.active: list[int] = []
        self.backend_log: Counter[str] = Counter()

    @property
    def _free_fill(self) -> float:
        return 255 if self.fp8 is not None else float("nan")

    def _decode(self, layer: int, stored: torch.Tensor) -> torch.Tensor:
        """Stored rows ``[..., stride]`` -> ``[..., row_width]`` values (FP8 rows dequantized to float32)."""
        if self.fp8 is not None:
            return dequantize_rows(stored, self.fp8[layer])
        return stored[..., : self.row_widths[layer]]

    @classmethod
    def for_model(
        cls,
        config: Any,
        max_tokens: int,
        page_size: int = 16,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        shuffle_pages: bool = False,
        fp8: bool = False,
    ) -> PagedLatentCache:
        """A cache sized for ``max_tokens`` tokens in total (all requests) of an :class:`MLAConfig`; ``fp8``
        stores FP8 rows (:mod:`mla_convert.kernels.fp8`; every layer's ``d_c`` a multiple of 16).

        Raises:
            ValueError: ``fp8`` with a latent width that is not a multiple of 16.
        """
        pages = max(1, -(-max_tokens // page_size))
        layouts = None
        if fp8:
            rope = config.num_rope_heads * config.qk_rope_head_dim
            layouts = [fp8_layout(int(d_c), rope) for d_c in config.kv_lora_rank]
        return cls(list(config.cache_width), page_size, pages, dtype, device, shuffle_pages, fp8=layouts)

    # ------------------------------------------------------------------ requests and pages
    def add_request(self) -> int:
        """Register an empty request; returns its id."""
        rid = self._next_id
        self._next_id += 1
        self.tables[rid] = []
        self.lengths[rid] = 0
        return rid

    def to(self, device: torch.device | str) -> PagedLatentCache:
        """Move every layer's pages to ``device`` in place (returns ``self``); a step in progress is dropped."""
        self.storage = [st.to(device) for st in self.storage]
        self.pages = [st[..., :w] for st, w in zip(self.storage, self.row_bytes, strict=True)]
        self.step = None
        return self

    def release(self, rid: int) -> None:
        """Free a request's pages (their rows are reset to NaN)."""
        for page in self.tables.pop(self._known(rid)):
            for layer in self.storage:
                layer[page].fill_(self._free_fill)
            self._free.append(page)
        del self.lengths[rid]

    def bind(self, rids: list[int]) -> None:
        """Make ``rids`` the batch rows of the next forward passes (row ``i`` is request ``rids[i]``)."""
        for rid in rids:
            self._known(rid)
        self.active = list(rids)

    def reserve(self, new_tokens: int) -> None:
        """Allocate pages so every bound request can take ``new_tokens`` more rows.

        Raises:
            CacheError: not enough free pages (nothing is allocated then).
        """
        need = [
            max(0, -(-(self.lengths[r] + new_tokens) // self.page_size) - len(self.tables[r]))
            for r in self.active
        ]
        if sum(need) > len(self._free):
            raise CacheError(
                f"paged cache is out of pages: need {sum(need)}, {len(self._free)} free of {self.num_pages} "
                f"(page size {self.page_size}); create it with a larger max_tokens"
            )
        for rid, n in zip(self.active, need, strict=True):
            self.tables[rid].extend(self._free.pop() for _ in range(n))

    def begin_step(self, new_tokens: int, into: StepMetadata | None = None) -> StepMetadata:
        """Reserve pages for ``new_tokens`` more rows per bound request and build the step's metadata once
        (:class:`StepMetadata`, also kept as :attr:`step` for the layers until :meth:`commit`).

        The host-side page lists reach the device by asynchronous host-to-device copies (never a device-to-host
        read, never a stream synchronisation). With ``into`` (from :meth:`static_step`) the values are copied
        into its tensors in place and the step keeps their addresses and its ``max_seq_len`` bound, so a
        captured CUDA graph (:class:`~mla_convert.runtime.graph.DecodeGraph`) replays on the new values.

        Raises:
            CacheError: not enough free pages (nothing is allocated then); with ``into``: another batch size or
                token count, or a request that would pass its ``max_seq_len`` bound.
        """
        lengths = tuple(self.lengths[r] for r in self.active)
        if into is not None:
            longest = max(lengths, default=0) + new_tokens
            if into.new_tokens != new_tokens or into.seq_lens.shape[0] != len(self.active):
                raise CacheError(
                    f"static step metadata is for {into.seq_lens.shape[0]} requests x {into.new_tokens} tokens; "
                    f"got {len(self.active)} x {new_tokens} (make another with static_step)"
                )
            if longest > into.max_seq_len:
                raise CacheError(
                    f"a request reaches {longest} rows, past the static step's bound of {into.max_seq_len} "
                    "(capture a new graph with a larger max_seq_len)"
                )
        self.reserve(new_tokens)
        device = self.storage[0].device
        width = max([len(self.tables[r]) for r in self.active] + [1])
        if into is not None:
            width = into.block_table.shape[1]
        if any(len(self.tables[r]) > width for r in self.active):
            raise CacheError(
                f"a request holds more than the static step's {width} pages (capture with a larger max_seq_len)"
            )
        table = [self.tables[r] + [0] * (width - len(self.tables[r])) for r in self.active]
        slots: list[list[int]] = []
        for rid, start in zip(self.active, lengths, strict=True):
            pages = self.tables[rid]
            slots.append(
                [
                    pages[p // self.page_size] * self.page_size + p % self.page_size
                    for p in range(start, start + new_tokens)
                ]
            )
        b = len(self.active)
        host = {
            "seq_lens": torch.tensor([n + new_tokens for n in lengths], dtype=torch.int32),
            "block_table": torch.tensor(table, dtype=torch.int32).reshape(b, width),
            "slots": torch.tensor(slots, dtype=torch.long).reshape(b, new_tokens),
            "positions": torch.tensor(lengths, dtype=torch.long)[:, None] + torch.arange(new_tokens)[None, :],
        }
        if into is None:
            on_device = {k: v.to(device, non_blocking=True) for k, v in host.items()}
            max_seq_len = max(lengths, default=0) + new_tokens
        else:
            on_device = {k: getattr(into, k) for k in host}
            for k, v in host.items():
                on_device[k].copy_(v, non_blocking=True)
            max_seq_len = into.max_seq_len
        self.step = StepMetadata(new_tokens=new_tokens, lengths=lengths, max_seq_len=max_seq_len, **on_device)
        return self.step

    def static_step(self, max_seq_len: int, new_tokens: int = 1) -> StepMetadata:
        """Step metadata buffers for the bound requests that later steps fill in place (``begin_step(t, into=)``):
        ``seq_lens [B]``, ``block_table [B, ceil(max_seq_len / page_size)]``, ``slots``/``positions [B, T]``
        on the cache's device (zeros until filled), with ``max_seq_len`` the bound every request must stay
        under (the kernel sizes its grid and splits from it, so a captured launch stays valid).

        Raises:
            CacheError: ``max_seq_len`` below ``new_tokens`` or more pages than the cache has.
        """
        pages = -(-max_seq_len // self.page_size)
        if max_seq_len < new_tokens or pages > self.num_pages:
            raise CacheError(
                f"static step bound {max_seq_len} rows needs 1..{self.num_pages} pages of {self.page_size}; "
                f"got {pages} for {new_tokens} new tokens"
            )
        device = self.storage[0].device
        b = len(self.active)
        return StepMetadata(
            new_tokens=new_tokens,
            lengths=(0,) * b,
            seq_lens=torch.zeros(b, dtype=torch.int32, device=device),
            block_table=torch.zeros(b, pages, dtype=torch.int32, device=device),
            slots=torch.zeros(b, new_tokens, dtype=torch.long, device=device),
            positions=torch.zeros(b, new_tokens, dtype=torch.long, device=device),
            max_seq_len=max_seq_len,
        )

    def write(self, layer: int, rows: torch.Tensor) -> None:
        """Store the new rows ``[B, T, row_width]`` of layer ``layer`` for the bound requests at positions
        ``committed .. committed + T - 1`` (not yet visible to :meth:`seq_lens` until :meth:`commit`).

        Inside a step (:meth:`begin_step`) this is one scatter through the step's slots on the device, with no
        host synchronisation; outside one, the slots are built from the page lists first.

        Raises:
            CacheError: wrong batch size or row width, or pages not reserved.
        """
        b, t, w = rows.shape
        if b != len(self.active) or w != self.row_widths[layer]:
            raise CacheError(
                f"layer {layer}: rows {tuple(rows.shape)} do not match {len(self.active)} bound requests "
                f"x row width {self.row_widths[layer]}"
            )
        step = self.step
        if step is None or step.new_tokens != t:
            for rid in self.active:
                if self.lengths[rid] + t > len(self.tables[rid]) * self.page_size:
                    raise CacheError(
                        f"request {rid}: pages not reserved for {t} new tokens (call reserve first)"
                    )
            slots = (
                torch.tensor(
                    [
                        [
                            self.tables[r][p // self.page_size] * self.page_size + p % self.page_size
                            for p in range(self.lengths[r], self.lengths[r] + t)
                        ]
                        for r in self.active
                    ],
                    dtype=torch.long,
                )
                .reshape(b, t)
                .to(self.storage[layer].device)
            )
        else:
            slots = step.slots
        flat = self.storage[layer].view(-1, self.row_strides[layer])
        if self.fp8 is not None:
            flat[slots.reshape(-1)] = quantize_rows(rows.reshape(b * t, w), self.fp8[layer])
        else:
            flat[slots.reshape(-1), :w] = rows.reshape(b * t, w).to(self.dtype)

    def gather_step(self, layer: int) -> torch.Tensor:
        """``[B, L, row_width]`` the first ``L = step.max_seq_len`` rows of every bound request (the step's new
        rows included), read through the step's block table on the device; needs a step of requests of one
        length (:attr:`StepMetadata.uniform`).

        Raises:
            CacheError: outside a step, or requests of different lengths.
        """
        step = self.step
        if step is None or not step.uniform:
            raise CacheError("gather_step needs a step (begin_step) over requests of one length")
        n = step.max_seq_len
        pos = torch.arange(n, device=step.block_table.device)
        pages = step.block_table[:, pos // self.page_size].long()  # [B, L]
        flat = self.storage[layer].view(-1, self.row_strides[layer])
        return self._decode(layer, flat[pages * self.page_size + pos % self.page_size])

    def commit(self, new_tokens: int) -> None:
        """Advance the committed length of every bound request by ``new_tokens``."""
        for rid in self.active:
            self.lengths[rid] += new_tokens
        self.step = None

    # ------------------------------------------------------------------ views for readers
    def seq_lens(self, pending: int = 0) -> torch.Tensor:
        """``[B]`` int32 committed lengths of the bound requests, plus ``pending`` uncommitted rows."""
        return torch.tensor([self.lengths[r] + pending for r in self.active], dtype=torch.int32)

    def block_table(self, device: torch.device | str | None = None) -> torch.Tensor:
        """``[B, max_pages]`` int32 page ids of the bound requests (unused entries 0)."""
        width = max([len(self.tables[r]) for r in self.active] + [1])
        table = torch.zeros(len(self.active), width, dtype=torch.int32)
        for i, rid in enumerate(self.active):
            table[i, : len(self.tables[rid])] = torch.tensor(self.tables[rid], dtype=torch.int32)
        return table.to(device or self.pages[0].device)

    def rows(self, layer: int, rid: int, length: int | None = None) -> torch.Tensor:
        """``[n, row_width]`` the first ``length`` rows of a request (default: committed length); FP8 rows come
        back dequantized to float32."""
        n = self.lengths[self._known(rid)] if length is None else length
        used = -(-n // self.page_size)
        pages = torch.tensor(self.tables[rid][:used], dtype=torch.long, device=self.pages[layer].device)
        stored = self.storage[layer][pages].reshape(-1, self.row_strides[layer])[:n]  # whole pages, then trim
        return self._decode(layer, stored)

    def gather(self, layer: int, length: int) -> torch.Tensor:
        """``[B, length, row_width]`` the first ``length`` rows of every bound request."""
        return torch.stack([self.rows(layer, rid, length) for rid in self.active])

    # ------------------------------------------------------------------ accounting
    def ledger(self) -> dict[str, Any]:
        """Measured bytes of what the cache holds now, over all requests and layers.

        Returns:
            ``tokens`` (committed, all requests), ``payload_bytes`` (committed rows' values only),
            ``allocated_bytes`` (memory of the pages in use: the unused tail of last pages and the row-stride
            padding included), ``row_padding_bytes`` (the padding's share of ``allocated_bytes``),
            ``capacity_bytes`` (all pages), ``row_widths`` / ``row_strides`` (elements per layer; FP8 strides
            in bytes), and per-token-per-layer averages of payload and allocation; for an FP8 cache also
            ``fp8_bytes_per_token_by_part`` (latent, scales, rope, padding, summed over layers).
        """
        tokens = sum(self.lengths.values())
        elem = self.storage[0].element_size()
        width_sum = sum(self.row_bytes)  # FP8: bytes of latent, scales and rope
        stride_sum = sum(self.row_strides)
        used_pages = sum(len(t) for t in self.tables.values())
        payload = tokens * width_sum * elem
        allocated = used_pages * self.page_size * stride_sum * elem
        layers = len(self.row_widths)
        out: dict[str, Any] = {
            "tokens": tokens,
            "layers": layers,
            "page_size": self.page_size,
            "dtype": "fp8_e4m3+scales" if self.fp8 is not None else str(self.dtype).replace("torch.", ""),
            "row_widths": list(self.row_widths),
            "row_strides": list(self.row_strides),
            "payload_bytes": payload,
            "allocated_bytes": allocated,
            "row_padding_bytes": used_pages * self.page_size * (stride_sum - width_sum) * elem,
            "capacity_bytes": sum(p.numel() * p.element_size() for p in self.storage),
            "payload_bytes_per_token_per_layer": payload / max(1, tokens * layers),
            "allocated_bytes_per_token_per_layer": allocated / max(1, tokens * layers),
        }
        if self.fp8 is not None:  # payload by part, summed over layers, per token
            parts = [lay.ledger() for lay in self.fp8]
            out["fp8_bytes_per_token_by_part"] = {k: sum(p[k] for p in parts) for k in parts[0]}
        return out

    def _known(self, rid: int) -> int:
        if rid not in self.tables:
            raise CacheError(f"unknown request id {rid}")
        return rid
