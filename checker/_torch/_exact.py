"""Equivalence on a real engine: distributed training on gloo processes against one device.

With the exact variant of the small model (integer weights and data, exact nonlinearities)
and SGD with a dyadic learning rate, every float32 sum is exact, so a correct composition
matches single-device training bit for bit, and a broken one (a fault injected into the
PyTorch run) differs. ``reference_is_exact`` checks the premise: the float32 reference equals
a float64 run of the same steps.

The engines covered: DDP, FSDP2 (both reshard settings), ZeRO-1, DTensor TP with and without
sequence parallelism, FSDP+TP, HSDP and pipelining (GPipe and 1F1B). A pipeline of degree p
runs a model whose layer count p divides (``config_for``); each stage holds only its layers,
so every parameter is compared on the one rank that holds it.

Faults, each the PyTorch form of a broken step program that z3 refutes (``faulty_program``:
the derived program minus the ops the run skips):
``SKIP_REDUCTION`` runs DDP's backward under ``no_sync()`` (the gradient all-reduce along dp
never happens); ``NO_REFRESH`` stops ``ZeroRedundancyOptimizer`` from broadcasting the updated
shards (replicated parameters go stale after a sharded update); ``SKIP_DPR_REDUCTION`` drops
HSDP's gradient all-reduce across the replicate dimension (``dpr``) inside FSDP2's reduction,
after the reduce-scatter along dp (which already averages over dp, so what is left is the
derived program minus the dpr all-reduce, scaling included); ``SKIP_SP_REDUCTION`` leaves the
``Partial`` gradients of the replicated weights used on sequence shards (norms, row-parallel
biases) unreduced: each tp rank updates them with its own shard's partial sum, the derived
program minus its tp gradient all-reduces (the missing sequence-parallel all-reduce Megatron
guards against).

Each injected fault counts the operations it skipped and fails if it skipped none, so a fault
that silently stopped applying would not pass as a divergence.
"""

from __future__ import annotations

import math
import os
import socket
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from datetime import timedelta
from enum import StrEnum
from pathlib import Path
from typing import Any
from unittest import mock

import torch
import torch.distributed as dist
from torch import nn

from checker._parse import parse
from checker._torch import _engine
from checker._torch._engine import Engine, Runner
from checker._torch._isolate import run_world
from checker._torch._net import Net, NetConfig, batch, init_exact_, loss_fn
from formal._program import StepProgram, derive_program
from formal._strategies import Composition
from formal._verdict import Status
from formal._vocab import Axis, OpKind, Phase

# Small enough that float32 stays exact for two steps at every replica count up to 4
# (``reference_is_exact`` checks it); two steps, so the second forward reads what the first
# update wrote (a stale replica is read).
EXACT = NetConfig(layers=2, hidden=8, heads=4, vocab=16, seq=4, batch=2, dropout=0.0, exact=True)
LR = 2.0**-4  # dyadic: an SGD update of a dyadic gradient stays exact
STEPS = 2


class Fault(StrEnum):
    NONE = "none"
    SKIP_REDUCTION = "skip-reduction"
    NO_REFRESH = "no-refresh"
    SKIP_DPR_REDUCTION = "skip-dpr-reduction"
    SKIP_SP_REDUCTION = "skip-sp-grad-reduction"
    NO_BACKWARD_SEND = "no-backward-send"


@dataclass(frozen=True)
class Case:
    composition: str  # at the world size of the run
    fault: Fault = Fault.NONE
    fsdp1: bool = False  # fsdp-sgo on FSDP1 (``Runner.fsdp1``) instead of FSDP2

    def label(self) -> str:
        name = f"{self.composition} (FSDP1)" if self.fsdp1 else self.composition
        return name if self.fault is Fault.NONE else f"{name} + {self.fault.value}"


