"""DeepSpeed ZeRO stages 1-3 on real gloo processes on the CPU, every rank measured.

``measure_deepspeed(world, texts)`` spawns ``world`` processes (one torch thread each, a gloo
group with a timeout on every collective, the whole world waited on with a deadline) that run
each ZeRO composition (``zero1<n>``, ``zero2<n>``, ``zero3<n>``) of the validation model
(``checker._torch._net``) through ``deepspeed.initialize`` with torch's Adam, fp32, and record:

* the bytes of the tensors the engine itself holds, by the attribute that holds them (the ZeRO
  optimizer's flat partitions, its gradient buffers, the optimizer's state, ZeRO-3's
  ``ds_tensor`` shards), after the backward (gradients) and after the step (the rest);
* every collective of one steady step (the third: ZeRO-3's second step still checks its
  recorded trace across ranks with broadcasts, ``reset_step`` in
  ``partitioned_param_coordinator.py``), from torch's dispatcher, ``reduce`` included.

The prediction reads the run's own DeepSpeed config through the importer
(``checker._import_deepspeed.deepspeed_effects``) and lists the calls with
``formal._engine_deepspeed.deepspeed_collectives``; the comparison is the list of
``(kind, group size, bytes)`` with each one's count.

Needs the ``deepspeed`` extra (installed with ``DS_BUILD_OPS=0``: no op is compiled; torch's
Adam is the client optimizer). Nothing in the core imports this module.
"""

from __future__ import annotations

import os
import pickle
import socket
import tempfile
import textwrap
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

from checker._parse import parse

if TYPE_CHECKING:
    from checker._torch._net import NetConfig

# The bucket DeepSpeed reduces gradients in, in elements (``reduce_bucket_size``; 5e8 by
# default, 2 GB of fp32 per rank, so the validation states it small and the prediction reads it).
REDUCE_BUCKET_ELEMENTS = 20_000
# ZeRO-3's fetch settings by name: every parameter partitioned and released after its use
# ("released", the placement's ZeRO-3); the same, released parameters kept when used again within
# REUSE_ELEMENTS ("reuse"); PREFETCH_ELEMENTS gathered ahead ("prefetch"), with a reuse distance
# too ("prefetch-reuse"); DeepSpeed's defaults ("defaults").
REUSE_ELEMENTS = 50_000
PREFETCH_ELEMENTS = 20_000
_RELEASED = {
    "stage3_param_persistence_threshold": 0,
    "stage3_model_persistence_threshold": 0,
    "stage3_max_reuse_distance": 0,
    "stage3_prefetch_bucket_size": 0,
}
ZERO3_SETTINGS: dict[str, dict[str, int]] = {
    "released": _RELEASED,
    "reuse": _RELEASED | {"stage3_max_reuse_distance": REUSE_ELEMENTS},
    "prefetch": _RELEASED | {"stage3_prefetch_bucket_size": PREFETCH_ELEMENTS},
    # a bucket smaller than most tensors: one parameter at a time is fetched ahead
    "prefetch-reuse": _RELEASED | {"stage3_prefetch_bucket_size": 100, "stage3_max_reuse_distance": PREFETCH_ELEMENTS},
    "defaults": {},
}
# A wedged collective ends the run instead of hanging it.
_TIMEOUT = timedelta(minutes=3)

# Which of the measured holders is which state. Keys: the holder names ``_holders`` reports.
STATE_OF_HOLDER: dict[str, str] = {
    "module parameters": "parameters",  # ZeRO-1/2: each parameter whole (fp32 here)
    "ds_tensor shards": "parameters",  # ZeRO-3: each parameter's own padded shard
    # The most the gradient holders hold at once, sampled at every collective of the step and
    # after it: the whole gradients (``param.grad``: ZeRO-1's gradients; under ZeRO-2/3 those
    # waiting for their bucket) and the partitions (ZeRO-1/2's ``averaged_gradients`` and
    # ``grads_in_partition``, ZeRO-3's ``grad_partitions_flat_buffer``).
    "param.grad (peak)": "gradients",
    "partition gradients (peak)": "gradients",
    "single_partition_of_fp32_groups": "optimizer",  # ZeRO-1/2: the fp32 master partition
    "fp32_partitioned_groups_flat": "optimizer",  # ZeRO-3: the fp32 master partition
    "optimizer state": "optimizer",  # Adam's exp_avg and exp_avg_sq of the master partition
    "ipg bucket": "buffers",  # the reduce bucket (``reduce_bucket_size`` elements) after the step
    "ipg bucket (peak over the step)": "buffers",
    # ZeRO-3: the parameters gathered whole (available, persistent ones always, or in flight),
    # at their most over the step: sampled after every collective, so right after every fetch.
    "gathered parameters (peak)": "gathered",
}


