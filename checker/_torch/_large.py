"""Large models under ``FakeTensorMode``: hundreds of millions of parameters, nothing allocated.

The model is built and stepped inside ``torch._subclasses.fake_tensor.FakeTensorMode`` on the
fake process group (pytorch-ground-truth.md): every tensor is a ``FakeTensor`` (shape, dtype,
storage identity, no data), so a step of a 0.5 B-parameter model takes seconds and a few hundred
MB of RAM. The device meshes and FSDP2's ``fully_shard`` run outside fake mode
(``Runner._device_mesh``, ``Runner._fsdp``); DDP cannot run under fake mode and is not measured.
Pipelining runs too: ``MemTracker`` refuses a module called once per micro-batch, so its
per-module statistics restart at each top-level call (the categories are global anyway).

One rank, one steady step (the second), measured three ways at once:

* ``CommRecorder`` and the storages of the rank's parameters, gradients and Adam state, as
  ``checker._torch._engine.measure`` does (``Measured``);
* PyTorch's ``MemTracker`` (``FSDPMemTracker`` for FSDP2 engines), per category: parameters,
  gradients, optimizer state at the end of the step, and the largest activation category during
  the step (every tensor created in forward that is still alive: saved tensors, the logits and
  the loss);
* ``SavedActivations`` (the repo's saved-tensor hooks), with each saved storage attributed to
  the module and the ``torch`` function that saved it (``Saved.by_op``).
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from checker._parse import parse
from checker._torch._compare import PEAK, Comparison, Row, state_rows
from checker._torch._engine import Engine, Measured, Runner, _stage, fake_group, model_state_tensors
from checker._torch._net import NetConfig
from checker._torch._predict import SAVED_BY_AUTOGRAD, predict
from checker._torch._record import CommRecorder, SavedActivations, _Held, storage_bytes, storage_key
from formal._engine_effects import EnginePrediction
from formal._placement import Recompute

# 0.53 B parameters (8 blocks of 50 M, embedding and head of 65.5 M each): few blocks keep the
# number of dispatched ops (the cost of a fake step) small; the vocabulary makes the logits count.
LARGE = NetConfig(layers=8, hidden=2048, heads=16, vocab=32000, seq=1024, batch=1)
LARGE_COMPOSITIONS: tuple[str, ...] = (
    "fsdp8",
    "fsdp-sgo8",
    "tp8",
    "tp8xsp",
    "tp2xfsdp4",
    "hsdp4xdpr2",
    "pp8xm16xgpipe",
    "pp8xm16",
)
# (composition, rank): rank 0 of each, and the last pipeline stage (the output layer and loss).
LARGE_RUNS: tuple[tuple[str, int], ...] = (
    *((t, 0) for t in LARGE_COMPOSITIONS),
    ("pp8xm16xgpipe", 7),
    ("pp8xm16", 7),
)

# Activation recomputation (Korthikanti et al. 2022): ``torch.utils.checkpoint`` on each block
# (full) or on each block's attention core (selective), under FSDP2 and under DTensor TP + SP.
RECOMPUTE_RUNS: tuple[tuple[str, int], ...] = (
    ("fsdp8xrecompute", 0),
    ("fsdp8xselective", 0),
    ("tp8xspxselective", 0),
)

# Pipelining with data parallelism: each stage wrapped with FSDP2 on a 2-D (pp, dp) mesh, pp
# outer; the first and the last stage (ranks 0 and 7), both schedules.
PIPELINE_DATA_RUNS: tuple[tuple[str, int], ...] = (
    ("pp4xfsdp2xm8", 0),
    ("pp4xfsdp2xm8", 7),
    ("pp4xfsdp2xm8xgpipe", 0),
    ("pp4xfsdp2xm8xgpipe", 7),
)

# A Llama-style model (``checker._torch._net.LlamaBlock``: separate q/k/v, SwiGLU, RMSNorm,
# grouped-query attention with 8 K/V heads of 16, no biases, no dropout): 0.51 B parameters.
LLAMA = NetConfig(
    layers=8, hidden=2048, heads=16, kv_heads=8, ffn=5632, vocab=32000, seq=1024, batch=1, dropout=0.0, llama=True
)
LLAMA_RUNS: tuple[tuple[str, int], ...] = (("fsdp8", 0), ("tp8", 0), ("tp8xsp", 0))


@dataclass
class Tracked:
    """``MemTracker``'s view of the measured step, in bytes per category."""

    tracker: str  # "MemTracker" or "FSDPMemTracker"
    end: dict[str, int]  # categories after the optimizer step
    peak: dict[str, int]  # categories at the step's peak total
    activation_max: int  # the largest activation category during the step
    parameters: int  # parameter categories at the end (FSDP2: sharded + unsharded)
    gradients: int
    optimizer: int  # per-element state: the optimizer category less Adam's ``step`` scalars


