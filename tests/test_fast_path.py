"""The default check's exact plain arithmetic gives sympy's numbers, and the check imports no sympy.

A concrete composition's costs are computed with ``int`` and ``Fraction`` (``formal._num``); the
same formulas computed by sympy (every degree and size a sympy integer) and the symbolic memory
expressions (every degree a symbol) evaluated at the degrees are two independent computations of
the same values. Every number the report shows is compared on generated compositions.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import replace
from fractions import Fraction
from pathlib import Path

import pytest
import sympy as sp
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from strategies_costs import compositions, models

from checker._analysis import analyze
from checker._parse import parse
from formal import _num as num
from formal._costs import (
    Memory,
    activation_breakdown,
    bubble_fraction,
    communication,
    in_flight_micro_batches,
    memory,
    pipeline_stages,
    stage_in_flight,
    transfers,
)
from formal._exact import exact_fraction
from formal._model import PRECISIONS, Model, Transformer, io_activation_bytes, layer_activation_bytes
from formal._placement import Placement
from formal._program import derive_program, group_sizes
from formal._saved import LayerShape
from formal._vocab import Stage

ROOT = Path(__file__).resolve().parent.parent
PROPERTY = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
precisions = st.sampled_from(sorted(PRECISIONS))


@st.composite
def concrete_compositions(draw: st.DrawFn) -> str:
    """``compositions()``, a pipelined one sometimes with uneven stages."""
    text = draw(compositions())
    if "pp" in text and draw(st.booleans()):
        text += "xuneven"
    return text


def as_sympy(pl: Placement) -> Placement:
    """The same placement with its degrees (and uneven layer share) as sympy numbers."""
    share = None if pl.layer_share is None else num.to_sympy(pl.layer_share)
    return replace(pl, mesh=tuple((a, sp.Integer(d)) for a, d in pl.mesh), layer_share=share)


def memory_values(mem: Memory) -> list[object]:
    states = (mem.parameters, mem.gradients, mem.optimizer)
    rows = [v for st_ in states for _, v in st_.by_group]
    return [*rows, *(s.total for s in states), mem.activations, mem.buffers, mem.host, mem.model_states, mem.total]


def assert_same(plain: object, symbolic: object, what: object) -> None:
    """Equal values; the plain one is an exact plain number (never a float nor a sympy value)."""
    if plain is None or symbolic is None:
        assert plain is None and symbolic is None, what
        return
    assert num.is_plain(plain), (what, plain)
    assert exact_fraction(plain) == exact_fraction(symbolic), (what, plain, symbolic)  # a float is refused


@PROPERTY
@given(concrete_compositions(), models(), precisions)
def test_plain_arithmetic_gives_sympys_numbers(text: str, model: Model, precision_name: str) -> None:
    precision = PRECISIONS[precision_name]
    pl = parse(text).placement(model)
    spl = as_sympy(pl)
    sizes = group_sizes(model)
    ssizes = {g: sp.Integer(n) for g, n in sizes.items()}
    program, sprogram = derive_program(pl, model), derive_program(spl, model, ssizes)
    for stage in pipeline_stages(pl):
        fast, slow = memory(pl, model, precision, sizes, stage), memory(spl, model, precision, ssizes, stage)
        assert num.is_sympy(slow.total)  # the reference really computed in sympy
        for i, (a, b) in enumerate(zip(memory_values(fast), memory_values(slow), strict=True)):
            assert_same(a, b, (text, stage, i))
        for t, u in zip(
            communication(program, precision, stage), communication(sprogram, precision, stage), strict=True
        ):
            assert (t.kind, t.axis, t.state, t.group, t.phase) == (u.kind, u.axis, u.state, u.group, u.phase)
            for field in ("elements", "count", "participants", "bytes", "paper_elements"):
                assert_same(getattr(t, field), getattr(u, field), (text, stage, t.kind, field))
        assert_same(in_flight_micro_batches(pl, stage), sp.sympify(in_flight_micro_batches(spl, stage)), stage)
        assert activation_breakdown(pl, model, precision, stage) == activation_breakdown(spl, model, precision, stage)
    if pl.pipelined:
        for index in range(int(pl.pipeline_degree)):
            assert_same(stage_in_flight(pl, index), sp.sympify(stage_in_flight(spl, index)), index)
    assert_same(bubble_fraction(pl), sp.sympify(bubble_fraction(spl)), "bubble")
    for a, b in zip(transfers(program, precision), transfers(sprogram, precision), strict=True):
        assert a[:4] == b[:4]
        assert_same(a[4], b[4], a[:4])
    assert [str(op) for op in program.ops] == [str(op) for op in sprogram.ops]  # the JSON's program


@PROPERTY
@given(concrete_compositions(), models(), precisions)
def test_symbolic_expressions_evaluate_to_the_reported_numbers(text: str, model: Model, precision_name: str) -> None:
    """The JSON's memory expressions (degrees as symbols) at the composition's degrees are the
    first stage's numbers the report prints."""
    precision = PRECISIONS[precision_name]
    a = analyze(parse(text), model, precision)
    pl = a.placement
    at = {sp.Symbol(f"d_{axis.value}", positive=True, integer=True): d for axis, d in pl.mesh}
    first = memory(pl, model, precision, group_sizes(model), Stage.FIRST)
    sym = a.symbolic_memory
    pairs = [
        (first.parameters.total, sym.parameters.total),
        (first.gradients.total, sym.gradients.total),
        (first.optimizer.total, sym.optimizer.total),
        (first.model_states, sym.model_states),
        (first.activations, sym.activations),
        (first.buffers, sym.buffers),
    ]
    for i, (plain, expression) in enumerate(pairs):
        assert_same(plain, None if expression is None else sp.sympify(expression).subs(at), (text, i))


