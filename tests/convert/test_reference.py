"""The README's reference conversion, end to end through the CLI, against its pinned manifest.

``manifests/smollm2-135m-reference.json`` pins the manifest of ``mla-convert factor smollm2-135m OUT --device
cpu`` (default options on the CPU: ``--device`` is a recorded option, and ``auto`` would convert on a GPU where
there is one, so a GPU host reproduces the pin only with ``cpu``). The suite converts it with the levers the
pinned search chose given (``tests/reference_runs.py``: the search left out, the rest the same), and checks that
its manifest, with ``choices`` saying where the levers came from as the search does, has the pinned canonical id
(``MLA_CONVERT_TEST_REFERENCE=out/smollm2-mla`` checks the quick start's searched one as it is). Any change of
output — tensors, options,
RoPE pairs, ranks, calibration documents, reconstruction figures — changes the canonical id and fails here; the
output files are pinned byte for byte, the weights and config per CPU model (``smollm2-135m-reference.bytes.json``:
float kernels round differently on different CPUs). After an intended change, re-pin with ``python tests/convert/test_reference.py --repin``
(on each machine whose bytes are pinned) and say why in the commit.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from mla_convert.artifacts.manifest import NON_SEMANTIC, canonical_id
from mla_convert.cli.commands import app
from mla_convert.kernels import kernel_backend

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from reference_runs import PINNED, as_searched, run_reference  # noqa: E402

#: The float-bearing files' bytes per CPU model (float kernels round differently on different CPUs).
BYTES = Path(__file__).resolve().parents[2] / "manifests" / "smollm2-135m-reference.bytes.json"


def cpu_model() -> str:
    """``model name`` of /proc/cpuinfo and a digest of its ``flags`` line ('' where there is none): the float
    kernels torch dispatches depend on the instruction sets, and a virtual machine's model name alone ("AMD
    EPYC") names several generations that round differently (two such hosts gave other bytes, same id)."""
    import hashlib

    info = Path("/proc/cpuinfo")
    name = flags = ""
    for line in info.read_text().splitlines() if info.exists() else []:
        if line.startswith("model name") and not name:
            name = line.split(":", 1)[1].strip()
        if line.startswith("flags") and not flags:
            flags = " ".join(sorted(line.split(":", 1)[1].split()))
    return f"{name} (flags {hashlib.sha256(flags.encode()).hexdigest()[:12]})" if name else ""


SCHEMA = Path(__file__).resolve().parents[2] / "mla_convert" / "artifacts" / "mla_manifest.schema.json"


@pytest.fixture(scope="module")
def reference(reference_ckpt) -> Path:
    return reference_ckpt


def _diff(a: dict, b: dict, skip: frozenset[str] = frozenset({"run"}), prefix: str = "") -> list[str]:
    """Every leaf where ``a`` (got) and ``b`` (pinned) differ, as ``key: pinned X got Y`` (top-level keys in ``skip``
    left out)."""
    keys = sorted(set(a) | set(b))
    out = []
    for k in keys:
        if not prefix and k in skip:
            continue
        va, vb = a.get(k), b.get(k)
        if isinstance(va, dict) and isinstance(vb, dict):
            out += _diff(va, vb, skip, f"{prefix}{k}.")
        elif va != vb:
            out.append(f"{prefix}{k}: pinned {str(vb)[:80]} got {str(va)[:80]}")
    return out


def _figures_differ_only(a: object, b: object, skip: frozenset[str] = frozenset()) -> bool:
    """Whether ``a`` equals ``b`` with every float within 0.5 % (relative) (keys in ``skip`` ignored at the top)."""
    if isinstance(a, dict) and isinstance(b, dict):
        keys = (set(a) | set(b)) - skip
        return all(k in a and k in b and _figures_differ_only(a[k], b[k]) for k in keys)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_figures_differ_only(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, float) or isinstance(b, float):
        return (
            isinstance(a, (int, float))
            and isinstance(b, (int, float))
            and a == pytest.approx(b, rel=5e-3, abs=1e-4)
        )
    return a == b


def test_reference_manifest_is_pinned(reference):
    written = json.loads((reference / "mla_manifest.json").read_text())
    assert written["canonical_id"] == canonical_id(written)
    got = as_searched(written)  # the levers given (the suite's run): where the pinned search chose them
    pinned = json.loads(PINNED.read_text())
    assert got["options"]["device"] == pinned["options"]["device"] == "cpu"  # reproducible on a GPU host too
    assert got["run"]["device"] == "cpu"
    if (
        cpu_model() in json.loads(BYTES.read_text())["by_cpu"]
        or got["canonical_id"] == pinned["canonical_id"]
    ):
        assert got["canonical_id"] == pinned["canonical_id"], "\n".join(_diff(got, pinned)[:12])
    else:  # another CPU's float kernels (an AMX Xeon: KL 0.6097 vs 0.60993): every figure within 0.5 %, the rest equal
        # the keys the canonical id leaves out (the weights ledger, recorded apart) are not compared either
        keep = frozenset(NON_SEMANTIC)
        assert _figures_differ_only(got, pinned, keep), "\n".join(_diff(got, pinned, keep)[:12])
    # Every output file is hashed; the reports carry timings, and the weights and config (its refit losses)
    # carry the CPU's float rounding: the rest is pinned byte for byte here, those two per CPU below. The model
    # card prints the rounded figures (perplexity 25.792 on an AVX-512 EPYC against the pin's 25.791), so its bytes
    # are pinned exactly where the canonical id is.
    assert set(got["outputs"]) == set(pinned["outputs"])
    floats = set(json.loads(BYTES.read_text())["files"])
    if got["canonical_id"] != pinned["canonical_id"]:
        floats.add("README.md")
    stable = {k: v for k, v in got["outputs"].items() if not k.startswith("report.") and k not in floats}
    assert stable == {
        k: v for k, v in pinned["outputs"].items() if not k.startswith("report.") and k not in floats
    }
    assert {"tokenizer.json", "generation_config.json", "README.md", "report.json"} <= set(got["outputs"])


