"""The conversion manifest (``mla_manifest.json``) and its canonical id.

The manifest records what was converted (source files' sha256, tokenizer digest), how (tool version,
every option, RoPE pairs and ranks per layer, calibration documents), what came out (output files'
sha256, reconstruction summary) and the cache schema. The canonical id is the sha256 of the sorted,
compact JSON of the *semantic* fields (everything except timings, host facts and file paths), so two
runs of the same conversion get the same id. Schema: ``manifests/mla_manifest.schema.json``.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from mla_convert.sources.checkpoint import sha256_file

MANIFEST = "mla_manifest.json"
SCHEMA_VERSION = 1
#: Top-level fields that are not part of the canonical id (they vary between identical runs).
NON_SEMANTIC = ("canonical_id", "run", "outputs")


class ManifestError(ValueError):
    """A manifest that does not verify (one line naming the first mismatch)."""


def canonical_id(manifest: dict[str, Any]) -> str:
    """sha256 of the sorted, compact JSON of the manifest without :data:`NON_SEMANTIC` fields."""
    semantic = {k: v for k, v in manifest.items() if k not in NON_SEMANTIC}
    blob = json.dumps(semantic, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(blob.encode()).hexdigest()


def hash_outputs(folder: Path, skip: tuple[str, ...] = (MANIFEST,)) -> dict[str, str]:
    """sha256 of every file in ``folder`` (relative posix path -> hex), excluding ``skip``."""
    return {
        p.relative_to(folder).as_posix(): sha256_file(p)
        for p in sorted(folder.rglob("*"))
        if p.is_file() and p.name not in skip
    }


def write_manifest(folder: Path, manifest: dict[str, Any], hashed_files: list[str]) -> dict[str, Any]:
    """Add output hashes of ``hashed_files`` and the canonical id, write ``folder/mla_manifest.json``."""
    files = hash_outputs(folder)
    manifest["outputs"] = {name: files[name] for name in hashed_files if name in files}
    manifest["schema_version"] = SCHEMA_VERSION
    manifest["canonical_id"] = canonical_id(manifest)
    (folder / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    return manifest


def verify(folder: Path) -> dict[str, Any]:
    """Re-hash the files a manifest lists and recompute its canonical id.

    Returns:
        ``{"canonical_id": ..., "files": n, "uncovered": [...]}`` when everything listed matches;
        ``uncovered`` names the files in ``folder`` (recursively, relative paths, sorted) that the manifest
        does not list, e.g. ``validation.json`` written later by ``validate``: they are not verified.

    Raises:
        ManifestError: missing manifest or file, a changed file, or a canonical id that does not match.
    """
    path = folder / MANIFEST
    if not path.exists():
        raise ManifestError(f"{path} not found; is {folder} an mla-convert output?")
    try:
        manifest = json.loads(path.read_text())
    except ValueError as exc:
        raise ManifestError(f"{path} is not valid JSON ({exc})") from exc
    for name, digest in manifest.get("outputs", {}).items():
        f = folder / name
        if not f.exists():
            raise ManifestError(f"{name} listed in the manifest is missing from {folder}")
        if sha256_file(f) != digest:
            raise ManifestError(
                f"{name} in {folder} does not match its sha256 in the manifest (changed after writing)"
            )
    cid = canonical_id(manifest)
    if cid != manifest.get("canonical_id"):
        raise ManifestError(
            f"canonical id mismatch in {path}: recorded {manifest.get('canonical_id')}, recomputed {cid}"
        )
    listed = set(manifest.get("outputs", {})) | {MANIFEST}
    uncovered = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())
    return {
        "canonical_id": cid,
        "files": len(manifest.get("outputs", {})),
        "uncovered": [n for n in uncovered if n not in listed],
    }