def ds_config(stage: int, cfg: NetConfig, multi_rank_allreduce: bool = True, zero3: str = "released") -> dict[str, Any]:
    """The DeepSpeed config of a ZeRO ``stage`` run: fp32, torch Adam as the client optimizer,
    every parameter partitioned under ZeRO-3 (persistence thresholds 0) and released after
    its use (``stage3_max_reuse_distance`` 0, no prefetch), the reduce bucket
    ``REDUCE_BUCKET_ELEMENTS``. ``multi_rank_allreduce`` False: ZeRO-1/2 send each gradient
    slice to its owner with ``reduce`` (``use_multi_rank_bucket_allreduce``).
    ``zero3`` (``ZERO3_SETTINGS``): ``"reuse"`` keeps a released parameter when the trace uses it
    again within ``REUSE_ELEMENTS``; ``"defaults"`` keeps DeepSpeed's persistence, reuse and
    prefetch defaults (every parameter of the small model is then persistent)."""
    zero: dict[str, Any] = {
        "stage": stage,
        "reduce_bucket_size": REDUCE_BUCKET_ELEMENTS,
        "allgather_bucket_size": REDUCE_BUCKET_ELEMENTS,
        "overlap_comm": False,
        "contiguous_gradients": True,
        "use_multi_rank_bucket_allreduce": multi_rank_allreduce,
    }
    if stage == 3:
        zero |= ZERO3_SETTINGS[zero3]
    return {
        "train_micro_batch_size_per_gpu": cfg.batch,
        "gradient_accumulation_steps": 1,
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }


@dataclass(frozen=True)
class DSMeasured:
    """One ZeRO composition on one rank: bytes per holder and the step's collectives
    (``(kind, group size, bytes)``; ``kind`` a torch.distributed function's name)."""

    composition: str
    rank: int
    holders: dict[str, int]
    calls: tuple[tuple[str, int, int], ...]
    seconds: float

    def state(self, name: str) -> int:
        return sum(b for h, b in self.holders.items() if STATE_OF_HOLDER.get(h) == name)


