"""Random-weight source checkpoints of real model shapes for ``benchmarks/scale.py``, made in bounded memory.

Each shape becomes a Hugging Face folder as a hub download looks: ``config.json`` (``dtype`` and
``torch_dtype`` bfloat16), sharded bfloat16 ``*.safetensors`` with ``model.safetensors.index.json``,
``generation_config.json`` and the bundled SmolLM2 tokenizer files (the models' vocabularies may be larger
than the tokenizer's; conversion only feeds token ids the tokenizer makes).

Memory stays bounded: the tensor list comes from the transformers model built on the ``meta`` device (no
storage), tensors are drawn one at a time from a generator seeded by ``(seed, tensor name)`` and each shard
is written with ``safetensors.torch.save_file`` (which writes from the tensors' memory, no copy) and freed
before the next, so the peak is about one shard (total / shards) above the interpreter. Each shard is
written to a temporary name and renamed, so an interrupted run keeps the shards it finished; the marker
file :data:`MARKER` is written last and makes a folder complete.

Init: normal(0, 0.02) for matrices, embeddings and biases, 1.0 for RMSNorm weights, so hidden states stay
finite through 32 layers (:func:`forward_check` runs the model layer by layer to show it).
"""

from __future__ import annotations

import json
import math
import os
import resource
import shutil
import time
import zlib
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
#: Written last into a generated folder: the shape it was made from and how long it took.
MARKER = ".scale-complete.json"
#: Tokenizer files copied from the bundled SmolLM2 folder (those that exist there).
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
)
INIT_STD = 0.02
GB = 1e9


@dataclass(frozen=True)
class Shape:
    """A decoder-only shape to generate (transformers config fields, plus file layout).

    Attributes:
        model_type: ``llama`` or ``qwen2`` (transformers config class).
        description: one line for tables, e.g. the model whose shape this is.
        shards: number of ``*.safetensors`` files (about total / shards bytes each).
        seed: base seed; each tensor's generator is seeded with ``(seed, crc32(name))``.
        config: keyword arguments of the config class (``rope_parameters`` in transformers 5 form).
    """

    model_type: str
    description: str
    shards: int
    config: dict[str, Any] = field(default_factory=dict)
    seed: int = 0

    @property
    def num_layers(self) -> int:
        return int(self.config["num_hidden_layers"])

    def summary(self) -> str:
        """``32 L, d 4096, 32/8 heads x 128, ff 14336, vocab 128256`` (for tables)."""
        c = self.config
        hd = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
        return (
            f"{c['num_hidden_layers']} L, d {c['hidden_size']}, {c['num_attention_heads']}/"
            f"{c['num_key_value_heads']} heads x {hd}, ff {c['intermediate_size']}, vocab {c['vocab_size']}"
        )


#: Token ids of the bundled SmolLM2 tokenizer (``<|im_start|>`` = 1, ``<|im_end|>`` = 2).
_TOKEN_IDS = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2}

#: Llama-3.1-8B's config (random weights of these shapes).
_LLAMA8B: dict[str, Any] = {
    "num_hidden_layers": 32,
    "hidden_size": 4096,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "intermediate_size": 14336,
    "vocab_size": 128256,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5,
    "rope_parameters": {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
    "tie_word_embeddings": False,
    **_TOKEN_IDS,
}

SHAPES: dict[str, Shape] = {
    "llama8b": Shape(
        "llama",
        "Llama-3.1-8B",
        shards=4,
        config=_LLAMA8B,
    ),
    # Llama-3.1-8B's shapes with 2 of its 32 layers: the per-layer cost of a conversion at its default options (16,384
    # calibration tokens, the search) measured in well under the hours the whole model takes (issue 51, item 4)
    "llama8b-2l": Shape(
        "llama",
        "Llama-3.1-8B, 2 of 32 layers",
        shards=1,
        config={**_LLAMA8B, "num_hidden_layers": 2},
    ),
    "qwen05b": Shape(
        "qwen2",
        "Qwen2-0.5B",
        shards=2,
        config={
            "num_hidden_layers": 24,
            "hidden_size": 896,
            "num_attention_heads": 14,
            "num_key_value_heads": 2,
            "intermediate_size": 4864,
            "vocab_size": 151936,
            "max_position_embeddings": 131072,
            "rms_norm_eps": 1e-6,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
            "tie_word_embeddings": True,
            "use_sliding_window": False,
            **_TOKEN_IDS,
        },
    ),
    # For testing this script in seconds: SmolLM2's vocabulary, 2 layers, 2 shards, SmolLM2's head_dim.
    "tiny": Shape(
        "llama",
        "script test",
        shards=2,
        config={
            "num_hidden_layers": 2,
            "hidden_size": 128,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 64,  # 32 RoPE pairs: factor's default options apply
            "intermediate_size": 256,
            "vocab_size": 49152,
            "max_position_embeddings": 2048,
            "rms_norm_eps": 1e-5,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
            "tie_word_embeddings": True,
            **_TOKEN_IDS,
        },
    ),
}


def cache_root() -> Path:
    """``$MLA_SCALE_CACHE`` or ``benchmarks/results/scale-cache``."""
    env = os.environ.get("MLA_SCALE_CACHE")
    return Path(env) if env else ROOT / "benchmarks" / "results" / "scale-cache"


def make_config(shape: Shape) -> Any:
    """The transformers config of ``shape`` (bfloat16, ``architectures`` set)."""
    from transformers import AutoConfig

    arch = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}[shape.model_type]
    return AutoConfig.for_model(shape.model_type, architectures=[arch], dtype="bfloat16", **shape.config)


