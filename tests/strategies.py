"""Reusable hypothesis strategies (plural nouns): models, compositions, program mutations, texts.

``compositions(model)`` draws library strategies on distinct axes with degrees that respect the
divisibility rules for ``model``, plus modifiers whose prerequisites hold; every draw must be
proved valid. Parameter offload (``offload-params``) is drawn with every data strategy, ZeRO-1/2
and distopt included: the derived program brings the host copy of replicated parameters to the
device for the refresh gather and back (DeepSpeed itself only offers parameter offload with ZeRO-3).
"""

from __future__ import annotations

from hypothesis import strategies as st

from checker._parse import parse
from formal._model import Ffn, Norm, Transformer
from formal._program import StepProgram
from formal._strategies import LIBRARY, Composition
from formal._vocab import State

DATA_PARALLEL = ("dp", "zero1", "zero2", "zero3", "fsdp", "fsdp-sgo", "hsdp", "distopt")
TOKENS = (
    "tp",
    "dp",
    "pp",
    "cp",
    "ep",
    "zero",
    "fsdp",
    "sp",
    "x",
    "×",
    "*",
    "m",
    "v",
    "2",
    "4",
    "8",
    "0",
    "-",
    "offload",
    "params",
    "recompute",
    " ",
    "",
    "1f1b",
    "gpipe",
    "dpr",
    "hsdp",
    "9999999",
    "é",
)


@st.composite
def models(draw: st.DrawFn) -> Transformer:
    """Small transformers whose sizes divide by 8 (tp, pp and ep up to 4, cp up to 2)."""
    moe = draw(st.booleans())
    return Transformer(
        "tiny-moe" if moe else "tiny",
        layers=8,
        hidden=512,
        heads=8,
        vocab=1024,
        seq=256,
        kv_heads=draw(st.sampled_from([None, 4])),
        ffn_kind=draw(st.sampled_from(list(Ffn))),
        norm=draw(st.sampled_from(list(Norm))),
        bias=draw(st.booleans()),
        learned_positions=draw(st.booleans()),
        tied_embeddings=draw(st.booleans()),
        experts=8 if moe else 0,
        top_k=2 if moe else 0,
    )


@st.composite
def compositions(draw: st.DrawFn, model: Transformer) -> Composition:
    """A library composition over distinct axes that respects ``model``'s divisibility rules."""
    terms: list[str] = []
    data = draw(st.sampled_from((None, *DATA_PARALLEL)))
    if data is not None:
        terms.append(f"{data}{draw(st.sampled_from([1, 2, 3, 4, 8, 16]))}")
        if data == "hsdp" or (draw(st.booleans()) and draw(st.booleans())):
            terms.append(f"dpr{draw(st.sampled_from([1, 2]))}")
    tp = draw(st.sampled_from([0, 1, 2, 4]))
    if tp:
        terms.append(f"tp{tp}")
    pp = draw(st.sampled_from([0, 1, 2, 4]))
    if pp:
        terms.append(f"pp{pp}")
    if draw(st.booleans()) and draw(st.booleans()):
        terms.append(f"cp{draw(st.sampled_from([1, 2]))}")
    if model.is_moe and draw(st.booleans()):
        terms.append(f"ep{draw(st.sampled_from([1, 2, 4]))}")
    if not terms:
        terms.append(f"dp{draw(st.sampled_from([2, 4]))}")
    terms = draw(st.permutations(terms))
    if tp and draw(st.booleans()):
        terms.append("sp")
    if pp:
        schedule = draw(st.sampled_from(["", "gpipe", "v2"]))
        if schedule:
            terms.append(schedule)
    if draw(st.booleans()):
        terms.append(f"m{draw(st.sampled_from([1, 2, 4]))}")
    recompute = draw(st.sampled_from(["", "recompute", "selective"]))
    if recompute:
        terms.append(recompute)
    if draw(st.booleans()) and draw(st.booleans()):
        terms.append("offload")
    if draw(st.booleans()) and draw(st.booleans()):
        terms.append("offload-params")
    return parse("x".join(terms))


def library_names() -> st.SearchStrategy[str]:
    return st.sampled_from(sorted(LIBRARY))


@st.composite
def mutations(draw: st.DrawFn, program: StepProgram) -> tuple[StepProgram, int]:
    """A program with one of its P/O/G collectives or transfers dropped, and the dropped index."""
    candidates = [
        i
        for i, op in enumerate(program.ops)
        if op.state is not State.ACTIVATIONS and (op.kind.is_collective or op.kind.is_transfer)
    ]
    index = draw(st.sampled_from(candidates))
    return program.with_ops(op for i, op in enumerate(program.ops) if i != index), index


def composition_texts() -> st.SearchStrategy[str]:
    """Arbitrary text and near-miss composition strings (tokens glued together)."""
    return st.one_of(st.text(max_size=40), st.lists(st.sampled_from(TOKENS), max_size=8).map("".join))


MODE_WORDS = ("R", "S", "S*", "M", "O", "S@1", "S*+hold", "R@1", "sharded", "Q", "", "S@99999999", "+hold")
KEYS = (
    "axis",
    "P",
    "O",
    "G",
    "A",
    "groups",
    "compute_sharded",
    "description",
    "op",
    "state",
    "group",
    "phase",
    "reduce",
    "offset",
    "scale",
    "bogus",
)
VALUES = (
    '"dp"',
    '"tp"',
    '"pp"',
    '"zz"',
    "1",
    "-1",
    "true",
    '"all"',
    '["attention"]',
    "[1]",
    '"1/d"',
    '"0"',
    '"sum"',
    '"mean"',
    '"all_reduce"',
    '"compute"',
    '"G"',
    '"P"',
    '"grad_sync"',
    "{}",
    "3.5",
    '"x"',
)


@st.composite
def strategy_files(draw: st.DrawFn) -> str:
    """TOML-shaped text built from the format's own words, right and wrong (plus raw text)."""
    if draw(st.booleans()) and draw(st.booleans()):
        return draw(st.text(max_size=200))
    lines: list[str] = []
    for _ in range(draw(st.integers(0, 3))):
        name = draw(st.sampled_from(["mine", "zero1", "sp", "x-y", "a1", "ok-name", "", "Up"]))
        lines.append(f"[strategies.{name}]" if name else "[strategies]")
        for _ in range(draw(st.integers(0, 5))):
            key = draw(st.sampled_from(KEYS))
            value = (
                f'"{draw(st.sampled_from(MODE_WORDS))}"'
                if key in "POGA" and draw(st.booleans())
                else draw(st.sampled_from(VALUES))
            )
            lines.append(f"{key} = {value}")
    for _ in range(draw(st.integers(0, 3))):
        lines.append("[[program]]")
        for _ in range(draw(st.integers(0, 5))):
            lines.append(f"{draw(st.sampled_from(KEYS))} = {draw(st.sampled_from(VALUES))}")
    return "\n".join(lines) + "\n"
