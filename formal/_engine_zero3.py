"""DeepSpeed ZeRO-3's parameter fetches over one steady step (0.19.8), module by module.

``partitioned_param_coordinator.py`` records the modules a step calls (its trace: every module's
pre-forward and pre-backward hook, parameter-free parents included) and replays it from the
second step on. A steady step keeps a queue of (parameter, trace position of its use), in
trace order. At each module of the trace (``fetch_sub_module``):

1. its parameters that are not available are gathered in one coalesced all-gather
   (``__all_gather_params``: each parameter's padded shard from every rank);
2. the queue's entries of this use are popped;
3. with ``stage3_prefetch_bucket_size`` > 0, entries are popped until that many elements (at
   most ``stage3_max_live_parameters`` less those gathered now) are chosen among parameters
   that are not available; the chosen ones are gathered in one all-gather. Every popped entry
   records its use as the parameter's latest fetched use, available or not;
4. after the module's forward or backward (``release_sub_module``), its parameters are
   released unless persistent, unless a popped entry recorded a later use (a prefetch skipped
   it, so its next use must find it gathered), or unless the trace uses them again within
   ``stage3_max_reuse_distance`` elements (``__params_to_release``).

``zero3_fetches`` replays this on the model's modules and gives the gathers and the elements
gathered (not persistent) after every module, the working set the memory terms read. The
trace is the module tree of ``checker._torch._net``'s models: the root, the embedding, each
block (a parameter-free parent) before its modules, the final norm and the head (under tied
embeddings a module of its own that reads the embedding's parameter), forward; the root, then
the same in reverse, backward (measured on DeepSpeed 0.19.8, docs/torch-validation.md).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

from formal._model import Transformer
from formal._tensors import parameter_tensors

_NEVER = -(10**18)


@dataclass(frozen=True)
class Zero3Settings:
    """The ZeRO-3 fetch settings, in elements (DeepSpeed's names without ``stage3_``)."""

    param_persistence_threshold: int
    model_persistence_threshold: int
    max_reuse_distance: int
    prefetch_bucket_elements: int
    max_live_parameters: int


@dataclass(frozen=True)
class Module:
    """One use of a module in the trace: its name, its own parameters (ids into ``sizes``), the
    pass, and the transformer layer it belongs to (None outside the layers)."""

    name: str
    params: tuple[int, ...]
    forward: bool
    layer: int | None = None


@dataclass(frozen=True)
class Zero3Fetches:
    """A steady step's fetches: ``gathers`` the parameters of each all-gather in issue order,
    ``live`` the elements gathered (not persistent) after each module's fetch and prefetch, and
    ``after`` the same after its release, per trace position."""

    trace: tuple[Module, ...]
    sizes: tuple[int, ...]
    persistent: frozenset[int]
    gathers: tuple[tuple[int, ...], ...]
    live: tuple[int, ...]
    after: tuple[int, ...]

    @property
    def peak(self) -> int:
        """The most elements gathered at once over the step (0 without a module)."""
        return max(self.live, default=0)

    @property
    def persistent_elements(self) -> int:
        """Elements of the persistent parameters, held whole on every rank all step."""
        return sum(self.sizes[p] for p in self.persistent)

    def padded(self, params: Sequence[int], ranks: int) -> int:
        """Elements an all-gather of ``params`` moves: each padded to a multiple of ``ranks``."""
        return ranks * sum(-(-self.sizes[p] // ranks) for p in params)


def module_trace(model: Transformer) -> tuple[tuple[int, ...], tuple[Module, ...]]:
    """The parameter sizes (registration order) and the trace of one step's module uses."""
    leaves: dict[str, tuple[int | None, list[int]]] = {}
    sizes: list[int] = []
    for t in parameter_tensors(model):
        leaves.setdefault(t.name.rsplit(".", 1)[0], (t.layer, []))[1].append(len(sizes))
        sizes.append(t.elements)

    def uses(names: Sequence[str], forward: bool) -> list[Module]:
        out = [Module("", (), forward)]  # the root's hook: no parameters of its own
        block: int | None = None
        for name in names:
            layer, params = leaves[name]
            if layer is not None and layer != block:
                out.append(Module(f"layers.{layer}", (), forward, layer))  # the block, a parent
            block = layer
            out.append(Module(name, tuple(params), forward, layer))
        return out

    if model.tied_embeddings:  # the head reads the embedding's own parameter
        leaves["head"] = (None, list(leaves["embed"][1]))
    names = list(leaves)
    return tuple(sizes), tuple(uses(names, True) + uses(names[::-1], False))


def persistent_parameters(sizes: Sequence[int], settings: Zero3Settings) -> frozenset[int]:
    """``mark_persistent_parameters``: in registration order, a parameter of at most
    ``param_persistence_threshold`` elements while the running total stays within
    ``model_persistence_threshold``."""
    out: set[int] = set()
    total = 0
    for p, n in enumerate(sizes):
        if n + total > settings.model_persistence_threshold:
            continue
        if n <= settings.param_persistence_threshold:
            out.add(p)
            total += n
    return frozenset(out)


@lru_cache(maxsize=64)
def zero3_fetches(model: Transformer, settings: Zero3Settings) -> Zero3Fetches:
    """Replay a steady step's fetches, prefetches and releases (the module docstring's rules).
    Kept per model and settings: the replay reads neither the mesh nor the ranks (the padding
    is the caller's, ``Zero3Fetches.padded``), so a planner's candidates share one."""
    sizes, trace = module_trace(model)
    persistent = persistent_parameters(sizes, settings)
    queue = deque((p, s) for s, m in enumerate(trace) for p in m.params)
    latest: dict[int, int] = {}
    gathered: set[int] = set()
    count = 0
    gathers: list[tuple[int, ...]] = []
    live: list[int] = []
    after: list[int] = []
    for s, module in enumerate(trace):
        fetch = tuple(p for p in module.params if p not in persistent and p not in gathered)
        if fetch:
            gathers.append(fetch)
            gathered.update(fetch)
            count += sum(sizes[p] for p in fetch)
        pending = {p for p in module.params if latest.get(p, _NEVER) < s}
        popped: set[int] = set()
        while queue and len(popped) < len(pending):
            p, used = queue.popleft()
            latest[p] = used
            popped.add(p)
        if settings.prefetch_bucket_elements > 0:
            limit = min(settings.max_live_parameters - count, settings.prefetch_bucket_elements)
            chosen: list[int] = []
            numel = 0
            while queue and numel < limit:
                p, used = queue.popleft()
                if p not in persistent and p not in gathered and p not in chosen:
                    chosen.append(p)
                    numel += sizes[p]
                latest[p] = max(latest.get(p, _NEVER), used)
            if chosen:
                gathers.append(tuple(chosen))
                gathered.update(chosen)
                count += numel
        live.append(count)
        step = s + 1  # the coordinator's step counter has moved past this module
        release = {p for p in module.params if p not in persistent and latest.get(p, _NEVER) <= step}
        seen = 0
        for later in trace[step:]:
            if seen >= settings.max_reuse_distance:
                break
            for p in later.params:
                release.discard(p)
                seen += sizes[p]
        for p in release & gathered:
            gathered.discard(p)
            count -= sizes[p]
        after.append(count)
    return Zero3Fetches(trace, sizes, persistent, tuple(gathers), tuple(live), tuple(after))


__all__ = ["Module", "Zero3Fetches", "Zero3Settings", "module_trace", "persistent_parameters", "zero3_fetches"]
