"""Child processes for measurements, safe to start from a process that has run torch, and
never waited on without a limit.

Forking a process whose OpenMP (libgomp) worker threads are alive copies the runtime's state
but not its threads: the child's first parallel region (``layer_norm``, a matmul) then waits
forever on threads that do not exist. This is the documented limitation of fork with threads
(POSIX ``fork``: "only the calling thread is replicated"; PyTorch's multiprocessing notes
recommend ``spawn`` or ``forkserver`` for CUDA and threaded code). So children here are never
forked from the caller:

* ``run_isolated`` runs one call in a child of the ``forkserver``: a fresh interpreter that has
  imported torch (``set_forkserver_preload``) but has never run a parallel region, so forking
  it is safe, and each child costs milliseconds instead of a torch import;
* ``run_world`` starts ``world`` ranks with ``spawn`` (fresh interpreters).

Both wait with a deadline. A child that outlives it is killed and the caller gets
``MeasurementTimeout``, one sentence naming what was being measured: a wedged measurement
fails the run instead of hanging it.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.context
import os
import time
from collections.abc import Callable
from typing import Any

# A fake-group measurement of the validation model takes 1-10 s on one busy core; a gloo world
# of 4 ranks running every composition takes up to a few minutes. The limits leave ample margin
# and can be raised for slow machines.
CHILD_TIMEOUT_S = float(os.environ.get("PLACEMENT_SEMANTICS_CHILD_TIMEOUT_S", "300"))
WORLD_TIMEOUT_S = float(os.environ.get("PLACEMENT_SEMANTICS_WORLD_TIMEOUT_S", "900"))

# What the forkserver imports once, before it forks any child.
_PRELOAD = ["torch", "checker._torch._engine", "checker._torch._net", "checker._torch_validate"]

_CONTEXT: multiprocessing.context.ForkServerContext | None = None


class MeasurementTimeout(RuntimeError):
    """A child process did not finish within its limit; it was killed."""


def _forkserver() -> multiprocessing.context.ForkServerContext:
    global _CONTEXT
    if _CONTEXT is None:
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(_PRELOAD)
        _CONTEXT = ctx
    return _CONTEXT


def run_isolated(fn: Callable[..., Any], args: tuple[Any, ...], what: str, timeout_s: float | None = None) -> Any:
    """``fn(*args)`` in a fresh child of the forkserver; its return value, or its exception
    re-raised here. ``fn`` must be a module-level function (it is pickled by name)."""
    limit = CHILD_TIMEOUT_S if timeout_s is None else timeout_s
    pool = _forkserver().Pool(1)
    try:
        result = pool.apply_async(fn, args)
        try:
            return result.get(timeout=limit)
        except multiprocessing.TimeoutError:
            raise MeasurementTimeout(
                f"{what}: the measurement did not finish in {limit:g} s; its process was killed"
            ) from None
    finally:
        pool.terminate()
        pool.join()


def run_world(
    fn: Callable[..., Any], args: tuple[Any, ...], world: int, what: str, timeout_s: float | None = None
) -> None:
    """``fn(rank, *args)`` on ``world`` freshly spawned processes, waited on together with one
    deadline. A rank that raises fails the run (the others are killed), as ``torch``'s
    ``spawn(join=True)`` does, but a rank that never returns fails it too."""
    import torch.multiprocessing as mp

    limit = WORLD_TIMEOUT_S if timeout_s is None else timeout_s
    context = mp.start_processes(  # type: ignore[attr-defined, no-untyped-call]
        fn,
        args=args,
        nprocs=world,
        join=False,
        start_method="spawn",
    )
    deadline = time.monotonic() + limit
    try:
        while not context.join(timeout=max(0.1, min(5.0, deadline - time.monotonic()))):
            if time.monotonic() >= deadline:
                raise MeasurementTimeout(f"{what}: {world} processes did not finish in {limit:g} s; they were killed")
    finally:
        for p in context.processes:
            if p.is_alive():
                p.kill()
            p.join(timeout=10)


__all__ = ["CHILD_TIMEOUT_S", "WORLD_TIMEOUT_S", "MeasurementTimeout", "run_isolated", "run_world"]
