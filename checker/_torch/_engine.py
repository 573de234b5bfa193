"""Run a composition with PyTorch's own implementations and measure one rank.

The composition decides which engine runs (``engine_for``): DDP, FSDP2 ``fully_shard``
(``reshard_after_forward`` True for ``fsdp``/``zero3``, False for ``fsdp-sgo``), DTensor tensor
parallelism (``tp``, with ``sp`` sequence parallelism), FSDP+TP, HSDP (``hsdp`` with ``dpr``) and
``torch.distributed.pipelining`` (``pp``, GPipe or 1F1B), alone or with DDP or FSDP2 on each stage
(``pp`` x ``dp``/``fsdp``, a 2-D mesh with pp outer). Each is applied by one small function in
a fixed order, as torchtitan's ``parallelize`` does: tensor parallel, then data parallel.
Recomputation (``recompute``, ``selective``) is ``torch.utils.checkpoint`` on each block or on
each block's attention core (``checker._torch._net.Block``); offload has no engine here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from checker._torch._net import Block, LlamaBlock, Net, NetConfig, batch, init_exact_, loss_fn
from checker._torch._record import Call, CommRecorder, SavedActivations, local, storage_bytes
from formal._axes import DATA, DATA_REPLICATE, PIPELINE, TENSOR
from formal._strategies import Composition
from formal._vocab import Axis, Mode, Stage, State
from formal.errors import CompositionError


class Engine(StrEnum):
    """The PyTorch implementation a composition runs on."""

    DDP = "DDP"
    FSDP = "FSDP2"
    TP = "DTensor TP"
    FSDP_TP = "FSDP2 + DTensor TP"
    HSDP = "FSDP2 HSDP"
    PIPELINE = "pipelining"
    PIPELINE_FSDP = "pipelining + FSDP2"
    PIPELINE_DDP = "pipelining + DDP"
    ZERO1 = "DDP + ZeroRedundancyOptimizer"
    FSDP1 = "FSDP1 SHARD_GRAD_OP"  # asked for (``Runner.fsdp1``): fsdp-sgo on FullyShardedDataParallel


def engine_for(comp: Composition) -> Engine:
    """The engine that implements ``comp``; a composition PyTorch has no engine for is an error."""
    mesh = {a: d for a, d in comp.mesh().items() if d > 1}
    names = {s.axis.kind: s.name for s in comp.strategies if (s.degree or 1) > 1}
    kinds = {a.kind for a in mesh}  # the harness has an engine per set of parallelism kinds
    dp_name = names.get(DATA)
    if comp.options.offload_optimizer or comp.options.offload_parameters:
        raise CompositionError(f"{comp}: offload has no engine in this harness")
    if PIPELINE in kinds and comp.options.pipeline_schedule.pytorch is None:
        raise CompositionError(f"{comp}: {comp.options.schedule.value} schedules are not run by this harness")
    if kinds == {PIPELINE}:
        return Engine.PIPELINE
    if kinds == {PIPELINE, DATA} and dp_name in ("dp", "ddp"):
        return Engine.PIPELINE_DDP
    if kinds == {PIPELINE, DATA} and dp_name in ("fsdp", "fsdp-sgo", "zero3"):
        return Engine.PIPELINE_FSDP
    if kinds == {TENSOR}:
        return Engine.TP
    if kinds == {DATA} and dp_name in ("dp", "ddp"):
        return Engine.DDP
    if kinds == {DATA} and dp_name == "zero1":
        return Engine.ZERO1
    if kinds == {DATA} and dp_name in ("fsdp", "fsdp-sgo", "zero3", "hsdp"):
        return Engine.FSDP
    if kinds == {DATA, TENSOR} and dp_name in ("fsdp", "fsdp-sgo", "zero3"):
        return Engine.FSDP_TP
    if (
        kinds == {DATA, DATA_REPLICATE}
        and dp_name in ("fsdp", "fsdp-sgo", "zero3", "hsdp")
        and names[DATA_REPLICATE] == "dpr"
    ):
        return Engine.HSDP
    raise CompositionError(
        f"{comp}: no PyTorch engine for this composition in the harness (DDP, ZeRO-1, FSDP, TP, FSDP+TP, HSDP, PP, "
        "PP+DDP, PP+FSDP)"
    )


def reshard_after_forward(comp: Composition) -> bool:
    """FSDP2's ``reshard_after_forward``: False when parameters are held through backward."""
    s = comp.strategy_on(Axis.DP)
    assert s is not None
    return not s.entry(State.PARAMETERS, _any_group()).keep_gathered


