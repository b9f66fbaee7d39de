"""``scripts/gpu_check.sh`` (the first GPU run): its CPU side runs in CI; the parts' bookkeeping is checked on
outputs written by hand (each part's command replaced by a stand-in), so nothing here needs a GPU or torch work."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import gpu_check  # noqa: E402
import gpu_parts  # noqa: E402

PARTS = ["tests", "decode", "factor", "validate", "adapt", "factor8b"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a CUDA host the script runs the whole GPU check")
def test_cpu_run_says_no_cuda_device_for_every_part_and_exits_0(tmp_path):
    out = tmp_path / "res" / "gpu_check.json"
    env = {**os.environ, "PYTHON": sys.executable}
    res = subprocess.run(
        ["bash", "scripts/gpu_check.sh", "--out", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert res.returncode == 0, res.stdout + res.stderr
    rec = json.loads(out.read_text())
    assert list(rec["parts"]) == PARTS
    for name, part in rec["parts"].items():
        assert part["status"] == "no CUDA device", name
        assert part["seconds"] is None and part["limit_s"] == gpu_check.LIMITS[name]
        assert "CPU build" in part["error"] or "sees no GPU" in part["error"]
        assert part["command"], name  # what a GPU run would run
    default = sum(gpu_check.LIMITS[n] for n in gpu_check.DEFAULT_PARTS)
    assert default <= gpu_check.BUDGET_S < 540  # every answer within 9 minutes
    assert gpu_check.LIMITS["factor8b"] <= gpu_check.BUDGET_S  # its own call (--parts factor8b), as long
    assert rec["parts"]["factor8b"]["command"][-3:] == ["--device", "cuda", "--overwrite"]  # default options
    assert rec["environment"]["cuda"] is False and rec["passed"] is False
    assert rec["parts"]["tests"]["command"][-5:-1] == [
        "tests/kernels", "tests/runtime", "tests/mla", "tests/convert/test_on_device.py"
    ]
    assert rec["parts"]["tests"]["command"][-1].endswith("::test_factor_on_a_gpu_fits_by_default")
    assert "--device" in rec["parts"]["factor"]["command"] and "cuda" in rec["parts"]["factor"]["command"]
    assert rec["parts"]["decode"]["command"][2] == "--gpu"
    table = out.with_suffix(".md").read_text()
    assert table.count("| no CUDA device |") == 6
    assert res.stdout.count("| no CUDA device |") == 6
    assert not any(tmp_path.glob("gpu-check-*"))  # nothing but the record is created


def test_a_cpu_run_never_replaces_a_record_with_gpu_answers(tmp_path, monkeypatch):
    default = tmp_path / "gpu_check.json"
    monkeypatch.setattr(gpu_check, "DEFAULT_OUT", default)
    assert gpu_check.resolve_out(None, cuda=False) == default  # nothing there yet
    default.write_text(json.dumps({"environment": {"cuda": True}}))
    assert gpu_check.resolve_out(None, cuda=False) == tmp_path / "gpu_check.no_cuda.json"
    assert gpu_check.resolve_out(None, cuda=True) == default
    assert gpu_check.resolve_out(tmp_path / "x.json", cuda=False) == tmp_path / "x.json"


def test_bad_options_are_one_error_line():
    with pytest.raises(SystemExit, match="--limit 'tests=abc': use NAME=SECONDS"):
        gpu_check.main(["--limit", "tests=abc"])
    with pytest.raises(SystemExit, match="--parts: unknown gpu"):
        gpu_check.main(["--parts", "tests,gpu"])
    assert gpu_check.parse_limits(["adapt=30"])["adapt"] == 30


PYTEST_LOG = """\
tests/kernels/test_kernel.py::test_a[fp8] PASSED                         [ 10%]
tests/kernels/test_kernel.py::test_b FAILED                              [ 20%]
tests/kernels/test_peer_matrices.py::test_full_grid_gpu[1-2] PASSED      [ 30%]
tests/kernels/test_peer_matrices.py::test_full_grid_gpu[2-2] FAILED      [ 40%]
tests/kernels/test_peer_matrices.py::test_long_gpu SKIPPED (needs sm_89) [ 50%]
tests/runtime/test_graph.py::test_c ERROR                                [ 60%]
tests/mla/test_folding.py::test_d PASSED                                 [ 70%]
============================= slowest 10 durations =============================
12.50s call     tests/kernels/test_peer_matrices.py::test_full_grid_gpu[1-2]
0.20s setup    tests/runtime/test_graph.py::test_c
=========================== short test summary info ============================
SKIPPED [2] tests/kernels/test_kernel.py:612: the interpreter's bfloat16 fault
SKIPPED [1] tests/kernels/test_peer_matrices.py:101: an FP8 cache needs sm_89 or newer
FAILED tests/kernels/test_kernel.py::test_b - AssertionError
======= 2 failed, 3 passed, 1 skipped, 1 error in 20.15s ========
"""


def test_pytest_log_counts_failures_gpu_only_cases_skips_and_slowest():
    rec = gpu_parts.parse_pytest(PYTEST_LOG)
    assert rec["counts"] == {"passed": 3, "failed": 2, "skipped": 1, "error": 1}
    assert rec["gpu_only"] == {"passed": 1, "failed": 1, "skipped": 1}
    assert rec["failures"] == [
        "tests/kernels/test_kernel.py::test_b",
        "tests/kernels/test_peer_matrices.py::test_full_grid_gpu[2-2]",
        "tests/runtime/test_graph.py::test_c",
    ]
    assert rec["skip_reasons"] == {
        "the interpreter's bfloat16 fault": 2,
        "an FP8 cache needs sm_89 or newer": 1,
    }
    assert rec["slowest"][0] == {
        "seconds": 12.5,
        "phase": "call",
        "test": "tests/kernels/test_peer_matrices.py::test_full_grid_gpu[1-2]",
    }
    assert rec["summary_line"] == "2 failed, 3 passed, 1 skipped, 1 error in 20.15s"


def fake_run(files: dict[str, str], rc: int | None = 0, output: str = ""):
    """A stand-in for ``run_logged``: writes ``files`` (paths relative to the work folder) and the log."""

    def run(cmd, log, limit_s, tag):
        work = log.parent
        work.mkdir(parents=True, exist_ok=True)
        for rel, text in files.items():
            (work / rel).parent.mkdir(parents=True, exist_ok=True)
            (work / rel).write_text(text)
        log.write_text(output)
        return rc, 1.5

    return run


def peak(**kw) -> str:
    return json.dumps({"rc": 0, "error": None, "wall_s": 40.0, "peak_gpu_allocated_mib": 1234.0, **kw})


def test_factor_part_reads_the_report_and_the_peak_memory(tmp_path, monkeypatch):
    report = {"model": {"eval": {"perplexity": 13.0, "reference_perplexity": 10.0, "kl": 0.25, "top1": 0.7}}}
    monkeypatch.setattr(
        gpu_parts,
        "run_logged",
        fake_run({"factor_peak.json": peak(), "smollm2-mla/report.json": json.dumps(report)}),
    )
    part = gpu_parts.Part("factor", "factor", 100)
    gpu_parts.part_factor(part, tmp_path)
    assert part.status == "ok" and part.error is None
    assert part.record["peak_gpu_allocated_mib"] == 1234.0 and part.record["eval"]["kl"] == 0.25
    assert part.summary == "40 s; peak GPU memory 1234 MiB allocated; perplexity ratio 1.300, KL 0.2500"
    assert part.command[part.command.index("--device") + 1] == "cuda"

    monkeypatch.setattr(gpu_parts, "run_logged", fake_run({}, rc=2, output="error: no text in the cache\n"))
    part = gpu_parts.Part("factor", "factor", 100)
    gpu_parts.part_factor(part, tmp_path / "again")
    assert part.status == "failed" and part.error == "exit 2: error: no text in the cache"


def test_the_8b_part_generates_its_source_then_converts_it_by_default_on_cuda(tmp_path, monkeypatch):
    report = {
        "run": {"peak_rss_mb": 4321.0, "per_layer": []},
        "weights": {"ratio": 1.1},
        "options": {"rope_pairs": 64, "rope_strategy": "2-norm", "refit_o_proj": "teacher"},
    }
    calls = []
    files = {"factor8b_peak.json": peak(), "llama8b-2l-mla/report.json": json.dumps(report)}
    run = fake_run(files)

    def recorded(cmd, log, limit_s, tag):
        calls.append((cmd, os.environ.get("MLA_SCALE_CACHE")))
        return run(cmd, log, limit_s, tag)

    monkeypatch.setattr(gpu_parts, "run_logged", recorded)
    monkeypatch.delenv("MLA_SCALE_CACHE", raising=False)
    part = gpu_parts.Part("factor8b", "factor8b", 500)
    gpu_parts.part_factor8b(part, tmp_path)
    assert part.status == "ok" and part.error is None, part.error
    (gen, cache), (fac, _) = calls
    assert gen[-3:] == ["--generate-only", "llama8b-2l", "--no-checks"] and cache == str(tmp_path / "scale-cache")
    assert "MLA_SCALE_CACHE" not in os.environ  # put back as it was
    argv = fac[fac.index("--") + 1 :]
    assert argv == [
        "factor", str(tmp_path / "scale-cache" / "llama8b-2l"), str(tmp_path / "llama8b-2l-mla"), "--device", "cuda",
        "--overwrite",
    ]  # fmt: skip  (default options: nothing else given)
    assert part.record["report_weights"] == {"ratio": 1.1} and part.seconds == 3.0
    assert part.summary == (
        "source 2 s; factor 40 s; peak GPU memory 1234 MiB allocated; peak host RSS 4.3 GB; chose 64 pairs, 2-norm, "
        "refit teacher"
    )

    monkeypatch.setattr(gpu_parts, "run_logged", fake_run({}, rc=1, output="OSError: disk full\n"))
    part = gpu_parts.Part("factor8b", "factor8b", 500)
    gpu_parts.part_factor8b(part, tmp_path / "again")
    assert part.status == "failed" and part.error == "generating the source: OSError: disk full"


def test_validate_part_fails_when_the_kernel_did_not_run_natively(tmp_path, monkeypatch):
    rungs = [{"number": 1, "name": "naive vs absorbed", "passed": True, "seconds": 2.0, "skipped": None}]
    res = {"passed": True, "failed_rungs": [], "rungs": rungs, "environment": {"kernel_backend": "x"}}
    for backend, status in (("triton-cuda", "ok"), ("triton-interpreter", "failed")):
        res["environment"]["kernel_backend"] = backend
        files = {"validate_peak.json": peak(), "smollm2-mla/validation.json": json.dumps(res)}
        monkeypatch.setattr(gpu_parts, "run_logged", fake_run(files))
        part = gpu_parts.Part("validate", "validate", 70)
        gpu_parts.part_validate(part, tmp_path / backend)
        assert part.status == status, backend
        assert part.summary.startswith(f"1/1 rungs passed on {backend}")
    assert part.error == "the kernel ran on triton-interpreter, not natively on CUDA"


def test_adapt_part_makes_20_bf16_steps_and_fails_on_a_zero_gradient_norm(tmp_path, monkeypatch):
    argv = gpu_parts.adapt_argv(Path("in"), Path("out"))
    opt = dict(zip(argv[3::2], argv[4::2], strict=False))
    tokens, seq, batch = int(opt["--tokens"]), int(opt["--seq-len"]), int(opt["--batch-size"])
    assert tokens / (seq * batch * int(opt["--grad-accum"])) == 20 and opt["--mixed-precision"] == "bf16"
    for norms, status in (([0.5] * 20, "ok"), ([0.5] * 19 + [0.0], "failed")):
        rows = [
            {"kind": "train", "step": i + 1, "loss": 3.0 - 0.01 * i, "grad_norm": n}
            for i, n in enumerate(norms)
        ]
        metrics = "\n".join(json.dumps(r) for r in [{"kind": "eval", "step": 0}, *rows])
        report = {
            "steps": 20,
            "tokens_per_s": 5000.0,
            "before": {"perplexity": 14.0},
            "after": {"perplexity": 12.0},
        }
        files = {
            "adapt_peak.json": peak(),
            "smollm2-mla-adapted/adapt_report.json": json.dumps(report),
            "smollm2-mla-adapted/metrics.jsonl": metrics,
        }
        monkeypatch.setattr(gpu_parts, "run_logged", fake_run(files))
        part = gpu_parts.Part("adapt", "adapt", 70)
        gpu_parts.part_adapt(part, tmp_path / status)
        assert part.status == status
        assert part.summary == "20 steps, 5000 tokens/s, loss 3.000 -> 2.810, peak GPU memory 1234 MiB"
    assert part.error == "gradient norm 0, missing or not finite at steps [20]"


def test_run_logged_kills_a_part_at_its_limit_and_keeps_its_output(tmp_path):
    log = tmp_path / "slow.log"
    cmd = [sys.executable, "-c", "import time; print('started', flush=True); time.sleep(60)"]
    rc, seconds = gpu_parts.run_logged(cmd, log, 2, "slow")
    assert rc is None and 2 <= seconds < 30
    assert log.read_text() == "started\n"
    rc, _ = gpu_parts.run_logged([sys.executable, "-c", "raise SystemExit(3)"], tmp_path / "b.log", 30, "b")
    assert rc == 3


def test_cli_wrapper_records_the_exit_status(tmp_path):
    rec = tmp_path / "rec.json"
    cmd = gpu_parts.cli_command(rec, "manifest", "verify", str(tmp_path / "missing"))
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    data = json.loads(rec.read_text())
    assert res.returncode == data["rc"] == 2, res.stdout + res.stderr
    assert data["argv"] == ["manifest", "verify", str(tmp_path / "missing")]
    assert data["peak_gpu_allocated_mib"] is None and data["wall_s"] > 0


def test_with_cuda_a_failed_part_skips_its_dependants_and_exits_1(tmp_path, monkeypatch):
    device = {
        "name": "NVIDIA H200",
        "capability": "9.0",
        "multiprocessors": 132,
        "memory_gib": 139.8,
        "count": 1,
    }
    env = {
        "python": sys.executable, "python_version": "3.12.3", "cuda": True, "device": device,
        "no_cuda_reason": None, "missing": ["pytest"], "packages": {"torch": "2.11.0+cu130"}, "git_commit": None,
    }  # fmt: skip
    monkeypatch.setattr(gpu_check, "probe_environment", lambda: env)
    ran = []

    def runner(status: str, error: str | None = None):
        def run(part, work):
            ran.append(part.name)
            part.status, part.error, part.seconds, part.summary = status, error, 3.0, f"{part.name} answer"

        return run

    monkeypatch.setattr(
        gpu_check,
        "RUNNERS",
        {
            "tests": runner("ok"),
            "decode": runner("ok"),
            "factor": runner("failed", "exit 2: error: no text"),
            "validate": runner("ok"),
            "adapt": runner("ok"),
        },
    )
    out = tmp_path / "gpu_check.json"
    assert gpu_check.main(["--out", str(out), "--work", str(tmp_path / "w"), "--limit", "decode=5"]) == 1
    rec = json.loads(out.read_text())
    assert ran == ["decode", "factor"]  # tests: pytest missing; validate and adapt need factor's checkpoint
    parts = rec["parts"]
    assert parts["tests"]["status"] == "failed" and "pytest" in parts["tests"]["error"]
    assert parts["decode"]["limit_s"] == 5
    assert parts["factor"] == {**parts["factor"], "status": "failed", "error": "exit 2: error: no text"}
    for name in ("validate", "adapt"):
        assert parts[name]["status"] == "skipped"
        assert parts[name]["error"] == "needs part factor's checkpoint (factor: failed)"
    table = out.with_suffix(".md").read_text()
    assert "NVIDIA H200 (sm_90, 132 SMs, 139.8 GiB)" in table
    assert (
        "| 3 | mla-convert factor smollm2-135m --device cuda | failed | 3 | 100 | exit 2: error: no text"
        in table
    )


def test_validate_alone_reuses_an_earlier_runs_checkpoint(tmp_path):
    assert not gpu_check.reusable("factor", ["validate"], tmp_path)
    (tmp_path / "smollm2-mla").mkdir()
    (tmp_path / "smollm2-mla" / "config.json").write_text("{}")
    assert gpu_check.reusable("factor", ["validate"], tmp_path)
    assert not gpu_check.reusable("factor", ["factor", "validate"], tmp_path)  # factor ran (and failed) now
