"""Decode speed and KV cache bytes of SmolLM2-135M and its MLA conversion at 31.25 % of the cache.

CPU part (always): one run fills a cache per attention path with real Wikipedia tokens (evaluation split,
chunked prefill) to each context length, then times single-token decode steps of every path in
turn (round robin, so machine load falls on all paths alike) and reports the median seconds per step,
its ratios to the source and to the naive MLA path, and the bytes the cache tensors hold. Paths:

* ``source``: transformers ``LlamaForCausalLM`` with its default attention (SDPA) and a ``DynamicCache`` of
  per-KV-head K and V: the speed to meet (the ``x source`` column);
* ``source, eager``: the same model with eager attention (as ``load_source_model`` loads it for calibration);
* ``MLA naive``: the converted model's reference path, ``DynamicCache`` of expanded K/V;
* ``MLA absorbed``: the absorbed path, ``DynamicCache`` holding ``c_kv`` and rotated ``k_rope`` only;
* ``MLA absorbed, folded``: the same with ``W_UK``/``W_UV`` folded into ``q_proj``/``o_proj`` where that saves
  work (``set_folding``; what ``generate`` runs), the product path;
* ``MLA absorbed, paged, folded``: that over a ``PagedLatentCache`` (what ``mla_convert.runtime.decode`` uses);
* ``MLA triton (interpreter)``: the Triton kernel over the paged cache at the first context only; on a
  CPU it runs in the Triton interpreter, so its time is a record of the backend, not a speed.

Every step feeds the next real token (teacher forcing), so all paths see the same sequence, and the
last column checks the paths' logits against the absorbed path's at the same steps.

GPU part (``torch.cuda.is_available()`` only): the bundled kernel (``latent_decode``) with bfloat16 queries over
bfloat16 and FP8 rows at B x context 1x32k, 16x4k, 64x4k, H = 9 and 128, d_c = 512 and 96, timed through CUDA-graph
replays (cold: the L2 flushed before each replay, CUDA events around it; hot: ``do_bench_cudagraph``, calls back
to back): achieved bandwidth (bytes it must read / time) against the measured device-to-device copy bandwidth,
FLOP/s against a measured bfloat16 matmul (H = 128 is compute-bound at both widths), the roofline fraction, the
error against the float64 oracle, and PyTorch SDPA on the expanded cache of the same shape (SmolLM2-135M's 3 KV
heads x 64 for H = 9; 128 heads x 128 for H = 128).

    .venv/bin/mla-convert --quiet factor smollm2-135m /tmp/bench-mla      # once, ~90 s
    .venv/bin/python benchmarks/decode.py --checkpoint /tmp/bench-mla [--readme]
    .venv/bin/python benchmarks/decode.py --gpu [--json rows.json]         # the GPU part alone

Without ``--checkpoint`` (or with a path that does not exist yet) the script makes the default conversion
first. Prints Markdown tables and writes them to ``benchmarks/results/decode.md`` (``--gpu``:
``benchmarks/results/decode_gpu.md``, so a GPU run never replaces the CPU table). ``scripts/gpu_check.sh`` runs
``--gpu`` as one part of the first GPU run.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch
from blocks import replace_block
from transformers import AutoTokenizer
from transformers.cache_utils import DynamicCache

import mla_convert  # noqa: F401  (registers model_type "mla"; sets TRITON_INTERPRET on a CPU)
from mla_convert.mla.modeling import MLAForCausalLM, latent_cache_bytes
from mla_convert.runtime.paged_cache import PagedLatentCache
from mla_convert.sources.checkpoint import load_source_model, open_source
from mla_convert.text.corpora import load_documents
from mla_convert.text.windows import split_documents, token_windows

ROOT = Path(__file__).resolve().parents[1]
MIB = 1 << 20


# ----------------------------------------------------------------------------------------- machine
def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_line() -> str:
    cores = os.cpu_count()
    return (
        f"{cpu_name()} ({cores} logical cores), {torch.get_num_threads()} torch threads, "
        f"torch {torch.__version__}, Python {platform.python_version()}"
    )


# ----------------------------------------------------------------------------------------- CPU part
@dataclass
class Runner:
    """One attention path: a model, the MLA path to select before each call, and its own cache."""

    name: str
    model: Any
    path: str | None  # MLA attention path, None for the source model
    cache: Any
    until: int | None = None  # last context this runner is timed at (None: all)
    times: dict[int, list[float]] = field(default_factory=dict)
    logits: dict[int, list[torch.Tensor]] = field(default_factory=dict)
    bytes_at: dict[int, dict[str, float]] = field(default_factory=dict)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """Feed ``ids [1, T]`` through the cache; the float32 logits of the last position ``[1, vocab]``."""
        if self.path is not None:
            self.model.set_attention_path(self.path)
        out = self.model(input_ids=ids, past_key_values=self.cache, use_cache=True, logits_to_keep=1)
        return out.logits[:, -1].float()

    def tokens(self) -> int:
        if isinstance(self.cache, PagedLatentCache):
            return int(self.cache.seq_lens()[0])
        return int(self.cache.get_seq_length())

    def measure_bytes(self, layers: int) -> dict[str, float]:
        """Bytes held by the cache tensors now (for a paged cache: committed rows; allocated pages too)."""
        n = self.tokens()
        if isinstance(self.cache, PagedLatentCache):
            led = self.cache.ledger()
            held, alloc = led["payload_bytes"], led["allocated_bytes"]
            elem = self.cache.pages[0].element_size()
        else:
            held, values = latent_cache_bytes(self.cache)
            alloc = held
            elem = held // max(1, values)
        return {
            "tokens": n,
            "bytes": held,
            "allocated": alloc,
            "bytes_per_token_layer": held / (n * layers),
            "values_per_token_layer": held / (n * layers * elem),
        }


def ensure_checkpoint(path: Path | None, tmp: Path) -> Path:
    """An existing converted checkpoint, or the default conversion written to ``path`` (or ``tmp``)."""
    if path is not None and (path / "config.json").exists():
        return path
    out = path or tmp / "smollm2-mla"
    print(f"converting smollm2-135m (default options, --cache-budget 120) into {out} ...", flush=True)
    t = time.perf_counter()
    subprocess.run(
        [sys.executable, "-m", "mla_convert", "--quiet", "factor", "smollm2-135m", str(out)], check=True
    )
    print(f"conversion took {time.perf_counter() - t:.0f} s", flush=True)
    return out


def prefill(runner: Runner, ids: torch.Tensor, chunk: int) -> None:
    """Append ``ids [1, T]`` to the runner's cache ``chunk`` tokens per forward."""
    for start in range(0, ids.shape[1], chunk):
        runner.forward(ids[:, start : start + chunk])


