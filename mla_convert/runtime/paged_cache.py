"""A paged KV cache that holds only MLA latent rows ``[c_kv | rotated k_rope]`` (docs/formats.md).

Layout per layer ``l``: ``pages[l]`` is ``[num_pages, page_size, d_c[l] + R * d_R]``; a request owns a
list of page ids (its block table, shared by all layers) and a committed length. A forward pass of
``T`` new tokens for the bound requests (see :meth:`PagedLatentCache.bind`) writes each layer's rows at
positions ``committed .. committed + T - 1`` and then :meth:`commit` advances the lengths, so a
half-finished step never becomes visible. Unused slots hold NaN: a reader that touches a slot past a
request's length poisons its result instead of silently reading stale data.

The cache also records which attention backend read it (``backend_log``), so a decode that was meant
to run on the Triton kernel can be proven to have done so.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch

from mla_convert.errors import UserError


class CacheError(UserError):
    """Out of pages, unknown request, or a write that does not match the cache layout."""


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
    ) -> None:
        if not 1 <= page_size <= 128:
            raise CacheError(f"page_size {page_size} is outside 1..128")
        if num_pages < 1:
            raise CacheError("num_pages must be at least 1")
        self.row_widths = list(row_widths)
        self.page_size = page_size
        self.num_pages = num_pages
        self.dtype = dtype
        self.pages = [
            torch.full((num_pages, page_size, w), float("nan"), dtype=dtype, device=device)
            for w in row_widths
        ]
        order = list(range(num_pages))
        if shuffle_pages:
            order = torch.randperm(num_pages, generator=torch.Generator().manual_seed(seed)).tolist()
        self._free = order[::-1]  # pop() hands out order[0] first
        self.tables: dict[int, list[int]] = {}
        self.lengths: dict[int, int] = {}
        self._next_id = 0
        self.active: list[int] = []
        self.backend_log: Counter[str] = Counter()

    @classmethod
    def for_model(
        cls,
        config: Any,
        max_tokens: int,
        page_size: int = 16,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        shuffle_pages: bool = False,
    ) -> PagedLatentCache:
        """A cache sized for ``max_tokens`` tokens in total (all requests) of an :class:`MLAConfig`."""
        pages = max(1, -(-max_tokens // page_size))
        return cls(list(config.cache_width), page_size, pages, dtype, device, shuffle_pages)

    # ------------------------------------------------------------------ requests and pages
    def add_request(self) -> int:
        """Register an empty request; returns its id."""
        rid = self._next_id
        self._next_id += 1
        self.tables[rid] = []
        self.lengths[rid] = 0
        return rid

    def release(self, rid: int) -> None:
        """Free a request's pages (their rows are reset to NaN)."""
        for page in self.tables.pop(self._known(rid)):
            for layer in self.pages:
                layer[page].fill_(float("nan"))
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

    def write(self, layer: int, rows: torch.Tensor) -> None:
        """Store the new rows ``[B, T, row_width]`` of layer ``layer`` for the bound requests at positions
        ``committed .. committed + T - 1`` (not yet visible to :meth:`seq_lens` until :meth:`commit`).

        Raises:
            CacheError: wrong batch size or row width, or pages not reserved.
        """
        b, t, w = rows.shape
        if b != len(self.active) or w != self.row_widths[layer]:
            raise CacheError(
                f"layer {layer}: rows {tuple(rows.shape)} do not match {len(self.active)} bound requests "
                f"x row width {self.row_widths[layer]}"
            )
        for i, rid in enumerate(self.active):
            pos = torch.arange(self.lengths[rid], self.lengths[rid] + t)
            table = self.tables[rid]
            if (int(pos[-1]) if t else -1) >= len(table) * self.page_size:
                raise CacheError(f"request {rid}: pages not reserved for {t} new tokens (call reserve first)")
            pages = torch.tensor(table, dtype=torch.long)[pos // self.page_size]
            self.pages[layer][pages, pos % self.page_size] = rows[i].to(self.dtype)

    def commit(self, new_tokens: int) -> None:
        """Advance the committed length of every bound request by ``new_tokens``."""
        for rid in self.active:
            self.lengths[rid] += new_tokens

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
        """``[n, row_width]`` the first ``length`` rows of a request (default: committed length)."""
        n = self.lengths[self._known(rid)] if length is None else length
        used = -(-n // self.page_size)
        pages = torch.tensor(self.tables[rid][:used], dtype=torch.long, device=self.pages[layer].device)
        return self.pages[layer][pages].reshape(-1, self.row_widths[layer])[:n]  # whole pages, then trim

    def gather(self, layer: int, length: int) -> torch.Tensor:
        """``[B, length, row_width]`` the first ``length`` rows of every bound request."""
        return torch.stack([self.rows(layer, rid, length) for rid in self.active])

    # ------------------------------------------------------------------ accounting
    def ledger(self) -> dict[str, Any]:
        """Measured bytes of what the cache holds now, over all requests and layers.

        Returns:
            ``tokens`` (committed, all requests), ``payload_bytes`` (committed rows only),
            ``allocated_bytes`` (pages in use, including the unused tail of last pages),
            ``capacity_bytes`` (all pages), and per-token-per-layer averages of the first two.
        """
        tokens = sum(self.lengths.values())
        elem = self.pages[0].element_size()
        width_sum = sum(self.row_widths)
        used_pages = sum(len(t) for t in self.tables.values())
        payload = tokens * width_sum * elem
        allocated = used_pages * self.page_size * width_sum * elem
        layers = len(self.row_widths)
        return {
            "tokens": tokens,
            "layers": layers,
            "page_size": self.page_size,
            "dtype": str(self.dtype).replace("torch.", ""),
            "payload_bytes": payload,
            "allocated_bytes": allocated,
            "capacity_bytes": sum(p.numel() * p.element_size() for p in self.pages),
            "payload_bytes_per_token_per_layer": payload / max(1, tokens * layers),
            "allocated_bytes_per_token_per_layer": allocated / max(1, tokens * layers),
        }

    def _known(self, rid: int) -> int:
        if rid not in self.tables:
            raise CacheError(f"unknown request id {rid}")
        return rid
