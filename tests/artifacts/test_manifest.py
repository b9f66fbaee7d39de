"""The manifest, its schema and its addenda, on small temporary folders (no model).

``manifest verify`` checks the manifest against the packaged schema, re-hashes what the manifest and its
addenda (files ``validate`` adds later) list, checks the addenda chain, and names files neither covers.
"""

from __future__ import annotations

import importlib.metadata
import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from mla_convert.artifacts.manifest import (
    ADDENDA,
    MANIFEST,
    ManifestError,
    canonical_id,
    check_schema,
    verify,
    write_addendum,
    write_manifest,
)
from mla_convert.cli.commands import app
from mla_convert.files import atomic_write_bytes, atomic_write_text, sha256_bytes, sha256_file, sha256_text

PINNED = Path(__file__).resolve().parents[2] / "manifests" / "smollm2-135m-reference.json"
VALIDATION = {"validation.json": '{"passed": true}\n', "validation.md": "# Validation: PASSED\n"}


def flat(text: str) -> str:
    """CLI output with whitespace collapsed (rich wraps at 80 columns off-terminal)."""
    return " ".join(text.split())


@pytest.fixture
def out(tmp_path: Path) -> Path:
    """A fake output folder: two files and a manifest covering both."""
    folder = tmp_path / "out"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(bytes(range(256)) * 4)
    (folder / "config.json").write_text('{"model_type": "mla"}\n')
    write_manifest(
        folder, {"tool": {"name": "mla-convert", "version": "0.1.0"}}, ["config.json", "model.safetensors"]
    )
    return folder


def test_hash_helpers_agree(tmp_path: Path) -> None:
    f = tmp_path / "f.bin"
    f.write_bytes("déjà vu".encode())
    assert sha256_file(f, chunk_bytes=3) == sha256_bytes(f.read_bytes()) == sha256_text("déjà vu")


def test_atomic_writers_replace_whole_files_and_leave_no_temporaries(tmp_path: Path) -> None:
    target = tmp_path / "sub" / "a.txt"
    atomic_write_text(target, "first\n")
    atomic_write_bytes(target, b"second\n")
    assert target.read_bytes() == b"second\n"
    assert sorted(p.name for p in target.parent.iterdir()) == ["a.txt"]
    assert target.stat().st_mode & 0o777 == 0o644
    (tmp_path / "dir").mkdir()
    (tmp_path / "dir" / "x").write_text("x")
    with pytest.raises(OSError):  # a folder in the way: nothing replaced, no temporary left
        atomic_write_text(tmp_path / "dir", "y")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dir", "sub"]


def test_version_comes_from_the_installed_distribution() -> None:
    import mla_convert

    assert mla_convert.__version__ == importlib.metadata.version("mla-convert")


def test_pinned_reference_manifest_matches_the_packaged_schema() -> None:
    pinned = json.loads(PINNED.read_text())
    check_schema(pinned, "mla_manifest.schema.json", PINNED)
    assert canonical_id(pinned) == pinned["canonical_id"]


def test_adaptation_manifest_of_the_reference_verifies(tmp_path: Path) -> None:
    """The adapt builder on the pinned reference as parent: schema-valid, its own id, the parent's named."""
    from mla_convert.adapt.manifest import adaptation_manifest
    from mla_convert.adapt.options import AdaptOptions

    ckpt = tmp_path / "smollm2-mla"
    ckpt.mkdir()
    (ckpt / MANIFEST).write_text(PINNED.read_text())
    evaluation = {"perplexity": 20.0, "kl": 0.1, "source_perplexity": 18.0}
    report = {"steps": 3, "tokens_trained": 6144, "processes": 1, "before": evaluation, "after": evaluation}
    manifest = adaptation_manifest(
        ckpt, AdaptOptions(), report, "smollm2-135m", {"train_sha256": "0" * 64}, {"trainable": 1}, ".w", {}
    )
    out = tmp_path / "adapted"
    out.mkdir()
    (out / "config.json").write_text("{}")
    written = write_manifest(out, manifest, ["config.json"])
    pinned = json.loads(PINNED.read_text())
    assert written["parent"] == {"canonical_id": pinned["canonical_id"], "checkpoint": "smollm2-mla"}
    assert written["source"] == pinned["source"] and written["adaptation"]["schedule"]["steps"] == 3
    assert verify(out)["canonical_id"] == written["canonical_id"] != pinned["canonical_id"]


