"""Hypothesis strategies of hostile input for the command-line fuzz tests (tests/test_fuzz_cli.py).

Every strategy is a plural noun. Command lines (``hostile_argvs``) mix well-formed words with
text that has broken parsers before: markup, ANSI escapes, control characters, digits of other
scripts, numbers too large for any arithmetic, undecodable bytes (as ``surrogateescape`` hands
them to Python). Configuration files (``deepspeed_configs``, ``torchtitan_configs``,
``megatron_scripts``, ``hf_configs``, ``strategies_files``) are the real examples of
``examples/`` mutated: keys deleted, values of the wrong type, huge and negative numbers,
unicode, deep nesting, then possibly corrupted as bytes (truncated, binary, not UTF-8).

Cases are kept fast on purpose: the valid parts are tiny compositions on ``--params`` models or
small presets, so that a case costs milliseconds and the budget goes to variety.
"""

from __future__ import annotations

import json
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hypothesis import strategies as st

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
CONFIGS = EXAMPLES / "configs"

# --- words ------------------------------------------------------------------------------------

NASTY_TEXTS = (
    "",
    " ",
    "[/bold]",
    "[bold]x[/]",
    "[red]",
    "\x1b[31mred\x1b[0m",
    "\x1b]0;title\x07",
    "\r",
    "\n",
    "\t",
    "\x00",
    "\x7f",
    "²",
    "٣",
    "１２",
    "Ⅷ",
    "1e400",
    "9" * 400,
    "-1",
    "0",
    "00",
    "2**70",
    "1180591620717411303424",
    "nan",
    "inf",
    "-inf",
    "auto",
    "$TP",
    "${WORLD}",
    "'",
    '"',
    "\\",
    "{}",
    "[]",
    "%s",
    "{0}",
    "😀",
    "\u202eevil",
    "\ufeff8",
    "\udcff",
    "\udc80abc",
    "-",
    "--",
    "x",
    "×",
    "*",
    " 8",
    "8 ",
    "+8",
    "0x10",
    "1_000",
    "8.0",
    "1e3",
    "٨",
    "8\x00",
    "$\\frac{$",
    "$x^$",
    "</script>",
    "<b>",
    "&amp;",
    "%(x)s",
    "\\",
    "{}{}",
)
NASTY_NUMBERS = (
    "0",
    "1",
    "2",
    "8",
    "-1",
    "-3",
    "²",
    "٣",
    "８",
    "1e400",
    "1e30",
    "9" * 50,
    "9" * 400,
    "2**70",
    "1180591620717411303424",
    "1000000",
    "1000001",
    "nan",
    "inf",
    "",
    " ",
    "8 ",
    "0x8",
    "1_0",
    "8.5",
    "abc",
    "+2",
    "\u0663\u0662",
    "\udcff",
    "4\n",
    "1e9",
    "7.5e9",
    "70B",
    "80GB",
    "80GiB",
    "1e-30",
    "0.4",
    "1e9\x1c",
    "8\u2028",
    "80GB\x85",
    "\x1f2",
)
# Compositions quick to decide: small degrees, the default or a --params model.
TINY_COMPOSITIONS = (
    "dp2",
    "zero1",
    "zero32",
    "zero2x",
    "tp2",
    "pp2",
    "dp2xtp2",
    "tp2xpp2",
    "fsdp2",
    "tp2xsp",
    "dp2xm2",
    "zero3xoffload",
    "dp2xrecompute",
    "tp3",
    "dp2xdp2",
    "tp2xzero3xpp4",
    "dp",
    "hsdp2",
    "fsdp2xdpr2",
    "tp2xspxdp2",
    "zero22",
    "cp2xdp2",
    "ep2xdp2",
    "pp2xgpipe",
    "pp2xv2",
)
MODELS = (
    "gpt3-1.3b",
    "llama2-7b",
    "mixtral-8x7b",
    "zero-7.5b",
    "",
    " ",
    "nonesuch",
    "config.json",
    "[/bold]",
    "\x1b[2J",
    "llama2-7b\x00",
    "/dev/null",
    "/",
    "missing.json",
)
OPTIONS = (
    "--devices",
    "--model",
    "--params",
    "--precision",
    "--device-memory",
    "--micro-batch",
    "--seq",
    "--json",
    "--csv",
    "--explain",
    "--timeout-ms",
    "--from",
    "--report",
    "--strategies",
    "--debug",
    "--no-such",
    "-h",
    "--version",
    "--",
    "--chart",
    "--values",
    "--to",
    "--all",
    "--degree",
)


