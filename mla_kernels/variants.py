"""Which compiled variant a kernel launch selects, computed from the launch's arguments as Triton's JIT does it.

Triton caches one compiled kernel per *specialisation key*: per parameter, the ``constexpr`` value, or the
argument's type plus what it specialises on (an integer equal to 1 becomes the constant 1, an integer divisible
by 16 or a 16-byte aligned pointer gets the ``tt.divisibility = 16`` attribute), except for the parameters named
in ``do_not_specialize`` (type only) and ``do_not_specialize_on_alignment``; then the launch options
(``num_warps``). :func:`launch_specialization` builds that key with Triton's own ``native_specialize_impl`` and
the NVIDIA backend's rules (:class:`triton.backends.compiler.BaseBackend`, which the NVIDIA backend does not
override), so it is the same on the CPU interpreter (where nothing compiles and no cache exists) and on a GPU
(where it names one entry of the kernel's cache, :func:`compiled_variants`). :func:`record_launches` collects the
keys of every launch of a module's kernels, and :mod:`mla_convert.kernels.compile_check` compiles exactly such keys.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

#: options the JIT adds to every launch itself (the same for every launch of a process)
_JIT_ADDED = frozenset({"debug", "instrumentation_mode", "fpsan_homomorphic_casts"})

Specialization = tuple[tuple[tuple[str, Any], ...], tuple[tuple[str, Any], ...]]


def _params(fn: Any) -> tuple[list[str], set[str], set[str], set[str]]:
    """``(names, constexpr names, do_not_specialize names, do_not_specialize_on_alignment names)`` of a
    ``triton.jit`` function, compiled (``JITFunction``) or interpreted (``InterpretedFunction``)."""
    raw = fn.fn
    names = list(inspect.signature(raw).parameters)
    annotations = {n: str(p.annotation) for n, p in inspect.signature(raw).parameters.items()}
    const = {n for n in names if "constexpr" in annotations[n]}
    kw = getattr(fn, "kwargs", None)
    if kw is not None:  # the interpreter keeps the decorator's arguments as given
        dns, dnsa = kw.get("do_not_specialize") or (), kw.get("do_not_specialize_on_alignment") or ()
    else:
        dns, dnsa = fn.do_not_specialize or (), fn.do_not_specialize_on_alignment or ()

    def named(items: Any) -> set[str]:
        return {names[i] if isinstance(i, int) else i for i in items}

    return names, const, named(dns), named(dnsa)


def launch_specialization(fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Specialization:
    """The specialisation key under which Triton's JIT caches the kernel ``fn[grid](*args, **kwargs)`` launches.

    Args:
        fn: a ``triton.jit`` function (compiled or interpreted); args, kwargs: the launch's arguments, constexprs
            and options (``num_warps``) as passed.

    Returns:
        ``(per-parameter entries, options)``: entries in parameter order, ``("constexpr", value)`` or ``(type,
        attribute)`` with attribute ``"D"`` (divisible by 16 / aligned), ``""`` or ``None`` (not specialised).

    Raises:
        TypeError: an argument is missing (the launch would fail the same way).
    """
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend

    names, const, dns, dnsa = _params(fn)
    bound = dict(zip(names, args, strict=False))
    bound.update({k: v for k, v in kwargs.items() if k in names})
    missing = [n for n in names if n not in bound]
    if missing:
        raise TypeError(f"{getattr(fn, '__name__', fn)} launched without {missing}")
    entries: list[tuple[str, Any]] = []
    for name in names:
        value = bound[name]
        if name in const:
            entries.append(("constexpr", value))
        else:
            spec = native_specialize_impl(BaseBackend, value, False, name not in dns, name not in dnsa)
            entries.append(tuple(spec))
    options = tuple(sorted((k, v) for k, v in kwargs.items() if k not in names and k not in _JIT_ADDED))
    return tuple(entries), options


class _Recorder:
    """Stands in for a kernel: ``rec[grid](*args, **kwargs)`` records the launch's key, then launches the real
    kernel unless ``launch`` is off."""

    def __init__(self, fn: Any, seen: list[Specialization], launch: bool) -> None:
        self.fn, self.seen, self.launch = fn, seen, launch

    def __getitem__(self, grid: Any) -> Any:
        def run(*args: Any, **kwargs: Any) -> Any:
            self.seen.append(launch_specialization(self.fn, args, kwargs))
            return self.fn[grid](*args, **kwargs) if self.launch else None

        return run


@contextmanager
def record_launches(
    module: Any, names: tuple[str, ...] = ("_split_kernel", "_merge_kernel"), launch: bool = True
) -> Iterator[dict[str, list[Specialization]]]:
    """Record the specialisation key of every launch of the kernels ``module.<name>`` while the block runs.

    Usage: ``with record_launches(K) as seen: K.latent_decode(...)``, then ``seen["_split_kernel"]`` lists one
    key per launch, options (``num_warps``) included. The launcher is wrapped (the module attribute replaced
    for the block), so the keys are the same under the interpreter, which drops launch options before its own
    hooks, and on a GPU. ``launch=False`` records without running anything (e.g. on the meta device).
    """
    seen: dict[str, list[Specialization]] = {name: [] for name in names}
    real = {name: getattr(module, name) for name in names}
    try:
        for name in names:
            setattr(module, name, _Recorder(real[name], seen[name], launch))
        yield seen
    finally:
        for name in names:
            setattr(module, name, real[name])


def compiled_variants(fn: Any) -> int | None:
    """Compiled kernels of ``fn`` in its JIT cache on the current CUDA device; ``None`` in the interpreter (which
    compiles nothing) or before the first launch on that device."""
    caches = getattr(fn, "device_caches", None)
    if caches is None:
        return None
    import torch

    if not torch.cuda.is_available():
        return None
    entry = caches.get(torch.cuda.current_device())
    return None if entry is None else len(entry[0])
