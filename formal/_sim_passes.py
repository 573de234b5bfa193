"""The reference model's forward and backward on the simulated mesh, with its activation exchanges.

``_Exchanges`` performs the activation collectives and pipeline sends at each site of the model
as the program lists them: a site the program leaves out leaves what an implementation would
(zeros for a missing gather or send, partial sums for a missing reduction), a repeated reduction
sums again. ``_Passes`` runs one micro-batch of the model (embedding, layers by chunk and stage,
final norm, head and loss, then the backward in reverse) on each device's slice of the batch
and of the tensors, reading parameters as the program's reads left them and adding gradients
to the micro-batch's buffers.
"""

from __future__ import annotations

from fractions import Fraction

import numpy as np

from formal._exact import exact
from formal._placement import Placement, Recompute
from formal._program import StepProgram
from formal._reference import Array, Batch, Numbers, ReferenceModel
from formal._sim_collectives import _Traffic
from formal._sim_experts import _Experts
from formal._sim_mesh import Device, PerDevice, _Geometry, _Layout, _Mesh
from formal._sim_states import _States
from formal._vocab import (
    ATTENTION,
    EMBEDDING,
    EMBEDDING_IO,
    FINAL_NORM,
    HEAD,
    LAYER_IO,
    LINEAR_INNER,
    LOGITS,
    MLP,
    NORM,
    OUTPUT_IO,
    ROW_BIAS,
    Axis,
    Group,
    OpKind,
    Phase,
    Reduce,
    State,
)

A = State.ACTIVATIONS
Reads = dict[Device, dict[Group, Array]]  # each device's parameters as a phase's reads left them
_Saved = dict[Device, tuple[Array, ...]]


class _Exchanges:
    """The program's activation collectives and sends, looked up by the site that performs them."""

    def __init__(self, program: StepProgram, mesh: _Mesh, numbers: Numbers, traffic: _Traffic) -> None:
        self.ops, self.mesh, self.n, self.traffic = program.ops, mesh, numbers, traffic
        self.act_ops: dict[tuple[OpKind, Group, Axis | None, Phase], list[int]] = {}
        for i, op in enumerate(self.ops):
            if op.state is A:
                self.act_ops.setdefault((op.kind, op.group, op.axis, op.phase), []).append(i)

    def _instances(self, kind: OpKind, group: Group, axis: Axis, phase: Phase) -> list[int]:
        return self.act_ops.get((kind, group, axis, phase), [])

    def act(self, kind: OpKind, group: Group, axis: Axis, phase: Phase, vals: PerDevice, dim: int = 1) -> PerDevice:
        """An activation collective along ``axis`` at one site of the model, as the program says."""
        if self.mesh.degree(axis) == 1:
            return vals
        n = self.n
        instances = self._instances(kind, group, axis, phase)
        out = dict(vals)
        for grp in self.mesh.groups(axis, vals):
            k = len(grp)
            pieces = [vals[d] for d in grp]
            if kind is OpKind.ALL_GATHER:
                if not instances:  # nothing gathered: the others' slots hold a freed buffer's zeros
                    for j, d in enumerate(grp):
                        blank = [np.zeros_like(pc) for pc in pieces]
                        blank[j] = pieces[j]
                        out[d] = np.concatenate(blank, axis=dim)
                    continue
                full = np.concatenate(pieces, axis=dim)
                for index in instances:  # a second gather of the same pieces changes nothing
                    self.traffic.activations(index, grp, full.size, kind, k)
                for d in grp:
                    out[d] = full
                continue
            current = pieces
            for step_no, index in enumerate(instances):
                op_reduce = self.ops[index].reduce
                total = n.sum_of(current)
                if op_reduce is Reduce.MEAN:
                    total = n.scale(total, Fraction(1, k))
                self.traffic.activations(index, grp, current[0].size, kind, k)
                if kind is OpKind.ALL_REDUCE:
                    current = [total for _ in grp]
                elif kind is OpKind.REDUCE_SCATTER:
                    if step_no == 0:
                        current = list(np.split(total, k, axis=dim))
                    else:  # reducing again sums different shards: wrong, as it would be
                        current = [total for _ in grp]
                else:
                    raise AssertionError(kind)
            if not instances and kind is OpKind.REDUCE_SCATTER:
                current = [np.split(pc, k, axis=dim)[j] for j, pc in enumerate(pieces)]
            for d, value in zip(grp, current, strict=True):
                out[d] = value
        return out

    def statistics(self, group: Group, axis: Axis, phase: Phase, vals: PerDevice, tokens: int, m: int) -> None:
        """A kernel's own per-token statistics, all-reduced along ``axis`` as the program's ops on
        ``group`` say (``op.count / m`` calls a micro-batch, ``tokens`` values each): the
        cross-entropy's over vocabulary shards. Only their traffic is recorded: the reference's
        squared-error loss is element-wise in the logits and reads no statistic (what a kernel
        must reduce is the scalar program's ``cross_entropy`` op, ``formal._sim_scalars``)."""
        if self.mesh.degree(axis) == 1:
            return
        for index in self._instances(OpKind.ALL_REDUCE, group, axis, phase):
            calls = Fraction(exact(self.ops[index].count)) / m
            for grp in self.mesh.groups(axis, vals):
                for _ in range(int(calls)):
                    self.traffic.activations(index, grp, tokens, OpKind.ALL_REDUCE, len(grp))

    def send(self, phase: Phase, vals: PerDevice, to_stage: int) -> PerDevice:
        """Each device's value to its peer on stage ``to_stage`` (zeros there if the program sends nothing)."""
        instances = self._instances(OpKind.SEND_RECV, LAYER_IO, Axis.PP, phase)
        out: PerDevice = {}
        for d, value in vals.items():
            dest = self.mesh.moved(d, Axis.PP, to_stage)
            out[dest] = value.copy() if instances else np.zeros_like(value)
            for index in instances:
                self.traffic.activations(index, [d], value.size, OpKind.SEND_RECV, 2)
        return out