@dataclass
class Saved:
    """Saved-for-backward tensors at their peak, by (module, torch function) that saved them."""

    peak: int
    by_op: dict[str, int] = field(default_factory=dict)


@dataclass
class LargeResult:
    measured: Measured
    tracked: Tracked
    saved: Saved
    seconds: float


class _Attributing(SavedActivations):
    """``SavedActivations`` that remembers which module and ``torch`` function saved each storage,
    and the set of storages alive at the peak."""

    def __init__(self, modules: Sequence[nn.Module]) -> None:
        super().__init__(modules)
        self.label: dict[int, str] = {}
        self.where = "(outside modules)"
        self.function = "?"
        self.at_peak: dict[int, int] = {}

    def _pack(self, t: torch.Tensor) -> Any:
        key = storage_key(t)
        fresh = key not in self.live  # a storage identity can be reused once freed
        held = super()._pack(t)
        if isinstance(held, _Held):
            if fresh:
                self.label[key] = f"{self.where} {self.function}"
            if self.current == self.peak:
                self.at_peak = {k: v[0] for k, v in self.live.items()}
        return held

    def by_op(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for key, nbytes in self.at_peak.items():
            label = self.label.get(key, "?")
            out[label] = out.get(label, 0) + nbytes
        return dict(sorted(out.items(), key=lambda kv: -kv[1]))


class _Functions(TorchFunctionMode):
    """Names the outermost ``torch`` function running (the one whose autograd node saves)."""

    def __init__(self, saved: _Attributing) -> None:
        super().__init__()
        self.saved = saved
        self.depth = 0

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        outer = self.saved.function
        if self.depth == 0:
            self.saved.function = getattr(func, "__name__", str(func))
        self.depth += 1
        try:
            return func(*args, **(kwargs or {}))
        finally:
            self.depth -= 1
            self.saved.function = outer


@contextmanager
def _module_names(model: nn.Module, saved: _Attributing) -> Iterator[None]:
    """Keeps ``saved.where`` at the innermost module running (layer indices collapsed to ``*``)."""
    names = {id(m): re.sub(r"layers\.\d+", "layers.*", n) or "(root)" for n, m in model.named_modules()}
    stack: list[str] = []

    def pre(module: nn.Module, _args: Any) -> None:
        stack.append(saved.where)
        saved.where = names.get(id(module), saved.where)

    def post(module: nn.Module, _args: Any, _out: Any) -> None:
        saved.where = stack.pop() if stack else "(outside modules)"

    from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

    handles = [register_module_forward_pre_hook(pre), register_module_forward_hook(post)]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


class _Propagation:
    """Whether DTensor's sharding propagation is running. It computes the output metadata by
    running the op on *global*-shape fake tensors, in the active fake mode if there is one
    (``detect_fake_mode() or FakeTensorMode()``). MemTracker skips those ops by noting that they
    run under another fake mode than the one it was entered in, which holds in eager runs; when
    the whole step runs under one ``FakeTensorMode`` it cannot tell them apart and would count
    full-size logits and scores as activations. The tracker below skips them by this flag."""

    depth = 0

    @classmethod
    @contextmanager
    def marked(cls) -> Iterator[None]:
        from torch.distributed.tensor._sharding_prop import ShardingPropagator

        original = ShardingPropagator._propagate_tensor_meta_non_cached

        def wrapped(self: Any, *args: Any, **kwargs: Any) -> Any:
            cls.depth += 1
            try:
                return original(self, *args, **kwargs)
            finally:
                cls.depth -= 1

        ShardingPropagator._propagate_tensor_meta_non_cached = wrapped  # type: ignore[method-assign]
        try:
            yield
        finally:
            ShardingPropagator._propagate_tensor_meta_non_cached = original  # type: ignore[method-assign]


def _tracker(runner: Runner, model: nn.Module, opt: torch.optim.Optimizer) -> Any:
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed._tools.mem_tracker import MemTracker

    class _Max:
        """Records the largest activation category of any snapshot (MemTracker keeps the
        categories of the peak total only); skips DTensor's propagation tensors."""

        activation_max = 0

        def _track(self, reftype: Any, t: torch.Tensor) -> None:
            if not _Propagation.depth:
                super()._track(reftype, t)  # type: ignore[misc]

        def _pre_fw_hook(self, module: nn.Module, inputs: Any) -> None:
            # A pipeline stage's module runs once per micro-batch at the top level, which
            # MemTracker refuses ("multiple iterative calls"); its per-module statistics are
            # not used here, so they start afresh at each call.
            tracking, modules = self.memory_tracking, self._mod_tracker  # type: ignore[attr-defined]
            if module in tracking and not modules.is_bw:
                name = modules.get_known_fqn(module)
                if set(modules.parents) - {name} == {"Global"}:
                    del tracking[module]
            super()._pre_fw_hook(module, inputs)  # type: ignore[misc]

        def _update_peak_stats(self, peak_state: Any) -> None:
            for snap in self._curr_mem_snap.values():  # type: ignore[attr-defined]
                self.activation_max = max(self.activation_max, snap.get(_act_key(snap), 0))
            super()._update_peak_stats(peak_state)  # type: ignore[misc]

    if runner.engine in (Engine.FSDP, Engine.FSDP_TP, Engine.HSDP, Engine.PIPELINE_FSDP):

        class _FSDP(_Max, FSDPMemTracker):  # type: ignore[no-untyped-call]
            def _fsdp_state_pre_forward(self, fsdp_mod: Any, orig: Any) -> Any:
                # The same restart for FSDP2's own pre-forward hook (a pipeline stage's root).
                inner = super()._fsdp_state_pre_forward(fsdp_mod, orig)

                def restarted(*args: Any, **kwargs: Any) -> Any:
                    tracking, modules = self.memory_tracking, self._mod_tracker
                    if fsdp_mod in tracking and not modules.is_bw:
                        name = modules.get_known_fqn(fsdp_mod)  # type: ignore[no-untyped-call]
                        if set(modules.parents) - {name} == {"Global"}:
                            del tracking[fsdp_mod]
                    return inner(*args, **kwargs)

                return restarted

        return _FSDP(model, opt)

    class _Plain(_Max, MemTracker):  # type: ignore[no-untyped-call]
        pass

    t = _Plain()
    # ZeroRedundancyOptimizer keeps the rank's state in its local optimizer (``optim``), which
    # the tracker must be given too: it reads an optimizer's state where it is registered.
    inner = getattr(opt, "optim", None)
    t.track_external(model, opt, *([inner] if isinstance(inner, torch.optim.Optimizer) else []))
    return t


def _act_key(snap: dict[Any, int]) -> Any:
    return next(k for k in snap if str(getattr(k, "value", k)) == "Activation")


def _categories(snapshots: dict[torch.device, dict[Any, int]]) -> dict[str, int]:
    out: dict[str, int] = {}
    for snap in snapshots.values():
        for k, v in snap.items():
            name = str(getattr(k, "value", k))
            out[name] = out.get(name, 0) + int(v)
    return out


def measure_large(text: str, cfg: NetConfig = LARGE, rank: int = 0) -> LargeResult:
    """Build and step ``text`` on ``cfg`` under ``FakeTensorMode`` (fake group, one rank)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    comp = parse(text, devices=None)
    start = time.perf_counter()
    teardown = fake_group(comp.devices, rank)
    try:
        runner = Runner(comp, cfg, rank, comp.devices, fake=True)
        if runner.engine in (Engine.DDP, Engine.ZERO1, Engine.PIPELINE_DDP):
            raise ValueError(f"{text}: {runner.engine.value} is not measured under FakeTensorMode here")
        with FakeTensorMode(allow_non_fake_inputs=True):
            model, schedule = runner.build()
            opt = runner._optimizer(model)
            runner.step(model, schedule, opt, 0)
            tracker = _tracker(runner, model, opt)
            saved = _Attributing([model])
            recorder = CommRecorder()
            with (
                _Propagation.marked(),
                tracker,
                recorder,
                _Functions(saved),
                _module_names(model, saved),
                saved.track(),
            ):
                runner.step(model, schedule, opt, 1)
            measured = _measured(runner, model, opt, recorder)
            tracked = _tracked(tracker, opt, measured)
    finally:
        teardown()
    return LargeResult(measured, tracked, Saved(saved.peak, saved.by_op()), time.perf_counter() - start)


def _measured(runner: Runner, model: nn.Module, opt: torch.optim.Optimizer, recorder: CommRecorder) -> Measured:
    params, grads, per_element, scalars = model_state_tensors(model, opt)
    return Measured(
        parameters=storage_bytes(params),
        gradients=storage_bytes(grads),
        optimizer=storage_bytes(per_element),
        optimizer_scalars=storage_bytes(scalars),
        activations=0,
        calls=tuple(recorder.calls),
        stage=_stage(runner),
        engine=runner.engine,
    )


def _tracked(tracker: Any, opt: torch.optim.Optimizer, measured: Measured) -> Tracked:
    end = _categories(tracker.get_tracker_snapshot("current"))
    peak = _categories(tracker.get_tracker_snapshot("peak"))
    fsdp = "Sharded Param" in end
    params = end["Sharded Param"] + end["Unsharded Param"] if fsdp else end["Parameter"]
    grads = end["Sharded Grad"] + end["Unsharded Grad"] if fsdp else end["Gradient"]
    opt_key = "OptState" if fsdp else "Optstate"
    return Tracked(
        type(tracker).__mro__[2].__name__,
        end,
        peak,
        int(tracker.activation_max),
        params,
        grads,
        end[opt_key] - measured.optimizer_scalars,
    )


def compare_large(text: str, cfg: NetConfig = LARGE, rank: int = 0) -> tuple[Comparison, LargeResult]:
    """Our prediction against the fake-mode run: model states against the storages and against
    ``MemTracker``'s categories (both exact), activations against ``MemTracker``'s largest
    activation category (the row ``activations``), the per-device peak the CLI prints
    (placement and engine terms, ``formal._engine_effects``) against the tracker's peak total
    (the row ``peak total``); ``saved_row`` compares with ``SavedActivations``."""
    result = measure_large(text, cfg, rank)
    comp = parse(text, devices=None)
    predicted = predict(comp, cfg.formal(), rank=rank)
    m, t = result.measured, result.tracked
    rows = (
        *state_rows(predicted, m),
        Row("tracker parameters", predicted.parameters, t.parameters),
        Row("tracker gradients", predicted.gradients, t.gradients),
        Row("tracker optimizer", predicted.optimizer, t.optimizer),
        # MemTracker's largest activation category falls at the end of a forward: what autograd
        # saved and what the engine holds then (a pipeline stage's in-flight outputs, idle receive
        # buffers), the engine's terms at that moment.
        Row("activations", predicted.activations + _held_beyond_saved(predicted.engine), t.activation_max),
        Row(PEAK, predicted.peak, t.peak["Total"]),
    )
    comparison = Comparison(
        comp,
        m.engine.value,
        m.stage,
        rows,
        predicted.calls,
        tuple(sorted(m.calls)),
        result.seconds,
        rank,
        predicted.engine,
    )
    return comparison, result


def _held_beyond_saved(e: EnginePrediction) -> int:
    """Activation-state engine terms held at the end of a forward that autograd does not save."""
    return sum(
        t.bytes
        for t in e.terms
        if t.state == "activations" and t.moment in ("persistent", "forward") and t.key not in SAVED_BY_AUTOGRAD
    )


def saved_row(c: Comparison, r: LargeResult) -> Row:
    """Predicted activations against the peak of tensors saved for backward (the engine's
    held-not-saved terms left out)."""
    assert c.engine_prediction is not None
    beyond = _held_beyond_saved(c.engine_prediction)
    return Row("saved activations", c.row("activations").predicted - beyond, r.saved.peak)


def large_ok(c: Comparison, r: LargeResult) -> bool:
    """Model states exact (storages and tracker), collectives equal, the peak within its
    tolerance, activations within the tolerance of both MemTracker and SavedActivations. Under
    full recomputation MemTracker's largest activation category falls inside a checkpointed
    block's forward, whose intermediates are alive but never saved (and never held at the
    peak): there only the saved tensors are compared."""
    from checker._torch._compare import ACTIVATION_TOLERANCE

    transient = c.composition.options.recompute is Recompute.FULL
    memtracker = c.activations_within or transient
    return (
        c.model_states_exact
        and c.calls_equal
        and c.peak_within
        and memtracker
        and abs(saved_row(c, r).error) <= ACTIVATION_TOLERANCE
    )


def format_large(results: Sequence[tuple[Comparison, LargeResult]], cfg: NetConfig = LARGE) -> str:
    """One line per composition, then what was saved for backward, by op, for each."""
    from checker._torch._compare import pct as _pct

    params = cfg.formal().parameter_count()
    w = max([14, *(len(str(c.composition)) + 1 for c, _ in results)])
    head = (
        f"{'composition':<{w}}{'rank':>5}{'model states pred':>18}{'measured':>11}{'tracker':>11}{'err':>7}"
        f"{'activ. pred':>13}{'MemTracker':>13}{'err':>8}{'saved':>13}{'err':>8}"
        f"{'peak pred':>13}{'tracker':>13}{'err':>8}{'calls':>6}{'equal':>6}{'s':>6}"
    )
    lines = [f"{cfg}: {params / 1e6:.0f} M parameters, fp32 Adam, world 8, FakeTensorMode", head, "-" * len(head)]
    for c, r in results:
        ms, act, sv, pk = c.row("model states"), c.row("activations"), saved_row(c, r), c.row(PEAK)
        tracker = r.tracked.parameters + r.tracked.gradients + r.tracked.optimizer
        exact = "exact" if c.model_states_exact else _pct(ms.error)
        lines.append(
            f"{c.composition!s:<{w}}{c.rank:>5}{ms.predicted:>18}{ms.measured:>11}{tracker:>11}{exact:>7}"
            f"{act.predicted:>13}{act.measured:>13}{_pct(act.error):>8}{sv.measured:>13}{_pct(sv.error):>8}"
            f"{pk.predicted:>13}{pk.measured:>13}{_pct(pk.error):>8}"
            f"{len(c.measured_calls):>6}{c.calls_equal!s:>6}{c.seconds:>6.1f}"
        )
    worst = max(results, key=lambda cr: abs(cr[0].row("activations").error))[0]
    lines.append(
        f"worst MemTracker activation error: {_pct(worst.row('activations').error)} "
        f"({worst.composition}, rank {worst.rank}); model states exact in "
        f"{sum(c.model_states_exact for c, _ in results)}/{len(results)}, collective lists equal in "
        f"{sum(c.calls_equal for c, _ in results)}/{len(results)}"
    )
    worst_peak = max(results, key=lambda cr: abs(cr[0].row(PEAK).error))[0]
    lines.append(
        f"worst peak error against the tracker's peak total: {_pct(worst_peak.row(PEAK).error)} "
        f"({worst_peak.composition}, rank {worst_peak.rank})"
    )
    for c, r in results:
        lines.append(f"{c.composition} rank {c.rank}: saved for backward at the peak, by module and function (bytes)")
        for label, nbytes in r.saved.by_op.items():
            lines.append(f"    {label:<40}{nbytes:>12}")
        lines.append(f"    {'(MemTracker activations not saved)':<40}{r.tracked.activation_max - r.saved.peak:>12}")
    return "\n".join(lines)


__all__ = [
    "LARGE",
    "LARGE_COMPOSITIONS",
    "LARGE_RUNS",
    "LLAMA",
    "LLAMA_RUNS",
    "LargeResult",
    "PIPELINE_DATA_RUNS",
    "RECOMPUTE_RUNS",
    "Saved",
    "Tracked",
    "compare_large",
    "format_large",
    "large_ok",
    "measure_large",
    "saved_row",
]