# --------------------------------------------------------------------------------------------- schema
def test_schema_violation_is_named(out: Path) -> None:
    m = json.loads((out / MANIFEST).read_text())
    m["tool"]["name"] = "other-tool"
    m["canonical_id"] = canonical_id(m)
    (out / MANIFEST).write_text(json.dumps(m))
    with pytest.raises(ManifestError, match=r"does not match mla_manifest.schema.json at \$.tool.name: "):
        verify(out)


def test_conversion_manifest_must_be_complete(out: Path) -> None:
    """A manifest with a cache schema is a conversion manifest: every conversion field is required."""
    m = json.loads((out / MANIFEST).read_text())
    m["cache_schema"] = {"row_layout": ["c_kv", "k_rope"]}
    m["canonical_id"] = canonical_id(m)
    (out / MANIFEST).write_text(json.dumps(m))
    with pytest.raises(
        ManifestError, match=r"mla_manifest.schema.json at (top level|\$.cache_schema): .*required"
    ):
        verify(out)


def test_bad_output_hash_is_a_schema_error(out: Path) -> None:
    m = json.loads((out / MANIFEST).read_text())
    m["outputs"]["config.json"] = "not-a-hash"
    (out / MANIFEST).write_text(json.dumps(m))
    with pytest.raises(ManifestError, match=r"at \$.outputs\['?config.json'?\]|at \$.outputs.config.json"):
        verify(out)


# -------------------------------------------------------------------------------------------- addenda
def test_addendum_covers_validation_files(out: Path) -> None:
    cid = verify(out)["canonical_id"]
    entry = write_addendum(out, "validation", VALIDATION)
    assert entry is not None and entry["previous"] == cid and entry["stage"] == "validation"
    assert entry["files"] == {n: sha256_text(t) for n, t in VALIDATION.items()}
    assert entry["tool"]["version"] == importlib.metadata.version("mla-convert")
    res = verify(out)
    assert res["canonical_id"] == cid and res["files"] == 4 and res["uncovered"] == []
    assert [(a["stage"], a["files"]) for a in res["addenda"]] == [("validation", 2)]
    cli = CliRunner().invoke(app, ["manifest", "verify", str(out)])
    assert cli.exit_code == 0, cli.output
    assert f"ok: 4 files match; canonical id {cid}" in flat(cli.stdout)
    assert "addenda (chained to the manifest): validation (2 files," in flat(cli.stdout)
    assert "not covered" not in cli.stdout


def test_second_validation_chains_and_replaces_the_hashes(out: Path) -> None:
    first = write_addendum(out, "validation", VALIDATION)
    second = write_addendum(out, "validation", {**VALIDATION, "validation.md": "# Validation: FAILED\n"})
    assert first is not None and second is not None and second["previous"] == first["digest"]
    res = verify(out)
    assert res["files"] == 4 and [a["stage"] for a in res["addenda"]] == ["validation", "validation"]


def test_changed_validation_file_fails_verify(out: Path) -> None:
    write_addendum(out, "validation", VALIDATION)
    (out / "validation.json").write_text('{"passed": false}\n')
    with pytest.raises(
        ManifestError,
        match="validation.json in .* does not match its sha256 in the validation addendum of the manifest",
    ):
        verify(out)
    (out / "validation.json").unlink()
    with pytest.raises(
        ManifestError, match="validation.json listed in the validation addendum .* is missing"
    ):
        verify(out)