class Recorder:
    """Every c10d collective of a block, from the dispatcher (``CommRecorder``'s conventions:
    all-gather the gathered output, reduce-scatter its input, the others the tensor), ``reduce``
    included, as ``(kind, group size, bytes)``; and at every call, the bytes the engine's
    gradient holders and reduce bucket hold then (their peaks over the step)."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.calls: list[tuple[str, int, int]] = []
        self.whole_peak = 0  # ``param.grad``
        self.partition_peak = 0  # the engine's partitioned gradient holders
        self.bucket_peak = 0
        self.gathered_peak = 0  # ZeRO-3's gathered parameters

    def sample(self) -> None:
        whole, partition = _gradient_tensors(self.engine)
        # Elements, not storages: under contiguous gradients a ``param.grad`` can be a view of
        # the reduce bucket, whose storage is the bucket's row.
        self.whole_peak = max(self.whole_peak, _nbytes(whole))
        self.partition_peak = max(self.partition_peak, _nbytes(_flat(partition)))
        self.bucket_peak = max(self.bucket_peak, _ipg_bytes(self.engine.optimizer))
        self.gathered_peak = max(self.gathered_peak, _gathered_bytes(self.engine))

    @contextmanager
    def active(self) -> Iterator[Recorder]:
        from checker._torch._record import CommRecorder

        outer = self

        class _Mode(CommRecorder):  # type: ignore[no-untyped-call]
            def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
                ns, name = func.namespace, func._schema.name.split("::")[-1]
                if ns == "c10d" and name == "reduce_":
                    outer.calls.append(("reduce", _group_size(args[1]), _nbytes(args[0])))
                    outer.sample()
                    return func(*args, **(kwargs or {}))
                before = len(self.calls)
                result = super().__torch_dispatch__(func, types, args, kwargs)
                for call in self.calls[before:]:
                    outer.calls.append((call.kind.value, call.group_size, call.bytes))
                    outer.sample()
                return result

        with _Mode():
            yield self
        self.sample()


def _gathered_bytes(engine: Any) -> int:
    """ZeRO-3's parameters gathered now, whole: available (persistent ones always) or in flight
    (``ZeroParamStatus``; 0 under ZeRO-1/2, whose parameters have no status)."""
    total = 0
    for p in engine.module.parameters():
        status = getattr(p, "ds_status", None)
        if status is None or status.name == "NOT_AVAILABLE":
            continue
        total += int(p.ds_numel) * int(p.element_size())
    return total


def _flat(x: Any) -> list[Any]:
    """The tensors of a (nested) list or dict of tensors."""
    if isinstance(x, dict):
        return [t for v in x.values() for t in _flat(v)]
    if isinstance(x, list | tuple):
        return [t for v in x for t in _flat(v)]
    return [] if x is None else [x]


def _group_size(arg: Any) -> int:
    from checker._torch._record import _group_size as size

    return size(arg)


def _nbytes(x: Any) -> int:
    import torch

    if isinstance(x, torch.Tensor):
        return int(x.numel() * x.element_size())
    if isinstance(x, list | tuple):
        return sum(_nbytes(y) for y in x)
    return 0


def _gradient_tensors(engine: Any) -> tuple[list[Any], list[Any]]:
    """The whole gradients (``param.grad``) and the engine's flat gradient partition: ZeRO-2's
    ``grads_in_partition``, ZeRO-3's ``grad_partitions_flat_buffer``, else (ZeRO-1) the
    partition slices of ``averaged_gradients``."""
    opt = engine.optimizer
    whole: list[Any] = [p.grad for p in engine.module.parameters() if p.grad is not None]
    for name in ("grad_partitions_flat_buffer", "grads_in_partition", "averaged_gradients"):
        value = getattr(opt, name, None)
        if value is not None:
            return whole, [value]
    return whole, []


def _bytes_of(x: Any) -> int:
    """Distinct storages behind a tensor or a (nested) list/dict of tensors."""
    import torch

    seen: dict[int, int] = {}

    def walk(y: Any) -> None:
        if isinstance(y, torch.Tensor):
            if y.numel():
                seen[int(y.untyped_storage()._cdata)] = int(y.untyped_storage().nbytes())
        elif isinstance(y, list | tuple):
            for z in y:
                walk(z)
        elif isinstance(y, dict):
            for z in y.values():
                walk(z)

    walk(x)
    return sum(seen.values())


def _holders(engine: Any) -> dict[str, int]:
    """The bytes of the tensors the engine holds after the step, by holder (``STATE_OF_HOLDER``)."""
    opt = engine.optimizer
    params = list(engine.module.parameters())
    out: dict[str, int] = {}
    if hasattr(params[0], "ds_tensor"):
        out["ds_tensor shards"] = _bytes_of([p.ds_tensor for p in params])
        out["module parameters"] = _bytes_of([p.data for p in params if p.data.numel()])
    else:
        out["module parameters"] = _bytes_of(params)
    for name in ("single_partition_of_fp32_groups", "fp32_partitioned_groups_flat"):
        value = getattr(opt, name, None)
        if value is not None:
            out[name] = _bytes_of(value)
    inner = opt.optimizer
    out["optimizer state"] = _bytes_of(
        [v for s in inner.state.values() for v in s.values() if hasattr(v, "dim") and v.dim() > 0]
    )
    out["ipg bucket"] = _ipg_bytes(opt)
    return out


def _ipg_bytes(opt: Any) -> int:
    """The reduce bucket's bytes: ZeRO-1/2's ``ipg_buffer`` per dtype, ZeRO-3's flat bucket."""
    found = []
    for name, value in vars(opt).items():
        if "ipg" in name.lower():
            found.append(value)
            buckets = value.values() if isinstance(value, dict) else []
            found += [getattr(b, "buffer", None) for b in buckets]
    return _bytes_of([f for f in found if f is not None])