def hostile_texts(max_size: int = 24) -> st.SearchStrategy[str]:
    """Short text: known troublemakers, their concatenations, and arbitrary characters."""
    known = st.sampled_from(NASTY_TEXTS)
    return st.one_of(
        known,
        st.lists(known, min_size=2, max_size=4).map("".join),
        st.text(max_size=max_size),
        st.text(st.characters(codec="ascii"), max_size=max_size),
    )


def hostile_numbers() -> st.SearchStrategy[str]:
    """What a user may type where a number belongs."""
    return st.one_of(
        st.sampled_from(NASTY_NUMBERS),
        st.integers(-(10**30), 10**60).map(str),
        st.integers(0, 2**70).map(lambda n: f"{n}"),
        hostile_texts(8),
    )


def small_numbers() -> st.SearchStrategy[str]:
    """Well-formed small counts, for the options whose large values are slow to compute with."""
    return st.sampled_from(("1", "2", "4", "8", "16", "64"))


def refused_numbers() -> st.SearchStrategy[str]:
    """Numbers no option accepts: not digits, zero, negative, or beyond every bound."""
    return st.one_of(
        st.sampled_from(
            (
                "0",
                "-1",
                "²",
                "٣",
                "８",
                "1e400",
                "9" * 400,
                "2**70",
                "1180591620717411303424",
                "nan",
                "",
                "abc",
                "0x8",
                "8.5",
                "\udcff",
                "1000000000000",
            )
        ),
        st.integers(10**12, 10**60).map(str),
    )


def compositions_texts() -> st.SearchStrategy[str]:
    """Tiny valid compositions, mangled ones, and arbitrary text."""
    tiny = st.sampled_from(TINY_COMPOSITIONS)
    return st.one_of(
        tiny,
        tiny,
        tiny,
        st.tuples(tiny, st.sampled_from(("x", "×", "*", "xx", "")), hostile_texts(6)).map("".join),
        st.tuples(st.sampled_from(("tp", "dp", "zero3", "pp", "m", "v", "cp")), hostile_numbers()).map("".join),
        hostile_texts(),
    )


