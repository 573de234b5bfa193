"""The composition language: ``tp2xzero3xpp4``, ``fsdp8xdpr2``, ``tp4xspxpp2xm8``.

Terms are joined by ``x`` (``×`` and ``*`` are accepted too). A term is a strategy name with an
optional degree, or a modifier (see ``MODIFIERS``). A name that ends in a digit may give its
degree with its axis, ``zero3(dp=8)``, which cannot be read as the number 38: ``readable``
writes a composition that way (``tp2 × zero3(dp=8) × pp4``) and ``parse`` reads it back.
Parsing is total: every string either parses or raises ``CompositionError`` naming the offending term.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import replace

from checker._numbers import MAX_DEGREE, parse_int
from formal._axes import DATA_REPLICATE
from formal._placement import Options, Recompute, Schedule, Strategy
from formal._scalars import SCALAR_MODIFIERS, scalar_modifier
from formal._schedules import for_term, modifier_help
from formal._strategies import LIBRARY, Composition, hpz_dpr
from formal.errors import CompositionError, InputError

MAX_TERMS = 32  # more terms than any mesh has axes and modifiers: a typo or a generated string
MAX_TEXT = 1_000  # characters of a composition

MODIFIERS: dict[str, str] = {
    "sp": "sequence parallelism on the tp axis (Korthikanti et al. 2022)",
    "m<N>": "N micro-batches per step (pipeline micro-batches or gradient accumulation)",
    **modifier_help(),  # the pipeline schedules' (formal._schedules)
    "uneven": "uneven pipeline stages: layers need not divide by pp; the fullest stage holds ceil(L/pp)",
    "offload": "optimizer state, gradients and the update on the host (ZeRO-Offload)",
    "offload-params": "parameters on the host, fetched before each use (ZeRO-Infinity)",
    "recompute": "full activation recomputation (keep each layer's input only)",
    "selective": "selective recomputation of the attention core (Korthikanti et al. 2022)",
    "flash": "attention scores never stored (FlashAttention): the same placement as selective",
    "clip": "global gradient-norm clipping (torchtitan max_norm, DeepSpeed gradient_clipping)",
    "per-token": "loss averaged over the global batch's valid tokens, whose counts differ per rank",
    "fp16": "fp16 dynamic loss scaling: an overflow anywhere skips the step on every rank",
    "balance-loss": "MoE load-balancing loss from each replica's micro-batch routing statistics",
    "global-balance-loss": "MoE load-balancing loss from the global batch's routing statistics",
    "hpz": "ZeRO++ hpZ on the zero3/fsdp term: zero3<k>xhpz-dpr<N/k>, k = --node-size (Wang et al. 2023)",
}

DEFAULT_NODE_SIZE = 8  # devices per node for the hpz modifier (check --node-size)
_HPZ_BASES = ("zero3", "fsdp")  # the ZeRO-3 placements hpZ partitions hierarchically

_AXIS_DEGREE = re.compile(r"^([a-z][a-z0-9-]*)\(([a-z]+)=([0-9]+)\)$")  # zero3(dp=8)
_TERM = re.compile(r"^([a-z][a-z0-9-]*?)([0-9]*)$")  # ASCII digits only: '²' or '٣' is not a degree
_SPLIT = re.compile(r"[x×*]")


def _split_terms(text: str) -> list[str]:
    # 'x' separates terms, but never inside a known name; no library name contains an 'x'.
    return [t.strip() for t in _SPLIT.split(text.strip().lower())]


def parse(
    text: str,
    strategies: Mapping[str, Callable[[], Strategy]] | None = None,
    devices: int | None = None,
    node_size: int = DEFAULT_NODE_SIZE,
) -> Composition:
    """Parse a composition; a term without a degree takes the devices left over.

    ``hpz`` splits the zero3/fsdp term's N devices into nodes of ``node_size``: it becomes
    ``zero3<node_size>xhpz-dpr<N/node_size>``, which is what ``str`` of the result writes.
    """
    if not isinstance(text, str) or not text.strip():
        raise CompositionError("empty composition: expected terms like tp2xzero3xpp4")
    if len(text) > MAX_TEXT:
        raise CompositionError(
            f"{text[:40]}...: {len(text)} characters is too long for a composition (at most {MAX_TEXT})"
        )
    if devices is not None and not 1 <= devices <= MAX_DEGREE:
        raise CompositionError(f"--devices {devices}: must be from 1 to {MAX_DEGREE:,}")
    library = {**LIBRARY, **(strategies or {})}
    terms = _split_terms(text)
    if len(terms) > MAX_TERMS:
        raise CompositionError(f"{text.strip()[:40]}...: {len(terms)} terms (at most {MAX_TERMS})")
    found: list[Strategy] = []
    modifiers: list[str] = []
    options = Options()
    hpz = False
    for term in terms:
        if not term:
            raise CompositionError(f"{text.strip()!r}: empty term (doubled or trailing 'x')")
        if term == "hpz":
            if hpz:
                raise CompositionError("hpz: modifier 'hpz' given twice")
            hpz = True
            continue
        if re.fullmatch(r"hpz\d+", term):
            raise CompositionError(
                f"{term}: hpz takes no degree (it splits the zero3/fsdp term into nodes of "
                "--node-size devices; write zero3<k>xhpz-dpr<n> for n nodes of k)"
            )
        mod = _modifier(term, options, modifiers)
        if mod is not None:
            options = mod
            modifiers.append(term)
            continue
        name, degree = _axis_and_degree(term, library) if "(" in term else _name_and_degree(term, library)
        found.append(library[name]().with_degree(degree))
    if not found:
        raise CompositionError(f"{text.strip()!r}: no strategy, only modifiers")
    found = _resolve_leftover(found, devices, text)
    if hpz:
        found = _hierarchical_partitioning(found, node_size)
    total = 1
    for strategy in found:
        total *= strategy.degree or 1
    if total > MAX_DEGREE:
        raise CompositionError(
            f"{text.strip()}: {total:,} devices (the product of the degrees) is absurd (at most {MAX_DEGREE:,})"
        )
    if not any(_modifier_kind(t) == "m" for t in modifiers):
        options = replace(options, micro_batches=_default_micro_batches(found))
    return Composition(tuple(found), options, tuple(modifiers))


def _hierarchical_partitioning(found: list[Strategy], node_size: int) -> list[Strategy]:
    """ZeRO++ hpZ (Wang et al. 2023, section 3.2): ZeRO-3 over N devices as ZeRO-3 within each
    node of k (dp) and, across the N/k nodes, parameters held through the backward (dpr), so
    that the backward gathers within the node from the secondary partition (P/k per device)."""
    if node_size < 1:
        raise CompositionError(f"hpz: --node-size {node_size} must be at least 1")
    base = [i for i, s in enumerate(found) if s.name in _HPZ_BASES]
    if not base:
        raise CompositionError(
            f"hpz: needs a {' or '.join(_HPZ_BASES)} term (hpZ partitions ZeRO-3's parameters within and across nodes)"
        )
    taken = [s for s in found if s.axis.kind is DATA_REPLICATE]
    if taken:
        raise CompositionError(f"hpz: {taken[0]} already uses the dpr axis, where hpz places the nodes")
    i = base[0]
    total = found[i].degree or 1
    if total % node_size:
        raise CompositionError(
            f"{found[i]}xhpz: the node size {node_size} (--node-size) does not divide "
            f"the {found[i].name} degree {total}"
        )
    out = list(found)
    out[i : i + 1] = [found[i].with_degree(node_size), hpz_dpr().with_degree(total // node_size)]
    return out


def _default_micro_batches(found: list[Strategy]) -> int:
    """Without ``m<N>``: one micro-batch, or 4p under a pipeline (1F1B bubble (p-1)/4p < 1/4)."""
    p = 1
    for s in found:
        if s.axis.kind.is_pipeline:
            p *= s.degree or 1
    return 4 * p if p > 1 else 1


def readable(composition: Composition) -> str:
    """``composition`` in a spelling no reader takes for a number: ``tp2 × zero3(dp=8) × pp4``.

    A strategy whose name ends in a digit shows its degree with its axis (``zero1(dp=512)``, not
    ``zero1512``); the others and the modifiers are written as ``str`` writes them. ``parse``
    reads the result back to the same composition."""

    def term(s: Strategy) -> str:
        if s.degree is None or not s.name[-1:].isdigit():
            return str(s)
        return f"{s.name}({s.axis.value}={s.degree})"

    return " × ".join([term(s) for s in composition.strategies] + list(composition.modifiers))


def _axis_and_degree(term: str, library: Mapping[str, Callable[[], Strategy]]) -> tuple[str, int | None]:
    """``zero3(dp=8)``: the strategy, its axis (checked) and its degree."""
    match = _AXIS_DEGREE.match(term)
    if not match:
        raise CompositionError(f"{term}: not a strategy term (expected e.g. zero3(dp=8) or tp2)")
    name, axis, digits = match.groups()
    if name not in library:
        raise CompositionError(f"{term}: unknown strategy {name!r} (known: {', '.join(sorted(library))})")
    actual = library[name]().axis.value
    if axis != actual:
        raise CompositionError(f"{term}: {name} lies along the {actual} axis, not {axis}")
    return name, _degree(term, digits)


def _name_and_degree(term: str, library: Mapping[str, Callable[[], Strategy]]) -> tuple[str, int | None]:
    if term in library:
        return term, None
    match = _TERM.match(term)
    if match:
        name, digits = match.group(1), match.group(2)
        # zero38 is zero3 with degree 8: try the longest known name that leaves only digits.
        for cut in range(len(term), 0, -1):
            head, tail = term[:cut], term[cut:]
            if head in library and tail.isascii() and tail.isdigit():
                return head, _degree(term, tail)
        if name == "zero" and "zero" not in library:  # hypothesis-style: echo the user's spelling
            raise CompositionError(f"{term}: ZeRO stage must be 1, 2 or 3")
        if name not in library:
            raise CompositionError(
                f"{term}: unknown strategy {name!r} (known: {', '.join(sorted(library))}; "
                f"modifiers: {', '.join(MODIFIERS)})"
            )
        return name, _degree(term, digits) if digits else None
    raise CompositionError(f"{term}: not a strategy term (expected a name and an optional degree, e.g. tp2)")


def _degree(term: str, digits: str) -> int:
    try:
        value = parse_int(digits, term, low=0)
    except InputError:
        raise CompositionError(f"{term}: degree {digits} is absurd (at most {MAX_DEGREE})") from None
    if value < 1:
        raise CompositionError(f"{term}: degree must be at least 1")
    return value


def _modifier(term: str, options: Options, seen: list[str]) -> Options | None:
    def once(key: str) -> None:
        if any(_modifier_kind(s) == key for s in seen):
            raise CompositionError(f"{term}: modifier {key!r} given twice")

    kind = _modifier_kind(term)
    if kind is None:
        return None
    once(kind)
    match kind:
        case "sp":
            return replace(options, sequence_parallel=True)
        case "m":
            return replace(options, micro_batches=_degree(term, term[1:]))
        case "v":
            return replace(options, chunks=_degree(term, term[1:]), schedule=Schedule.INTERLEAVED)
        case "schedule":
            schedule = for_term(term)
            assert schedule is not None
            return replace(options, schedule=schedule)
        case "uneven":
            return replace(options, uneven_stages=True)
        case "offload":
            return replace(options, offload_optimizer=True)
        case "offload-params":
            return replace(options, offload_parameters=True)
        case "clip" | "per-token" | "fp16" | "balance-loss" | "global-balance-loss":
            return replace(options, scalars=scalar_modifier(term, options.scalars))
        case "recompute":
            full = term in ("recompute", "full-recompute")
            recompute = Recompute.FULL if full else Recompute.SELECTIVE
            return replace(options, recompute=recompute, fused_attention=term == "flash")
        case _:
            raise AssertionError(kind)


def _modifier_kind(term: str) -> str | None:
    if term == "sp":
        return "sp"
    if re.fullmatch(r"m[0-9]+", term):
        return "m"
    if re.fullmatch(r"v[0-9]+", term):
        return "v"
    if for_term(term) is not None:
        return "schedule"
    if term == "uneven":
        return "uneven"
    if term in ("offload", "offload-optimizer"):
        return "offload"
    if term == "offload-params":
        return "offload-params"
    if term in SCALAR_MODIFIERS:
        return term
    if term in ("recompute", "full-recompute", "selective", "selective-recompute", "flash"):
        return "recompute"
    return None


def _resolve_leftover(found: list[Strategy], devices: int | None, text: str) -> list[Strategy]:
    missing = [i for i, s in enumerate(found) if s.degree is None]
    if not missing:
        return found
    if len(missing) > 1:
        names = ", ".join(str(found[i]) for i in missing)
        raise CompositionError(f"{text.strip()}: {names} have no degree; give all but one a degree")
    given = 1
    for s in found:
        given *= s.degree or 1
    total = devices if devices is not None else None
    if total is None:
        raise CompositionError(f"{found[missing[0]].name}: no degree and no --devices to take it from")
    if total % given:
        raise CompositionError(
            f"{found[missing[0]].name}: --devices {total} is not a multiple of the other degrees' product {given}"
        )
    out = list(found)
    out[missing[0]] = found[missing[0]].with_degree(total // given)
    return out