def cases(world: int) -> list[Case]:
    """The runs at one world size: valid compositions and the injected faults. The 2-D
    compositions (FSDP+TP, HSDP, a pipeline with DDP or FSDP2 on each stage) need a world
    divisible by 4; the pipelines run 2 x world micro-batches, GPipe and 1F1B."""
    w, half = world, world // 2
    two_d = world % 4 == 0
    valid = [
        Case(f"ddp{w}"),
        Case(f"fsdp{w}"),
        Case(f"fsdp-sgo{w}"),
        Case(f"fsdp-sgo{w}", fsdp1=True),  # ZeRO-2 on FSDP1's SHARD_GRAD_OP
        Case(f"zero1{w}"),
        Case(f"tp{w}"),
        Case(f"tp{w}xsp"),
        *([Case(f"tp2xfsdp{half}"), Case(f"hsdp{half}xdpr2")] if two_d else []),
        *([Case(f"pp2xdp{half}xm4"), Case(f"pp2xfsdp{half}xm4")] if two_d else []),
        Case(f"pp{w}xm{2 * w}xgpipe"),
        Case(f"pp{w}xm{2 * w}"),
    ]
    faults = [
        Case(f"ddp{w}", Fault.SKIP_REDUCTION),
        Case(f"zero1{w}", Fault.NO_REFRESH),
        Case(f"tp{w}xsp", Fault.SKIP_SP_REDUCTION),
        Case(f"pp{w}xm{2 * w}", Fault.NO_BACKWARD_SEND),
        *([Case(f"hsdp{half}xdpr2", Fault.SKIP_DPR_REDUCTION)] if two_d else []),
    ]
    return valid + faults


def config_for(comp: Composition) -> NetConfig:
    """The exact model a composition runs: ``EXACT``, with its layer count raised to a multiple
    of the pipeline degree when a pipeline needs whole layers per stage."""
    stages = comp.mesh().get(Axis.PP, 1)
    return replace(EXACT, layers=math.lcm(EXACT.layers, stages))


@dataclass(frozen=True)
class Setup:
    """What the single-device reference of a run must reproduce: the model, the number of
    data-parallel replicas and the micro-batches a pipeline splits each replica's batch into."""

    cfg: NetConfig
    replicas: int
    micro_batches: int


def setup_for(comp: Composition, world: int) -> Setup:
    runner = Runner(comp, config_for(comp), 0, world, fake=False)
    # A pipeline runs ``micro_batches`` micro-batches per step, each loss scaled by 1/m
    # (``Runner._pipeline``); the other engines run the replica's whole batch in one backward.
    m = comp.options.micro_batches if runner.pipelined() else 1
    assert runner.samples_per_replica() == runner.cfg.batch * m, "micro-batches outside a pipeline"
    return Setup(runner.cfg, runner.data_replicas(), m)


def faulty_program(comp: Composition, fault: Fault, cfg: NetConfig | None = None) -> StepProgram:
    """The step program the faulty PyTorch run executes: the derived one minus what it skips."""
    model = (cfg or config_for(comp)).formal()
    program = derive_program(comp.placement(model), model)
    if fault is Fault.NONE:
        return program
    phase, axis, kinds = _SKIPPED[fault]
    return program.with_ops(
        op for op in program.ops if not (op.phase is phase and (axis is None or op.axis is axis) and op.kind in kinds)
    )


_REDUCTIONS = frozenset({OpKind.ALL_REDUCE, OpKind.REDUCE_SCATTER})
# What each fault's run skips: the ops of this phase, on this axis, of these kinds.
_SKIPPED: dict[Fault, tuple[Phase, Axis | None, frozenset[OpKind]]] = {  # None: any axis
    Fault.SKIP_REDUCTION: (Phase.GRAD_SYNC, Axis.DP, _REDUCTIONS),
    Fault.NO_REFRESH: (Phase.REFRESH, None, frozenset({OpKind.ALL_GATHER})),
    Fault.SKIP_DPR_REDUCTION: (Phase.GRAD_SYNC, Axis.DPR, _REDUCTIONS),
    Fault.SKIP_SP_REDUCTION: (Phase.GRAD_SYNC, Axis.TP, _REDUCTIONS),
    Fault.NO_BACKWARD_SEND: (Phase.BACKWARD, Axis.PP, frozenset({OpKind.SEND_RECV})),
}


def z3_status(case: Case, world: int) -> Status | None:
    """z3's verdict on the program the run executes, when the solver module is present."""
    try:
        from formal._smt import decide
    except ImportError:
        return None
    comp = parse(case.composition, devices=world)
    cfg = config_for(comp)
    program = faulty_program(comp, case.fault, cfg)
    return decide(comp, program, cfg.formal(), devices=world).status


# ---- single device ------------------------------------------------------------------------


def reference(
    cfg: NetConfig, replicas: int, dtype: torch.dtype = torch.float32, steps: int = STEPS, micro_batches: int = 1
) -> dict[str, torch.Tensor]:
    """Single-device SGD on the global batch (``batch x micro_batches`` samples per replica,
    as ``Runner.step_data`` draws it); the loss is the mean over the replicas' and
    micro-batches' shares."""
    torch.manual_seed(0)
    net = Net(cfg)
    init_exact_(net, 0)
    net = net.to(dtype)
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    samples = cfg.batch * micro_batches * replicas
    for step in range(steps):
        opt.zero_grad()
        ids, targets = batch(cfg, samples, seed=1000 + step)
        loss = loss_fn(cfg, net(ids), targets.to(dtype), 1.0 / (replicas * micro_batches))
        loss.backward()  # type: ignore[no-untyped-call]
        opt.step()
    return {k: v.detach().clone() for k, v in net.state_dict().items()}


