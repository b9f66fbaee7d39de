"""The manifest of an output folder (``mla_manifest.json``), its addenda and its canonical id.

The manifest records what was converted (source files' sha256, tokenizer digest), how (tool version,
every option, RoPE pairs and ranks per layer, calibration documents), what came out (output files'
sha256, reconstruction summary) and the cache schema; an adapted checkpoint's manifest adds its parent's
canonical id and the adaptation. The canonical id is the sha256 of the sorted, compact JSON of the
*semantic* fields (everything except timings, host facts and file paths), so two runs of the same
conversion get the same id. A conversion's manifest is built here (:func:`conversion_manifest`), an
adaptation's in :mod:`mla_convert.adapt.manifest`; both are written by :func:`write_manifest`.

Files a later stage adds to a finished folder (``validate``: ``validation.json``/``.md``) are written
by :func:`write_addendum` and recorded in ``mla_manifest.addenda.json``: one entry per stage run with
the time, the tool version and each file's sha256, chained to the manifest's canonical id (each entry's
``previous`` is the digest of the one before), so :func:`verify` covers them and an edited entry shows.

Schemas (shipped in this package): ``mla_manifest.schema.json``, ``mla_manifest.addenda.schema.json``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime, timezone
from functools import cache
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from mla_convert.errors import UserError
from mla_convert.files import atomic_write_bytes, atomic_write_text, sha256_file, sha256_text

if TYPE_CHECKING:
    from mla_convert.metrics import EvalResult
    from mla_convert.mla.configuration import MLAConfig
    from mla_convert.sources.checkpoint import SourceModel

__all__ = [
    "ADDENDA",
    "MANIFEST",
    "ManifestError",
    "ManifestMismatch",
    "canonical_id",
    "conversion_manifest",
    "origin_name",
    "sha256_file",
    "verify",
    "write_addendum",
    "write_manifest",
]

MANIFEST = "mla_manifest.json"
ADDENDA = "mla_manifest.addenda.json"
SCHEMA = "mla_manifest.schema.json"
ADDENDA_SCHEMA = "mla_manifest.addenda.schema.json"
SCHEMA_VERSION = 1
#: Top-level fields that are not part of the canonical id: what varies between identical runs (timings, host facts,
#: the outputs' paths) and ``weights``, the weights ledger, a function of the source (its files' sha256) and of the
#: options, ranks and RoPE split, all under the id (so a change of the ledger's wording keeps a conversion's id).
NON_SEMANTIC = ("canonical_id", "run", "outputs", "weights")


class ManifestError(UserError):
    """A manifest that does not verify (one line naming the first mismatch)."""


class ManifestMismatch(ManifestError):
    """Verification found a difference: a changed or missing file, a wrong canonical id, a broken addenda
    chain: the folder was checked and is not what its manifest says."""


# ---------------------------------------------------------------------------------------------- build

#: Options added after the pinned reference manifest, with their off value: recorded only when set, so a conversion
#: that does not use them keeps the canonical id an earlier version gave it.
ADDED_OPTIONS: dict[str, Any] = {"reconstruct_steps": 0, "calib_data": None}


def recorded_options(dump: dict[str, Any]) -> dict[str, Any]:
    """The options a manifest records: every field, less each of :data:`ADDED_OPTIONS` at its off value."""
    return {k: v for k, v in dump.items() if k not in ADDED_OPTIONS or v not in (ADDED_OPTIONS[k], None)}



class ConversionOptions(Protocol):
    """What a conversion's manifest reads of its options (a :class:`~mla_convert.convert.options.options.ConvertOptions`)."""

    @property
    def rope_mode(self) -> str:
        """How RoPE is kept (recorded under ``rope``)."""
        ...

    def model_dump(self) -> dict[str, Any]:
        """Every option, recorded in full."""
        ...


class ConversionRecord(Protocol):
    """What a conversion's manifest reads of the conversion (a :class:`~mla_convert.convert.pipeline.records.Streamed`)."""

    @property
    def config(self) -> MLAConfig:
        """The converted model's config."""
        ...

    @property
    def layers(self) -> Sequence[Any]:
        """Per-layer records (``rope_pairs``, ``attn_rel_error``)."""
        ...

    @property
    def calib_tokens(self) -> int:
        """Calibration tokens."""
        ...
def tool_record() -> dict[str, str]:
    """``{"name": "mla-convert", "version": <installed version>}``."""
    from mla_convert import __version__

    return {"name": "mla-convert", "version": __version__}


def origin_name(origin: str) -> str:
    """How a manifest records a source: a built-in name as given, an existing path by its last component."""
    return origin if not Path(origin).exists() else Path(origin).name


