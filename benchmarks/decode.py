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

GPU part (``torch.cuda.is_available()`` only): the bundled kernel (``latent_decode``, bfloat16) at
B x context 1x32k, 16x4k, 64x4k, H = 9 and 128, d_c = 512 and 96: kernel time, achieved bandwidth
(bytes it must read / time) against the device's copy bandwidth, and PyTorch SDPA on the expanded
cache of the same shape (SmolLM2-135M's 3 KV heads x 64 for H = 9; 128 heads x 128 for H = 128).

    .venv/bin/mla-convert --quiet factor smollm2-135m /tmp/bench-mla      # once, ~90 s
    .venv/bin/python benchmarks/decode.py --checkpoint /tmp/bench-mla [--readme]
    .venv/bin/python benchmarks/decode.py --gpu                            # the GPU part alone

Without ``--checkpoint`` (or with a path that does not exist yet) the script makes the default conversion
first. Prints Markdown tables and writes them to ``benchmarks/results/decode.md``.
"""

from __future__ import annotations

import argparse
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
from readme import replace_block
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
def gpu_bench(args: argparse.Namespace) -> list[str]:
    """Kernel time and bandwidth of ``latent_decode`` vs the copy bandwidth and SDPA (CUDA only)."""
    import torch.nn.functional as F
    from triton.testing import do_bench

    from mla_convert.kernels import latent_decode_reference, load_kernel

    kernel = load_kernel()
    dev = torch.device("cuda")
    dt = torch.bfloat16
    elem = 2

    def bench(fn: Any) -> float:
        """Median seconds of ``fn`` with the L2 cache flushed before each call (triton's do_bench)."""
        return do_bench(fn, warmup=25, rep=100, return_mode="median") / 1e3

    src = torch.empty(1 << 30, dtype=torch.uint8, device=dev)
    copy_s = bench(partial(torch.Tensor.copy_, torch.empty_like(src), src))
    copy_bw = 2 * src.numel() / copy_s  # read + write bytes per second
    del src
    torch.cuda.empty_cache()
    lines = [
        f"GPU: {torch.cuda.get_device_name(dev)}, torch {torch.__version__}, bfloat16. Device copy bandwidth "
        f"(1 GiB device-to-device copy, read + write bytes / time): {copy_bw / 1e9:.0f} GB/s. Kernel bytes = "
        "cache rows read (B x context x (d_c + d_R)) + queries + outputs + block table; SDPA bytes = K and V "
        "read + query + output. Times: median over calls with the L2 cache flushed before each "
        "(`triton.testing.do_bench`). d_R = 64 with d_c = 512 (DeepSeek-V3's shape) and 24 with d_c = 96 "
        "(96 + 24 = SmolLM2's 120-value budget); one shared rope head; page size 64.",
        "",
        "| B x context | H | d_c + d_R | kernel us | kernel GB/s | % of copy BW | max err vs fp64 "
        "| SDPA K/V heads x dim | SDPA us | SDPA GB/s | kernel x SDPA time |",
        "|---|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|",
    ]
    page = 64
    for b, ctx in ((1, 32768), (16, 4096), (64, 4096)):
        for h in (9, 128):
            kv_heads, hd = (3, 64) if h == 9 else (128, 128)
            sdpa_cell = "n/a"
            try:
                sdpa = partial(
                    F.scaled_dot_product_attention,
                    torch.randn(b, h, 1, hd, device=dev, dtype=dt),
                    torch.randn(b, kv_heads, ctx, hd, device=dev, dtype=dt),
                    torch.randn(b, kv_heads, ctx, hd, device=dev, dtype=dt),
                    enable_gqa=kv_heads != h,
                )
                sdpa_s = bench(sdpa)
                sdpa_bytes = (2 * b * kv_heads * ctx * hd + 2 * b * h * hd) * elem
                sdpa_cell = f"{kv_heads} x {hd} | {1e6 * sdpa_s:.1f} | {sdpa_bytes / sdpa_s / 1e9:.0f}"
                del sdpa
            except torch.cuda.OutOfMemoryError:
                sdpa_s = float("nan")
                sdpa_cell = f"{kv_heads} x {hd} | OOM | OOM"
            torch.cuda.empty_cache()
            for d_c, d_r in ((512, 64), (96, 24)):
                per_request = -(-ctx // page)
                stride = -(-(d_c + d_r) // 16) * 16  # the paged cache's padded row stride
                cache = torch.randn(b * per_request, page, stride, device=dev, dtype=dt)[..., : d_c + d_r]
                table = torch.arange(b * per_request, device=dev, dtype=torch.int32).view(b, per_request)
                lens = torch.full((b,), ctx, device=dev, dtype=torch.int32)
                q_abs = torch.randn(b, h, d_c, device=dev, dtype=dt)
                q_rope = torch.randn(b, h, d_r, device=dev, dtype=dt)
                heads = torch.zeros(h, device=dev, dtype=torch.int32)
                scale = (d_c + d_r) ** -0.5

                call = partial(
                    kernel.latent_decode, q_abs, q_rope, cache, table, lens, heads, softmax_scale=scale
                )
                out, _ = call()
                n = min(b, 2)  # the float64 oracle on the first requests
                ref, _ = latent_decode_reference(
                    q_abs[:n], q_rope[:n], cache, table[:n], lens[:n], heads, scale
                )
                err = float((out[:n].double() - ref).abs().max())
                k_s = bench(call)
                k_bytes = (
                    (b * ctx * (d_c + d_r) + b * h * (d_c + d_r) + b * h * d_c) * elem
                    + b * h * 4
                    + table.numel() * 4
                )
                lines.append(
                    f"| {b} x {ctx:,} | {h} | {d_c} + {d_r} | {1e6 * k_s:.1f} | {k_bytes / k_s / 1e9:.0f} "
                    f"| {100 * k_bytes / k_s / copy_bw:.0f} % | {err:.1e} | {sdpa_cell} | {k_s / sdpa_s:.2f} |"
                )
                print(lines[-1], flush=True)
                del call, cache, table, q_abs, q_rope, out, ref
                torch.cuda.empty_cache()
    return lines


# ----------------------------------------------------------------------------------------- output
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
        "--readme", action="store_true", help="also replace the block between the README's markers"
    )
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "decode.md")
    args = ap.parse_args()
    if args.gpu and not torch.cuda.is_available():
        print(
            "no CUDA device: the GPU benchmark needs one (torch.cuda.is_available() is False); nothing written"
        )
        return
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
        sections += ["**GPU**, latent decode kernel vs SDPA:", "", *gpu_bench(args)]
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