def cpu_bench(args: argparse.Namespace) -> tuple[list[str], dict[str, Any]]:
    contexts = sorted(int(c) for c in args.contexts.split(","))
    per_ctx = args.warmup + args.steps
    src = open_source("smollm2-135m")
    source = load_source_model(src)
    source_sdpa = load_source_model(src)
    source_sdpa.set_attn_implementation("sdpa")
    max_pos = int(source.config.max_position_embeddings)
    total = contexts[-1] + per_ctx
    if total > max_pos:
        raise SystemExit(
            f"context {contexts[-1]} + {per_ctx} decode steps = {total} positions > the model's {max_pos}; "
            "use a shorter last context"
        )
    tok = AutoTokenizer.from_pretrained(str(src.path))
    docs = split_documents(load_documents("wikipedia"))["evaluation"]
    stream = token_windows(tok, docs, total, 1, bos=False)  # one window of consecutive article tokens
    print(f"text: {stream.shape[1]} Wikipedia tokens (evaluation split, {len(docs)} articles available)")

    with tempfile.TemporaryDirectory() as tmp:
        ckpt = ensure_checkpoint(args.checkpoint, Path(tmp))
        mla = MLAForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32).eval()
        folded = MLAForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32).eval()
    folded.set_folding(True)  # what generate() runs: W_UK / W_UV folded into q_proj / o_proj where it pays
    cfg = mla.config
    layers = cfg.num_hidden_layers
    widths = list(cfg.cache_width)
    print(
        f"MLA checkpoint {ckpt}: cache {sum(widths) / layers:.2f} values/token/layer on average "
        f"(d_c per layer {min(cfg.kv_lora_rank)}..{max(cfg.kv_lora_rank)}, rope {cfg.num_rope_heads} x "
        f"{cfg.qk_rope_head_dim}); source {2 * source.config.num_key_value_heads * source.config.head_dim}",
        flush=True,
    )
    paged = PagedLatentCache.for_model(cfg, total + args.page_size, args.page_size)
    paged.bind([paged.add_request()])
    runners = [
        Runner("source (Llama, SDPA)", source_sdpa, None, DynamicCache(config=source.config)),
        Runner("source (Llama, eager attention)", source, None, DynamicCache(config=source.config)),
        Runner("MLA naive (expanded K/V)", mla, "naive", DynamicCache(config=cfg)),
        Runner("MLA absorbed (latent)", mla, "absorbed", DynamicCache(config=cfg)),
        Runner("MLA absorbed (latent), folded", folded, "absorbed", DynamicCache(config=cfg)),
        Runner("MLA absorbed, paged latent, folded", folded, "absorbed", paged),
    ]
    if args.triton_steps and not torch.cuda.is_available():  # on a GPU machine the GPU part times it
        tri = PagedLatentCache.for_model(cfg, contexts[0] + per_ctx + args.page_size, args.page_size)
        tri.bind([tri.add_request()])
        runners.append(
            Runner("MLA triton kernel, paged (Triton interpreter)", folded, "triton", tri, until=contexts[0])
        )
    absorbed = runners[3]

    load_start = os.getloadavg()[0]
    wall = time.perf_counter()
    with torch.no_grad():
        for ctx in contexts:
            live = [r for r in runners if r.until is None or ctx <= r.until]
            for r in live:
                t = time.perf_counter()
                prefill(r, stream[:, r.tokens() : ctx], args.chunk)
                print(f"  [{ctx}] prefill {r.name}: {time.perf_counter() - t:.1f} s", flush=True)
            for i in range(per_ctx):
                tok_ids = stream[:, ctx + i : ctx + i + 1]
                shift = i % len(live)
                for r in live[shift:] + live[:shift]:  # rotate the order every step
                    if r.path == "triton" and i >= args.warmup + args.triton_steps:
                        continue
                    t = time.perf_counter()
                    logits = r.forward(tok_ids)
                    dt = time.perf_counter() - t
                    if i >= args.warmup:
                        r.times.setdefault(ctx, []).append(dt)
                    r.logits.setdefault(ctx, []).append(logits)
            for r in live:
                r.bytes_at[ctx] = r.measure_bytes(layers)
                med = statistics.median(r.times.get(ctx) or [float("nan")])
                print(f"  [{ctx}] {r.name}: {1e3 * med:.1f} ms/step", flush=True)
            for r in runners:
                if r.until is not None and ctx >= r.until:
                    r.cache = None  # free it
    wall = time.perf_counter() - wall
    load = f"1-min load average {load_start:.1f} at the start, {os.getloadavg()[0]:.1f} at the end"

    src_kv = 2 * source.config.num_key_value_heads * source.config.head_dim
    lines = [
        f"Machine: {machine_line()}. float32, batch 1, `torch.no_grad()`. Context: real Wikipedia tokens "
        f"(evaluation split) filled {args.chunk} per forward; then {args.warmup} warm-up + {args.steps} timed "
        f"decode steps per path, paths interleaved round robin; time = median wall time of one full "
        f"model step (embeddings, {layers} layers, LM head for one token). Cache bytes are measured from the "
        f"cache tensors after the last step (the most they held at that context; the paged row counts "
        f"committed rows, its pages add < one page per layer). MLA checkpoint: default conversion, "
        f"{sum(widths) / layers:.0f} values/token/layer vs the source's {src_kv} "
        f"({100 * sum(widths) / layers / src_kv:.2f} %). Whole CPU run {wall:.0f} s; {load}.",
        "",
        "| context | path | ms / step | x source | x naive | cache values / token / layer | cache MB "
        "| cache x source | max abs logit diff vs absorbed |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    source_r, naive_r = runners[0], runners[2]
    summary: dict[str, Any] = {"contexts": contexts, "wall_s": wall}
    for ctx in contexts:
        med = {r.name: statistics.median(r.times[ctx]) for r in runners if r.times.get(ctx)}
        for r in runners:
            if ctx not in r.times:
                continue
            m = med[r.name]
            by = r.bytes_at[ctx]
            if r.path is None:  # the source models compute another function
                diff = "n/a (source)"
            else:
                n = len(r.logits[ctx])
                d = max(
                    float((a - b).abs().max())
                    for a, b in zip(r.logits[ctx], absorbed.logits[ctx][:n], strict=True)
                )
                diff = f"{d:.1e}"
            rel = by["bytes_per_token_layer"] / source_r.bytes_at[ctx]["bytes_per_token_layer"]
            if r.path == "triton":  # the interpreter's time records the backend; it is not a speed
                speed = f"{1e3 * m:.0f} (interpreted, median of {len(r.times[ctx])}) | n/a | n/a"
            else:
                speed = f"{1e3 * m:.1f} | {m / med[source_r.name]:.2f} | {m / med[naive_r.name]:.2f}"
            lines.append(
                f"| {ctx:,} | {r.name} | {speed} | {by['values_per_token_layer']:.1f} "
                f"| {by['bytes'] / MIB:.1f} | {rel:.4f} | {diff} |"
            )
        summary[ctx] = {name: m for name, m in med.items()}
    summary["bytes"] = {r.name: r.bytes_at for r in runners}
    summary["names"] = [r.name for r in runners]
    return lines, summary


# ----------------------------------------------------------------------------------------- GPU part
#: (batch, context) x H shapes of the GPU part; d_c + d_R pairs: DeepSeek-V3's and SmolLM2's 120-value budget
GPU_SHAPES = ((1, 32768), (16, 4096), (64, 4096))
GPU_HEADS = (9, 128)
GPU_WIDTHS = ((512, 64), (96, 24))
GPU_PAGE = 64
L2_FLUSH_BYTES = 256 * MIB  # larger than any GPU's L2 (an H200 has 60 MB)


def kernel_bytes(b: int, ctx: int, h: int, d_c: int, d_r: int, row_bytes: int) -> int:
    """Bytes one decode call must move: the cached rows it reads (``row_bytes`` of payload each, no padding),
    the bfloat16 queries, the bfloat16 output, the float32 lse and the int32 block table and lengths."""
    pages = -(-ctx // GPU_PAGE)
    return b * ctx * row_bytes + b * h * (d_c + d_r) * 2 + b * h * d_c * 2 + b * h * 4 + b * (pages + 1) * 4


def kernel_flops(b: int, ctx: int, h: int, d_c: int, d_r: int) -> int:
    """Useful floating-point operations of one decode call: ``2 (d_c + d_R)`` per score and ``2 d_c`` per value
    product, for every head and cached row (padding rows of a 16-row block are not counted)."""
    return 2 * b * ctx * h * (2 * d_c + d_r)


def write_json(path: Path, record: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(record, indent=2) + "\n")
    tmp.replace(path)


def gpu_bench(args: argparse.Namespace) -> tuple[list[str], dict[str, Any]]:
    """``latent_decode`` (bfloat16 and FP8 rows) timed through CUDA-graph replays, against the device's measured
    copy bandwidth and bfloat16 matmul rate and PyTorch SDPA on the expanded cache (CUDA only).

    Returns:
        the Markdown lines and a record: ``device`` (name, SMs, memory), ``copy_gbps`` (read + write bytes of a
        1 GiB device-to-device copy per second / 1e9), ``matmul_tflops`` (8192^3 bfloat16), and ``rows``: one
        dict per kernel cell (shape, row format, bytes, times in microseconds cold and back to back, GB/s,
        TFLOP/s, % of copy bandwidth, of the matmul rate and of the roofline, the bound, the error against the
        float64 oracle, SDPA's time).
    """
    import torch.nn.functional as F
    from triton.testing import do_bench_cudagraph

    from mla_convert.kernels import fp8 as F8
    from mla_convert.kernels import latent_decode_reference, launch, load_kernel

    kernel = load_kernel()
    dev = torch.device("cuda")
    dt = torch.bfloat16
    flush = torch.empty(L2_FLUSH_BYTES, dtype=torch.uint8, device=dev)
    reps = args.gpu_reps

    def capture(fn: Any) -> torch.cuda.CUDAGraph:
        """``fn`` run twice on a side stream (compile, warm), then captured as one CUDA graph."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()
            fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        torch.cuda.synchronize()
        return graph

    def cold(graph: torch.cuda.CUDAGraph) -> float:
        """Median seconds of one replay of ``graph``, the L2 flushed before each (CUDA events around it)."""
        marks = [
            (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)
        ]
        for start, end in marks:
            flush.zero_()
            start.record()
            graph.replay()
            end.record()
        torch.cuda.synchronize()
        return statistics.median(s.elapsed_time(e) for s, e in marks) / 1e3

    def hot(fn: Any) -> float:
        """Median seconds of one call, calls back to back in one graph (``do_bench_cudagraph``; L2 warm)."""
        return float(do_bench_cudagraph(fn, rep=20, return_mode="median")) / 1e3

    def time_sdpa(b: int, h: int, kv_heads: int, hd: int, ctx: int) -> tuple[float, str]:
        """Seconds of PyTorch SDPA for one query token over ``ctx`` expanded K/V rows (as :func:`cold`), or
        NaN and why it could not run."""
        try:
            q = torch.randn(b, h, 1, hd, device=dev, dtype=dt)
            k = torch.randn(b, kv_heads, ctx, hd, device=dev, dtype=dt)
            v = torch.randn_like(k)
            sdpa = partial(F.scaled_dot_product_attention, q, k, v, enable_gqa=kv_heads != h)
            return cold(capture(sdpa)), ""
        except torch.cuda.OutOfMemoryError:
            return float("nan"), "OOM"
        except RuntimeError as exc:  # e.g. a backend that cannot be captured
            return float("nan"), f"error: {str(exc).splitlines()[0][:80]}"

    props = torch.cuda.get_device_properties(dev)
    src = torch.empty(1 << 30, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    copy_s = cold(capture(partial(dst.copy_, src)))
    copy_bw = 2 * src.numel() / copy_s  # read + write bytes per second
    del src, dst
    a = torch.randn(8192, 8192, device=dev, dtype=dt)
    mm_s = hot(partial(torch.mm, a, a))
    peak_flops = 2 * 8192**3 / mm_s
    del a
    torch.cuda.empty_cache()
    ridge = peak_flops / copy_bw  # FLOP per byte where the two limits meet
    record: dict[str, Any] = {
        "device": {
            "name": torch.cuda.get_device_name(dev),
            "capability": ".".join(map(str, torch.cuda.get_device_capability(dev))),
            "multiprocessors": props.multi_processor_count,
            "memory_gib": props.total_memory / 2**30,
        },
        "torch": torch.__version__,
        "copy_gbps": copy_bw / 1e9,
        "matmul_tflops": peak_flops / 1e12,
        "ridge_flop_per_byte": ridge,
        "rows": [],
    }
    fp8_ok = torch.cuda.get_device_capability(dev) >= (8, 9)
    lines = [
        f"GPU: {record['device']['name']} ({props.multi_processor_count} SMs), torch {torch.__version__}, bfloat16 "
        f"queries. Measured here: device copy bandwidth {copy_bw / 1e9:.0f} GB/s (1 GiB device-to-device copy, "
        f"read + write bytes / time, L2 flushed) and bfloat16 matmul {peak_flops / 1e12:.0f} TFLOP/s (8192^3, "
        f"`do_bench_cudagraph`); ridge {ridge:.0f} FLOP/byte. Kernel bytes = cached rows read (bfloat16: "
        "2 (d_c + d_R) bytes a row; FP8: E4M3 latent + float32 scales + bfloat16 rope, `mla_kernels/fp8.py`) + "
        "queries + output + lse + block table; FLOPs = 2 (2 d_c + d_R) per head and cached row. *cold us*: median "
        f"of {reps} CUDA-graph replays of one call with the L2 flushed before each (CUDA events around each "
        "replay); GB/s, TFLOP/s and the percentages use it. *hot us*: calls back to back in one graph "
        "(`triton.testing.do_bench_cudagraph`, L2 warm: a cache smaller than the L2 stays in it). *% roofline*: "
        "max(bytes / copy BW, FLOPs / matmul rate) / time; *bound*: the larger of the two. d_R = 64 with "
        "d_c = 512 (DeepSeek-V3's shape) and 24 with d_c = 96 (SmolLM2's 120-value budget); one shared rope head; "
        f"page size {GPU_PAGE}. SDPA: PyTorch's on the expanded bfloat16 K/V of the same context (SmolLM2's "
        "3 KV heads x 64 for H = 9, 128 x 128 for H = 128), timed the same way.",
        "",
        "| B x context | H | d_c + d_R | rows | splits | MB moved | cold us | hot us | GB/s | % copy BW | TFLOP/s "
        "| % matmul | bound | % roofline | max err vs fp64 | x bf16 time | SDPA us | kernel x SDPA time |",
        "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|",
    ]
    for b, ctx in GPU_SHAPES:
        for h in GPU_HEADS:
            kv_heads, hd = (3, 64) if h == 9 else (128, 128)
            sdpa_s, sdpa_note = time_sdpa(b, h, kv_heads, hd, ctx)
            torch.cuda.empty_cache()
            for d_c, d_r in GPU_WIDTHS:
                per_request = -(-ctx // GPU_PAGE)
                stride = -(-(d_c + d_r) // 16) * 16  # the paged cache's padded row stride
                rows16 = torch.randn(b * per_request, GPU_PAGE, stride, device=dev, dtype=dt)[
                    ..., : d_c + d_r
                ]
                table = torch.arange(b * per_request, device=dev, dtype=torch.int32).view(b, per_request)
                lens = torch.full((b,), ctx, device=dev, dtype=torch.int32)
                q_abs = torch.randn(b, h, d_c, device=dev, dtype=dt)
                q_rope = torch.randn(b, h, d_r, device=dev, dtype=dt)
                heads = torch.zeros(h, device=dev, dtype=torch.int32)
                scale = (d_c + d_r) ** -0.5
                bf16_s = float("nan")
                formats: list[tuple[str, torch.Tensor, Any, int]] = [("bf16", rows16, None, 2 * (d_c + d_r))]
                if fp8_ok:
                    lay = F8.layout(d_c, d_r)
                    formats.append(("fp8", F8.quantize_rows(rows16, lay), lay, lay.row_bytes))
                for fmt, cache, lay, row_bytes in formats:
                    call = partial(
                        kernel.latent_decode,
                        q_abs,
                        q_rope,
                        cache,
                        table,
                        lens,
                        heads,
                        softmax_scale=scale,
                        fp8=lay,
                    )
                    splits = launch.default_num_splits(
                        b, h, per_request * GPU_PAGE, d_c, cache.shape[2] * cache.element_size(),
                        launch.multiprocessor_count(dev), launch.default_block_n(d_c),
                    )  # fmt: skip
                    out, _ = call()
                    n = min(b, 2)  # the float64 oracle on the first requests
                    ref, _ = latent_decode_reference(
                        q_abs[:n], q_rope[:n], cache, table[:n], lens[:n], heads, scale, fp8=lay
                    )
                    err = float((out[:n].double() - ref).abs().max())
                    k_s = cold(capture(call))
                    h_s = hot(call)
                    if fmt == "bf16":
                        bf16_s = k_s
                    by = kernel_bytes(b, ctx, h, d_c, d_r, row_bytes)
                    fl = kernel_flops(b, ctx, h, d_c, d_r)
                    floor = max(by / copy_bw, fl / peak_flops)
                    row = {
                        "batch": b, "context": ctx, "heads": h, "d_c": d_c, "d_r": d_r, "rows": fmt,
                        "num_splits": splits, "bytes": by, "flops": fl,
                        "cold_us": 1e6 * k_s, "hot_us": 1e6 * h_s,
                        "gbps": by / k_s / 1e9, "pct_copy_bw": 100 * by / k_s / copy_bw,
                        "tflops": fl / k_s / 1e12, "pct_matmul": 100 * fl / k_s / peak_flops,
                        "bound": "compute" if fl / by > ridge else "memory",
                        "pct_roofline": 100 * floor / k_s, "max_err_vs_fp64": err,
                        "x_bf16_time": k_s / bf16_s,
                        "sdpa_kv": f"{kv_heads} x {hd}", "sdpa_us": 1e6 * sdpa_s if not sdpa_note else None,
                        "sdpa_note": sdpa_note or None, "x_sdpa_time": k_s / sdpa_s if not sdpa_note else None,
                    }  # fmt: skip
                    record["rows"].append(row)
                    if (
                        args.json
                    ):  # after every row, so a run stopped at its time limit keeps what it measured
                        write_json(args.json, record)
                    sdpa_cell = sdpa_note or f"{1e6 * sdpa_s:.1f} | {k_s / sdpa_s:.2f}"
                    lines.append(
                        f"| {b} x {ctx:,} | {h} | {d_c} + {d_r} | {fmt} | {splits} | {by / 1e6:.1f} "
                        f"| {row['cold_us']:.1f} | {row['hot_us']:.1f} | {row['gbps']:.0f} | {row['pct_copy_bw']:.0f} % "
                        f"| {row['tflops']:.1f} | {row['pct_matmul']:.0f} % | {row['bound']} "
                        f"| {row['pct_roofline']:.0f} % | {err:.1e} | {row['x_bf16_time']:.2f} | {sdpa_cell} |"
                    )
                    print(lines[-1], flush=True)
                    del call, out, ref
                del rows16, formats, cache, table, q_abs, q_rope
                torch.cuda.empty_cache()
    if not fp8_ok:
        lines += ["", f"FP8 rows left out: {record['device']['name']} is below sm_89 (no E4M3)."]
    return lines, record


# ----------------------------------------------------------------------------------------- output
RESULTS = Path(__file__).parent / "results"


def collect_block(path: Path) -> str:
    """The ``decode`` block from the tables a run stored in ``path`` (``results/decode.md``): they are the block."""
    return path.read_text().strip("\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", type=Path, help="converted MLA checkpoint (made here when missing)")
    ap.add_argument(
        "--contexts",
        default="512,2048,8176",
        help="cached tokens before the first decode step; 8176 = SmolLM2's 8192 positions - 16 (room for "
        "the warm-up and timed steps)",
    )
    ap.add_argument("--steps", type=int, default=12, help="timed decode steps per context and path")
    ap.add_argument("--warmup", type=int, default=2, help="untimed decode steps before them")
    ap.add_argument("--chunk", type=int, default=512, help="prefill tokens per forward")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument(
        "--triton-steps",
        type=int,
        default=2,
        help="timed decode steps of the Triton kernel at the first context (CPU only, in the Triton "
        "interpreter: a record that the kernel runs and agrees, not a speed; 0 leaves it out)",
    )
    ap.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch CPU threads (1: a one-token step of a 135M model is per-op overhead, and extra threads "
        "only add synchronisation on a busy 2-core machine)",
    )
    ap.add_argument("--no-cpu", action="store_true", help="only the GPU part")
    ap.add_argument(
        "--gpu",
        action="store_true",
        help="only the GPU part, in one command when a device is lent; prints 'no CUDA device' and writes "
        "nothing without one",
    )
    ap.add_argument(
        "--readme", action="store_true", help="also replace the block between its markers (README.md or docs/)"
    )
    ap.add_argument(
        "--gpu-reps", type=int, default=30, help="CUDA-graph replays per cold (L2-flushed) GPU timing"
    )
    ap.add_argument(
        "--out",
        type=Path,
        help="Markdown output (default benchmarks/results/decode.md; with --gpu, decode_gpu.md beside it)",
    )
    ap.add_argument("--json", type=Path, help="also write the GPU part's record (one dict per row) here")
    ap.add_argument("--collect", action="store_true", help="measure nothing: the block again from --out's stored tables")
    args = ap.parse_args()
    if args.collect:
        text = collect_block(args.out or RESULTS / "decode.md")
        print(text)
        if args.readme:
            replace_block("decode", text)
        return
    if args.gpu and not torch.cuda.is_available():
        print(
            "no CUDA device: the GPU benchmark needs one (torch.cuda.is_available() is False); nothing written"
        )
        return
    results = Path(__file__).parent / "results"
    args.out = args.out or results / ("decode_gpu.md" if args.gpu else "decode.md")
    args.no_cpu = args.no_cpu or args.gpu
    torch.set_num_threads(max(1, args.threads))
    torch.manual_seed(0)
    sections: list[str] = []
    if not args.no_cpu:
        lines, summary = cpu_bench(args)
        sections += ["**CPU**, SmolLM2-135M-Instruct vs its MLA conversion (31.25 % cache):", "", *lines]
        last = summary["contexts"][-1]
        src_name, ab_name = "source (Llama, SDPA)", "MLA absorbed (latent), folded"
        verdicts = []
        for ctx in summary["contexts"]:
            ab, sr = summary[ctx][ab_name], summary[ctx][src_name]
            verdicts.append(
                f"{ctx:,} tokens: {1e3 * ab:.1f} vs {1e3 * sr:.1f} ms ({ab / sr:.2f}x, "
                f"{'met' if ab <= sr else 'not met'})"
            )
        ratio = summary["bytes"][ab_name][last]["bytes"] / summary["bytes"][src_name][last]["bytes"]
        verdict = (
            f"Target: the folded absorbed latent step (what `generate` runs) at the source's SDPA step time: "
            f"{'; '.join(verdicts)}. Its cache holds {ratio:.4f}x the source's bytes."
        )
        sections += ["", verdict]
        print(verdict)
    sections.append("")
    if torch.cuda.is_available():
        gpu_lines, record = gpu_bench(args)
        sections += ["**GPU**, latent decode kernel (bfloat16 and FP8 rows) vs SDPA:", "", *gpu_lines]
        if args.json:
            write_json(args.json, record)
    else:
        sections.append("GPU part: no GPU: skipped (no CUDA device on this machine).")
        print("no GPU: skipped")
    text = "\n".join(sections).strip()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text + "\n")
    if args.readme:
        replace_block("decode", text)
    print()
    print(text)


if __name__ == "__main__":
    main()