def skeleton(config: Any) -> torch.nn.Module:
    """The causal LM of ``config`` on the ``meta`` device: names, shapes and layer classes, no storage."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def tensor_specs(config: Any) -> dict[str, tuple[int, ...]]:
    """Saved tensor name -> shape, in the order transformers saves them (tied ``lm_head`` left out)."""
    model = skeleton(config)
    return {name: tuple(p.shape) for name, p in model.named_parameters()}  # shared parameters once


def plan_shards(specs: dict[str, tuple[int, ...]], shards: int) -> Any:
    """Split ``specs`` (bfloat16) into about ``shards`` files with huggingface_hub's splitter.

    Returns:
        huggingface_hub ``StateDictSplit`` (``filename_to_tensors``, ``tensor_to_filename``, ``metadata``).
    """
    from huggingface_hub import split_torch_state_dict_into_shards

    meta = {n: torch.empty(s, dtype=torch.bfloat16, device="meta") for n, s in specs.items()}
    sizes = [math.prod(s) * 2 for s in specs.values()]
    limit = math.ceil(sum(sizes) / shards)
    while True:  # the splitter fills greedily in order; raise the limit until it makes <= shards files
        split = split_torch_state_dict_into_shards(meta, max_shard_size=limit)
        if len(split.filename_to_tensors) <= shards:
            return split
        limit += max(sizes) // 16


def draw(name: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """One bfloat16 tensor: 1.0 for norm weights, normal(0, 0.02) otherwise, from its own seeded generator."""
    if name.endswith("norm.weight"):
        return torch.ones(shape, dtype=torch.bfloat16)
    gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    return torch.empty(shape, dtype=torch.bfloat16).normal_(0.0, INIT_STD, generator=gen)


def bundled_tokenizer_dir() -> Path:
    """The cached safetensors folder of the bundled SmolLM2-135M (tokenizer files)."""
    from mla_convert.sources.checkpoint import open_source

    return open_source("smollm2-135m").path


def read_marker(folder: Path) -> dict[str, Any] | None:
    """The marker of a complete folder made from the same shape, else None."""
    path = folder / MARKER
    if not path.exists():
        return None
    try:
        marker = json.loads(path.read_text())
    except ValueError:
        return None
    return marker if marker.get("shape") == _shape_record(folder.name) else None


def _shape_record(name: str) -> dict[str, Any]:
    return json.loads(json.dumps(asdict(SHAPES[name])))


def generate(name: str, root: Path | None = None, log: Any = print) -> dict[str, Any]:
    """Make (or finish) the folder of shape ``name`` under ``root`` and return its marker.

    A complete folder (marker of the same shape) is returned as is; shards already renamed into place are
    kept. Peak memory: about one shard plus the interpreter.

    Raises:
        KeyError: unknown shape name.
        SystemExit: when the written folder fails :func:`verify`.
    """
    shape = SHAPES[name]
    folder = (root or cache_root()) / name
    done = read_marker(folder)
    if done is not None:
        return done
    t0 = time.perf_counter()
    folder.mkdir(parents=True, exist_ok=True)
    ignore = folder.parent / ".gitignore"  # the cache never shows up in git (nor travels to a device run)
    if not ignore.exists():
        ignore.write_text("# generated by benchmarks/scale_sources.py\n*\n")
    config = make_config(shape)
    specs = tensor_specs(config)
    split = plan_shards(specs, shape.shards)
    reused = 0
    for i, (file, names) in enumerate(split.filename_to_tensors.items(), 1):
        path = folder / file
        if path.exists() and _layout(path) == {n: specs[n] for n in names}:
            reused += 1
            log(f"  {name}: shard {i}/{len(split.filename_to_tensors)} {file} already written")
            continue
        ts = time.perf_counter()
        tensors = {n: draw(n, specs[n], shape.seed) for n in names}
        tmp = path.with_name(path.name + ".tmp")
        from safetensors.torch import save_file

        save_file(tensors, str(tmp), metadata={"format": "pt"})
        del tensors
        tmp.replace(path)
        log(
            f"  {name}: shard {i}/{len(split.filename_to_tensors)} {file} "
            f"({path.stat().st_size / GB:.2f} GB) in {time.perf_counter() - ts:.0f} s"
        )
    if split.is_sharded:
        index = {"metadata": split.metadata, "weight_map": split.tensor_to_filename}
        (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    config.save_pretrained(str(folder))
    cfg_path = folder / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["torch_dtype"] = "bfloat16"  # what pre-5 transformers wrote; hub checkpoints carry it
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    from transformers import GenerationConfig

    GenerationConfig(**_TOKEN_IDS).save_pretrained(str(folder))
    tok = bundled_tokenizer_dir()
    for n in TOKENIZER_FILES:
        if (tok / n).exists():
            shutil.copy2(tok / n, folder / n)
    verify(name, folder)
    marker = {
        "shape": _shape_record(name),
        "safetensors_bytes": sum(p.stat().st_size for p in folder.glob("*.safetensors")),
        "parameters": sum(math.prod(s) for s in specs.values()),
        "files": len(split.filename_to_tensors),
        "generate_s": time.perf_counter() - t0,
        "shards_reused": reused,
        "written": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    (folder / MARKER).write_text(json.dumps(marker, indent=2) + "\n")
    return marker


def _layout(path: Path) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape of a bfloat16 safetensors file (empty when unreadable or another dtype)."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            slices = {n: f.get_slice(n) for n in f.keys()}
            if any(sl.get_dtype() != "BF16" for sl in slices.values()):
                return {}
            return {n: tuple(sl.get_shape()) for n, sl in slices.items()}
    except Exception:  # noqa: BLE001 - a damaged shard is simply rewritten
        return {}


def verify(name: str, folder: Path) -> None:
    """Check a generated folder without reading weights: AutoConfig loads (bfloat16), the index names every
    tensor of every shard once with the expected shape and bfloat16, ``total_size`` is the tensor bytes,
    and ``mla_convert``'s own source checks (:func:`~mla_convert.sources.checkpoint.open_source`) pass.

    Raises:
        SystemExit: naming the first inconsistency.
    """
    from safetensors import safe_open
    from transformers import AutoConfig

    from mla_convert.sources.checkpoint import open_source

    config = AutoConfig.from_pretrained(str(folder))
    if config.dtype not in (torch.bfloat16, "bfloat16"):
        raise SystemExit(f"error: {folder}/config.json loads with dtype {config.dtype}, expected bfloat16")
    specs = tensor_specs(config)
    index_path = folder / "model.safetensors.index.json"
    if index_path.exists():
        index = json.loads(index_path.read_text())
        wmap: dict[str, str] = index["weight_map"]
        total = int(index["metadata"]["total_size"])
    else:
        wmap = {n: "model.safetensors" for n in specs}
        total = None
    if set(wmap) != set(specs):
        raise SystemExit(f"error: {folder}: index names {sorted(set(wmap) ^ set(specs))[:4]} wrongly")
    nbytes = 0
    for file in sorted(set(wmap.values())):
        with safe_open(str(folder / file), framework="pt") as f:
            keys = set(f.keys())
            want = {n for n, v in wmap.items() if v == file}
            if keys != want:
                raise SystemExit(f"error: {folder / file} holds {sorted(keys ^ want)[:4]} against the index")
            for n in keys:
                sl = f.get_slice(n)
                if tuple(sl.get_shape()) != specs[n] or sl.get_dtype() != "BF16":
                    raise SystemExit(f"error: {folder / file}: {n} is {sl.get_dtype()} {sl.get_shape()}")
                nbytes += math.prod(specs[n]) * 2
    if total is not None and total != nbytes:
        raise SystemExit(f"error: {index_path}: total_size {total} != {nbytes} bytes of tensors")
    open_source(folder)


@torch.no_grad()
def forward_check(folder: Path, tokens: int = 16) -> dict[str, float]:
    """Run the generated model on ``tokens`` random token ids one decoder layer at a time (float32, each
    layer read from the shards, built, run and freed), so memory stays about one layer plus the embedding
    (about 3 GB for the 8B shape: its float32 embedding and ``lm_head``).

    Returns:
        ``{"max_abs_hidden": ..., "logit_std": ...}`` of the final hidden states and last-token logits.

    Raises:
        SystemExit: when the hidden states or logits are not finite.
    """
    from safetensors import safe_open
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(folder))
    config._attn_implementation = "eager"
    skel = skeleton(config)
    inner: Any = skel.model  # type: ignore[attr-defined]  # LlamaModel / Qwen2Model
    index_path = folder / "model.safetensors.index.json"
    if index_path.exists():
        wmap = json.loads(index_path.read_text())["weight_map"]
    else:
        wmap = {n: "model.safetensors" for n, _ in skel.named_parameters()}

    def get(n: str) -> torch.Tensor:
        # open per tensor: a handle kept open keeps every page it read mapped, and counted in RSS
        with safe_open(str(folder / wmap[n]), framework="pt") as f:
            return f.get_tensor(n).float()

    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, int(config.vocab_size), (1, tokens), generator=gen)
    h = torch.nn.functional.embedding(ids, get("model.embed_tokens.weight"))
    pos = torch.arange(tokens)[None]
    rotary = type(inner.rotary_emb)(config=config)
    cos_sin = rotary(h, pos)
    mask = torch.full((tokens, tokens), float("-inf")).triu(1)[None, None]
    for i in range(int(config.num_hidden_layers)):
        layer = type(inner.layers[0])(config, i).float()
        prefix = f"model.layers.{i}."
        layer.load_state_dict({n: get(prefix + n) for n, _ in layer.named_parameters()})
        out = layer(h, attention_mask=mask, position_ids=pos, position_embeddings=cos_sin)
        h = out[0] if isinstance(out, tuple) else out
        del layer
    norm = type(inner.norm)(int(config.hidden_size), eps=float(config.rms_norm_eps))
    norm.load_state_dict({"weight": get("model.norm.weight")})
    head = "model.embed_tokens.weight" if config.tie_word_embeddings else "lm_head.weight"
    logits = norm(h)[:, -1] @ get(head).T
    stats = {"max_abs_hidden": float(h.abs().max()), "logit_std": float(logits.std())}
    if not all(math.isfinite(v) for v in stats.values()):
        raise SystemExit(f"error: {folder}: non-finite activations {stats}")
    return stats


def load_check(folder: Path) -> dict[str, float]:
    """Load the folder with ``AutoModelForCausalLM.from_pretrained`` (bfloat16) and run 8 tokens.

    Returns:
        ``{"parameters": ..., "logit_std": ...}``.

    Raises:
        SystemExit: when the logits are not finite.
    """
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.bfloat16).eval()
    with torch.no_grad():
        logits = model(torch.arange(8)[None] + 100).logits.float()
    if not torch.isfinite(logits).all():
        raise SystemExit(f"error: {folder}: from_pretrained model gives non-finite logits")
    return {"parameters": float(sum(p.numel() for p in model.parameters())), "logit_std": float(logits.std())}


def generate_only(name: str, checks: bool) -> None:
    """Make (or finish) the cached source ``name``, record time and this process's peak RSS in its marker,
    then (``checks``) run it layer by layer and, for models up to 1.5 B parameters, load it with
    ``AutoModelForCausalLM.from_pretrained``."""
    if name not in SHAPES:
        raise SystemExit(f"error: no generated shape {name!r}; choose from {', '.join(SHAPES)}")
    folder = cache_root() / name
    fresh = read_marker(folder) is None
    marker = generate(name, log=lambda s: print(s, flush=True))
    if fresh:
        marker["peak_rss_gb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GB
        (folder / MARKER).write_text(json.dumps(marker, indent=2) + "\n")
    peak = f", peak RSS {marker['peak_rss_gb']:.2f} GB" if "peak_rss_gb" in marker else ""
    print(
        f"{name}: {'generated' if fresh else 'already complete'}: {marker['safetensors_bytes'] / GB:.2f} GB in "
        f"{marker['files']} file(s), {marker['parameters'] / 1e9:.3f} B parameters, "
        f"{marker['generate_s']:.0f} s{peak}; {folder}",
        flush=True,
    )
    if checks:
        t0 = time.perf_counter()
        print(f"{name}: layer-by-layer forward {forward_check(folder)} ({time.perf_counter() - t0:.0f} s)")
        if marker["parameters"] <= 1.5e9:
            print(f"{name}: AutoModelForCausalLM.from_pretrained {load_check(folder)}")
