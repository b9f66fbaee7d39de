"""Greedy completers for :mod:`mla_convert.tasks.humaneval`: a model through transformers (a source, or a converted
checkpoint decoding through its latent cache) or a GGUF through a real llama.cpp.

* :class:`TorchCompleter`: ``generate()`` with ``do_sample=False`` and the stop strings; a converted model runs its
  absorbed path, its cache holding only ``[c_kv | k_rope]`` per token and layer.
* :class:`LlamaCppCompleter`: the script :mod:`mla_convert.engines.llamacpp.complete` in the llama.cpp venv
  (``scripts/llamacpp_env.sh``), one process for all prompts, its lines read as they come.
"""

from __future__ import annotations

import json
import subprocess
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from mla_convert.errors import UserError


class TorchCompleter:
    """Greedy continuation through transformers.

    Args:
        model: a causal LM (an ``MLAForCausalLM`` runs its absorbed latent-cache path with W_UK / W_UV folded).
        tokenizer: its tokenizer (``tokenizer(prompt)`` adds BOS where the model wants one).
        name: what the model is (a folder or source name), for the summary.
    """

    def __init__(self, model: Any, tokenizer: Any, name: str) -> None:
        self.model, self.tokenizer, self.name = model, tokenizer, name
        if hasattr(model, "set_attention_path"):
            model.set_attention_path("absorbed")
            model.set_folding(True)

    def describe(self) -> dict[str, Any]:
        """The model, the engine and its dtype."""
        dtype = str(next(self.model.parameters()).dtype).removeprefix("torch.")
        kind = (
            "MLA latent cache (absorbed)" if hasattr(self.model, "set_attention_path") else "source attention"
        )
        return {"model": self.name, "engine": "transformers", "dtype": dtype, "attention": kind}

    def complete(
        self,
        prompts: Sequence[str],
        max_new_tokens: int,
        stop: Sequence[str],
        done: Callable[[int, str], None],
    ) -> list[str]:
        """One greedy continuation per prompt (the text after it), stopped at EOS, ``max_new_tokens`` or a stop."""
        out = []
        for i, prompt in enumerate(prompts):
            ids = self.tokenizer(prompt, return_tensors="pt").input_ids
            text = self.tokenizer.decode(self.greedy_ids(ids, max_new_tokens, stop), skip_special_tokens=True)
            out.append(text)
            done(i, text)
        return out

    def greedy_ids(self, ids: Any, max_new_tokens: int, stop: Sequence[str] = ()) -> list[int]:
        """The greedy token ids after ``ids`` (``[1, T]`` token ids, the prompt as the model reads it), stopped at
        EOS, ``max_new_tokens`` or a ``stop`` string."""
        import torch

        extra: dict[str, Any] = {"stop_strings": list(stop), "tokenizer": self.tokenizer} if stop else {}
        with torch.no_grad():
            seq = self.model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                pad_token_id=self.tokenizer.pad_token_id or self.tokenizer.eos_token_id,
                **extra,
            )
        return [int(t) for t in seq[0, ids.shape[1] :].tolist()]


