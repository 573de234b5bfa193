"""What one rank does, recorded from the engine: collectives from the dispatcher, activations
saved for backward, and the bytes of parameters, gradients and optimizer state it holds.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from formal._vocab import OpKind


@dataclass(frozen=True, order=True)
class Call:
    """One collective call on this rank: its kind, how many ranks take part, and the bytes of
    the whole tensor it acts on (all-gather: the gathered output; reduce-scatter: the input;
    all-reduce and point-to-point: the tensor)."""

    kind: OpKind
    group_size: int
    bytes: int

    def __str__(self) -> str:
        return f"{self.kind.value}[{self.group_size}] {self.bytes} B"


# The dispatcher's collectives: c10d (eager ProcessGroup ops: DDP, FSDP2, pipelining) and
# _c10d_functional (DTensor redistributions). Argument positions per op family below.
_C10D_KIND: dict[str, OpKind] = {
    "allreduce_": OpKind.ALL_REDUCE,
    "allreduce_coalesced_": OpKind.ALL_REDUCE,
    "_allgather_base_": OpKind.ALL_GATHER,
    "allgather_": OpKind.ALL_GATHER,
    "allgather_into_tensor_coalesced_": OpKind.ALL_GATHER,
    "_reduce_scatter_base_": OpKind.REDUCE_SCATTER,
    "reduce_scatter_": OpKind.REDUCE_SCATTER,
    "reduce_scatter_tensor_coalesced_": OpKind.REDUCE_SCATTER,
    "broadcast_": OpKind.BROADCAST,
    "send": OpKind.SEND_RECV,
    "recv_": OpKind.SEND_RECV,
    "alltoall_base_": OpKind.ALL_TO_ALL,
}
_FUNCTIONAL_KIND: dict[str, OpKind] = {
    "all_reduce": OpKind.ALL_REDUCE,
    "all_reduce_coalesced": OpKind.ALL_REDUCE,
    "all_gather_into_tensor": OpKind.ALL_GATHER,
    "all_gather_into_tensor_coalesced": OpKind.ALL_GATHER,
    "reduce_scatter_tensor": OpKind.REDUCE_SCATTER,
    "reduce_scatter_tensor_coalesced": OpKind.REDUCE_SCATTER,
    "all_to_all_single": OpKind.ALL_TO_ALL,
    "broadcast": OpKind.BROADCAST,
}


def _tensors(x: Any) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, list | tuple):
        return [t for item in x for t in _tensors(item)]
    return []


def _nbytes(ts: Iterable[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in ts)


def _group_size(arg: Any) -> int:
    if isinstance(arg, str):
        from torch.distributed.distributed_c10d import _resolve_process_group  # type: ignore[attr-defined]

        return int(_resolve_process_group(arg).size())  # type: ignore[arg-type]
    if isinstance(arg, int):
        return arg
    if isinstance(arg, torch.ScriptObject):
        arg = dist.ProcessGroup.unbox(arg)
    return int(arg.size())


class CommRecorder(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Logs every c10d / functional collective with its group size and tensor bytes.

    DTensor arguments are handed back (``NotImplemented``) so DTensor decomposes its
    redistributions into plain functional collectives first, which are then logged.
    """

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.calls: list[Call] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        from torch.distributed.tensor import DTensor

        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented
        ns, name = func.namespace, func._schema.name.split("::")[-1]
        if ns == "c10d" and name in _C10D_KIND:
            self.calls.append(self._c10d(name, _C10D_KIND[name], args))
        elif ns == "_c10d_functional" and name in _FUNCTIONAL_KIND:
            self.calls.append(self._functional(name, _FUNCTIONAL_KIND[name], args))
        return func(*args, **kwargs)

    @staticmethod
    def _c10d(name: str, kind: OpKind, args: Any) -> Call:
        match kind:
            case OpKind.ALL_GATHER if name == "_allgather_base_" or name.endswith("coalesced_"):
                full = _nbytes(_tensors(args[0]))  # output tensor(s)
                group = args[2]
            case OpKind.ALL_GATHER:
                full = _nbytes(_tensors(args[0]))  # list of output tensors
                group = args[2]
            case OpKind.REDUCE_SCATTER:
                full = _nbytes(_tensors(args[1]))  # input tensor(s)
                group = args[2]
            case OpKind.SEND_RECV:
                full = _nbytes(_tensors(args[0]))
                group = args[1]
            case OpKind.ALL_TO_ALL:
                full = _nbytes(_tensors(args[1]))
                group = args[2]
            case _:
                full = _nbytes(_tensors(args[0]))
                group = args[1]
        return Call(kind, _group_size(group), full)

    @staticmethod
    def _functional(name: str, kind: OpKind, args: Any) -> Call:
        tensors = _tensors(args[0])
        match kind:
            case OpKind.ALL_GATHER:
                size = _group_size(args[-1])
                return Call(kind, size, _nbytes(tensors) * size)
            case OpKind.REDUCE_SCATTER:
                return Call(kind, _group_size(args[-1]), _nbytes(tensors))
            case OpKind.ALL_TO_ALL:
                return Call(kind, _group_size(args[-1]), _nbytes(tensors))
            case _:
                return Call(kind, _group_size(args[-1]), _nbytes(tensors))