def _worker(
    rank: int, world: int, port: int, out: str, texts: list[str], multi_rank_allreduce: bool, zero3: str
) -> None:
    os.dup2(2, 1)  # DeepSpeed logs to stdout: keep the parent's stdout (a report, JSON) clean
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=_TIMEOUT
    )
    results = []
    try:
        for text in texts:
            start = time.perf_counter()
            held, calls = _run_one(text, rank, world, multi_rank_allreduce, zero3)
            results.append(DSMeasured(text, rank, held, calls, time.perf_counter() - start))
    finally:
        dist.destroy_process_group()
    with open(Path(out) / f"rank{rank}.pkl", "wb") as f:
        pickle.dump(results, f)


def stage_of(text: str, world: int) -> int:
    comp = parse(text, devices=world)
    names = {s.name for s in comp.strategies}
    for stage in (1, 2, 3):
        if f"zero{stage}" in names:
            return stage
    raise ValueError(f"{text}: not a ZeRO stage (zero1, zero2, zero3)")


def _run_one(
    text: str, rank: int, world: int, multi_rank_allreduce: bool, zero3: str
) -> tuple[dict[str, int], tuple[tuple[str, int, int], ...]]:
    import deepspeed  # type: ignore[import-not-found, unused-ignore]
    import torch

    from checker._torch._net import Net, NetConfig, batch, loss_fn

    cfg = NetConfig()
    torch.manual_seed(0)
    net = Net(cfg)
    adam = torch.optim.Adam(net.parameters(), lr=1e-3)
    engine, *_ = deepspeed.initialize(
        model=net, optimizer=adam, config=ds_config(stage_of(text, world), cfg, multi_rank_allreduce, zero3)
    )
    steps = 3  # the third step is a steady one (optimizer state exists, ZeRO-3's trace checked)
    rec = Recorder(engine)
    for step in range(steps):
        ids, targets = batch(cfg, cfg.batch * world, seed=1000 + step)
        mine = slice(rank * cfg.batch, (rank + 1) * cfg.batch)
        if step < steps - 1:
            engine.backward(loss_fn(cfg, engine(ids[mine]), targets[mine]))
            engine.step()
            continue
        with rec.active():
            engine.backward(loss_fn(cfg, engine(ids[mine]), targets[mine]))
            engine.step()
    held = _holders(engine)
    held["param.grad (peak)"] = rec.whole_peak
    held["partition gradients (peak)"] = rec.partition_peak
    held["ipg bucket (peak over the step)"] = rec.bucket_peak
    held["gathered parameters (peak)"] = rec.gathered_peak
    return held, tuple(rec.calls)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def measure_deepspeed(
    world: int, texts: tuple[str, ...], multi_rank_allreduce: bool = True, zero3: str = "released"
) -> list[DSMeasured]:
    """Run ``texts`` on ``world`` gloo processes (one spawn); every rank's measurements, in
    composition order, then rank order."""
    from checker._torch._isolate import run_world

    with tempfile.TemporaryDirectory() as tmp:
        run_world(
            _worker,
            (world, _free_port(), tmp, list(texts), multi_rank_allreduce, zero3),
            world,
            f"deepspeed world {world}",
        )
        per_rank = []
        for r in range(world):
            with open(Path(tmp) / f"rank{r}.pkl", "rb") as f:
                per_rank.append(pickle.load(f))
    return [per_rank[r][i] for i in range(len(texts)) for r in range(world)]


# ---- the prediction under the ``deepspeed`` engine, and the comparison --------------------


def _vocabulary_kinds() -> frozenset[str]:
    """The collective kinds of the op vocabulary; a recorded call of another kind is reported as
    not modelled, never compared as one of these."""
    from formal._vocab import OpKind

    return frozenset(k.value for k in OpKind if k.is_collective)