class LlamaCppCompleter:
    """Greedy continuation in a real llama.cpp.

    Args:
        gguf: the model file (a source's GGUF, or our ``export --format gguf``).
        python: the llama.cpp venv's python.
        threads: llama.cpp threads (1 on a shared two-core machine: two spin at every barrier).
        n_ctx: the context llama.cpp allocates (prompt + completion must fit).
    """

    def __init__(self, gguf: Path, python: str, threads: int = 1, n_ctx: int = 2048) -> None:
        self.gguf, self.python, self.threads, self.n_ctx = gguf, python, threads, n_ctx

    def describe(self) -> dict[str, Any]:
        """The model file, the engine and its threads."""
        return {"model": str(self.gguf), "engine": "llama.cpp", "threads": self.threads, "n_ctx": self.n_ctx}

    def complete(
        self,
        prompts: Sequence[str],
        max_new_tokens: int,
        stop: Sequence[str],
        done: Callable[[int, str], None],
    ) -> list[str]:
        """One greedy continuation per prompt, from llama.cpp's logits, reported as the engine finishes each.

        Raises:
            UserError: llama.cpp failed (its last log lines).
        """
        out: list[str] = [""] * len(prompts)
        if not prompts:
            return out
        from mla_convert.engines.llamacpp import complete

        script = Path(complete.__file__)
        with tempfile.TemporaryDirectory(prefix="mla-llamacpp-") as tmp:
            request = Path(tmp) / "request.json"
            payload = {
                "model": str(self.gguf),
                "prompts": list(prompts),
                "max_new_tokens": max_new_tokens,
                "stop": list(stop),
                "threads": self.threads,
                "n_ctx": self.n_ctx,
            }
            request.write_text(json.dumps(payload), encoding="utf-8")
            log = Path(tmp) / "log.txt"
            with log.open("w") as err:
                proc = subprocess.Popen(
                    [self.python, str(script), str(request)], stdout=subprocess.PIPE, stderr=err, text=True
                )
                assert proc.stdout is not None
                for line in proc.stdout:
                    row = json.loads(line)
                    out[int(row["index"])] = str(row["text"])
                    done(int(row["index"]), str(row["text"]))
                proc.wait()
            if proc.returncode != 0:
                tail = " | ".join(log.read_text(errors="replace").strip().splitlines()[-3:])
                raise UserError(f"llama.cpp failed on {self.gguf} (exit {proc.returncode}: {tail})")
        return out


def torch_completer(spec: str, dtype: str = "float32") -> TorchCompleter:
    """A :class:`TorchCompleter` for ``spec``: a converted checkpoint folder (MLA, or our DeepSeek-V3 export), or a
    source (a folder, a ``.gguf`` file or a built-in name), in ``dtype``.

    Raises:
        UserError: the checkpoint or source cannot be opened (its one-line reason).
    """
    import torch
    from transformers import AutoTokenizer

    from mla_convert.mla.checkpoint import load_checkpoint, read_checkpoint_config
    from mla_convert.sources.checkpoint import load_source_model, open_source

    path = Path(spec).expanduser()
    config = read_checkpoint_config(path, require_mla=False) if (path / "config.json").is_file() else {}
    if config.get("model_type") in ("mla", "deepseek_v3"):
        model = load_checkpoint(path, require_mla=True, dtype=getattr(torch, dtype))
        tokenizer = AutoTokenizer.from_pretrained(str(path))
    else:
        src = open_source(spec)
        model = load_source_model(src, getattr(torch, dtype))
        tokenizer = AutoTokenizer.from_pretrained(str(src.path))
    return TorchCompleter(model, tokenizer, spec)


def llamacpp_completer(spec: str, threads: int = 1) -> LlamaCppCompleter:
    """A :class:`LlamaCppCompleter` for ``spec``: a ``.gguf`` file (our ``export --format gguf``, or any GGUF), or a
    source whose weights are a GGUF (a built-in name: its own pinned file).

    Raises:
        UserError: no llama.cpp venv, or ``spec`` is not a GGUF (the message says how to make one).
    """
    from mla_convert.engines.llamacpp.env import find_llamacpp
    from mla_convert.sources.locate import locate_source

    python = find_llamacpp()
    if python is None:
        raise UserError(
            "no llama.cpp venv: run `bash scripts/llamacpp_env.sh` once (it builds llama-cpp-python)"
        )
    kind, path = locate_source(spec)
    if kind == "builtin":
        from mla_convert.sources.checkpoint import open_source

        files = open_source(spec).origin_files
        path = files[0] if files and files[0].suffix == ".gguf" else None
    config = Path(spec) / "config.json"
    if path is not None and path.is_dir() and config.is_file() and any(
        json.loads(config.read_text()).get(f) for f in ("q_bias", "kv_a_bias", "o_bias")
    ):
        raise UserError(
            f"--engine llama.cpp runs a .gguf file, and {spec} is a conversion with attention biases, which no GGUF "
            "holds exactly (docs/export.md): run it with --engine transformers"
        )
    if path is None or path.suffix != ".gguf":
        raise UserError(
            f"--engine llama.cpp runs a .gguf file, and {spec} is not one; export it first "
            f"(`mla-convert export {spec} {str(spec).rstrip('/')}.gguf --format gguf`) and pass the .gguf it writes, "
            "or run it with --engine transformers"
        )
    return LlamaCppCompleter(path, python, threads)
