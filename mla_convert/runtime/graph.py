"""One decode step of a converted model as a replayable CUDA graph over the paged latent cache.

A decode step (``B`` requests x 1 token, the Triton path) reads no device value on the host (see
:meth:`~mla_convert.runtime.paged_cache.PagedLatentCache.begin_step`), so it can be recorded once and replayed:
the step's inputs live in fixed buffers (token ids, and the :class:`~mla_convert.runtime.paged_cache.StepMetadata`
tensors made by ``static_step``), the host fills them with asynchronous copies before each replay, and the
kernel's grid and split count are fixed by the capture's ``max_seq_len`` bound (the kernel reads each
request's true length from ``seq_lens`` on the device). The persistent state stays the cache's
``[c_kv | k_rope]`` rows; nothing else survives a step.

On a CUDA device the step is captured with ``torch.cuda.graph`` after a warm-up on a side stream (which also
compiles the kernels); elsewhere (``capture=False``, or a CPU under the Triton interpreter) the same body runs
eagerly on the same buffers, which is how the capture path's logic is tested without a GPU. See PyTorch's
"CUDA Graphs" notes (static inputs, warm-up, private memory pool) and vLLM/SGLang's decode graphs.

A replay reads every weight by the address it had at capture, and the folded inference weights
(:meth:`~mla_convert.mla.modeling.MLAForCausalLM.set_folding`) as they were then: derived tensors that
``set_folding(False)`` drops and an in-place update of ``q_proj``/``kv_b_proj``/``o_proj`` makes stale. So
before each step the graph compares what it captured -- each layer's folded weights (their identity: the model
re-folds when a source weight's storage or in-place version changes) and every parameter's and buffer's address,
dtype and device -- with the model's current ones, and captures again where they differ (:attr:`captures`
counts the captures). The eager body uses the folded weights of its last capture as well, so a stale graph
shows on the CPU as it would on a GPU.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from itertools import chain
from typing import Any

import torch

from mla_convert.runtime.paged_cache import CacheError, PagedLatentCache, StepMetadata


class DecodeGraph:
    """A captured (CUDA) or eagerly replayed (CPU) one-token decode step of ``model`` over ``cache``.

    Args:
        model: an :class:`~mla_convert.mla.modeling.MLAForCausalLM` on the cache's device; it is switched to the
            ``triton`` attention path for the graph's lifetime (:meth:`close` restores the previous one).
        cache: a :class:`PagedLatentCache` with its batch bound (:meth:`PagedLatentCache.bind`) and every request
            already prefilled (lengths >= 1).
        max_seq_len: rows (tokens) a request may reach while this graph is used; the kernel's splits and the
            block table's width are sized for it.
        capture: record a CUDA graph (default: when the cache is on a CUDA device).

    Raises:
        CacheError: an empty batch, an unprefilled request, or a bound the cache cannot hold.
        ValueError: ``capture=True`` off a CUDA device.
    """

    def __init__(
        self, model: Any, cache: PagedLatentCache, max_seq_len: int, capture: bool | None = None
    ) -> None:
        device = cache.storage[0].device
        if not cache.active:
            raise CacheError("bind the requests (cache.bind) before building a decode graph")
        if any(cache.lengths[r] < 1 for r in cache.active):
            raise CacheError(
                "prefill every bound request before building a decode graph (a step needs history)"
            )
        capture = device.type == "cuda" if capture is None else capture
        if capture and device.type != "cuda":
            raise ValueError(f"a CUDA graph needs the cache on a CUDA device; it is on {device}")
        self.model = model
        self.cache = cache
        self.batch = len(cache.active)
        self.static: StepMetadata = cache.static_step(max_seq_len, new_tokens=1)
        self.input_ids = torch.zeros(self.batch, 1, dtype=torch.long, device=device)
        self._previous_path = model.config.attn_implementation_mla
        model.set_attention_path("triton")
        self.graph: Any = None
        self.capture = capture
        self.replays = 0
        self.captures = 0
        self.logits = torch.empty(0)
        self._captured = self._weights_state()
        if capture:
            cache.begin_step(
                1, into=self.static
            )  # valid metadata for the warm-up (rows it writes are rewritten)
            try:
                self.logits = self._capture()
            finally:
                cache.step = None  # nothing of the warm-up or the capture is committed
        else:
            self.captures = 1

    def _weights_state(self) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
        """What a capture bakes in: each layer's folded weights as the model would use them now (``None`` where
        it does not fold; the model re-folds here if a source weight changed) and the address, dtype and device
        of every parameter and buffer."""
        with torch.no_grad():
            folded = tuple(layer.self_attn.folded_weights() for layer in self.model.model.layers)
        tensors = tuple(
            (t.data_ptr(), t.dtype, t.device) for t in chain(self.model.parameters(), self.model.buffers())
        )
        return folded, tensors

    def _is_stale(self) -> bool:
        """Whether the model's weights differ from the captured ones (see the module docstring)."""
        folded, tensors = self._weights_state()
        old_folded, old_tensors = self._captured
        same = len(folded) == len(old_folded) and all(a is b for a, b in zip(folded, old_folded, strict=True))
        if same and tensors == old_tensors:
            return False
        self._captured = (folded, tensors)  # holds the folded tensors the next capture reads
        return True

    @contextmanager
    def _captured_folding(self) -> Iterator[None]:
        """The eager body reads the folded weights of the last capture, as a replay does."""
        layers = [layer.self_attn for layer in self.model.model.layers]
        for attn, folded in zip(layers, self._captured[0], strict=True):
            attn.folded_weights = lambda folded=folded: folded  # an instance attribute over the method
        try:
            yield
        finally:
            for attn in layers:
                del attn.folded_weights

    @torch.no_grad()
    def _body(self) -> torch.Tensor:
        """Embedding, every layer over the cache's current step, norm and LM head: ``[B, vocab]`` float32."""
        if self.model.config.attn_implementation_mla != "triton":
            raise ValueError(
                "the model left the triton path while its decode graph lives; close the graph first"
            )
        inner = self.model.model
        hidden = inner.embed_tokens(self.input_ids)
        for layer in inner.layers:
            hidden = layer(hidden, self.static.positions, None, self.cache)
        return self.model.lm_head(inner.norm(hidden))[:, -1].float()

    def _capture(self) -> torch.Tensor:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):  # compiles the kernels and settles allocations outside the capture
                self._body()
        torch.cuda.current_stream().wait_stream(side)
        self.graph = None  # the previous graph's memory pool goes back first
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            logits = self._body()
        self.graph = graph
        self.captures += 1
        return logits

    def step(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Run one decode step for the bound requests and commit its rows.

        Args:
            input_ids: ``[B, 1]`` the token each request feeds (on any device; copied into the graph's buffer).

        Returns:
            ``[B, vocab]`` float32 logits of the next token: the graph's output buffer, overwritten by the next
            step (clone it to keep it).

        The model's weights are compared with the captured ones first; where they changed (``set_folding``, a
        weight updated in place under folding, replaced, cast or moved) the step is captured again before it runs.

        Raises:
            CacheError: a request would pass ``max_seq_len``, or the batch changed since the graph was built.
            ValueError: the model left the triton attention path while the graph lives.
        """
        if tuple(input_ids.shape) != (self.batch, 1):
            raise CacheError(
                f"input_ids must be [{self.batch}, 1] for this graph; got {tuple(input_ids.shape)}"
            )
        if len(self.cache.active) != self.batch:
            raise CacheError("the cache's bound batch changed since the graph was built; build a new graph")
        if self.model.config.attn_implementation_mla != "triton":
            raise ValueError(
                "the model left the triton path while its decode graph lives; close the graph first"
            )
        self.input_ids.copy_(input_ids, non_blocking=True)
        self.cache.begin_step(1, into=self.static)
        try:
            stale = self._is_stale()
            if self.capture:
                if stale:
                    self.logits = self._capture()  # warm-up rows are rewritten by the replay below
                self.graph.replay()
                self.cache.backend_log["triton-cuda:decode-graph"] += len(self.model.model.layers)
            else:
                self.captures += stale
                with self._captured_folding():
                    self.logits = self._body()
        except BaseException:
            self.cache.step = None
            raise
        self.cache.commit(1)
        self.replays += 1
        return self.logits

    def close(self) -> None:
        """Restore the model's previous attention path and drop the graph (its memory pool is freed)."""
        self.model.set_attention_path(self._previous_path)
        self.graph = None

    def __enter__(self) -> DecodeGraph:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