@dataclass(frozen=True)
class DSComparison:
    """One ZeRO composition on one rank: model states and the reduce bucket predicted (placement
    plus ``formal._engine_deepspeed.deepspeed_terms``) against DeepSpeed's own tensors, and the
    collectives: as a list, and as bytes per kind."""

    composition: str
    rank: int
    world: int
    rows: tuple[tuple[str, int, int], ...]  # (quantity, predicted, measured)
    predicted_calls: tuple[tuple[str, int, int], ...]
    measured_calls: tuple[tuple[str, int, int], ...]
    predicted_volume: dict[str, int]
    measured_volume: dict[str, int]
    not_modelled: tuple[str, ...]  # recorded kinds the vocabulary lacks, settings the terms lack
    seconds: float
    terms: tuple[Any, ...]
    collective_terms: tuple[Any, ...] = ()

    @property
    def model_states_exact(self) -> bool:
        return all(p == m for q, p, m in self.rows if q not in _BUFFER_ROWS)

    @property
    def bucket_exact(self) -> bool:
        return all(p == m for q, p, m in self.rows if q == "reduce bucket")

    @property
    def gathered_exact(self) -> bool:
        """ZeRO-3's gathered working set at its peak (True where it has none)."""
        return all(p == m for q, p, m in self.rows if q == "gathered (peak)")

    @property
    def calls_equal(self) -> bool:
        from collections import Counter

        return Counter(self.predicted_calls) == Counter(self.measured_calls)

    @property
    def volumes_equal(self) -> bool:
        return self.predicted_volume == self.measured_volume

    @property
    def ok(self) -> bool:
        return (
            self.model_states_exact
            and self.bucket_exact
            and self.gathered_exact
            and self.calls_equal
            and not self.not_modelled
        )


# The rows beside the model states: the reduce bucket, ZeRO-3's gathered parameters at their peak.
_BUFFER_ROWS = ("reduce bucket", "gathered (peak)")


@dataclass(frozen=True)
class DSPrediction:
    """``predict_deepspeed``'s answer: per-rank bytes, the collective calls (sorted), the memory
    terms and collective terms behind them, and what the terms do not model."""

    states: dict[str, int]
    calls: tuple[tuple[str, int, int], ...]
    terms: tuple[Any, ...]
    collective_terms: tuple[Any, ...]
    not_modelled: tuple[str, ...]


def predict_deepspeed(
    text: str, world: int, rank: int = 0, multi_rank_allreduce: bool = True, zero3: str = "released"
) -> DSPrediction:
    """Per-rank bytes (parameters, gradients, optimizer, reduce bucket) and collective calls of
    ``text`` under the ``deepspeed`` engine: the placement's memory, ``deepspeed_terms`` and
    ``deepspeed_collectives``, with the engine settings the importer reads from the run's own
    config (``ds_config``)."""
    from checker._import_deepspeed import deepspeed_effects
    from checker._torch._net import NetConfig
    from checker._torch._predict import harness_precision
    from formal._costs import memory
    from formal._engine_deepspeed import deepspeed_collectives, deepspeed_terms, zero3_replay
    from formal._exact import exact_int
    from formal._program import group_sizes
    from formal._vocab import State

    cfg = NetConfig()
    model = cfg.formal()
    precision = harness_precision()
    pl = parse(text, devices=world).placement(model)
    mem = memory(pl, model, precision, group_sizes(model))
    fx = deepspeed_effects(ds_config(stage_of(text, world), cfg, multi_rank_allreduce, zero3), "ds_config")
    terms = tuple(t for t in deepspeed_terms(pl, model, precision, mem, fx, data_rank=rank) if t.bytes)

    def add(state: str) -> int:
        return sum(t.bytes for t in terms if t.state == state)

    replay = zero3_replay(pl, model, fx)
    states = {
        "parameters": exact_int(mem.parameters.total),
        "gradients": exact_int(mem.gradients.total) + add("gradients"),
        "optimizer": exact_int(mem.optimizer.total) + add("optimizer"),
        "reduce bucket": sum(t.bytes for t in terms if t.key == "deepspeed_reduce_bucket"),
        # the replayed fetches' most elements gathered at once and the persistent parameters, whole
        "gathered (peak)": 0
        if replay is None
        else (replay.peak + replay.persistent_elements) * precision.wire_bytes_of(State.PARAMETERS),
    }
    collectives, notes = deepspeed_collectives(pl, model, precision, fx)
    calls = sorted((t.kind.value, t.ranks, b) for t in collectives for b in t.calls)
    return DSPrediction(states, tuple(calls), terms, collectives, notes)