# --- command lines ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    """One fuzz case: the command line and the files it names (written in a fresh directory).

    ``{dir}`` in an argument is replaced by that directory. ``outputs`` are the files the case
    asks the tool to write, with the content (if any) that was there before it ran.
    """

    argv: tuple[str, ...]
    files: tuple[tuple[str, bytes], ...] = ()
    outputs: tuple[tuple[str, bytes | None], ...] = ()
    disk_full: bool = False  # every write of an output file fails part-way
    slow: bool = field(default=False, compare=False)


def _options(draw: st.DrawFn, names: tuple[str, ...], numbers: st.SearchStrategy[str]) -> list[str]:
    out: list[str] = []
    for name in draw(st.lists(st.sampled_from(names), max_size=4)):
        match name:
            case (
                "--devices"
                | "--micro-batch"
                | "--seq"
                | "--timeout-ms"
                | "--degree"
                | "--global-batch"
                | "--node-size"
                | "--top"
            ):
                out += [name, draw(numbers)]
            case "--params":
                out += [name, draw(st.one_of(st.sampled_from(("1e9", "7.5e9", "70B", "1e6")), hostile_numbers()))]
            case "--model":
                out += [name, draw(st.sampled_from(MODELS))]
            case "--precision":
                out += [name, draw(st.sampled_from(("zero", "fp32", "deepspeed", "megatron", "fp8", "", "[b]")))]
            case "--device-memory":
                out += [name, draw(st.one_of(st.sampled_from(("80GB", "80GiB", "8e10", "1TB")), hostile_numbers()))]
            case "--json" | "--csv" | "--explain" | "--debug" | "--all" | "--simulate":
                out.append(name)
            case _:
                out.append(name)
                if draw(st.booleans()):
                    out.append(draw(hostile_texts(10)))
    return out


_CHECK_OPTIONS = (
    "--devices",
    "--params",
    "--params",
    "--model",
    "--precision",
    "--device-memory",
    "--micro-batch",
    "--seq",
    "--json",
    "--csv",
    "--explain",
    "--timeout-ms",
    "--debug",
    "--no-such",
    "--",
)


@st.composite
def hostile_argvs(draw: st.DrawFn) -> Case:
    """Command lines for every subcommand, with hostile words where values belong."""
    kind = draw(
        st.sampled_from(
            (
                "check",
                "check",
                "check",
                "check",
                "sweep",
                "compare",
                "explain",
                "export",
                "plan",
                "strategies",
                "words",
                "simulate",
            )
        )
    )
    match kind:
        case "check":
            words = [draw(compositions_texts())]
            if draw(st.booleans()):
                words.insert(0, "check")
            words += _options(draw, _CHECK_OPTIONS, hostile_numbers())
            if "--params" not in words and "--model" not in words and draw(st.booleans()):
                words += ["--params", "1e9"]
        case "simulate":  # the reference simulator, on compositions small enough to run in milliseconds
            words = [
                draw(st.sampled_from(("dp2", "tp2", "zero22", "pp2", "dp2xtp2", "tp2xsp", "fsdp2"))),
                "--simulate",
                "--params",
                "1e6",
            ]
            words += _options(draw, ("--json", "--micro-batch", "--seq", "--explain"), refused_numbers())
        case "sweep":
            template = draw(
                st.one_of(st.sampled_from(("tp{}", "zero3{}", "tp{}xdp2", "{}", "tp{}{}", "tp")), hostile_texts(8))
            )
            values = draw(
                st.one_of(
                    st.lists(hostile_numbers(), max_size=5).map(",".join),
                    st.sampled_from(("1,2,4", "2", ",", "1,,2", "²", "1," * 100)),
                )
            )
            words = ["sweep", template, "--values", values, "--params", "1e9"]
            words += _options(draw, ("--devices", "--json", "--csv", "--micro-batch", "--seq"), hostile_numbers())
        case "compare":
            words = ["compare", *draw(st.lists(compositions_texts(), min_size=0, max_size=3))]
            words += _options(draw, ("--devices", "--params", "--json", "--csv", "--model"), hostile_numbers())
        case "explain":
            words = ["explain"]
            if draw(st.booleans()):
                words.append(
                    draw(st.one_of(st.sampled_from(("zero2", "fsdp", "tp", "dpr", "ZERO2", "zero9")), hostile_texts(8)))
                )
            words += _options(draw, ("--all", "--degree", "--json", "--csv"), hostile_numbers())
        case "export":
            words = [
                "export",
                draw(compositions_texts()),
                "--to",
                draw(st.one_of(st.sampled_from(("torchtitan", "deepspeed", "megatron", "dtensor")), hostile_texts(8))),
            ]
            words += _options(draw, ("--devices", "--params", "--json", "--csv", "--model"), hostile_numbers())
        case "plan":  # large valid device counts enumerate many meshes: only small or refused numbers here
            numbers = st.one_of(small_numbers(), refused_numbers())
            words = ["plan", "--params", draw(st.sampled_from(("1e9", "7.5e9", "1e6"))), "--devices", draw(numbers)]
            words += _options(
                draw, ("--global-batch", "--seq", "--node-size", "--top", "--json", "--precision"), numbers
            )
            if draw(st.booleans()):
                words += [
                    "--micro-batch",
                    draw(
                        st.one_of(
                            st.lists(numbers, min_size=1, max_size=3).map(",".join),
                            st.sampled_from(("1,2,4", "", ",", "2**70")),
                        )
                    ),
                ]
            if draw(st.booleans()):
                axis = draw(st.sampled_from(("tp", "pp", "dp", "qq", "", "TP")))
                words += ["--fix", f"{axis}{draw(st.sampled_from(('=', '', '==')))}{draw(numbers)}"]
            if draw(st.booleans()):
                words += [
                    "--device-flops",
                    draw(st.one_of(st.sampled_from(("312e12", "1e15", "312T")), refused_numbers())),
                ]
            if draw(st.booleans()):
                words += [
                    "--bandwidth",
                    draw(
                        st.sampled_from(("dp=50GB/s", "tp=", "=1", "qq=1GB/s", "dp=-1GB/s", "dp=1e400GB/s", "dp=²GB/s"))
                    ),
                ]
        case "strategies":
            words = ["strategies", *draw(st.lists(hostile_texts(6), max_size=1))]
        case _:
            words = draw(st.lists(st.one_of(st.sampled_from(OPTIONS), hostile_texts(8)), min_size=1, max_size=5))
            if any(w.startswith("--") for w in words[1:]) or words[0] in ("plan", "sweep"):
                words = ["--params", "1e9", *words]  # keep a stray word from choosing a slow default
            if words and words[0] == "plan":
                words = ["explain", *words]
    return Case(tuple(words))


# --- documents --------------------------------------------------------------------------------


def _paths(doc: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every path into a document (dict keys and list indices), parents before children."""
    out: list[tuple[Any, ...]] = [prefix] if prefix else []
    if isinstance(doc, dict):
        for key, value in doc.items():
            out += _paths(value, (*prefix, key))
    elif isinstance(doc, list):
        for i, value in enumerate(doc):
            out += _paths(value, (*prefix, i))
    return out