class _Passes:
    """One micro-batch of the reference model on every device, as the program's exchanges allow."""

    def __init__(
        self,
        model: ReferenceModel,
        pl: Placement,
        mesh: _Mesh,
        layout: _Layout,
        geometry: _Geometry,
        numbers: Numbers,
        states: _States,
        exchanges: _Exchanges,
        moe: _Experts,
    ) -> None:
        self.model, self.pl, self.mesh, self.layout, self.n = model, pl, mesh, layout, numbers
        self.states, self.exchanges, self.moe = states, exchanges, moe
        moe.bind(self._sp_split, self._block_out, self._gather_grad, self._block_in_grad)
        self.m, self.t, self.sp, self.s_chunk = geometry.m, geometry.t, geometry.sp, geometry.s_chunk
        self.data_axes, self.same_data = geometry.data_axes, geometry.same_data
        self._read: Reads = {}  # the parameters the pass reads now: the forward's, then the backward's

    def _index(self, dev: Device, group: Group, which: int, layer: int | None) -> Array:
        """Flat indices of one tensor on a device, cut to its TP slice when compute-sharded."""
        t = self.model.tensors(group)[which]
        index = t.index if layer is None else t.index[layer]
        if t.tp_dim is not None and self.t > 1 and self.pl.computes_sharded(Axis.TP, group):
            r = self.mesh.coord(dev, Axis.TP)
            n_ = index.shape[t.tp_dim]
            index = np.take(index, range(r * n_ // self.t, (r + 1) * n_ // self.t), axis=t.tp_dim)
        return index

    def _w(self, dev: Device, group: Group, which: int, layer: int | None = None) -> Array:
        """A device's working copy of one tensor, cut to its TP slice when compute-sharded."""
        return self._read[dev][group][self._index(dev, group, which, layer)]

    def _add_grad(self, dev: Device, group: Group, which: int, layer: int | None, value: Array) -> None:
        index = self._index(dev, group, which, layer)
        arr = self.states.fresh[dev][group]
        arr[index] = self.n.add(arr[index], value)

    def _seq_slice(self, dev: Device) -> slice:
        """The positions of the full sequence a device's tokens cover (cp chunk, SP slice)."""
        start = self.mesh.coord(dev, Axis.CP) * self.s_chunk
        return slice(start, start + self.s_chunk)

    def _sp_split(self, dev: Device, value: Array) -> Array:
        if not self.sp:
            return value
        return np.split(value, self.t, axis=1)[self.mesh.coord(dev, Axis.TP)]

    def _layer_forward(self, layer: int, x: PerDevice, phase: Phase) -> tuple[PerDevice, _Saved]:
        n, t_ax = self.n, Axis.TP
        u = {d: n.mul(x[d], self._w(d, NORM, 0, layer)) for d in x}
        u_full = self.exchanges.act(OpKind.ALL_GATHER, LAYER_IO, t_ax, phase, u) if self.sp else u
        q, kv, c, z, a = {}, {}, {}, {}, {}
        for d in x:
            wqkv = self._w(d, ATTENTION, 0, layer)
            proj = [n.mm(u_full[d], wqkv[:, j]) for j in range(3)]
            if self.model.bias:  # the QKV bias, split by columns with its matrix
                bqkv = self._w(d, ATTENTION, 2, layer)
                proj = [n.add(proj[j], bqkv[j]) for j in range(3)]
            q[d] = proj[0]
            kv[d] = np.concatenate(proj[1:], axis=2)
        kv_all = self.exchanges.act(OpKind.ALL_GATHER, LINEAR_INNER, Axis.CP, phase, kv)
        for d in x:
            half = kv_all[d].shape[2] // 2
            prefix = n.cumsum(n.mul(kv_all[d][..., :half], kv_all[d][..., half:]), axis=1)
            c[d] = prefix[:, self._seq_slice(d)]
            z[d] = n.mul(q[d], c[d])
            a[d] = n.mm(z[d], self._w(d, ATTENTION, 1, layer))
        a = self._row_bias(self._block_out(a, phase), 0, layer)
        x_mid = {d: n.add(x[d], a[d]) for d in x}
        w = {d: n.mul(x_mid[d], self._w(d, NORM, 1, layer)) for d in x}
        w_full = self.exchanges.act(OpKind.ALL_GATHER, LAYER_IO, t_ax, phase, w) if self.sp else w
        if self.model.experts:  # the block keeps what its backward reads; here its own input stands in
            o, ffn_saved = self.moe.forward(layer, w, w_full, phase, self._read), w
        else:
            y = {d: n.mm(w_full[d], self._w(d, MLP, 0, layer)) for d in x}
            if self.model.bias:  # fc1's bias, split by columns with its matrix
                y = {d: n.add(y[d], self._w(d, MLP, 2, layer)) for d in x}
            o = self._block_out({d: n.mm(y[d], self._w(d, MLP, 1, layer)) for d in x}, phase)
            ffn_saved = dict(y)
        o = self._row_bias(o, 1, layer)
        x_out = {d: n.add(x_mid[d], o[d]) for d in x}
        saved: _Saved = {
            d: (x[d], u_full[d], q[d], kv_all[d], c[d], z[d], x_mid[d], w_full[d], ffn_saved[d]) for d in x
        }
        return x_out, saved

    def _row_bias(self, out: PerDevice, which: int, layer: int) -> PerDevice:
        """The row-parallel linear's bias, added after its reduction (Megatron's RowParallelLinear):
        whole on every tp rank, so under sequence parallelism each rank adds it to its sequence shard."""
        if not self.model.bias:
            return out
        return {d: self.n.add(v, self._w(d, ROW_BIAS, which, layer)) for d, v in out.items()}

    def _row_bias_grad(self, dout: PerDevice, which: int, layer: int) -> None:
        """Its gradient: the sum of the output gradient over the device's tokens (a partial sum
        across tp under sequence parallelism, whose reduction is an op of the program)."""
        if self.model.bias:
            for d, v in dout.items():
                self._add_grad(d, ROW_BIAS, which, layer, self.n.total(v, axis=(0, 1)))

    def _gather_grad(self, value: PerDevice) -> PerDevice:
        """Under sequence parallelism, the backward of a reduce-scatter: the shards' all-gather."""
        if not self.sp:
            return value
        return self.exchanges.act(OpKind.ALL_GATHER, LAYER_IO, Axis.TP, Phase.BACKWARD, value)

    def _block_out(self, partial: PerDevice, phase: Phase) -> PerDevice:
        """Megatron's g operator: the row-parallel output's partial sums across tp."""
        if self.t == 1:
            return partial
        kind = OpKind.REDUCE_SCATTER if self.sp else OpKind.ALL_REDUCE
        return self.exchanges.act(kind, LAYER_IO, Axis.TP, phase, partial)

    def _block_in_grad(self, partial: PerDevice) -> PerDevice:
        """Megatron's f operator in backward: the column-parallel input gradient across tp."""
        return self._block_out(partial, Phase.BACKWARD)

    def _layer_backward(self, layer: int, dx: PerDevice, saved: dict[Device, tuple[Array, ...]]) -> PerDevice:
        n, h = self.n, self.model.hidden
        bw = Phase.BACKWARD
        act = self.exchanges.act
        gather = (lambda v: act(OpKind.ALL_GATHER, LAYER_IO, Axis.TP, bw, v)) if self.sp else (lambda v: v)
        self._row_bias_grad(dx, 1, layer)
        if self.model.experts:  # the block gathers its own output gradient (after the gate's)
            w_own, w_all = {d: saved[d][8] for d in dx}, {d: saved[d][7] for d in dx}
            dw = self.moe.backward(layer, w_own, w_all, dx, self._read)
        else:
            do_full = gather(dx)
            dw_part = {}
            for d in dx:
                w_full, y = saved[d][7], saved[d][8]
                fc1, fc2 = self._w(d, MLP, 0, layer), self._w(d, MLP, 1, layer)
                self._add_grad(d, MLP, 1, layer, n.mm(y.reshape(-1, y.shape[-1]).T, do_full[d].reshape(-1, h)))
                dy = n.mm(do_full[d], fc2.T)
                self._add_grad(d, MLP, 0, layer, n.mm(w_full.reshape(-1, h).T, dy.reshape(-1, dy.shape[-1])))
                if self.model.bias:
                    self._add_grad(d, MLP, 2, layer, n.total(dy, axis=(0, 1)))
                dw_part[d] = n.mm(dy, fc1.T)
            dw = self._block_in_grad(dw_part)
        dx2 = {}
        for d in dx:
            x_mid = saved[d][6]
            self._add_grad(d, NORM, 1, layer, n.total(n.mul(dw[d], x_mid), axis=(0, 1)))
            dx2[d] = n.add(dx[d], n.mul(dw[d], self._w(d, NORM, 1, layer)))
        self._row_bias_grad(dx2, 0, layer)
        da_full = gather(dx2)
        dkv_part, dq = {}, {}
        for d in dx:
            x_in, u_full, q, kv_all, c, z, x_mid, w_full, y = saved[d]
            out_w = self._w(d, ATTENTION, 1, layer)
            self._add_grad(d, ATTENTION, 1, layer, n.mm(z.reshape(-1, z.shape[-1]).T, da_full[d].reshape(-1, h)))
            dz = n.mm(da_full[d], out_w.T)
            dq[d] = n.mul(dz, c)
            dc = n.zeros((*kv_all.shape[:2], kv_all.shape[2] // 2))
            dc[:, self._seq_slice(d)] = n.mul(dz, q)
            dprod = n.rev_cumsum(dc, axis=1)
            half = kv_all.shape[2] // 2
            dkv_part[d] = np.concatenate([n.mul(dprod, kv_all[..., half:]), n.mul(dprod, kv_all[..., :half])], axis=2)
        dkv = self.exchanges.act(OpKind.REDUCE_SCATTER, LINEAR_INNER, Axis.CP, bw, dkv_part)
        du_part = {}
        for d in dx:
            x_in, u_full = saved[d][0], saved[d][1]
            local = dkv[d]
            half = local.shape[2] // 2
            dk, dv = local[..., :half], local[..., half:]
            wqkv = self._w(d, ATTENTION, 0, layer)
            u2 = u_full.reshape(-1, h)
            grad = np.stack([n.mm(u2.T, g_.reshape(-1, half)) for g_ in (dq[d], dk, dv)], axis=1)
            self._add_grad(d, ATTENTION, 0, layer, grad)
            if self.model.bias:
                self._add_grad(d, ATTENTION, 2, layer, np.stack([n.total(g_, axis=(0, 1)) for g_ in (dq[d], dk, dv)]))
            du_part[d] = n.add(n.add(n.mm(dq[d], wqkv[:, 0].T), n.mm(dk, wqkv[:, 1].T)), n.mm(dv, wqkv[:, 2].T))
        du = self._block_in_grad(du_part)
        out = {}
        for d in dx:
            x_in = saved[d][0]
            self._add_grad(d, NORM, 0, layer, n.total(n.mul(du[d], x_in), axis=(0, 1)))
            out[d] = n.add(dx2[d], n.mul(du[d], self._w(d, NORM, 0, layer)))
        return out

    def _batch_of(self, dev: Device, batch: Batch, mb: int) -> tuple[np.ndarray, Array]:
        """The samples (and along cp the tokens) a device reads, by the placement's data
        assignment: its own along an axis splitting the activations, coordinate 0's along one
        replicating them."""
        reader = dev
        for axis in self.same_data:
            reader = self.mesh.moved(reader, axis, 0)
        replica = 0
        for axis in self.data_axes:
            replica = replica * self.mesh.degree(axis) + self.mesh.coord(reader, axis)
        b = self.model.micro_batch
        start = (replica * self.m + mb) * b
        sl = self._seq_slice(reader)
        return batch.tokens[start : start + b, sl], batch.targets[start : start + b, sl]

    def _vocab_range(self, dev: Device, group: Group = EMBEDDING) -> tuple[int, int]:
        """The vocabulary rows of ``group`` (the embedding or the head) a device computes: its tp
        slice when the group is computed split along tp, else all of them."""
        if not self.pl.computes_sharded(Axis.TP, group):
            return 0, self.model.vocab
        per = self.model.vocab // self.t
        r = self.mesh.coord(dev, Axis.TP)
        return r * per, (r + 1) * per

    def micro_batch(self, batch: Batch, mb: int, forward: Reads, backward: Reads) -> None:
        """Forward, loss and backward of micro-batch ``mb``; gradients go to the ``fresh`` buffers.

        The forward (the head's logits included) reads the parameters as ``forward`` has them, the
        backward (and its replay under recomputation) as ``backward`` has them.
        """
        self._read = forward
        self.moe.tokens = {d: self._batch_of(d, batch, mb)[0] for d in self.mesh.devices}
        n, lay = self.n, self.layout
        h = self.model.hidden
        chunks = len(lay.chunk_layers)
        recompute = self.pl.options.recompute
        vocab_split = self.t > 1 and self.pl.computes_sharded(Axis.TP, EMBEDDING)
        head_group = EMBEDDING if self.model.tied else HEAD
        head_split = self.t > 1 and self.pl.computes_sharded(Axis.TP, head_group)
        # forward
        first = self.mesh.stage_devices(0)
        x: PerDevice = {}
        for d in first:
            tokens, _ = self._batch_of(d, batch, mb)
            lo, hi = self._vocab_range(d)
            emb = self._w(d, EMBEDDING, 0)
            inside = (tokens >= lo) & (tokens < hi)
            x[d] = np.where(inside[..., None], emb[np.clip(tokens - lo, 0, hi - lo - 1)], 0).astype(emb.dtype)
        if vocab_split:  # partial sums of the vocabulary-split lookup
            kind = OpKind.REDUCE_SCATTER if self.sp else OpKind.ALL_REDUCE
            x = self.exchanges.act(kind, EMBEDDING_IO, Axis.TP, Phase.FORWARD, x)
        elif self.sp:
            x = {d: self._sp_split(d, x[d]) for d in x}
        saved: dict[int, dict[Device, tuple[Array, ...]]] = {}
        inputs: dict[int, PerDevice] = {}
        for c in range(chunks):
            if c > 0 and lay.chunk_stage(c) != lay.chunk_stage(c - 1):
                x = self.exchanges.send(Phase.FORWARD, x, lay.chunk_stage(c))
            for layer in lay.chunk_layers[c]:
                inputs[layer] = x
                x, saved[layer] = self._layer_forward(layer, x, Phase.FORWARD)
                if recompute is Recompute.FULL:
                    del saved[layer]  # only the layer input is kept (a checkpoint)
        # head and loss (last stage)
        xf = {d: n.mul(x[d], self._w(d, FINAL_NORM, 0)) for d in x}
        if self.sp:  # the head reads the whole sequence
            xf_full = self.exchanges.act(OpKind.ALL_GATHER, OUTPUT_IO, Axis.TP, Phase.FORWARD, xf)
        else:
            xf_full = xf
        # The squared error is element-wise in the logits: a vocabulary-split head computes its
        # slice of the logits and of their gradient with no exchange.
        errors: PerDevice = {}
        for d in x:
            _, targets = self._batch_of(d, batch, mb)
            lo, hi = self._vocab_range(d, head_group) if head_split else (0, self.model.vocab)
            errors[d] = n.sub(n.mm(xf_full[d], self._w(d, head_group, 0).T), targets[..., lo:hi])
        if head_split:  # a cross-entropy kernel's statistics over the vocabulary shards
            token_count = self.model.micro_batch * self.s_chunk
            self.exchanges.statistics(LOGITS, Axis.TP, Phase.FORWARD, errors, token_count, self.m)
        self._read = backward
        dxf_part: PerDevice = {}
        tokens_local = self.m * self.model.micro_batch * self.s_chunk
        for d in x:
            head = self._w(d, head_group, 0)
            lo, hi = self._vocab_range(d, head_group) if head_split else (0, self.model.vocab)
            dlogits = n.scale(errors[d], Fraction(2, tokens_local))
            grad = n.mm(dlogits.reshape(-1, hi - lo).T, xf_full[d].reshape(-1, h))
            self._add_grad(d, head_group, 0, None, grad)
            dxf_part[d] = n.mm(dlogits, head)
        if head_split:  # the input gradient of the vocabulary-split head: partial sums
            kind = OpKind.REDUCE_SCATTER if self.sp else OpKind.ALL_REDUCE
            dxf = self.exchanges.act(kind, OUTPUT_IO, Axis.TP, Phase.BACKWARD, dxf_part)
        else:
            dxf = {d: self._sp_split(d, v) for d, v in dxf_part.items()}
        dx: PerDevice = {}
        for d in x:
            self._add_grad(d, FINAL_NORM, 0, None, n.total(n.mul(dxf[d], x[d]), axis=(0, 1)))
            dx[d] = n.mul(dxf[d], self._w(d, FINAL_NORM, 0))
        # backward
        for c in reversed(range(chunks)):
            for layer in reversed(lay.chunk_layers[c]):
                if layer not in saved:  # full recomputation: replay the forward from the checkpoint
                    _, saved[layer] = self._layer_forward(layer, inputs[layer], Phase.BACKWARD)
                dx = self._layer_backward(layer, dx, saved[layer])
            if c > 0 and lay.chunk_stage(c) != lay.chunk_stage(c - 1):
                dx = self.exchanges.send(Phase.BACKWARD, dx, lay.chunk_stage(c - 1))
        if self.sp:  # the lookup's backward reads the whole sequence's gradient
            dx = self.exchanges.act(OpKind.ALL_GATHER, EMBEDDING_IO, Axis.TP, Phase.BACKWARD, dx)
        for d in dx:
            tokens, _ = self._batch_of(d, batch, mb)
            lo, hi = self._vocab_range(d)
            grad = n.zeros((hi - lo, h))
            inside = (tokens >= lo) & (tokens < hi)
            np.add.at(grad, tokens[inside] - lo, dx[d][inside])
            self._add_grad(d, EMBEDDING, 0, None, n.fix(grad))