def _volume(calls: tuple[tuple[str, int, int], ...]) -> dict[str, int]:
    out: dict[str, int] = {}
    for kind, _, nbytes in calls:
        out[kind] = out.get(kind, 0) + nbytes
    return out


def compare_deepspeed(
    m: DSMeasured, world: int, multi_rank_allreduce: bool = True, zero3: str = "released"
) -> DSComparison:
    """``m`` against ``predict_deepspeed`` for its rank (the settings as it ran)."""
    pred = predict_deepspeed(m.composition, world, m.rank, multi_rank_allreduce, zero3)
    states, calls, terms = pred.states, pred.calls, pred.terms
    stage = stage_of(m.composition, world)
    measured = {
        "parameters": m.holders.get("ds_tensor shards", 0) if stage == 3 else m.holders["module parameters"],
        # ZeRO-1 holds the whole gradients (``param.grad``) through backward; ZeRO-2/3 the
        # partition (their ``param.grad`` only waits for its bucket: the bucket's row).
        "gradients": m.holders["param.grad (peak)" if stage == 1 else "partition gradients (peak)"],
        "optimizer": m.state("optimizer"),
        "reduce bucket": m.holders["ipg bucket (peak over the step)"],
        "gathered (peak)": m.holders.get("gathered parameters (peak)", 0),
    }
    names = ("parameters", "gradients", "optimizer", "reduce bucket", "gathered (peak)")
    rows = tuple((q, states[q], measured[q]) for q in names[: 5 if stage == 3 else 4])
    rows = (*rows[:3], ("model states", sum(r[1] for r in rows[:3]), sum(r[2] for r in rows[:3])), *rows[3:])
    kinds = _vocabulary_kinds()
    unknown = sorted({c[0] for c in m.calls if c[0] not in kinds})
    not_modelled = (*(f"{k} (no such kind in the op vocabulary)" for k in unknown), *pred.not_modelled)
    return DSComparison(
        m.composition,
        m.rank,
        world,
        rows,
        calls,
        tuple(sorted(m.calls)),
        _volume(calls),
        _volume(tuple(sorted(m.calls))),
        not_modelled,
        m.seconds,
        terms,
        pred.collective_terms,
    )


def _differences(c: DSComparison) -> list[str]:
    """The ``(kind, group size, bytes)`` entries whose counts differ: predicted, recorded."""
    from collections import Counter

    p, m = Counter(c.predicted_calls), Counter(c.measured_calls)
    keys = sorted(k for k in set(p) | set(m) if p[k] != m[k])
    return [f"  {k[0]:<15} {k[1]:>3} ranks {k[2]:>10} B: {p[k]:>4} predicted, {m[k]:>4} recorded" for k in keys]