def _copy(doc: Any) -> Any:
    return json.loads(json.dumps(doc))


def _node(doc: Any, path: tuple[Any, ...]) -> Any:
    node = doc
    for key in path:
        node = node[key]
    return node


def _parent(doc: Any, path: tuple[Any, ...]) -> Any:
    return _node(doc, path[:-1])


def hostile_values(json_only: bool = False) -> st.SearchStrategy[Any]:
    """A value of the wrong type or size for whatever key it lands on."""
    scalars = st.one_of(
        st.none() if json_only else st.sampled_from(("none",)),
        st.booleans(),
        st.integers(-(2**70), 2**70),
        st.sampled_from(
            (
                0,
                -1,
                1,
                2,
                3,
                4,
                8,
                -(2**63),
                2**63,
                10**19,
                10**400,
                "auto",
                "cpu",
                "none",
                "1F1B",
                "Interleaved1F1B",
                "full",
                "selective",
                "op",
                "2",
                "-1",
                1.5,
                0.0,
                -0.0,
                1e308,
                float("inf"),
                float("-inf"),
                float("nan"),
            )
        ),
        st.floats(allow_nan=True, allow_infinity=True),
        hostile_texts(12),
    )
    return st.recursive(
        scalars,
        lambda inner: st.one_of(
            st.lists(inner, max_size=3),
            st.dictionaries(st.sampled_from(("stage", "enabled", "device", "a", "")), inner, max_size=2),
        ),
        max_leaves=4,
    )


@st.composite
def mutated_documents(draw: st.DrawFn, base: Any, known_keys: tuple[str, ...], json_only: bool) -> Any:
    """``base`` after a few mutations: a key deleted, set to a hostile value, renamed, added or
    nested deeply."""
    doc = _copy(base)
    for _ in range(draw(st.sampled_from((0, 1, 1, 1, 2, 3)))):
        paths = _paths(doc)
        op = draw(st.sampled_from(("delete", "set", "set", "set", "add", "nest", "rename")))
        if not paths and op in ("delete", "set", "nest", "rename"):
            op = "add"
        match op:
            case "delete":
                path = draw(st.sampled_from(paths))
                parent = _parent(doc, path)
                del parent[path[-1]]
            case "set":
                path = draw(st.sampled_from(paths))
                _parent(doc, path)[path[-1]] = draw(hostile_values(json_only))
            case "nest":
                path = draw(st.sampled_from(paths))
                value: Any = _parent(doc, path)[path[-1]]
                for _ in range(draw(st.sampled_from((2, 10, 40, 200)))):
                    value = (draw(st.sampled_from(("list", "dict"))) == "list" and [value]) or {"a": value}
                _parent(doc, path)[path[-1]] = value
            case "rename":
                path = draw(st.sampled_from(paths))
                parent = _parent(doc, path)
                if isinstance(parent, dict):
                    parent[draw(hostile_texts(10))] = parent.pop(path[-1])
            case _:
                tables = [p for p in [(), *paths] if isinstance(_node(doc, p), dict)]
                node = _node(doc, draw(st.sampled_from(tables))) if tables else None
                if isinstance(node, dict):
                    key = draw(st.one_of(st.sampled_from(known_keys), hostile_texts(10)))
                    node[key] = draw(hostile_values(json_only))
    return doc


