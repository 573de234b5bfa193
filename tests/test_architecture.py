"""The project's structural rules: no module over 700 lines, no import cycle, no axis-name match.

Covers every module of ``formal``, ``checker`` (with ``checker._torch``) and ``proofs``. An
import counts wherever it is written: at the top of a module, inside a function, or under
``if TYPE_CHECKING:``. ``from package import name`` is an import of ``package.name`` when that
is a module, of ``package`` otherwise.

The allow-lists name what breaks a rule today and is being fixed elsewhere. They may only
shrink: an entry that no longer breaks its rule fails the test until it is removed.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("formal", "checker", "proofs")
MAX_LINES = 700

# Modules still over the limit, each with why it is tolerated for now.
OVERSIZED_ALLOWED: dict[str, str] = {}

# Import cycles still present (each one strongly connected set of modules), and why.
CYCLES_ALLOWED: dict[frozenset[str], str] = {}

# Where the axis kinds (``formal/_axes.py``) say which axis name is which parallelism.
AXIS_NAME_OWNERS = frozenset({"formal/_vocab.py", "formal/_axes.py"})
AXIS_MEMBERS = frozenset({"DP", "DPR", "TP", "PP", "CP", "EP"})
AXIS_VALUES = frozenset({"dp", "dpr", "tp", "pp", "cp", "ep"})

# Modules that still match on axis names, with their count: other work owns them now (the
# simulator, the z3 encodings, the TOML reader, the exporters). A count may only fall.
AXIS_NAME_MATCHES_ALLOWED: dict[str, int] = {}


def _modules(root: Path, packages: tuple[str, ...]) -> dict[str, Path]:
    """Dotted module name to file, for every ``.py`` file of ``packages`` under ``root``."""
    out: dict[str, Path] = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def _known(name: str, modules: dict[str, Path]) -> str | None:
    """The longest prefix of ``name`` that is one of ``modules`` (None: outside them)."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def import_graph(root: Path, packages: tuple[str, ...]) -> dict[str, set[str]]:
    """Each module's imports of other modules of ``packages``, from any place in its source."""
    modules = _modules(root, packages)
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets: list[str] = []
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if isinstance(node, ast.Import):
                targets += [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: up from the importing module's package
                    anchor = package
                    for _ in range(node.level - 1):
                        anchor = anchor.rpartition(".")[0]
                    base = f"{anchor}.{base}" if base else anchor
                for alias in node.names:
                    sub = f"{base}.{alias.name}"
                    targets.append(sub if sub in modules else base)
        graph[name] = {t for t in (_known(t, modules) for t in targets) if t is not None and t != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """The strongly connected sets of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[frozenset[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(frozenset(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _line_counts() -> dict[str, int]:
    return {
        path.relative_to(ROOT).as_posix(): len(path.read_text(encoding="utf-8").splitlines())
        for path in _modules(ROOT, PACKAGES).values()
    }


def _describe(component: frozenset[str], graph: dict[str, set[str]]) -> str:
    edges = [f"{a} -> {b}" for a in sorted(component) for b in sorted(graph[a] & component)]
    return "{" + ", ".join(sorted(component)) + "}: " + "; ".join(edges)


def test_no_module_is_over_the_line_limit() -> None:
    over = {path: n for path, n in _line_counts().items() if n > MAX_LINES and path not in OVERSIZED_ALLOWED}
    assert not over, f"modules over {MAX_LINES} lines (split them): {over}"


def test_every_oversized_module_allowed_is_still_oversized() -> None:
    counts = _line_counts()
    fixed = {path: counts.get(path) for path in OVERSIZED_ALLOWED if counts.get(path, 0) <= MAX_LINES}
    assert not fixed, f"no longer over {MAX_LINES} lines (or gone): remove from OVERSIZED_ALLOWED: {fixed}"


def test_the_import_graph_has_no_cycle() -> None:
    graph = import_graph(ROOT, PACKAGES)
    new = [_describe(c, graph) for c in cycles(graph) if c not in CYCLES_ALLOWED]
    assert not new, "import cycles:\n" + "\n".join(new)


def test_every_cycle_allowed_is_still_there() -> None:
    present = set(cycles(import_graph(ROOT, PACKAGES)))
    gone = [sorted(c) for c in CYCLES_ALLOWED if c not in present]
    assert not gone, f"no longer a cycle as listed: update CYCLES_ALLOWED: {gone}"


def test_the_scanner_sees_function_level_and_type_checking_imports(tmp_path: Path) -> None:
    (tmp_path / "pkg" / "sub").mkdir(parents=True)
    files = {
        "pkg/__init__.py": "",
        "pkg/a.py": "def f() -> None:\n    from pkg import b\n",
        "pkg/b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .sub import c\n",
        "pkg/sub/__init__.py": "",
        "pkg/sub/c.py": "import pkg.a\nimport os\n",
        "pkg/d.py": "from . import a\n",
    }
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    graph = import_graph(tmp_path, ("pkg",))
    assert graph["pkg.a"] == {"pkg.b"} and graph["pkg.b"] == {"pkg.sub.c"} and graph["pkg.sub.c"] == {"pkg.a"}
    assert graph["pkg.d"] == {"pkg.a"}
    assert cycles(graph) == [frozenset({"pkg.a", "pkg.b", "pkg.sub.c"})]


def _is_axis_name(node: ast.expr) -> bool:
    return (
        isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Name)
        and node.value.id == "Axis"
        and node.attr in AXIS_MEMBERS
    )


def _names_in(node: ast.expr) -> list[ast.expr]:
    """``Axis.X`` itself, or the ``Axis.X`` elements of a tuple or list display (a set display
    is counted where it stands, below)."""
    if _is_axis_name(node):
        return [node]
    if isinstance(node, ast.Tuple | ast.List):
        return [e for e in node.elts if _is_axis_name(e)]
    return []


def _is_axis_value_test(node: ast.Compare) -> bool:
    """A comparison of something's ``.value`` with a string that spells an axis (``a.value == "pp"``)."""
    operands = [node.left, *node.comparators]
    spelled = any(isinstance(o, ast.Constant) and o.value in AXIS_VALUES for o in operands)
    return spelled and any(isinstance(o, ast.Attribute) and o.attr == "value" for o in operands)


def axis_name_matches(source: str) -> list[int]:
    """Lines where ``source`` matches on an axis name instead of asking the axis' kind.

    A match is (1) ``Axis.TP`` (any member) as an operand of a comparison (``==``, ``!=``,
    ``is``, ``is not``, ``in``, ``not in``, orderings), alone or inside a tuple, list or set
    display there (``axis in (Axis.DP, Axis.DPR)``, ``axes == {Axis.PP}``); (2) ``Axis.TP`` as
    a ``match`` case pattern (``case Axis.DP | Axis.CP:``); (3) ``Axis.TP`` in a set display
    anywhere (``{Axis.TP, Axis.CP}``: a set of names kept for a membership test later); (4) an
    ``x.value`` compared with a string that spells an axis (``axis.value == "pp"``).

    Not a match, and allowed: naming an axis where the name is the data, i.e. constructing
    (``Strategy("tp", Axis.TP, ...)``, ``Op(..., Axis.TP, ...)``), looking up or passing
    (``mesh[Axis.PP]``, ``pl.degree(Axis.TP)``, ``{Axis.TP: 8}`` as pins), parsing and printing.
    Comparing two axis variables (``op.axis is axis``) is not a name match either.
    """
    lines: list[int] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            for operand in (node.left, *node.comparators):
                lines += [n.lineno for n in _names_in(operand)]
            if _is_axis_value_test(node):
                lines.append(node.lineno)
        elif isinstance(node, ast.MatchValue):
            lines += [n.lineno for n in _names_in(node.value)]
        elif isinstance(node, ast.Set):
            lines += [e.lineno for e in node.elts if _is_axis_name(e)]
    return sorted(lines)


def _axis_name_counts() -> dict[str, int]:
    out: dict[str, int] = {}
    for path in _modules(ROOT, PACKAGES).values():
        name = path.relative_to(ROOT).as_posix()
        if name in AXIS_NAME_OWNERS:
            continue
        found = len(axis_name_matches(path.read_text(encoding="utf-8")))
        if found:
            out[name] = found
    return out


def test_no_module_matches_on_an_axis_name() -> None:
    """Consumers ask ``axis.kind`` (``formal/_axes.py``) what an axis does; only ``formal/_axes.py``
    and ``formal/_vocab.py`` say which name is which kind. Listed modules may not add matches."""
    counts = _axis_name_counts()
    grown = {
        f: (n, AXIS_NAME_MATCHES_ALLOWED.get(f, 0))
        for f, n in counts.items()
        if n > AXIS_NAME_MATCHES_ALLOWED.get(f, 0)
    }
    assert not grown, f"modules matching on axis names (found, allowed): ask axis.kind instead: {grown}"


def test_every_axis_name_match_allowed_is_still_there() -> None:
    counts = _axis_name_counts()
    fallen = {f: (counts.get(f, 0), n) for f, n in AXIS_NAME_MATCHES_ALLOWED.items() if counts.get(f, 0) < n}
    assert not fallen, (
        f"fewer axis-name matches than allowed (found, allowed): lower AXIS_NAME_MATCHES_ALLOWED: {fallen}"
    )


@pytest.mark.parametrize(
    ("source", "lines"),
    [
        ("if axis is Axis.PP:\n    pass\n", [1]),
        ("ok = Axis.TP not in pl.axes\n", [1]),
        ("ok = op.axis in (Axis.DP,\n Axis.DPR)\n", [1, 2]),
        ("ok = axes == {Axis.DP, Axis.TP}\n", [1, 1]),
        ("match a:\n    case Axis.DP | Axis.CP:\n        pass\n", [2, 2]),
        ("NAMES = {Axis.TP, Axis.CP}\n", [1, 1]),
        ('ok = s.axis.value == "pp"\n', [1]),
        ("s = Strategy('tp', Axis.TP)\nd = pl.degree(Axis.PP)\nm = mesh[Axis.CP]\npins = {Axis.TP: 8}\n", []),
        ("ok = op.axis is axis\nok = axis.kind.is_pipeline\nok = name == 'pp'\n", []),
    ],
)
def test_the_axis_name_scanner(source: str, lines: list[int]) -> None:
    assert axis_name_matches(source) == lines