def reference_is_exact(cfg: NetConfig, replicas: int, micro_batches: int = 1) -> bool:
    """The premise of bit-for-bit comparison: float32 training equals float64 training."""
    f32 = reference(cfg, replicas, torch.float32, micro_batches=micro_batches)
    f64 = reference(cfg, replicas, torch.float64, micro_batches=micro_batches)
    return all(torch.equal(f32[k].double(), f64[k]) for k in f32)


# ---- distributed (one process per rank) -----------------------------------------------------


def _full_state(model: nn.Module) -> dict[str, torch.Tensor]:
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.distributed.tensor import DTensor

    if isinstance(model, FullyShardedDataParallel):  # FSDP1: its flat shards made whole again
        with FullyShardedDataParallel.summon_full_params(model):
            return {
                name.replace("_fsdp_wrapped_module.", ""): p.detach().clone()
                for name, p in model.module.named_parameters()
            }
    out: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():
        full = p.full_tensor() if isinstance(p, DTensor) else p
        out[name.removeprefix("module.")] = full.detach().clone()
    return out


@contextmanager
def _skip_all_reduce(group: Any) -> Iterator[list[int]]:
    """The injected HSDP fault: every ``all_reduce`` among the ranks of ``group`` (the replicate
    dimension) is skipped, the tensor left as the reduce-scatter along dp produced it. Yields
    the count. Groups are matched by their ranks: meshes built for earlier runs in the same
    process hand FSDP2 other group objects over the same ranks."""
    real = dist.all_reduce
    ranks = dist.get_process_group_ranks(group)
    skipped = [0]

    def all_reduce(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        on = kwargs.get("group", args[1] if len(args) > 1 else None)
        if on is not None and dist.get_process_group_ranks(on) == ranks:
            skipped[0] += 1
            return None
        return real(tensor, *args, **kwargs)

    with mock.patch.object(dist, "all_reduce", all_reduce):
        yield skipped


def _keep_partial_gradients(skipped: list[int]) -> Callable[[nn.Module], None]:
    """The injected sequence-parallel fault, in place of ``reduce_partial_gradients``: each
    ``Partial`` gradient is taken as this rank's local partial sum, not all-reduced along tp."""
    from torch.distributed.tensor import DTensor

    def keep(model: nn.Module) -> None:
        for p in model.parameters():
            g = p.grad
            if isinstance(g, DTensor) and isinstance(p, DTensor) and any(x.is_partial() for x in g.placements):
                p.grad = DTensor.from_local(g.to_local(), g.device_mesh, p.placements, run_check=False)
                skipped[0] += 1

    return keep


def _run_case(case: Case, rank: int, world: int) -> dict[str, torch.Tensor]:
    comp = parse(case.composition, devices=world)
    runner = Runner(
        comp,
        config_for(comp),
        rank,
        world,
        fake=False,
        lr=LR,
        optimizer="sgd",
        stage_input_grads=case.fault is not Fault.NO_BACKWARD_SEND,
        fsdp1=case.fsdp1,
    )
    model, schedule = runner.build()
    opt = runner._optimizer(model)
    skipped = [0]
    if case.fault is Fault.NO_REFRESH:
        assert runner.engine is Engine.ZERO1

        def no_refresh() -> None:  # the injected fault
            skipped[0] += 1

        opt._sync_params = no_refresh  # type: ignore[attr-defined]
    for step in range(STEPS):  # dbg
        match case.fault:
            case Fault.NONE | Fault.NO_REFRESH:
                runner.step(model, schedule, opt, step)
            case Fault.SKIP_REDUCTION:
                assert runner.engine is Engine.DDP
                with model.no_sync():  # type: ignore[operator]  # the injected fault
                    runner.step(model, schedule, opt, step)
                # DDP's comm hook (the all-reduce) records its bucket when it runs: it never did.
                skipped[0] += not runner.bucket_bytes
            case Fault.SKIP_DPR_REDUCTION:
                assert runner.engine is Engine.HSDP
                from torch.distributed.tensor import DTensor

                sharded = next(p for p in model.parameters())
                assert isinstance(sharded, DTensor)
                dpr = sharded.device_mesh.get_group("dpr")
                with _skip_all_reduce(dpr) as count:
                    runner.step(model, schedule, opt, step)
                skipped[0] += count[0]
            case Fault.SKIP_SP_REDUCTION:
                assert runner.engine is Engine.TP and comp.options.sequence_parallel
                with mock.patch.object(_engine, "reduce_partial_gradients", _keep_partial_gradients(skipped)):
                    runner.step(model, schedule, opt, step)
            case Fault.NO_BACKWARD_SEND:
                # The injected fault: stage inputs that do not require grad (the harness's own
                # bug before it was found), so no stage computes or sends an input gradient.
                # What reaches the previous stage is no gradient, so the first stage never
                # learns: checked there (its parameters get no gradient); the other stages
                # count on that check, since the last one trains on its own loss.
                assert runner.engine is Engine.PIPELINE
                runner.step(model, schedule, opt, step)
                if rank == 0:
                    skipped[0] += all(p.grad is None or not bool(p.grad.any()) for p in model.parameters())
                else:
                    skipped[0] += 1
            case _:
                raise AssertionError(case.fault)
    if case.fault is not Fault.NONE and not skipped[0]:
        raise AssertionError(f"{case.label()}: the injected fault skipped nothing")
    return _full_state(model)


def _worker(rank: int, world: int, port: int, out: str, labels: list[tuple[str, str, bool]]) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    # A wedged collective (one rank failing while the others wait) ends the run instead of hanging.
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=timedelta(minutes=5)
    )
    try:
        results: dict[str, dict[str, torch.Tensor]] = {}
        for comp_text, fault, fsdp1 in labels:
            case = Case(comp_text, Fault(fault), fsdp1)
            results[case.label()] = _run_case(case, rank, world)
        torch.save(results, Path(out) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass(frozen=True)
class Outcome:
    case: Case
    world: int
    matches: bool  # bit for bit equal to single-device training, on every rank
    ranks_agree: bool  # every parameter held by several ranks ends the same on all of them
    shared: bool  # some parameter is held by two ranks (not so in a pipeline: one stage each)
    max_difference: float
    z3: Status | None
    premise: bool  # the float32 reference equals the float64 one (``reference_is_exact``)

    @property
    def expected(self) -> bool:
        """Whether the engine did what the verdict says: valid matches, refuted diverges."""
        valid = self.case.fault is Fault.NONE
        if not self.premise:
            return False
        if self.z3 is not None:
            return self.matches == (self.z3 is Status.PROVED) and (self.z3 is Status.PROVED) == valid
        return self.matches == valid


def equivalence(world: int, selected: list[Case] | None = None) -> list[Outcome]:
    """Run the cases on ``world`` real gloo processes and compare with one device."""
    chosen = selected if selected is not None else cases(world)
    with tempfile.TemporaryDirectory() as tmp:
        labels = [(c.composition, c.fault.value, c.fsdp1) for c in chosen]
        run_world(_worker, (world, _free_port(), tmp, labels), world, f"equivalence on {world} gloo processes")
        per_rank = [torch.load(Path(tmp) / f"rank{r}.pt") for r in range(world)]
    out: list[Outcome] = []
    for case in chosen:
        comp = parse(case.composition, devices=world)
        setup = setup_for(comp, world)
        ref = reference(setup.cfg, setup.replicas, micro_batches=setup.micro_batches)
        states = [r[case.label()] for r in per_rank]
        # A pipeline stage holds only its own layers: every parameter is compared on each rank
        # that holds it, and every parameter must be held by some rank.
        held = set().union(*(s.keys() for s in states))
        if held != set(ref):
            raise AssertionError(f"{case.label()}: parameters held {sorted(held ^ set(ref))} differ from the model's")
        diff = max(float((s[k] - ref[k]).abs().max()) for s in states for k in s)
        matches = all(torch.equal(s[k], ref[k]) for s in states for k in s)
        agree = all(torch.equal(s[k], t[k]) for s in states for t in states for k in s.keys() & t.keys())
        shared = any(len(s.keys() & t.keys()) > 0 for i, s in enumerate(states) for t in states[i + 1 :])
        premise = reference_is_exact(setup.cfg, setup.replicas, setup.micro_batches)
        out.append(Outcome(case, world, matches, agree, shared, diff, z3_status(case, world), premise))
    return out


__all__ = [
    "EXACT",
    "Case",
    "Fault",
    "Outcome",
    "Setup",
    "cases",
    "config_for",
    "equivalence",
    "faulty_program",
    "reference_is_exact",
    "replace",
    "setup_for",
]