@st.composite
def corrupted_bytes(draw: st.DrawFn, text: str) -> bytes:
    """The file's bytes, usually as written, sometimes truncated, binary or not UTF-8."""
    data = text.encode("utf-8", "surrogatepass")
    match draw(st.sampled_from(("as-is",) * 12 + ("truncate", "binary", "latin-1", "bom", "nul", "empty", "huge"))):
        case "truncate":
            return data[: draw(st.integers(0, max(len(data) - 1, 0)))]
        case "binary":
            return draw(st.binary(min_size=1, max_size=64))
        case "latin-1":
            return data + b"\xe9\xff\xfe"
        case "bom":
            return b"\xef\xbb\xbf" + data
        case "nul":
            return data[: len(data) // 2] + b"\x00" + data[len(data) // 2 :]
        case "empty":
            return draw(st.sampled_from((b"", b" \n", b"\n\n")))
        case "huge":  # one byte over the reader's limit
            return b" " * (4 * 2**20 + 1)
    return data


# --- TOML (a writer for the documents the mutations make) -------------------------------------

_BARE = re.compile(r"[A-Za-z0-9_-]+")


def _toml_key(key: str) -> str:
    return key if _BARE.fullmatch(key) else json.dumps(key, ensure_ascii=True)


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if value != value:
            return "nan"
        if value in (float("inf"), float("-inf")):
            return "inf" if value > 0 else "-inf"
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=True)
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_toml_key(str(k))} = {_toml_value(v)}" for k, v in value.items()) + "}"
    return json.dumps(str(value))


def toml_text(doc: dict[str, Any]) -> str:
    """``doc`` as TOML: top-level values, then one [table] per dict, [[array]] per list of dicts."""
    lines: list[str] = []
    tables: list[tuple[str, dict[str, Any]]] = []
    arrays: list[tuple[str, list[dict[str, Any]]]] = []
    for key, value in doc.items():
        if isinstance(value, dict):
            tables.append((key, value))
        elif isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
            arrays.append((key, value))
        else:
            lines.append(f"{_toml_key(key)} = {_toml_value(value)}")
    for key, body in tables:
        lines.append(f"[{_toml_key(key)}]")
        lines += [f"{_toml_key(str(k))} = {_toml_value(v)}" for k, v in body.items()]
    for key, items in arrays:
        for body in items:
            lines.append(f"[[{_toml_key(key)}]]")
            lines += [f"{_toml_key(str(k))} = {_toml_value(v)}" for k, v in body.items()]
    return "\n".join(lines) + "\n"


# --- configuration files ----------------------------------------------------------------------


def _load_json(name: str) -> Any:
    return json.loads((CONFIGS / name).read_text())