def local(t: torch.Tensor) -> torch.Tensor:
    """The plain tensor under wrapper subclasses: a DTensor's local shard, the value of a
    functional collective's ``AsyncCollectiveTensor`` (or the tensor itself)."""
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    while is_traceable_wrapper_subclass(t):
        attrs, _ = t.__tensor_flatten__()
        t = getattr(t, attrs[0])
    return t


def storage_key(t: torch.Tensor) -> int:
    """The identity of ``t``'s storage (the StorageImpl, not its data pointer, which every
    ``FakeTensor`` leaves at 0)."""
    return int(local(t).untyped_storage()._cdata)


def storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (a view is not counted twice)."""
    seen: dict[int, int] = {}
    for t in tensors:
        lt = local(t)
        nbytes = lt.untyped_storage().nbytes()
        if nbytes:
            seen[storage_key(lt)] = nbytes
    return sum(seen.values())


class SavedActivations:
    """Peak bytes of the tensors autograd saves for backward, parameters excluded.

    Counts distinct storages that are alive in some graph at once (a saved tensor is released
    when its backward node runs), so the peak is the activations of all micro-batches in
    flight, whatever the schedule, which MemTracker cannot follow across repeated module calls.
    """

    def __init__(self, modules: Iterable[nn.Module]) -> None:
        self.modules = list(modules)
        self.live: dict[int, list[int]] = {}  # storage -> [bytes, references]
        self.current = 0
        self.peak = 0

    def _parameter_storages(self) -> set[int]:
        out: set[int] = set()
        for m in self.modules:
            for p in m.parameters():
                if local(p).untyped_storage().nbytes():
                    out.add(storage_key(p))
        return out

    def _pack(self, t: torch.Tensor) -> Any:
        lt = local(t)
        key = storage_key(lt)
        nbytes = int(lt.untyped_storage().nbytes())
        if isinstance(t, nn.Parameter) or not nbytes or key in self._parameter_storages():
            return t
        holder = _Held(t)
        entry = self.live.setdefault(key, [nbytes, 0])
        if entry[1] == 0:
            self.current += nbytes
            self.peak = max(self.peak, self.current)
        entry[1] += 1
        weakref.finalize(holder, self._release, key)
        return holder

    def _release(self, key: int) -> None:
        entry = self.live[key]
        entry[1] -= 1
        if entry[1] == 0:
            self.current -= entry[0]
            del self.live[key]

    @staticmethod
    def _unpack(x: Any) -> torch.Tensor:
        return x.tensor if isinstance(x, _Held) else x

    @contextmanager
    def track(self) -> Iterator[SavedActivations]:
        with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
            yield self


class _Held:
    __slots__ = ("__weakref__", "tensor")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


def ranks_in(group: dist.ProcessGroup | None) -> int:
    return int(dist.get_world_size(group))