@PROPERTY
@given(
    st.integers(1, 65536),
    st.integers(1, 64),
    st.integers(1, 64).map(lambda k: 8 * k),
    st.sampled_from([1, 2, 4, 8]),
    st.integers(1, 200_000),
    st.sampled_from([(2, 1, 4), (4, 1, 4), (2, 2, 2)]),
    st.booleans(),
    st.booleans(),
)
def test_activation_formulas_agree_on_plain_and_sympy_sizes(
    seq: int,
    micro_batch: int,
    hidden: int,
    heads: int,
    vocab: int,
    widths: tuple[int, int, int],
    gated: bool,
    dropout: bool,
) -> None:
    """Korthikanti's per-layer and input/output bytes (``formal._saved``) from ints and from sympy integers."""
    element, mask, logits = widths
    shape = LayerShape(ffn=3 * hidden, kv_heads=heads, gated=gated, dropout=dropout)
    plain = layer_activation_bytes(seq, micro_batch, hidden, heads, element, mask, shape)
    ints = (sp.Integer(seq), sp.Integer(micro_batch), sp.Integer(hidden), sp.Integer(heads))
    sshape = LayerShape(ffn=sp.Integer(3 * hidden), kv_heads=sp.Integer(heads), gated=gated, dropout=dropout)
    symbolic = layer_activation_bytes(*ints, element, mask, sshape)
    for g in plain:
        assert_same(plain[g], symbolic[g], g)
    io = io_activation_bytes(seq, micro_batch, hidden, vocab, element, mask, logits, dropout=dropout)
    sio = io_activation_bytes(*ints[:3], sp.Integer(vocab), element, mask, logits, dropout=dropout)
    for g in io:
        assert_same(io[g], sp.sympify(sio[g]), g)


def test_an_analysis_has_plain_numbers() -> None:
    model = Transformer("t", layers=3, hidden=64, heads=4, vocab=100, seq=16)
    a = analyze(parse("tp2xzero3xpp3xm4", devices=12), model)
    assert all(num.is_plain(v) for v in memory_values(a.memory) if v is not None)
    assert num.is_plain(a.bubble) and a.bubble == Fraction(2, 4)  # (p - 1)/m, Narayanan et al. 2021
    assert num.is_plain(a.model_state_psi)


@pytest.mark.parametrize(
    "argv",
    [
        ["tp2xzero3xpp4"],
        ["compare", "dp", "zero1", "zero3", "--devices", "8"],
        ["sweep", "tp{}xzero3", "--values", "1,2"],
    ],
)
def test_numbers_alone_import_no_sympy_nor_numpy(argv: list[str]) -> None:
    """The default check (``check-composition tp2xzero3xpp4``) and the tables of compare and sweep
    print numbers only: in their whole run neither sympy nor numpy is imported (the process's exit
    runs ``atexit`` callbacks, which look at what was loaded)."""
    probe = (
        "import atexit, runpy, sys\n"
        "atexit.register(lambda: print('loaded:', sorted(m for m in ('sympy', 'numpy') if m in sys.modules),"
        " file=sys.stderr))\n"
        f"sys.argv = ['check-composition', *{argv!r}]\n"
        "runpy.run_module('checker.cli', run_name='__main__')\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "80"}
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, env=env, cwd=ROOT, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip()
    assert "loaded: []" in done.stderr, done.stderr


def test_the_json_document_still_has_the_symbolic_expressions() -> None:
    """``--json`` keeps the memory expressions in the degrees (the only output that needs sympy)."""
    from checker._report import to_json

    model = Transformer("t", layers=4, hidden=64, heads=4, vocab=100, seq=16)
    doc = to_json(analyze(parse("zero3", devices=8), model))
    assert doc["memory"]["expressions"]["parameters"].endswith("/d_dp")
    # the expression at d_dp = 8 is the printed number
    value = sp.sympify(doc["memory"]["expressions"]["model_states"]).subs(sp.Symbol("d_dp"), 8)  # text: no assumptions
    assert sp.ceiling(value) == doc["memory"]["per_device"]["model_states"]


@given(st.integers(-(10**20), 10**20), st.integers(1, 10**20))
def test_ratio_is_exact_for_plain_and_sympy_operands(p: int, q: int) -> None:
    """Regression: sympy registers its integers as ``numbers.Integral``, and ``ratio(1, Integer(8))``
    once divided two Python ints (0.125, a float). Every mix of operands gives the exact p/q."""
    want = Fraction(p, q)
    for a, b in ((p, q), (sp.Integer(p), q), (p, sp.Integer(q)), (sp.Integer(p), sp.Integer(q)), (Fraction(p), q)):
        got = num.ratio(a, b)
        assert not isinstance(got, float)
        assert exact_fraction(got) == want
    assert type(num.ratio(2 * q, q)) is int  # a whole ratio of plain numbers is an int