_DEEPSPEED = tuple(_load_json(p.name) for p in sorted(CONFIGS.glob("deepspeed_*.json")))
_TORCHTITAN = tuple(tomllib.loads(p.read_text()) for p in sorted(CONFIGS.glob("torchtitan_*.toml")))
_MEGATRON = tuple(p.read_text() for p in sorted(CONFIGS.glob("megatron_*.sh")))
_DS_KEYS = (
    "train_batch_size",
    "train_micro_batch_size_per_gpu",
    "gradient_accumulation_steps",
    "zero_optimization",
    "pipeline",
    "tensor_parallel",
    "fp16",
    "bf16",
    "stage",
    "offload_optimizer",
    "offload_param",
    "sequence_parallel_size",
    "activation_checkpointing",
    "stages",
    "autotp_size",
    "enabled",
    "device",
)
_TT_KEYS = (
    "parallelism",
    "training",
    "model",
    "activation_checkpoint",
    "data_parallel_shard_degree",
    "tensor_parallel_degree",
    "pipeline_parallel_degree",
    "pipeline_parallel_split_points",
    "pipeline_parallel_schedule",
    "local_batch_size",
    "seq_len",
    "mode",
    "selective_ac_option",
    "flavor",
    "expert_parallel_degree",
    "fsdp_reshard_after_forward",
    "global_batch_size",
    "enable_cpu_offload",
)
_HF_BASES = (
    {
        "model_type": "llama",
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 128,
        "intermediate_size": 128,
        "vocab_size": 1000,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "_name_or_path": "tiny-llama",
        "head_dim": 16,
    },
    {
        "model_type": "gpt2",
        "n_embd": 64,
        "n_layer": 2,
        "n_head": 4,
        "n_positions": 128,
        "vocab_size": 1000,
        "n_inner": None,
        "_name_or_path": "tiny-gpt2",
    },
    {
        "model_type": "mixtral",
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "max_position_embeddings": 128,
        "intermediate_size": 128,
        "vocab_size": 1000,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
    },
)
_HF_KEYS = (
    "model_type",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "head_dim",
    "vocab_size",
    "max_position_embeddings",
    "intermediate_size",
    "num_key_value_heads",
    "n_embd",
    "n_layer",
    "n_head",
    "_name_or_path",
    "hidden_act",
    "attention_bias",
    "num_local_experts",
    "num_experts_per_tok",
)


def _devices(draw: st.DrawFn) -> list[str]:
    choice = draw(st.sampled_from(("none", "none", "none", "small", "small", "hostile")))
    if choice == "none":
        return []
    worlds = st.sampled_from(("8", "16", "32", "64", "384", "1024"))  # the examples' own world sizes
    return ["--devices", draw(st.one_of(small_numbers(), worlds) if choice == "small" else refused_numbers())]


def _model(draw: st.DrawFn) -> list[str]:
    return draw(st.sampled_from(([], ["--params", "1e9"], ["--model", "gpt3-1.3b"], ["--model", "llama3-8b"])))


def _command(draw: st.DrawFn, config: str) -> list[str]:
    if draw(st.integers(0, 4)) == 0:
        return [
            "export",
            "--from",
            config,
            "--to",
            draw(st.sampled_from(("torchtitan", "deepspeed", "megatron", "dtensor"))),
        ]
    return ["--from", config, *draw(st.sampled_from(([], ["--json"], ["--csv"])))]


@st.composite
def deepspeed_configs(draw: st.DrawFn) -> Case:
    """A mutated DeepSpeed example, checked or exported with ``--from``."""
    doc = draw(mutated_documents(draw(st.sampled_from(_DEEPSPEED)), _DS_KEYS, json_only=True))
    text = json.dumps(doc, ensure_ascii=draw(st.booleans()))
    name = draw(st.sampled_from(("ds.json",) * 6 + ("ds.JSON", "ds.yaml", "ds")))
    data = draw(corrupted_bytes(text))
    return Case((*_command(draw, "{dir}/" + name), *_devices(draw), *_model(draw)), ((name, data),))


@st.composite
def torchtitan_configs(draw: st.DrawFn) -> Case:
    """A mutated torchtitan example (as TOML, or as its text with lines cut), with ``--from``."""
    base = draw(st.sampled_from(_TORCHTITAN))
    if draw(st.integers(0, 5)) == 0:
        lines = toml_text(base).splitlines()
        keep = draw(st.lists(st.booleans(), min_size=len(lines), max_size=len(lines)))
        text = "\n".join(line for line, k in zip(lines, keep, strict=True) if k) + "\n"
    else:
        text = toml_text(draw(mutated_documents(base, _TT_KEYS, json_only=False)))
    name = draw(st.sampled_from(("tt.toml",) * 6 + ("tt.TOML", "tt.ini")))
    data = draw(corrupted_bytes(text))
    return Case((*_command(draw, "{dir}/" + name), *_devices(draw), *_model(draw)), ((name, data),))


