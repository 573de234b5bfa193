"""Hypothesis strategies for the cost model: models, degrees, compositions (plural nouns)."""

from __future__ import annotations

from hypothesis import strategies as st

from formal._model import Ffn, Norm, ParameterCount, Transformer

# One strategy per axis; the degree is drawn separately. ``hsdp`` pairs with ``dpr``.
DATA_STRATEGIES = ("dp", "zero1", "zero2", "zero3", "fsdp", "fsdp-sgo", "hsdp", "distopt")
MODIFIERS = ("sp", "selective", "recompute", "offload", "offload-params", "gpipe", "v2", "zb")


def degrees(max_value: int = 16) -> st.SearchStrategy[int]:
    """Mesh degrees: mostly powers of two, sometimes 3 or 6 (odd shards round up)."""
    return st.sampled_from([d for d in (1, 2, 3, 4, 6, 8, 16) if d <= max_value])


@st.composite
def transformers(draw: st.DrawFn) -> Transformer:
    heads = draw(st.sampled_from([1, 2, 4, 8]))
    kv = draw(st.sampled_from([h for h in (1, 2, 4, 8) if heads % h == 0]))
    hidden = heads * draw(st.integers(1, 16)) * 8
    return Transformer(
        "random",
        layers=draw(st.integers(1, 12)),
        hidden=hidden,
        heads=heads,
        kv_heads=kv,
        vocab=draw(st.integers(8, 4096)),
        seq=draw(st.integers(1, 256)),
        micro_batch=draw(st.integers(1, 4)),
        ffn=draw(st.none() | st.integers(1, 1024)),
        ffn_kind=draw(st.sampled_from(list(Ffn))),
        norm=draw(st.sampled_from(list(Norm))),
        bias=draw(st.booleans()),
        learned_positions=draw(st.booleans()),
        tied_embeddings=draw(st.booleans()),
        final_norm=draw(st.booleans()),
    )


def parameter_counts() -> st.SearchStrategy[ParameterCount]:
    return st.builds(ParameterCount, st.integers(1, 10**13))


def models() -> st.SearchStrategy[Transformer | ParameterCount]:
    return st.one_of(transformers(), parameter_counts())


@st.composite
def compositions(draw: st.DrawFn, pipeline: bool = True, modifiers: bool = True) -> str:
    """A composition string: a data-parallel strategy plus optional tp, cp, pp and modifiers."""
    data = draw(st.sampled_from(DATA_STRATEGIES))
    terms = [f"{data}{draw(degrees())}"]
    if data == "hsdp":
        terms.append(f"dpr{draw(degrees(4))}")
    tp = draw(st.booleans())
    if tp:
        terms.insert(0, f"tp{draw(degrees(8))}")
    if draw(st.booleans()):
        terms.append(f"cp{draw(degrees(4))}")
    pp = pipeline and draw(st.booleans())
    if pp:
        terms.append(f"pp{draw(degrees(8))}")
        terms.append(f"m{draw(st.integers(1, 32))}")
    if modifiers:
        for mod in draw(st.lists(st.sampled_from(MODIFIERS), unique=True, max_size=3)):
            if mod == "sp" and not tp:
                continue
            if mod in ("gpipe", "v2", "zb") and (not pp or any(t in ("gpipe", "v2", "zb") for t in terms)):
                continue
            if mod in ("selective", "recompute") and any(t in ("selective", "recompute") for t in terms):
                continue
            terms.append(mod)
    return "x".join(terms)
