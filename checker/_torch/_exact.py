"""Equivalence on a real engine: distributed training on gloo processes against one device.

With the exact variant of the small model (integer weights and data, exact nonlinearities)
and SGD with a dyadic learning rate, every float32 sum is exact, so a correct composition
matches single-device training bit for bit, and a broken one (a fault injected into the
PyTorch run) differs. ``reference_is_exact`` checks the premise: the float32 reference equals
a float64 run of the same steps.

Faults, each the PyTorch form of a broken step program that z3 refutes:
``SKIP_REDUCTION`` runs DDP's backward under ``no_sync()`` (the gradient all-reduce along dp
never happens); ``NO_REFRESH`` stops ``ZeroRedundancyOptimizer`` from broadcasting the updated
shards (replicated parameters go stale after a sharded update).
"""

from __future__ import annotations

import os
import socket
import tempfile
from dataclasses import dataclass, replace
from enum import StrEnum
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from checker._parse import parse
from checker._torch._engine import Engine, Runner
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


@dataclass(frozen=True)
class Case:
    composition: str  # at the world size of the run
    fault: Fault = Fault.NONE

    def label(self) -> str:
        return self.composition if self.fault is Fault.NONE else f"{self.composition} + {self.fault.value}"


def cases(world: int) -> list[Case]:
    """The runs at one world size: valid compositions and the injected faults."""
    return [
        Case(f"ddp{world}"), Case(f"fsdp{world}"), Case(f"fsdp-sgo{world}"), Case(f"zero1{world}"),
        Case(f"tp{world}"), Case(f"ddp{world}", Fault.SKIP_REDUCTION), Case(f"zero1{world}", Fault.NO_REFRESH),
    ]


def faulty_program(comp: Composition, fault: Fault, cfg: NetConfig = EXACT) -> StepProgram:
    """The step program the faulty PyTorch run executes: the derived one minus what it skips."""
    model = cfg.formal()
    program = derive_program(comp.placement(model), model)
    match fault:
        case Fault.NONE:
            return program
        case Fault.SKIP_REDUCTION:
            return program.with_ops(op for op in program.ops
                                    if not (op.phase is Phase.GRAD_SYNC and op.axis is Axis.DP
                                            and op.kind.is_reduction))
        case Fault.NO_REFRESH:
            return program.with_ops(op for op in program.ops
                                    if not (op.phase is Phase.REFRESH and op.kind is OpKind.ALL_GATHER))
        case _:
            raise AssertionError(fault)


def z3_status(case: Case, world: int) -> Status | None:
    """z3's verdict on the program the run executes, when the solver module is present."""
    try:
        from formal._smt import decide
    except ImportError:
        return None
    comp = parse(case.composition, devices=world)
    program = faulty_program(comp, case.fault)
    return decide(comp, program, EXACT.formal(), devices=world).status


# ---- single device ------------------------------------------------------------------------

def reference(cfg: NetConfig, replicas: int, dtype: torch.dtype = torch.float32,
              steps: int = STEPS) -> dict[str, torch.Tensor]:
    """Single-device SGD on the global batch; the loss is the mean over the replicas' shares."""
    torch.manual_seed(0)
    net = Net(cfg)
    init_exact_(net, 0)
    net = net.to(dtype)
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    samples = cfg.batch * replicas
    for step in range(steps):
        opt.zero_grad()
        ids, targets = batch(cfg, samples, seed=1000 + step)
        loss_fn(cfg, net(ids), targets.to(dtype), 1.0 / replicas).backward()  # type: ignore[no-untyped-call]
        opt.step()
    return {k: v.detach().clone() for k, v in net.state_dict().items()}


def reference_is_exact(cfg: NetConfig, replicas: int) -> bool:
    """The premise of bit-for-bit comparison: float32 training equals float64 training."""
    f32 = reference(cfg, replicas, torch.float32)
    f64 = reference(cfg, replicas, torch.float64)
    return all(torch.equal(f32[k].double(), f64[k]) for k in f32)


# ---- distributed (one process per rank) -----------------------------------------------------

def _full_state(model: nn.Module) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor
    out: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():
        full = p.full_tensor() if isinstance(p, DTensor) else p
        out[name.removeprefix("module.")] = full.detach().clone()
    return out


def _run_case(case: Case, rank: int, world: int) -> dict[str, torch.Tensor]:
    comp = parse(case.composition, devices=world)
    runner = Runner(comp, EXACT, rank, world, fake=False, lr=LR, optimizer="sgd")
    model, schedule = runner.build()
    opt = runner._optimizer(model)
    if case.fault is Fault.NO_REFRESH:
        assert runner.engine is Engine.ZERO1
        opt._sync_params = lambda: None  # type: ignore[attr-defined]  # the injected fault
    for step in range(STEPS):
        if case.fault is Fault.SKIP_REDUCTION:
            assert runner.engine is Engine.DDP
            with model.no_sync():  # type: ignore[operator]  # the injected fault
                runner.step(model, schedule, opt, step)
        else:
            runner.step(model, schedule, opt, step)
    return _full_state(model)


def _worker(rank: int, world: int, port: int, out: str, labels: list[tuple[str, str]]) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        results: dict[str, dict[str, torch.Tensor]] = {}
        for comp_text, fault in labels:
            case = Case(comp_text, Fault(fault))
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
    ranks_agree: bool  # every rank ends with the same full parameters
    max_difference: float
    z3: Status | None

    @property
    def expected(self) -> bool:
        """Whether the engine did what the verdict says: valid matches, refuted diverges."""
        valid = self.case.fault is Fault.NONE
        if self.z3 is not None:
            return self.matches == (self.z3 is Status.PROVED) and (self.z3 is Status.PROVED) == valid
        return self.matches == valid


def equivalence(world: int, selected: list[Case] | None = None) -> list[Outcome]:
    """Run the cases on ``world`` real gloo processes and compare with one device."""
    import torch.multiprocessing as mp
    chosen = selected if selected is not None else cases(world)
    with tempfile.TemporaryDirectory() as tmp:
        labels = [(c.composition, c.fault.value) for c in chosen]
        mp.spawn(_worker, args=(world, _free_port(), tmp, labels), nprocs=world,  # type: ignore[attr-defined, no-untyped-call]
                 join=True)
        per_rank = [torch.load(Path(tmp) / f"rank{r}.pt") for r in range(world)]
    out: list[Outcome] = []
    for case in chosen:
        comp = parse(case.composition, devices=world)
        replicas = Runner(comp, EXACT, 0, world, fake=False).data_replicas()
        ref = reference(EXACT, replicas)
        states = [r[case.label()] for r in per_rank]
        diff = max(float((s[k] - ref[k]).abs().max()) for s in states for k in ref)
        matches = all(torch.equal(s[k], ref[k]) for s in states for k in ref)
        agree = all(torch.equal(s[k], states[0][k]) for s in states for k in ref)
        out.append(Outcome(case, world, matches, agree, diff, z3_status(case, world)))
    return out


__all__ = ["EXACT", "Case", "Fault", "Outcome", "cases", "equivalence", "reference_is_exact", "replace"]