_MEG_ARGS = (
    "--tensor-model-parallel-size",
    "--pipeline-model-parallel-size",
    "--context-parallel-size",
    "--expert-model-parallel-size",
    "--micro-batch-size",
    "--global-batch-size",
    "--seq-length",
    "--num-layers",
    "--hidden-size",
    "--num-attention-heads",
    "--num-layers-per-virtual-pipeline-stage",
    "--recompute-granularity",
    "--recompute-method",
    "--recompute-num-layers",
    "--sequence-parallel",
    "--use-distributed-optimizer",
    "--expert-tensor-parallel-size",
    "--nproc_per_node",
    "--nnodes",
    "--no-such-argument",
    "--use-torch-fsdp2",
    "--bf16",
)


@st.composite
def megatron_scripts(draw: st.DrawFn) -> Case:
    """A mutated Megatron launch script: lines deleted, values replaced, arguments added."""
    lines = draw(st.sampled_from(_MEGATRON)).splitlines()
    for _ in range(draw(st.integers(0, 4))):
        op = draw(st.sampled_from(("delete", "value", "value", "add", "quote", "garbage")))
        i = draw(st.integers(0, len(lines) - 1)) if lines else 0
        match op:
            case "delete" if lines:
                del lines[i]
            case "value" if lines:
                parts = lines[i].split()
                if len(parts) >= 2 and parts[0].startswith("--"):
                    lines[i] = f"    {parts[0]} {draw(hostile_numbers())} \\"
            case "add":
                lines.insert(max(i, 1), f"    {draw(st.sampled_from(_MEG_ARGS))} {draw(hostile_numbers())} \\")
            case "quote":
                lines.insert(max(i, 1), draw(st.sampled_from(("    --seed '1 \\", '    "', "    \\", "  # --tp 8"))))
            case _:
                lines.insert(i, draw(hostile_texts(20)))
    text = "\n".join(lines) + "\n"
    name = draw(st.sampled_from(("run.sh",) * 6 + ("args.txt", "launch", "run.py", "run.sh.bak")))
    data = draw(corrupted_bytes(text))
    return Case((*_command(draw, "{dir}/" + name), *_devices(draw), *_model(draw)), ((name, data),))


@st.composite
def hf_configs(draw: st.DrawFn) -> Case:
    """A mutated small Hugging Face config.json, as ``--model`` of a tiny composition."""
    doc = draw(mutated_documents(draw(st.sampled_from(_HF_BASES)), _HF_KEYS, json_only=True))
    data = draw(corrupted_bytes(json.dumps(doc, ensure_ascii=draw(st.booleans()))))
    name = draw(st.sampled_from(("config.json",) * 6 + ("config.JSON", "config")))
    comp = draw(st.sampled_from(("dp2", "tp2", "pp2", "tp2xsp", "zero3", "ep2xdp2", "dp2xrecompute")))
    extra = draw(st.sampled_from(([], [], ["--json"], ["--micro-batch", "2"], ["--seq", "64"], ["--seq", "0"])))
    model = ("--model", "{dir}/" + name)
    match draw(st.integers(0, 19)):  # the model's name also reaches charts and reports, rarely (they are slow)
        case 0:
            return Case(("compare", "dp2", comp, *model, "--chart", "{dir}/c.svg"), ((name, data),), slow=True)
        case 1:
            return Case((comp, *model, "--report", "{dir}/r.html"), ((name, data),), slow=True)
        case 2:
            return Case(("plan", *model, "--devices", "4"), ((name, data),))
    return Case((comp, *model, "--devices", "4", *extra), ((name, data),))


_STRATEGY_EXAMPLES = tuple(
    (case["args"], (ROOT / case["args"][case["args"].index("--strategies") + 1]).read_text())
    for case in tomllib.loads((EXAMPLES / "expected.toml").read_text())["case"]
    if "--strategies" in case["args"]
)
_ST_KEYS = (
    "strategies",
    "program",
    "axis",
    "P",
    "O",
    "G",
    "A",
    "op",
    "state",
    "group",
    "phase",
    "reduce",
    "offset",
    "scale",
    "groups",
    "compute_sharded",
    "description",
)


