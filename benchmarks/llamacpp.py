"""The source GGUF and the MLA GGUF of the reference conversion in a real llama.cpp: perplexity at each weight
quantization and KV cache type, the KV memory llama.cpp allocates, prefill and decode time (issue 35, item 5).

    .venv/bin/python benchmarks/llamacpp.py --ckpt out/smollm2-mla [--parts ppl,kv,speed] [--repeats 2] \\
        [--work out/llamacpp-bench] [--llamacpp-python PY]
    .venv/bin/python benchmarks/llamacpp.py --collect      # only the block again, from the stored rows

Models: the bundled SmolLM2-135M-Instruct GGUF (Q4_1, dequantized once to float32 by llama.cpp's quantizer with
requantizing allowed, then quantized like the MLA file) and ``mla-convert export CKPT --format gguf`` of the
reference conversion (default ``--cache-block 32``), each at ``f16``, ``q8_0`` and ``q4_k_m`` weights through
llama.cpp's own quantizer (the MLA file keeps ``attn_kv_a_mqa`` float32, as the export does). KV cache ``f16``
(flash attention off) and ``q8_0`` (K and V, flash attention on, which llama.cpp requires for it).

* ``ppl``: perplexity on :data:`PPL_WINDOWS` x 512 tokens of the Wikipedia evaluation split (the reference conversion's
  windows), each window scored alone, through the checkpoint's tokenizer (the source's);
* ``kv``: the KV cache llama.cpp allocates at 512 / 2048 / 8192 tokens of context (its log line);
* ``speed``: prefill and decode milliseconds per token at 512 / 2048 / 8192 tokens of context (real Wikipedia
  text; one pass per model: the prompt up to 512, 16 decode steps, on to 2048, ...), ``--repeats`` rounds, source
  and MLA alternating within each round (and who goes first alternating between rounds) so that the machine's
  other jobs hit both; the table gives the best round of each.

Every row is stored in ``benchmarks/results/llamacpp.json`` as it finishes (a rerun measures only the missing rows)
and the ``llamacpp-bench`` block (docs/serving.md) is rewritten from that file (:func:`block`). Runs in llama.cpp
through ``benchmarks/llamacpp_runner.py`` (the llama.cpp venv's python).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
RESULTS = BENCH / "results" / "llamacpp.json"
RUNNER = BENCH / "llamacpp_runner.py"
PARTS = ("ppl", "kv", "speed")
MODELS = ("source", "mla")
WEIGHTS = ("f16", "q8_0", "q4_k_m")
CACHES = ("f16", "q8_0")
CONTEXTS = (512, 2048, 8192)
PPL_WINDOWS = 8
DECODE_STEPS = 16
#: weight type -> llama_ftype of llama.cpp's quantizer (include/llama.h)
FTYPES = {"f32": 0, "f16": 1, "q8_0": 7, "q4_k_m": 15}
#: weight type -> ``export --format gguf --dtype``
EXPORT_DTYPES = {"f16": "float16", "q8_0": "q8_0", "q4_k_m": "q4_k_m"}
COMMAND = "python benchmarks/llamacpp.py --ckpt CKPT"


# ------------------------------------------------------------------------------------------------ stored rows
def row_key(row: dict[str, Any]) -> tuple[Any, ...]:
    """What identifies a row (a rerun skips rows whose key is stored)."""
    return tuple(row.get(k) for k in ("part", "model", "weights", "cache", "ctx", "repeat"))


def load_results(path: Path = RESULTS) -> dict[str, Any]:
    """The stored results (``{"meta": {...}, "rows": [...]}``; empty when the file does not exist)."""
    return json.loads(path.read_text()) if path.exists() else {"meta": {}, "rows": []}


def store(results: dict[str, Any], path: Path = RESULTS) -> None:
    """Write ``results`` (a temporary sibling renamed into place: an interrupted write keeps the previous file)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(results, indent=1) + "\n")
    os.replace(tmp, path)