def test_edited_addendum_fails_verify(out: Path) -> None:
    write_addendum(out, "validation", VALIDATION)
    record = json.loads((out / ADDENDA).read_text())
    record["addenda"][0]["time"] = "2000-01-01T00:00:00+00:00"
    (out / ADDENDA).write_text(json.dumps(record))
    with pytest.raises(ManifestError, match=r"entry 0 \(validation\) does not match its digest"):
        verify(out)


def test_addenda_of_another_manifest_fail_verify(out: Path) -> None:
    write_addendum(out, "validation", VALIDATION)
    write_manifest(
        out, {"tool": {"name": "mla-convert", "version": "9.9"}}, ["config.json", "model.safetensors"]
    )
    with pytest.raises(
        ManifestError, match=r"entry 0 \(validation\) does not chain to this manifest's canonical id"
    ):
        verify(out)


def test_addendum_may_not_replace_covered_files(out: Path) -> None:
    before = (out / "config.json").read_bytes()
    with pytest.raises(
        ManifestError, match="validation would replace config.json .* which the manifest covers"
    ):
        write_addendum(out, "validation", {"config.json": "{}"})
    assert (out / "config.json").read_bytes() == before and not (out / ADDENDA).exists()


def test_addendum_without_manifest_writes_unrecorded(tmp_path: Path) -> None:
    assert write_addendum(tmp_path, "validation", VALIDATION) is None
    assert sorted(p.name for p in tmp_path.iterdir()) == ["validation.json", "validation.md"]


def test_write_validation_records_an_addendum(out: Path) -> None:
    from mla_convert.validate.ladder import Check, Rung, ValidationResult, write_validation

    rung = Rung(1, "naive-vs-absorbed", "fake", [Check("x", 0.0, "<= 1e-05", True)])
    env = {"kernel_backend": "fake", "triton": "-", "torch": "-"}
    res = ValidationResult(str(out), [rung], {}, env)
    write_validation(out, res)
    assert json.loads((out / "validation.json").read_text())["passed"] is True
    checked = verify(out)
    assert checked["files"] == 4 and checked["uncovered"] == []


# ------------------------------------------------------------------------------------------- uncovered
def test_stray_file_is_listed_as_uncovered(out: Path) -> None:
    write_addendum(out, "validation", VALIDATION)
    (out / "notes.txt").write_text("added by hand\n")
    (out / "extra").mkdir()
    (out / "extra" / "a.bin").write_bytes(b"\0")
    assert verify(out)["uncovered"] == ["extra/a.bin", "notes.txt"]
    cli = CliRunner().invoke(app, ["manifest", "verify", str(out)])
    assert cli.exit_code == 0, cli.output
    assert "not covered by the manifest (not verified): extra/a.bin, notes.txt" in flat(cli.stdout)


def test_verify_exit_codes(out: Path) -> None:
    """0 verified (uncovered files named); 2 with one error: line on a difference (a changed file; uncovered
    files with --strict) or without a manifest."""
    runner = CliRunner()
    assert runner.invoke(app, ["manifest", "verify", str(out), "--strict"]).exit_code == 0
    (out / "notes.txt").write_text("added by hand\n")
    assert runner.invoke(app, ["manifest", "verify", str(out)]).exit_code == 0
    strict = runner.invoke(app, ["manifest", "verify", str(out), "--strict"])
    assert strict.exit_code == 2 and "not covered by the manifest (--strict)" in flat(strict.stderr)
    (out / "notes.txt").unlink()
    first = sorted(p for p in out.iterdir() if p.name != MANIFEST)[0]
    first.write_bytes(first.read_bytes() + b"!")
    changed = runner.invoke(app, ["manifest", "verify", str(out)])
    assert changed.exit_code == 2 and "changed after writing" in flat(changed.stderr)
    assert runner.invoke(app, ["manifest", "verify", str(out / "nothing")]).exit_code == 2