def conversion_manifest(
    src: SourceModel,
    options: ConversionOptions,
    conv: ConversionRecord,
    ev: EvalResult,
    text_name: str,
    documents: Mapping[str, list[dict[str, Any]]],
    run: dict[str, Any],
    choices: Mapping[str, str] | None = None,
    weights: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The manifest of a ``factor`` output, before :func:`write_manifest` adds outputs and the id.

    Args:
        src: the opened source (its files are hashed here).
        options: the conversion options (recorded in full).
        conv: the conversion (per-layer records, MLA config, calibration token count).
        ev: held-out evaluation of the converted model against the source.
        text_name: the calibration text (``wikipedia``, ``news`` or ``local files``).
        documents: ``{"calibration": [...], "evaluation": [...]}`` document records (id, sha256, chars).
        run: timings and host facts (not part of the canonical id).
        choices: where each chosen option came from (:attr:`~mla_convert.convert.options.resolve.Resolution.choices`).
        weights: the weights ledger (:meth:`~mla_convert.convert.estimate.weights.WeightsLedger.as_dict`): parameters
            and bytes of the converted attention and model against the source's per place it is stored, and the
            break-even in cached tokens (not part of the canonical id: :data:`NON_SEMANTIC`).
    """
    from mla_convert.sources.checkpoint import tokenizer_digest

    cfg = conv.config
    return {
        "tool": tool_record(),
        "source": {
            "origin": origin_name(src.origin),
            "family": src.family.name,
            "files": [{"name": f.name, "sha256": sha256_file(f)} for f in src.origin_files],
            "tokenizer_sha256": tokenizer_digest(src),
        },
        "options": recorded_options(options.model_dump()),
        "choices": dict(choices or {}),
        "rope": {
            "mode": options.rope_mode,
            "pairs": [r.rope_pairs for r in conv.layers],
            "inv_freq": cfg.rope_inv_freq,
        },
        "ranks": cfg.kv_lora_rank,
        "calibration": {
            "text": text_name,
            "documents": documents["calibration"],
            "tokens": conv.calib_tokens,
        },
        "evaluation": {"documents": documents["evaluation"]},
        "reconstruction": {
            "perplexity_source": round(ev.reference_perplexity or 0.0, 4),
            "perplexity": round(ev.perplexity, 4),
            "kl": round(ev.kl or 0.0, 5),
            "top1": round(ev.top1 or 0.0, 4),
            "mean_attn_rel_error": round(
                sum(r.attn_rel_error or 0 for r in conv.layers) / len(conv.layers), 5
            ),
            **_refit_record(cfg.source.get("o_proj_refit")),
            **_fitted_record(conv.layers),
        },
        "cache_schema": {
            "row_layout": ["c_kv", "k_rope"],
            "kv_lora_rank": cfg.kv_lora_rank,
            "rope_width": cfg.num_rope_heads * cfg.qk_rope_head_dim,
            "num_rope_heads": cfg.num_rope_heads,
            "qk_rope_head_dim": cfg.qk_rope_head_dim,
            "rope_layout": "rotate_half within each rope head; k_rope cached already rotated at its absolute position",
            "dtype": getattr(conv, "dtype", "float32"),
            "values_per_token_per_layer": cfg.cache_width,
            "softmax_scale": cfg.softmax_scale,
        },
        **({"weights": dict(weights)} if weights is not None else {}),
        "run": run,
    }


def _fitted_record(layers: Sequence[Any]) -> dict[str, Any]:
    """The fitted reconstruction's decisions for the manifest: steps, lossy layers fitted, layers that kept their
    fit, and the mean held-out relative attention error before and after (the closed form's where a fit was
    dropped); empty where it did not run, so a conversion without it keeps the canonical id it had before the step
    existed."""
    fits = [r.reconstruct for r in layers if getattr(r, "reconstruct", None)]
    if not fits:
        return {}
    return {
        "fitted": {
            "steps": fits[0]["steps"],
            "layers_fitted": len(fits),
            "layers_kept": sum(bool(f["kept"]) for f in fits),
            "mean_before": round(sum(f["before"] for f in fits) / len(fits), 5),
            "mean_after": round(sum(f["after"] for f in fits) / len(fits), 5),
        }
    }


def _refit_record(refit: dict[str, Any] | None) -> dict[str, Any]:
    """The o_proj refit's decision for the manifest: kept or not, mean held-out loss (nats) before/after and
    its spread over the held-out windows (min and max of after - before); empty without a refit."""
    if not refit or refit.get("loss_before") is None:
        return {}
    deltas = [a - b for a, b in zip(refit["window_losses_after"], refit["window_losses_before"], strict=True)]
    return {
        "o_proj_refit": {
            "kept": refit["kept"],
            "held_out_windows": len(deltas),
            "loss_before": round(refit["loss_before"], 5),
            "loss_after": round(refit["loss_after"], 5),
            "delta_min": round(min(deltas), 5),
            "delta_max": round(max(deltas), 5),
        }
    }


# ---------------------------------------------------------------------------------------------- write
def _compact(data: Any) -> str:
    """Sorted, compact, ASCII JSON: the bytes the canonical id and addendum digests are taken over."""
    return json.dumps(data, sort_keys=True, separators=(",", ":"), ensure_ascii=True)


def canonical_id(manifest: dict[str, Any]) -> str:
    """sha256 of the sorted, compact JSON of the manifest without :data:`NON_SEMANTIC` fields."""
    return sha256_text(_compact({k: v for k, v in manifest.items() if k not in NON_SEMANTIC}))


def write_manifest(folder: Path, manifest: dict[str, Any], hashed_files: list[str]) -> dict[str, Any]:
    """Add the sha256 of ``hashed_files`` (names relative to ``folder``; missing ones are left out), the
    schema version and the canonical id to ``manifest`` (in place), and write ``folder/mla_manifest.json``.

    Returns:
        The completed manifest.

    Raises:
        OSError: a file cannot be read or the manifest cannot be written.
    """
    manifest["outputs"] = {
        n: sha256_file(folder / n)
        for n in hashed_files
        if n not in (MANIFEST, ADDENDA) and (folder / n).is_file()
    }
    manifest["schema_version"] = SCHEMA_VERSION
    manifest["canonical_id"] = canonical_id(manifest)
    atomic_write_text(folder / MANIFEST, json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    return manifest


def _entry_digest(entry: Mapping[str, Any]) -> str:
    """sha256 of an addendum entry's compact JSON without its ``digest``."""
    return sha256_text(_compact({k: v for k, v in entry.items() if k != "digest"}))


def write_addendum(folder: Path, stage: str, files: Mapping[str, str | bytes]) -> dict[str, Any] | None:
    """Write files that ``stage`` adds to a finished output folder, and record them in its addenda.

    Each file is written atomically (text as UTF-8). When ``folder`` holds a manifest with a canonical
    id, an entry ``{stage, time (UTC ISO 8601), tool, files: name -> sha256, previous, digest}`` is
    appended to ``folder/mla_manifest.addenda.json`` (also atomically), ``previous`` being the digest of
    the last entry, or the manifest's canonical id for the first one.

    Args:
        folder: the output folder (e.g. a converted checkpoint).
        stage: what adds the files, e.g. ``"validation"``.
        files: file name (relative to ``folder``) -> content.

    Returns:
        The new entry, or None when ``folder`` has no readable manifest (the files are written, unrecorded).

    Raises:
        ManifestError: a name is the manifest's, its addenda's, or a file the manifest covers; or the
            existing addenda do not read (checked before anything is written).
        OSError: a file cannot be written.
    """
    manifest = _read_json(folder / MANIFEST)
    outputs = manifest.get("outputs", {}) if isinstance(manifest, dict) else {}
    for name in files:
        if name in (MANIFEST, ADDENDA) or name in outputs:
            raise ManifestError(
                f"{stage} would replace {name} in {folder}, which the manifest covers; write it elsewhere"
            )
    cid = manifest.get("canonical_id") if isinstance(manifest, dict) else None
    addenda = _read_addenda(folder) if isinstance(cid, str) else []
    for name, body in files.items():
        atomic_write_bytes(folder / name, body.encode("utf-8") if isinstance(body, str) else body)
    if not isinstance(cid, str):
        return None
    entry: dict[str, Any] = {
        "stage": stage,
        "time": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "tool": tool_record(),
        "files": {name: sha256_file(folder / name) for name in sorted(files)},
        "previous": addenda[-1]["digest"] if addenda else cid,
    }
    entry["digest"] = _entry_digest(entry)
    record = {"schema_version": SCHEMA_VERSION, "addenda": [*addenda, entry]}
    atomic_write_text(folder / ADDENDA, json.dumps(record, indent=2, sort_keys=True) + "\n")
    return entry


# --------------------------------------------------------------------------------------------- verify
@cache
def _validator(name: str) -> Any:
    """A jsonschema validator for the schema file ``name`` shipped in this package."""
    import jsonschema

    schema = json.loads(resources.files(__package__).joinpath(name).read_text(encoding="utf-8"))
    return jsonschema.Draft202012Validator(schema)


def check_schema(
    data: Any, schema: str, where: Path, fix: str = "write the folder again with mla-convert"
) -> None:
    """Validate ``data`` (read from ``where``) against the packaged schema file ``schema``; ``fix`` ends
    the message.

    Raises:
        ManifestError: naming the first offending field (JSON path) and what is wrong with it.
    """
    import jsonschema

    err = jsonschema.exceptions.best_match(_validator(schema).iter_errors(data))
    if err is None:
        return
    field = err.json_path if err.path else "top level"
    message = " ".join(err.message.split())
    if len(message) > 160:
        message = message[:157] + "..."
    raise ManifestError(f"{where} does not match {schema} at {field}: {message}; {fix}")


def _read_json(path: Path) -> Any:
    """Parsed JSON of ``path``, or None when it is missing or not JSON."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def _read_addenda(folder: Path) -> list[dict[str, Any]]:
    """The addenda entries of ``folder`` ([] without an addenda file), schema-checked.

    Raises:
        ManifestError: the file is not JSON or does not match its schema.
    """
    path = folder / ADDENDA
    if not path.exists():
        return []
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ManifestError(
            f"{path} is not valid JSON ({exc}); restore it, or delete it and the files it lists"
        ) from exc
    check_schema(data, ADDENDA_SCHEMA, path, "restore it, or delete it and the files it lists")
    return list(data["addenda"])


def _addenda_files(folder: Path, cid: str) -> tuple[dict[str, tuple[str, str]], list[dict[str, Any]]]:
    """Check the addenda chain of ``folder`` against the manifest's canonical id ``cid``.

    Returns:
        (file name -> (sha256, which addendum) as recorded last; one ``{stage, time, files}`` per entry).

    Raises:
        ManifestError: an entry changed after writing or not chained to this manifest.
    """
    latest: dict[str, tuple[str, str]] = {}
    summary = []
    previous = cid
    for i, entry in enumerate(_read_addenda(folder)):
        where = f"{folder / ADDENDA} entry {i} ({entry['stage']})"
        if entry["previous"] != previous:
            what = "this manifest's canonical id" if i == 0 else "the entry before it"
            raise ManifestMismatch(f"{where} does not chain to {what} (edited, or written for another manifest)")
        if _entry_digest(entry) != entry["digest"]:
            raise ManifestMismatch(f"{where} does not match its digest (changed after writing)")
        previous = entry["digest"]
        by = f"{entry['stage']} addendum of the manifest"
        latest.update({name: (digest, by) for name, digest in entry["files"].items()})
        summary.append({"stage": entry["stage"], "time": entry["time"], "files": len(entry["files"])})
    return latest, summary


def _check_files(folder: Path, expected: Mapping[str, tuple[str, str]]) -> None:
    """Re-hash ``folder/name`` for each ``name -> (sha256, record that lists it)``.

    Raises:
        ManifestError: the first missing or changed file, naming the record that lists it.
    """
    for name, (digest, by) in expected.items():
        f = folder / name
        if not f.is_file():
            raise ManifestMismatch(f"{name} listed in the {by} is missing from {folder}")
        if sha256_file(f) != digest:
            raise ManifestMismatch(
                f"{name} in {folder} does not match its sha256 in the {by} (changed after writing)"
            )


def verify(folder: Path) -> dict[str, Any]:
    """Check a manifest against its schema, re-hash the files it and its addenda list, recompute its
    canonical id and check the addenda chain.

    Returns:
        ``{"canonical_id": ..., "files": n, "uncovered": [...], "addenda": [...]}`` when everything
        matches: ``files`` counts the files verified (manifest outputs and addenda files), ``uncovered``
        names the files in ``folder`` (recursively, relative paths, sorted) that neither covers (they are
        not verified), ``addenda`` has one ``{stage, time, files}`` per addendum.

    Raises:
        ManifestError: missing or malformed manifest, a schema violation, a missing or changed file, a
            canonical id that does not match, or addenda that were edited or belong to another manifest.
    """
    path = folder / MANIFEST
    if not path.exists():
        raise ManifestError(f"{path} not found; is {folder} an mla-convert output?")
    try:
        manifest = json.loads(path.read_text())
    except ValueError as exc:
        raise ManifestError(f"{path} is not valid JSON ({exc})") from exc
    check_schema(manifest, SCHEMA, path)
    outputs: dict[str, str] = manifest["outputs"]
    _check_files(folder, {name: (digest, "manifest") for name, digest in outputs.items()})
    cid = canonical_id(manifest)
    if cid != manifest["canonical_id"]:
        raise ManifestMismatch(
            f"canonical id mismatch in {path}: recorded {manifest['canonical_id']}, recomputed {cid}"
        )
    added, summary = _addenda_files(folder, cid)
    _check_files(folder, added)
    covered = set(outputs) | set(added)
    listed = covered | {MANIFEST, ADDENDA}
    present = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())
    return {
        "canonical_id": cid,
        "files": len(covered),
        "uncovered": [n for n in present if n not in listed],
        "addenda": summary,
    }