@st.composite
def strategies_files(draw: st.DrawFn) -> Case:
    """A mutated example strategies file with the command line its golden case runs."""
    args, text = draw(st.sampled_from(_STRATEGY_EXAMPLES))
    doc = tomllib.loads(text)
    if draw(st.integers(0, 3)):
        text = toml_text(draw(mutated_documents(doc, _ST_KEYS, json_only=False)))
    i = args.index("--strategies")
    argv = [*args[:i], "--strategies", "{dir}/user.toml", *args[i + 2 :]]
    if draw(st.integers(0, 9)) == 0:  # the file's program on the reference simulator (a few tenths of a second)
        argv.append("--simulate")
    return Case(tuple(argv), (("user.toml", draw(corrupted_bytes(text))),))


# --- output files -----------------------------------------------------------------------------


@st.composite
def output_cases(draw: st.DrawFn) -> Case:
    """``--report``, ``plan --csv`` and ``--chart`` into good and bad places, over an old file or
    none, and sometimes on a disk that fills up part-way."""
    named = st.text(st.characters(exclude_categories=["Cs"], exclude_characters="/\x00"), min_size=1, max_size=12)
    target = draw(
        st.one_of(
            st.sampled_from(
                (
                    "report.html",
                    "out.csv",
                    "chart.svg",
                    "chart.png",
                    "chart.gif",
                    "missing/x.html",
                    "",
                    ".",
                    "sub",
                    "sub/deeper/x.csv",
                    "r\x00.html",
                    "ünï.html",
                )
            ),
            st.tuples(named, st.sampled_from((".html", ".csv", ".svg", ".png", ".SVG", "")))
            .map("".join)
            .filter(
                # not a name the case uses otherwise, nor one that looks like the writer's temporary file
                lambda n: n not in (".", "..", "sub", "missing") and not re.match(r"^\..*\.tmp$", n)
            ),
        )
    )
    old = draw(st.one_of(st.none(), st.just(b"old report\n"), st.binary(max_size=32)))
    kind = draw(st.sampled_from(("report", "csv", "compare", "sweep")))
    path = "{dir}/" + target if target else ""
    files: tuple[tuple[str, bytes], ...] = (("sub/keep", b""),)
    argv: list[str]
    match kind:
        case "report":
            argv = [
                draw(st.sampled_from(("dp2", "tp3", "zero22", "tp2xpp2", "zero4"))),
                "--params",
                "1e9",
                "--report",
                path,
                *draw(st.sampled_from(((), ("--json",), ("--csv",)))),
            ]
        case "csv":
            argv = ["plan", "--params", "1e9", "--devices", draw(st.sampled_from(("2", "4", "0"))), "--csv", path]
        case "compare":
            argv = [
                "compare",
                *draw(st.lists(st.sampled_from(("dp2", "zero22", "tp2", "zero5")), min_size=1, max_size=3)),
                "--params",
                "1e9",
                "--chart",
                path,
            ]
        case _:
            argv = [
                "sweep",
                draw(st.sampled_from(("tp{}", "zero3{}", "q{}"))),
                "--values",
                draw(st.sampled_from(("1,2", "2", "3"))),
                "--params",
                "1e9",
                "--chart",
                path,
            ]
    outputs: tuple[tuple[str, bytes | None], ...] = ()
    if target and "\x00" not in target and target not in (".", "sub"):
        if target.startswith("missing"):  # its directory does not exist: nothing there before
            old = None
        outputs = ((target, old),)
        if old is not None:
            files = (*files, (target, old))
    return Case(tuple(argv), files, outputs, disk_full=draw(st.integers(0, 4)) == 0, slow=True)


__all__ = [
    "Case",
    "compositions_texts",
    "corrupted_bytes",
    "deepspeed_configs",
    "hf_configs",
    "hostile_argvs",
    "hostile_numbers",
    "hostile_texts",
    "hostile_values",
    "megatron_scripts",
    "mutated_documents",
    "output_cases",
    "refused_numbers",
    "small_numbers",
    "strategies_files",
    "toml_text",
    "torchtitan_configs",
]