# ------------------------------------------------------------------------------------------------ arithmetic
def attention_macs(meta: dict[str, Any]) -> float:
    """Attention multiply-adds per cached token per layer of one query token, from GGUF metadata: MLA (absorbed,
    ``deepseek2``) ``H (2 d_c + d_R)`` (scores over the latent and rope key, values over the latent); a K/V model
    ``2 H d`` (``d`` the head width)."""
    arch = meta["general.architecture"]
    h = int(meta[f"{arch}.attention.head_count"])
    if arch == "deepseek2":
        return h * (
            2 * int(meta[f"{arch}.attention.kv_lora_rank"]) + int(meta[f"{arch}.rope.dimension_count"])
        )
    d = int(meta.get(f"{arch}.attention.key_length", int(meta[f"{arch}.embedding_length"]) // h))
    return 2 * h * d


def arithmetic_ratio(src: dict[str, Any], mla: dict[str, Any], ctx: float) -> float:
    """MLA / source multiply-adds per token with ``ctx`` cached tokens: weights (``matmul_params``) plus every
    layer's attention (:func:`attention_macs`) over ``ctx`` tokens."""

    def macs(m: dict[str, Any]) -> float:
        return m["matmul_params"] + m["layers"] * ctx * m["attention_macs"]

    return macs(mla) / macs(src)


def gguf_shape(path: Path) -> dict[str, Any]:
    """The metadata :func:`arithmetic_ratio` needs, read from the GGUF ``path``: ``attention_macs``, ``layers`` and
    ``matmul_params`` (the weight multiply-adds of one token: every 2-D tensor but the embedding lookup, the
    output projection counted once, tied or not)."""
    from gguf import GGUFReader

    r = GGUFReader(str(path))
    meta = {k: f.contents() for k, f in r.fields.items() if not k.startswith("tokenizer.")}
    arch = meta["general.architecture"]
    sizes = {t.name: int(t.n_elements) for t in r.tensors if len(t.shape) >= 2}
    params = sum(n for name, n in sizes.items() if name != "token_embd.weight")
    if "output.weight" not in sizes:
        params += sizes["token_embd.weight"]  # tied: the embedding is the output projection
    record = json.loads(meta.get("mla_convert.export", "{}"))  # our export's record (the MLA file)
    pad = {k: record[k] for k in ("kv_lora_rank", "cache_block", "cache_block_padding") if k in record}
    return {**pad, "attention_macs": attention_macs(meta), "layers": int(meta[f"{arch}.block_count"]),
            "matmul_params": params, "file_mib": path.stat().st_size / 2**20}  # fmt: skip


# ------------------------------------------------------------------------------------------------ the block
def _best(rows: list[dict[str, Any]], key: str, **match: Any) -> float | None:
    vals = [r[key] for r in rows if all(r.get(k) == v for k, v in match.items())]
    return min(vals) if vals else None


def _f(x: float | None, fmt: str = ".2f") -> str:
    return "—" if x is None else format(x, fmt)


def _ratio(a: float | None, b: float | None) -> str:
    return "—" if a is None or b is None or b == 0 else f"{a / b:.2f} x"


def _rounds(rows: list[dict[str, Any]]) -> str:
    """How many interleaved rounds the speed rows of each weight and cache type hold and the machine's load when
    each pass started, as the caption says it."""
    sp = [r for r in rows if r["part"] == "speed"]
    said = []
    for w, c in dict.fromkeys((r["weights"], r["cache"]) for r in sp):
        group = [r for r in sp if r["weights"] == w and r["cache"] == c]
        n = len({r["repeat"] for r in group})
        text = f"{w} weights, {c} cache: " + (
            "one round (source, then MLA)"
            if n == 1
            else f"best of {n} interleaved rounds (who goes first alternates)"
        )
        loads = {
            m: [r["load_before"] for r in group if r["model"] == m and r["ctx"] == CONTEXTS[0]]
            for m in MODELS
        }
        if all(loads.values()):
            text += (
                " (1-minute load average when each pass started: "
                + ", ".join(f"{m} {'/'.join(f'{x:.1f}' for x in v)}" for m, v in loads.items())
                + ")"
            )
        said.append(text)
    return "; ".join(said)


def ppl_table(rows: list[dict[str, Any]], meta: dict[str, Any]) -> list[str]:
    """Perplexity (and file size) of the source and MLA GGUF at each weight type and cache type."""
    ppl = [r for r in rows if r["part"] == "ppl"]
    out = [
        "| weights | KV cache | source ppl | MLA ppl | source file MiB | MLA file MiB |",
        "|---|---|---|---|---|---|",
    ]
    for w in WEIGHTS:
        for c in CACHES:
            s = next(
                (r for r in ppl if r["model"] == "source" and r["weights"] == w and r["cache"] == c), None
            )
            m = next((r for r in ppl if r["model"] == "mla" and r["weights"] == w and r["cache"] == c), None)
            if s is None and m is None:
                continue
            files = meta.get("files", {})
            out.append(f"| {w} | {c} | {_f(s and s['ppl'])} | {_f(m and m['ppl'])} | "
                       f"{_f(files.get(f'source-{w}', {}).get('file_mib'), '.1f')} | "
                       f"{_f(files.get(f'mla-{w}', {}).get('file_mib'), '.1f')} |")  # fmt: skip
    return out


def kv_table(rows: list[dict[str, Any]]) -> list[str]:
    """KV cache MiB llama.cpp allocated at each context and cache type, source vs MLA."""
    kv = [r for r in rows if r["part"] == "kv"]
    out = ["| KV cache | context | source MiB (K + V) | MLA MiB (K only) | MLA / source | values/token/layer "
           "(source / MLA) |", "|---|---|---|---|---|---|"]  # fmt: skip
    for c in CACHES:
        for n in CONTEXTS:
            s = next((r for r in kv if r["model"] == "source" and r["cache"] == c and r["ctx"] == n), None)
            m = next((r for r in kv if r["model"] == "mla" and r["cache"] == c and r["ctx"] == n), None)
            if s is None and m is None:
                continue
            sm, mm = s and s["k_mib"] + s["v_mib"], m and m["k_mib"] + m["v_mib"]
            vals = f"{_f(s and s['values_per_token_per_layer'], '.0f')} / {_f(m and m['values_per_token_per_layer'], '.0f')}"
            out.append(f"| {c} | {n} | {_f(sm)} | {_f(mm)} | {_ratio(mm, sm)} | {vals} |")
    return out


def speed_table(rows: list[dict[str, Any]], meta: dict[str, Any]) -> list[str]:
    """Prefill and decode ms/token, source vs MLA, measured ratio beside the arithmetic one."""
    sp = [r for r in rows if r["part"] == "speed"]
    shapes = meta.get("files", {})
    out = ["| weights, KV cache | context | prefill ms/token source / MLA | measured | arithmetic | "
           "decode ms/token source / MLA | measured | arithmetic |", "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for w in WEIGHTS:
        for c in CACHES:
            for n in CONTEXTS:
                q = {"weights": w, "cache": c, "ctx": n}
                ps, pm = (
                    _best(sp, "prefill_ms", model="source", **q),
                    _best(sp, "prefill_ms", model="mla", **q),
                )
                ds, dm = _best(sp, "decode_ms", model="source", **q), _best(sp, "decode_ms", model="mla", **q)
                if ps is None and pm is None:
                    continue
                src, mla = shapes.get(f"source-{w}"), shapes.get(f"mla-{w}")
                ar_p = f"{arithmetic_ratio(src, mla, (n + 1) / 2):.2f} x" if src and mla else "—"
                ar_d = f"{arithmetic_ratio(src, mla, n + DECODE_STEPS / 2):.2f} x" if src and mla else "—"
                out.append(f"| {w}, {c} | {n} | {_f(ps, '.3f')} / {_f(pm, '.3f')} | {_ratio(pm, ps)} | {ar_p} | "
                           f"{_f(ds, '.2f')} / {_f(dm, '.2f')} | {_ratio(dm, ds)} | {ar_d} |")  # fmt: skip
    return out


def block(results: dict[str, Any]) -> str:
    """The ``llamacpp-bench`` block: a caption and the tables of the parts that have rows."""
    rows, meta = results["rows"], results.get("meta", {})
    parts = {r["part"] for r in rows}
    shapes = meta.get("files", {})
    src, mla = shapes.get("source-f16"), shapes.get("mla-f16")
    lines = [
        f"Written by `{COMMAND}` (`benchmarks/results/llamacpp.json`; `--collect` rewrites this block from it). "
        f"{meta.get('engine', 'llama.cpp')}; source: the bundled SmolLM2-135M-Instruct GGUF (Q4_1, dequantized to "
        "float32 by llama.cpp's quantizer, then quantized like the MLA file); MLA: `mla-convert export CKPT OUT.gguf "
        "--format gguf` of the reference conversion (`--cache-block 32`), quantized by llama.cpp's own quantizer "
        "(`attn_kv_a_mqa` kept float32). KV cache f16: flash attention off (llama-cpp-python's default); q8_0: K and "
        "V, flash attention on (llama.cpp requires it for a quantized V).",
    ]
    if "ppl" in parts:
        lines += ["", f"Perplexity on {meta.get('ppl_text', 'real text')}:", "", *ppl_table(rows, meta)]
    if mla and mla.get("cache_block_padding") is not None:
        pad = mla["cache_block_padding"]
        lines[0] += (
            f" The MLA file's latent is {mla['kv_lora_rank']} wide: the checkpoint's largest rank "
            f"{mla['kv_lora_rank'] - pad} zero-padded by {pad} values per token per layer so that the latent and the "
            f"K row are whole blocks of {mla['cache_block']} (a q8_0 cache is refused otherwise)."
        )
    if "kv" in parts:
        lines += [
            "",
            "KV cache llama.cpp allocates (its `llama_kv_cache` log line; 30 layers):",
            "",
            *kv_table(rows),
        ]
    if "speed" in parts:
        arith = ""
        if src and mla:
            arith = (f" Arithmetic: attention multiply-adds per cached token per layer "
                     f"{mla['attention_macs']:.0f} (MLA absorbed, H(2 d_c + d_R)) against {src['attention_macs']:.0f} "
                     f"(source, 2 H d), {mla['attention_macs'] / src['attention_macs']:.2f} x; the arithmetic column "
                     "adds the weights' multiply-adds per token (every matrix but the embedding lookup) to the "
                     "attention over the context (prefill: the mean (N + 1) / 2 cached tokens), so it tends to "
                     "the attention ratio as the context grows.")  # fmt: skip
        lines += ["", f"Prefill and decode time per token ({meta.get('speed_text', 'real text')}): "
                  f"{meta.get('machine', 'a shared CPU')}; one llama.cpp thread per process (two OpenMP threads "
                  "spin at every barrier while other jobs hold the cores: 10-100 x slower here); "
                  f"{_rounds(rows)}.{arith}", "",
                  *speed_table(rows, meta)]  # fmt: skip
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------ measuring
def run(python: str, request: dict[str, Any], timeout_s: int = 1800) -> tuple[dict[str, Any], str]:
    """Run :mod:`llamacpp_runner` on ``request``; returns (its result, its log).

    Raises:
        RuntimeError: the llama.cpp process failed (its last log lines).
    """
    with tempfile.TemporaryDirectory(prefix="mla-llamacpp-bench-") as tmp:
        req, res = Path(tmp) / "request.json", Path(tmp) / "result.json"
        req.write_text(json.dumps(request))
        done = subprocess.run([python, str(RUNNER), str(req), str(res)], capture_output=True, text=True,
                              timeout=timeout_s, cwd=tmp)  # fmt: skip
        log = done.stdout + done.stderr
        if done.returncode != 0 or not res.is_file():
            tail = "\n".join(log.strip().splitlines()[-12:])
            raise RuntimeError(f"llama.cpp failed ({request['job']} on {request['model']}):\n{tail}")
        return json.loads(res.read_text()), log


def kv_rows(log: str, model: str, cache: str, contexts: tuple[int, ...]) -> list[dict[str, Any]]:
    """One row per ``llama_kv_cache`` line of ``log`` (in the order the contexts were created).

    Raises:
        RuntimeError: the log has not one line per context.
    """
    from mla_convert.engines.llamacpp.check import _KV_LINE, kv_cache

    found = [kv_cache(m.group(0)) for m in _KV_LINE.finditer(log)]
    if len(found) != len(contexts):
        raise RuntimeError(f"llama.cpp's log has {len(found)} KV cache lines for {len(contexts)} contexts")
    return [
        {"part": "kv", "model": model, "cache": cache, "ctx": n, **f}
        for n, f in zip(contexts, found, strict=True)
    ]


def prepare(ckpt: Path, work: Path, python: str, weights: tuple[str, ...]) -> dict[str, Path]:
    """The GGUF files (``source-W``, ``mla-W`` for each weight type), written into ``work`` when missing."""
    from mla_convert.engines.llamacpp.env import quantize
    from mla_convert.engines.llamacpp.gguf_file import export_gguf
    from mla_convert.sources.assets import bundled_gguf_path

    work = work.resolve()  # the runner runs in a temporary folder
    work.mkdir(parents=True, exist_ok=True)
    files: dict[str, Path] = {}
    f32 = work / "source-f32.gguf"
    if not f32.exists():
        print(f"{f32.name}: the bundled Q4_1 GGUF dequantized by llama.cpp's quantizer", flush=True)
        quantize(python, bundled_gguf_path(), f32, "f32", keep=(), ftype=FTYPES["f32"], allow_requantize=True)
    for w in weights:
        src, mla = work / f"source-{w}.gguf", work / f"mla-{w}.gguf"
        if not src.exists():
            print(f"{src.name}: llama.cpp's quantizer", flush=True)
            quantize(python, f32, src, w, keep=(), ftype=FTYPES[w])
        if not mla.exists():
            print(f"{mla.name}: mla-convert export --format gguf --dtype {EXPORT_DTYPES[w]}", flush=True)
            export_gguf(ckpt, mla, EXPORT_DTYPES[w], llamacpp_python=python, check=False)
        files[f"source-{w}"], files[f"mla-{w}"] = src, mla
    return files


def texts(ckpt: Path) -> tuple[list[list[int]], list[int], str, str]:
    """(perplexity windows, speed ids, their captions) through the checkpoint's tokenizer."""
    from transformers import AutoTokenizer

    from mla_convert.text.corpora import load_documents
    from mla_convert.text.windows import adds_bos, split_documents, token_windows

    tok = AutoTokenizer.from_pretrained(str(ckpt))
    docs = load_documents("wikipedia")
    ppl = token_windows(
        tok, split_documents(docs)["evaluation"], 512, PPL_WINDOWS, bos=adds_bos(tok)
    ).tolist()
    need = max(CONTEXTS) + DECODE_STEPS
    ids = token_windows(tok, docs, need, 1, bos=False)[0].tolist()
    return (ppl, ids, f"{len(ppl)} x 512 tokens of the Wikipedia evaluation split ({len(ppl) * 511} scored)",
            f"the first tokens of the Wikipedia corpus, {DECODE_STEPS} decode steps after the prefill")  # fmt: skip


def measure(a: argparse.Namespace, results: dict[str, Any]) -> None:
    """Measure the missing rows of the chosen parts, storing each as it finishes."""
    from mla_convert.engines.llamacpp.env import find_llamacpp

    python = a.llamacpp_python or find_llamacpp()
    if not python:
        raise SystemExit("error: no llama.cpp: run `bash scripts/llamacpp_env.sh` and pass --llamacpp-python")
    parts = tuple(a.parts.split(","))
    speed_w = tuple(a.speed_weights.split(","))
    weights = WEIGHTS if "ppl" in parts else tuple(w for w in WEIGHTS if w in speed_w or w == "f16")
    files = prepare(a.ckpt, a.work, python, weights)
    meta = results.setdefault("meta", {})
    meta.setdefault("files", {}).update({k: gguf_shape(p) for k, p in files.items()})
    ppl_ids, speed_ids, meta["ppl_text"], meta["speed_text"] = texts(a.ckpt)
    meta["machine"] = a.machine
    done = {row_key(r) for r in results["rows"]}

    def add(row: dict[str, Any], version: str) -> None:
        meta["engine"] = f"llama.cpp (llama-cpp-python {version}, CPU)"
        results["rows"].append(row)
        done.add(row_key(row))
        store(results, a.results)
        print(json.dumps({k: v for k, v in row.items() if k not in ("resolution",)}), flush=True)

    if "kv" in parts:
        for c in CACHES:
            for m in MODELS:
                if all(("kv", m, None, c, n, None) in done for n in CONTEXTS):
                    continue
                res, log = run(python, {"job": "kv", "model": str(files[f"{m}-f16"]), "cache_type": c,
                                        "contexts": list(CONTEXTS)})  # fmt: skip
                for row in kv_rows(log, m, c, CONTEXTS):
                    if row_key(row) not in done:
                        add(row, res["llama_cpp"])
    if "ppl" in parts:
        for w in WEIGHTS:
            for c in CACHES:
                for m in MODELS:
                    if ("ppl", m, w, c, None, None) in done:
                        continue
                    res, _ = run(python, {"job": "ppl", "model": str(files[f"{m}-{w}"]), "cache_type": c,
                                          "windows": ppl_ids})  # fmt: skip
                    add({"part": "ppl", "model": m, "weights": w, "cache": c, "tokens": res["tokens"],
                         "nll": res["nll"], "ppl": math.exp(res["nll"] / res["tokens"])}, res["llama_cpp"])  # fmt: skip
    if "speed" in parts:
        for rep in range(a.repeats):
            for w in speed_w:
                for c in a.speed_caches.split(","):
                    for m in MODELS if rep % 2 == 0 else MODELS[::-1]:  # alternate who goes first
                        if all(("speed", m, w, c, n, rep) in done for n in CONTEXTS):
                            continue
                        load = os.getloadavg()[0]
                        res, _ = run(python, {"job": "speed", "model": str(files[f"{m}-{w}"]), "cache_type": c,
                                              "ids": speed_ids, "contexts": list(CONTEXTS), "decode": DECODE_STEPS})  # fmt: skip
                        at = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
                        for n in CONTEXTS:
                            t = res["contexts"][str(n)]
                            add({"part": "speed", "model": m, "weights": w, "cache": c, "ctx": n, "repeat": rep,
                                 "prefill_ms": t["prefill_ms"], "decode_ms": t["decode_ms"],
                                 "load_before": round(load, 2), "at": at}, res["llama_cpp"])  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    """The command line (module docstring)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--ckpt", type=Path, help="the reference conversion (mla-convert factor smollm2-135m OUT)"
    )
    ap.add_argument(
        "--work", type=Path, default=Path("out/llamacpp-bench"), help="where the GGUF files are kept"
    )
    ap.add_argument(
        "--llamacpp-python", help="the python of scripts/llamacpp_env.sh (default: its cached venv)"
    )
    ap.add_argument("--parts", default=",".join(PARTS), help="comma-separated: ppl, kv, speed")
    ap.add_argument("--repeats", type=int, default=2, help="interleaved rounds of the speed part")
    ap.add_argument(
        "--speed-weights", default="q8_0", help="weight types of the speed part (comma-separated)"
    )
    ap.add_argument(
        "--speed-caches", default="f16,q8_0", help="cache types of the speed part (comma-separated)"
    )
    ap.add_argument(
        "--machine",
        default="2 CPU cores shared with other jobs (CI, other sessions)",
        help="the machine's state, said in the caption",
    )
    ap.add_argument(
        "--collect", action="store_true", help="measure nothing: write the block from the stored rows"
    )
    ap.add_argument("--results", type=Path, default=RESULTS, help=argparse.SUPPRESS)
    return ap


def main(argv: list[str] | None = None) -> None:
    ap = build_parser()
    a = ap.parse_args(argv)
    bad = [p for p in a.parts.split(",") if p not in PARTS]
    if bad:
        ap.error(f"--parts {','.join(bad)}: choose from {', '.join(PARTS)}")
    results = load_results(a.results)
    if not a.collect:
        if a.ckpt is None:
            ap.error("give --ckpt (the reference conversion), or --collect")
        measure(a, results)
    text = block(results)
    print(text)
    from blocks import replace_block

    print(f"llamacpp-bench: {replace_block('llamacpp-bench', text)}")


if __name__ == "__main__":
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    main()