def test_reference_weights_are_pinned_for_this_cpu(reference):
    pins = json.loads(BYTES.read_text())
    cpu = cpu_model()
    if cpu not in pins["by_cpu"]:
        pytest.skip(
            f"no byte pin for CPU {cpu!r} (pinned: {', '.join(pins['by_cpu'])}); the canonical id is pinned"
        )
    got = json.loads((reference / "mla_manifest.json").read_text())["outputs"]
    assert {k: got[k] for k in pins["files"]} == pins["by_cpu"][cpu]


def test_reference_manifest_matches_schema(reference):
    jsonschema = pytest.importorskip("jsonschema")
    jsonschema.validate(
        json.loads((reference / "mla_manifest.json").read_text()), json.loads(SCHEMA.read_text())
    )


def test_reference_report_and_cli(reference):
    report = json.loads((reference / "report.json").read_text())
    cache = report["model"]["cache"]
    assert cache["converted"]["values_per_token_per_layer"] == pytest.approx(120)
    assert cache["ratio"] == pytest.approx(0.3125)
    assert cache["source"]["values_per_token_per_layer"] == 384
    ev = report["model"]["eval"]
    assert ev["tokens"] == 8 * 511 and 1.0 < ev["perplexity"] / ev["reference_perplexity"] < 10
    assert len(report["layers"]) == 30 and all(r["attn_rel_error"] is not None for r in report["layers"])
    # a CPU conversion leaves the fitted reconstruction off by default, and nothing of it is recorded
    assert all("reconstruct" not in r for r in report["layers"])
    manifest = json.loads((reference / "mla_manifest.json").read_text())
    assert "fitted" not in manifest["reconstruction"] and "reconstruct_steps" not in manifest["choices"]
    assert "reconstruct_steps" not in manifest["options"]
    # the default calibration mixture: the 16384-token budget as 32 windows drawn across the calibration splits of
    # Wikipedia (18 articles), its chat-templated conversations (80) and gensim's code (10 files), one share each
    text = report["text"]
    assert text["name"] == "wikipedia + wikipedia-chat + code" and text["calibration_tokens"] == 16384
    kinds = [r["id"].split(":")[0] for r in text["calibration"]]
    assert [kinds.count(k) for k in ("wiki", "wikipedia-chat", "code")] == [18, 80, 10], kinds
    assert text["calibration_documents_used"] is None  # chat turns hold EOS themselves: not counted
    assert text["held_out_tokens"] == 4 * 512
    assert (
        "calibration on 16384 tokens of wikipedia + wikipedia-chat + code (one share per source, weighted) drawn "
        "across the 108 calibration documents" in (reference / "report.md").read_text()
    )
    for name in ("config.json", "generation_config.json", "tokenizer.json", "README.md", "report.md"):
        assert (reference / name).exists(), name
    runner = CliRunner()
    res = runner.invoke(app, ["manifest", "verify", str(reference)])
    assert res.exit_code == 0 and "ok:" in res.stdout
    res = runner.invoke(
        app, ["generate", str(reference), "The capital of France is", "--max-new-tokens", "8"]
    )
    assert res.exit_code == 0 and res.stdout.startswith("The capital of France is")
    res_k = runner.invoke(
        app,
        [
            "generate",
            str(reference),
            "The capital of France is",
            "--max-new-tokens",
            "8",
            "--backend",
            "triton",
        ],
    )
    assert res_k.exit_code == 0 and res_k.stdout == res.stdout  # same greedy text on the kernel
    assert f"{kernel_backend()}:decode x210" in res_k.stderr  # 7 decode steps x 30 layers ran the kernel
    res = runner.invoke(app, ["eval", str(reference), "--windows", "1", "--window", "256"])
    assert res.exit_code == 0 and "perplexity" in res.stdout


if __name__ == "__main__" and "--repin" in sys.argv:
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        manifest = run_reference(Path(tmp) / "ref", search=True)  # the default conversion, its search included
    PINNED.write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    pins = json.loads(BYTES.read_text())
    pins["by_cpu"] = {cpu_model(): {k: manifest["outputs"][k] for k in pins["files"]}}  # other CPUs' bytes are stale
    BYTES.write_text(json.dumps(pins, indent=2) + "\n")
    print(f"pinned {manifest['canonical_id']} in {PINNED} and this CPU's bytes in {BYTES}")

if __name__ == "__main__" and "--pin-bytes-from" in sys.argv:  # a reference conversion made on this machine
    # (a searched one, the quick start's, also re-pins the manifest's output hashes: the same canonical id)
    folder = Path(sys.argv[sys.argv.index("--pin-bytes-from") + 1])
    manifest = json.loads((folder / "mla_manifest.json").read_text())  # the quick start's, or the suite's
    if as_searched(manifest)["canonical_id"] != json.loads(PINNED.read_text())["canonical_id"]:
        sys.exit(f"{folder} is not the pinned reference conversion (canonical id {manifest['canonical_id']})")
    if manifest["canonical_id"] == json.loads(PINNED.read_text())["canonical_id"]:  # searched: the pin itself
        PINNED.write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")  # its outputs (the model card)
    pins = json.loads(BYTES.read_text())
    pins["by_cpu"][cpu_model()] = {k: manifest["outputs"][k] for k in pins["files"]}
    BYTES.write_text(json.dumps(pins, indent=2) + "\n")
    print(f"pinned this CPU's bytes ({cpu_model()}) from {folder} in {BYTES}")