def _any_group() -> Any:
    from formal._vocab import ATTENTION

    return ATTENTION


@dataclass
class Measured:
    """One rank, one steady training step (after warm-up steps)."""

    parameters: int
    gradients: int
    optimizer: int  # per-element optimizer state (Adam's exp_avg and exp_avg_sq)
    optimizer_scalars: int  # Adam's per-tensor ``step`` counters (not per-element state)
    activations: int  # peak bytes saved for backward, parameters excluded
    calls: tuple[Call, ...]
    stage: Stage
    engine: Engine
    notes: list[str] = field(default_factory=list)
    tracked_peak: int | None = None  # MemTracker's peak total of a further steady step, when asked


@dataclass
class Runner:
    """Everything one rank needs to run ``steps`` steps of ``comp``."""

    comp: Composition
    cfg: NetConfig
    rank: int
    world: int
    fake: bool
    gradient_as_bucket_view: bool = False
    lr: float = 1e-3
    optimizer: str = "adam"  # "adam" (measurement) or "sgd" (exactness runs)
    stage_input_grads: bool = True  # pipelining: stage inputs require grad (False: the injected fault)
    seed: int = 0
    fsdp1: bool = False  # run fsdp-sgo on FSDP1 (FullyShardedDataParallel, SHARD_GRAD_OP), not FSDP2

    def __post_init__(self) -> None:
        self.engine = engine_for(self.comp)
        if self.fsdp1:
            if self.engine is not Engine.FSDP or reshard_after_forward(self.comp):
                raise CompositionError(f"{self.comp}: FSDP1 runs fsdp-sgo alone here (SHARD_GRAD_OP)")
            self.engine = Engine.FSDP1
        self.mesh = {a: d for a, d in self.comp.mesh().items() if d > 1}
        self.bucket_bytes: dict[int, int] = {}
        self.bucket_buffers: dict[int, torch.Tensor] = {}  # the flat buffers themselves, by index

    # ---- building ---------------------------------------------------------------------
    def build(self) -> tuple[nn.Module, Any]:
        torch.manual_seed(self.seed)
        net = Net(self.cfg)
        if self.cfg.exact:
            init_exact_(net, self.seed)
        for block in net.layers.values():  # torch.utils.checkpoint on each block or its attention core
            assert isinstance(block, Block | LlamaBlock)
            block.recompute = self.comp.options.recompute.value
        match self.engine:
            case Engine.DDP | Engine.ZERO1:
                return self._ddp(net), None
            case Engine.FSDP:
                return self._fsdp(net, self._mesh1d(Axis.DP)), None
            case Engine.FSDP1:
                return self._fsdp1(net), None
            case Engine.TP:
                return self._tp(net, self._mesh1d(Axis.TP)), None
            case Engine.FSDP_TP:
                mesh = self._device_mesh((self.mesh[Axis.DP], self.mesh[Axis.TP]), ("dp", "tp"))
                return self._fsdp(self._tp(net, mesh["tp"]), mesh["dp"]), None
            case Engine.HSDP:
                mesh = self._device_mesh((self.mesh[Axis.DPR], self.mesh[Axis.DP]), ("dpr", "dp"))
                return self._fsdp(net, mesh), None
            case Engine.PIPELINE | Engine.PIPELINE_FSDP | Engine.PIPELINE_DDP:
                return self._pipeline(net)
            case _:
                raise AssertionError(self.engine)

    def _mesh1d(self, axis: Axis) -> Any:
        return self._device_mesh((self.mesh[axis],), (axis.value,))

    @staticmethod
    def _device_mesh(shape: tuple[int, ...], names: tuple[str, ...]) -> Any:
        """``init_device_mesh`` outside any ``FakeTensorMode``: the mesh holds real rank tensors
        (``checker._torch._large`` builds and steps large models under fake mode)."""
        from torch._subclasses.fake_tensor import unset_fake_temporarily
        from torch.distributed.device_mesh import init_device_mesh

        with unset_fake_temporarily():
            return init_device_mesh("cpu", shape, mesh_dim_names=names)

    def pipelined(self) -> bool:
        return self.engine in (Engine.PIPELINE, Engine.PIPELINE_FSDP, Engine.PIPELINE_DDP)

    def pipeline_index(self) -> int:
        """The pipeline stage this rank runs: pp is the outer mesh dimension (rank = stage x dp +
        data rank), as in torchtitan's meshes."""
        return self.rank // self.mesh.get(Axis.DP, 1) if self.pipelined() else 0

    def _ddp(self, net: Net, group: Any = None) -> nn.Module:
        from torch.nn.parallel import DistributedDataParallel as DDP

        model = DDP(net, gradient_as_bucket_view=self.gradient_as_bucket_view, process_group=group)
        world = self.world
        buckets, buffers = self.bucket_bytes, self.bucket_buffers

        def hook(_state: Any, bucket: Any) -> torch.futures.Future[torch.Tensor]:
            # The default hook's all-reduce, run synchronously: the fake group's future carries
            # no value (pytorch-ground-truth.md). It also reveals DDP's bucket buffers.
            t = bucket.buffer()
            buckets[bucket.index()] = t.untyped_storage().nbytes()
            buffers[bucket.index()] = t
            t.div_(world if group is None else group.size())
            dist.all_reduce(t, group=group)
            fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
            fut.set_result(t)
            return fut

        # DDP inspects the annotations; under postponed evaluation they would be strings.
        hook.__annotations__ = {
            "_state": object,
            "bucket": dist.GradBucket,  # type: ignore[attr-defined]
            "return": torch.futures.Future[torch.Tensor],
        }
        model.register_comm_hook(None, hook)
        return model

    def _fsdp(self, net: nn.Module, mesh: Any) -> nn.Module:
        from torch.distributed.fsdp import fully_shard

        reshard = reshard_after_forward(self.comp)
        layers = net.layers if isinstance(net, Net) else net.get_submodule("layers")
        # Outside any FakeTensorMode (FSDP+TP concatenates the dp and tp meshes, real tensors);
        # fake parameters stay fake, their ops dispatch to their own mode.
        from torch._subclasses.fake_tensor import unset_fake_temporarily

        with unset_fake_temporarily():
            for block in layers.values():  # type: ignore[operator]
                fully_shard(block, mesh=mesh, reshard_after_forward=reshard)
            # The root (embedding, final norm, head) keeps PyTorch's default, None: True for a
            # non-root module, False for the root, whose parameters backward needs at once.
            fully_shard(net, mesh=mesh, reshard_after_forward=None if reshard else False)
        return net

    def _fsdp1(self, net: Net) -> nn.Module:
        """FSDP1 with ``SHARD_GRAD_OP`` (ZeRO-2: parameters gathered in the forward and kept
        through the backward): one ``FlatParameter`` per block and one for the root (embedding,
        final norm, head), the units FSDP2's ``fully_shard`` makes here."""
        from torch.distributed.fsdp import FullyShardedDataParallel, ShardingStrategy
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        return FullyShardedDataParallel(
            net,
            sharding_strategy=ShardingStrategy.SHARD_GRAD_OP,
            auto_wrap_policy=ModuleWrapPolicy({Block, LlamaBlock}),
            device_id=torch.device("cpu"),
        )

    def _tp(self, net: Net, mesh: Any) -> Net:
        from torch.distributed.tensor import Replicate, Shard
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            RowwiseParallel,
            SequenceParallel,
            parallelize_module,
        )

        sp = self.comp.options.sequence_parallel
        seq = Shard(1) if sp else Replicate()
        plan: dict[str, Any] = {
            # Vocabulary-parallel embedding: rows of the table split; its output is a partial
            # sum, all-reduced (or reduce-scattered along the sequence under sp).
            "embed": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq),
            # Vocabulary-parallel head: logits stay split for the vocabulary-parallel loss.
            "head": ColwiseParallel(input_layouts=seq, output_layouts=Shard(-1), use_local_output=False),
        }
        if sp:
            plan["norm"] = SequenceParallel()
        for name in net.layers:
            pre = f"layers.{name}."
            if self.cfg.llama:  # torchtitan's Llama plan: q/k/v, gate/up column, o/down row parallel
                for col in ("q", "k", "v", "gate", "up"):
                    plan[pre + col] = ColwiseParallel(input_layouts=seq)
                plan[pre + "o"] = RowwiseParallel(output_layouts=seq)
                plan[pre + "down"] = RowwiseParallel(output_layouts=seq)
                if sp:
                    plan[pre + "ln1"] = SequenceParallel()
                    plan[pre + "ln2"] = SequenceParallel()
                continue
            plan[pre + "qkv"] = ColwiseParallel(input_layouts=seq)
            plan[pre + "proj"] = RowwiseParallel(output_layouts=seq)
            plan[pre + "fc1"] = ColwiseParallel(input_layouts=seq)
            plan[pre + "fc2"] = RowwiseParallel(output_layouts=seq)
            if sp:
                plan[pre + "ln1"] = SequenceParallel()
                plan[pre + "ln2"] = SequenceParallel()
        parallelize_module(net, mesh, plan)
        return net

    def _pipeline(self, net: Net) -> tuple[nn.Module, Any]:
        import torch.distributed.pipelining as pipelining
        from torch.distributed.pipelining import PipelineStage
        from torch.distributed.pipelining.schedules import PipelineScheduleSingle

        cfg, p = self.cfg, self.mesh[Axis.PP]
        if cfg.layers % p:
            raise CompositionError(f"pp{p}: layers={cfg.layers} is not divisible by the pipeline degree")
        per = cfg.layers // p
        index = self.pipeline_index()
        keep = {str(i) for i in range(index * per, (index + 1) * per)}
        for name in list(net.layers):
            if name not in keep:
                del net.layers[name]
        first, last = index == 0, index == p - 1
        if not first:
            net.embed = None
        if not last:
            net.norm = None
            net.head = None
        group = None
        module: nn.Module = net
        if self.engine is not Engine.PIPELINE:
            # A 2-D mesh, pp outer: the stage sends along pp and shards or replicates along dp.
            mesh = self._device_mesh((p, self.mesh[Axis.DP]), ("pp", "dp"))
            group = mesh["pp"].get_group()
            if self.engine is Engine.PIPELINE_FSDP:
                module = self._fsdp(net, mesh["dp"])
            else:
                module = self._ddp(net, mesh["dp"].get_group())
        b = cfg.batch
        hidden = torch.zeros(b, cfg.seq, cfg.hidden)
        # The activations passed between stages require grad: a stage takes requires_grad of
        # what it receives from these examples, and without it computes no input gradient, so
        # the earlier stages would get none (their parameters never trained on real gloo).
        act = hidden.clone().requires_grad_(self.stage_input_grads)
        x_in = torch.zeros(b, cfg.seq, dtype=torch.long) if first else act
        y_out = torch.zeros(b, cfg.seq, cfg.vocab) if last else act
        # Explicit shapes: the fake group's receive would mislead shape inference.
        stage = PipelineStage(
            module,
            index,
            p,
            torch.device("cpu"),
            input_args=(x_in,),
            output_args=(y_out,),
            input_grads=(None if first else hidden,),
            output_grads=(None if last else hidden,),
            group=group,
        )
        m = self.comp.options.micro_batches
        scale = 1.0
        # The schedule's own single-stage class (engine_for refuses a schedule without one).
        make: type[PipelineScheduleSingle] = getattr(pipelining, str(self.comp.options.pipeline_schedule.pytorch))

        def pipe_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
            return loss_fn(cfg, logits, targets, scale / m)

        schedule = make(stage, n_microbatches=m, loss_fn=pipe_loss, scale_grads=False)
        if self.fake:
            # The fake group's receive carries no vote, so the stages would fall back to
            # dynamic shape inference over the fake receive; every shape is given: static.
            from torch.distributed.pipelining._utils import InferenceMode

            def static(stages: list[Any], has_backward: bool, p2p_done: bool) -> None:
                for st in stages:
                    st._inference_mode = InferenceMode.STATIC

            schedule._warmup_p2p = static  # type: ignore[method-assign]
        return module, schedule

    def _optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        params = [p for p in model.parameters() if p.requires_grad]
        if self.engine is Engine.ZERO1:
            from torch.distributed.optim import ZeroRedundancyOptimizer

            cls = torch.optim.SGD if self.optimizer == "sgd" else torch.optim.Adam
            return ZeroRedundancyOptimizer(params, optimizer_class=cls, lr=self.lr)
        if self.optimizer == "sgd":
            return torch.optim.SGD(params, lr=self.lr)
        return torch.optim.Adam(params, lr=self.lr, foreach=False)

    # ---- one step ---------------------------------------------------------------------
    def samples_per_replica(self) -> int:
        return self.cfg.batch * self.comp.options.micro_batches

    def data_replicas(self) -> int:
        return self.mesh.get(Axis.DP, 1) * self.mesh.get(Axis.DPR, 1)

    def replica_index(self) -> int:
        """Which data-parallel replica this rank is (ranks of one replica see the same data)."""
        match self.engine:
            case Engine.FSDP_TP:
                return self.rank // self.mesh[Axis.TP]
            case Engine.TP | Engine.PIPELINE:
                return 0
            case Engine.PIPELINE_FSDP | Engine.PIPELINE_DDP:
                return self.rank % self.mesh[Axis.DP]
            case _:
                return self.rank

    def step_data(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's slice of the global batch of ``step`` (the same global batch everywhere)."""
        n = self.samples_per_replica()
        ids, targets = batch(self.cfg, n * self.data_replicas(), seed=1000 + step)
        r = self.replica_index()
        return ids[r * n : (r + 1) * n], targets[r * n : (r + 1) * n]

    def step(self, model: nn.Module, schedule: Any, opt: torch.optim.Optimizer, step: int) -> None:
        opt.zero_grad(set_to_none=False)
        ids, targets = self.step_data(step)
        if self.pipelined():
            p, index = self.mesh[Axis.PP], self.pipeline_index()
            if index == 0:
                schedule.step(ids)
            elif index == p - 1:
                # The loss is all a training step needs: without return_outputs=False the last
                # stage keeps every micro-batch's output (the logits) to merge them at the end.
                schedule.step(target=targets, return_outputs=False)
            else:
                schedule.step()
        else:
            self._accumulate(model, ids, targets)
        reduce_partial_gradients(model)
        opt.step()

    def _accumulate(self, model: nn.Module, ids: torch.Tensor, targets: torch.Tensor) -> None:
        """Gradient accumulation over the step's m micro-batches, one forward and backward each
        (``m<N>`` without a pipeline): DDP skips its all-reduce on all but the last (``no_sync``),
        FSDP2 reduce-scatters after each backward (its default); a micro-batch's loss is its
        share of the replica's mean (1/m; exact mode's sum needs no scale)."""
        import contextlib

        m = self.comp.options.micro_batches
        scale = 1.0 if self.cfg.exact else 1.0 / m
        pieces = zip(torch.split(ids, self.cfg.batch), torch.split(targets, self.cfg.batch), strict=True)
        for i, (x, y) in enumerate(pieces):
            quiet = self.engine in (Engine.DDP, Engine.ZERO1) and i < m - 1
            with model.no_sync() if quiet else contextlib.nullcontext():  # type: ignore[operator]
                self.backward(model(x), y, scale)

    def backward(self, logits: Any, targets: torch.Tensor, scale: float = 1.0) -> None:
        # Each replica's loss is its share of the global mean: DDP and FSDP average the
        # replicas' gradients, so the per-replica loss is the replica's own mean.
        from torch.distributed.tensor import DTensor

        if isinstance(logits, DTensor):
            from torch.distributed.tensor.parallel import loss_parallel

            if self.cfg.exact:
                from torch.distributed.tensor import Replicate

                full = logits.redistribute(placements=[Replicate()]).to_local()
                loss_fn(self.cfg, full, targets, scale).backward()  # type: ignore[no-untyped-call]
                return
            with loss_parallel():
                loss_fn(self.cfg, logits, targets, scale).backward()  # type: ignore[no-untyped-call]
            return
        loss_fn(self.cfg, logits, targets, scale).backward()  # type: ignore[no-untyped-call]


def reduce_partial_gradients(model: nn.Module) -> None:
    """Reduce DTensor gradients left ``Partial`` (replicated weights used on sequence shards
    under sequence parallelism) once, before the optimizer: the step program's gradient
    synchronisation. Left Partial, DTensor would all-reduce them inside every optimizer op that
    reads them (three times per tensor for Adam)."""
    from torch.distributed.tensor import DTensor

    for p in model.parameters():
        g = p.grad
        if isinstance(g, DTensor) and isinstance(p, DTensor) and any(x.is_partial() for x in g.placements):
            p.grad = g.redistribute(g.device_mesh, p.placements)


def measure(
    comp: Composition,
    cfg: NetConfig,
    rank: int,
    world: int,
    *,
    steps: int | None = None,
    gradient_as_bucket_view: bool = False,
    fake: bool = True,
    fsdp1: bool = False,
    tracked: bool = False,
) -> Measured:
    """Run ``steps`` steps on the current process group (fake or real) and measure the last.

    The measured step is a steady one: the second (optimizer state exists), or for DDP the
    third, since DDP rebuilds its buckets in gradient-ready order after the first iteration.
    ``fake``: the current group is the fake one (pipelining then needs static shapes); False on
    real gloo processes (``checker._torch._gloo``). ``fsdp1``: fsdp-sgo on FSDP1 (``Runner``).
    ``tracked``: one more steady step under PyTorch's ``MemTracker`` gives its peak total.
    """
    runner = Runner(comp, cfg, rank, world, fake=fake, gradient_as_bucket_view=gradient_as_bucket_view, fsdp1=fsdp1)
    if steps is None:
        steps = 3 if runner.engine in (Engine.DDP, Engine.ZERO1, Engine.PIPELINE_DDP) else 2
    model, schedule = runner.build()
    opt = runner._optimizer(model)
    for i in range(steps - 1):
        runner.step(model, schedule, opt, i)
    modules = [model]
    saved = SavedActivations(modules)
    recorder = CommRecorder()
    with recorder, saved.track():
        runner.step(model, schedule, opt, steps - 1)
    params, grads, per_element, scalars = model_state_tensors(model, opt)
    bucket = sum(runner.bucket_bytes.values()) if not gradient_as_bucket_view else 0
    stage = _stage(runner)
    peak = None
    if tracked:
        from torch.distributed._tools.mem_tracker import MemTracker

        tracker = MemTracker()
        tracker.track_external(model, opt)
        with tracker:
            runner.step(model, schedule, opt, steps)
        peak = sum(int(cats["Total"]) for cats in tracker.get_tracker_snapshot("peak").values())
    return Measured(
        parameters=storage_bytes(params),
        gradients=storage_bytes(grads) + bucket,
        optimizer=storage_bytes(per_element),
        optimizer_scalars=storage_bytes(scalars),
        activations=saved.peak,
        calls=tuple(recorder.calls),
        stage=stage,
        engine=runner.engine,
        tracked_peak=peak,
    )


def model_state_tensors(
    model: nn.Module, opt: torch.optim.Optimizer
) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    """A rank's parameters, gradients, per-element optimizer state and per-tensor optimizer
    scalars (Adam's ``step``), for measuring their storage bytes."""
    params: list[torch.Tensor] = list(model.parameters())
    grads = [p.grad for p in params if p.grad is not None]
    per_element: list[torch.Tensor] = []
    scalars: list[torch.Tensor] = []
    for state in _optimizer_states(opt):
        for value in state.values():
            if isinstance(value, torch.Tensor):
                (scalars if local(value).dim() == 0 else per_element).append(value)
    return params, grads, per_element, scalars


def _optimizer_states(opt: torch.optim.Optimizer) -> list[dict[str, Any]]:
    inner = getattr(opt, "optim", None)  # ZeroRedundancyOptimizer wraps the local optimizer
    source = inner if isinstance(inner, torch.optim.Optimizer) else opt
    return [s for s in source.state.values() if isinstance(s, dict)]


def _stage(runner: Runner) -> Stage:
    if not runner.pipelined():
        return Stage.FIRST
    return Stage.of(runner.pipeline_index(), runner.mesh[Axis.PP])


def fake_group(world: int, rank: int = 0) -> Callable[[], None]:
    """Start a fake process group of ``world`` ranks seen from ``rank``; returns its teardown."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    return dist.destroy_process_group


__all__ = ["Engine", "Measured", "Mode", "Runner", "engine_for", "fake_group", "measure"]
