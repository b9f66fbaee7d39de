"""Off a terminal (a redirected log, CI) the CLI draws no progress bars and cuts no table cell."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def test_inspect_log_has_no_bars_and_whole_rows(tmp_path: Path) -> None:
    # a fresh cache makes transformers parse the bundled GGUF's config and tokenizer (a tqdm bar on a terminal)
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("COLUMNS", "TQDM_DISABLE", "HF_HUB_DISABLE_PROGRESS_BARS")
    }
    env["MLA_CONVERT_CACHE"] = str(tmp_path / "cache")
    res = subprocess.run(
        [sys.executable, "-m", "mla_convert", "inspect", "smollm2-135m"],
        capture_output=True,
        text=True,
        env=env,
    )
    assert res.returncode == 0, res.stderr[-2000:]
    assert "\r" not in res.stderr and "it/s" not in res.stderr, res.stderr[-2000:]
    row = next(line for line in res.stdout.splitlines() if "MLA [c_kv | k_rope] at 18.75%" in line)
    assert row.rstrip().endswith("│")  # one physical line per table row: nothing wrapped
    assert "at this fraction)" in row or "measured_splits.json" in row  # the last cell is whole