def format_deepspeed(results: list[DSComparison]) -> str:
    """Per composition and rank: model states and bucket predicted against measured, the
    collectives per kind (calls and bytes), the differing calls, the terms (fits 80 columns)."""
    lines = []
    for c in results:
        lines.append(f"{c.composition} on deepspeed, rank {c.rank} of {c.world} (gloo), {c.seconds:.1f} s")
        lines.append(f"  {'bytes per rank':<16}{'predicted':>12}{'measured':>12}")
        lines += [f"  {q:<16}{p:>12}{mm:>12}{'' if p == mm else '   <- differs'}" for q, p, mm in c.rows]
        lines.append(f"  {'collectives':<16}{'calls':>7}{'recorded':>9}{'bytes':>12}{'recorded':>12}")
        for kind in sorted(set(c.predicted_volume) | set(c.measured_volume)):
            n_p = sum(1 for k, _, _ in c.predicted_calls if k == kind)
            n_m = sum(1 for k, _, _ in c.measured_calls if k == kind)
            p, mm = c.predicted_volume.get(kind, 0), c.measured_volume.get(kind, 0)
            same = p == mm and n_p == n_m
            lines.append(f"  {kind:<16}{n_p:>7}{n_m:>9}{p:>12}{mm:>12}{'' if same else '  <- differs'}")
        differing = _differences(c)
        lines += differing[:8] + ([f"  ... {len(differing) - 8} more"] if len(differing) > 8 else [])
        checks = [
            f"collectives list equal: {c.calls_equal}",
            f"model states exact: {c.model_states_exact}",
            f"bucket exact: {c.bucket_exact}",
        ]
        if any(q == "gathered (peak)" for q, _, _ in c.rows):
            checks.append(f"gathered exact: {c.gathered_exact}")
        said = [
            "; ".join(checks),
            *(f"not modelled: {line}" for line in c.not_modelled),
            *(f"+ {t.label}: {t.bytes} B, {t.moment}" for t in c.terms),
            *(f"+ {t.label}: {len(t.calls)} x {t.kind.value}, {t.bytes} B" for t in c.collective_terms),
        ]
        lines += [
            row for line in said for row in textwrap.wrap(line, 80, initial_indent="  ", subsequent_indent="    ")
        ]
    return "\n".join(lines)


def as_json(c: DSComparison) -> dict[str, Any]:
    return {
        "composition": c.composition,
        "engine": "deepspeed",
        "rank": c.rank,
        "world": c.world,
        "bytes": {q: {"predicted": p, "measured": m} for q, p, m in c.rows},
        "collectives": {
            "predicted": [list(x) for x in c.predicted_calls],
            "recorded": [list(x) for x in c.measured_calls],
            "equal": c.calls_equal,
            "bytes_per_kind": {"predicted": c.predicted_volume, "recorded": c.measured_volume},
            "not_modelled": list(c.not_modelled),
        },
        "model_states_exact": c.model_states_exact,
        "bucket_exact": c.bucket_exact,
        "gathered_exact": c.gathered_exact,
        "ok": c.ok,
        "terms": [{"name": t.key, "label": t.label, "bytes": t.bytes, "moment": t.moment} for t in c.terms],
        "collective_terms": [
            {"name": t.key, "label": t.label, "kind": t.kind.value, "ranks": t.ranks, "calls": list(t.calls)}
            for t in c.collective_terms
        ],
    }


def cli_validation(composition: Any) -> tuple[dict[str, Any], str]:
    """For ``check-composition zero<k><n> --validate deepspeed``: every rank of ``n`` (2 to 4)
    gloo processes; the JSON object and the text. ``InputError`` (one line, exit 2) for other
    compositions or without DeepSpeed."""
    from formal.errors import InputError

    text = str(composition)
    names = [s.name for s in composition.strategies]
    world = int(composition.devices)
    if len(names) != 1 or names[0] not in ("zero1", "zero2", "zero3") or world not in (2, 3, 4):
        raise InputError(f"--validate deepspeed: {text}: runs one ZeRO stage on 2 to 4 processes (zero12 ... zero34)")
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # no accelerator probing (and its warning)
    try:
        import deepspeed  # type: ignore[import-not-found, unused-ignore]  # noqa: F401
    except ImportError as err:
        raise InputError(
            "--validate deepspeed: DeepSpeed is not installed (DS_BUILD_OPS=0 pip install -e '.[deepspeed]')"
        ) from err
    start = time.perf_counter()
    results = [compare_deepspeed(m, world) for m in measure_deepspeed(world, (text,))]
    note = (
        "validated on the small model of checker._torch._net (not --model), fp32, torch Adam,\n"
        f"DeepSpeed on {world} gloo processes, {time.perf_counter() - start:.1f} s"
    )
    doc = {"ok": all(c.ok for c in results), "ranks": [as_json(c) for c in results]}
    return doc, note + "\n" + format_deepspeed(results)
