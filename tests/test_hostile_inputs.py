"""Inputs that once broke the command line: each is now one ``error:`` line and exit code 2.

Each case is a file or command line that used to end in a traceback (exit 1, which a script
reads as "invalid"), in a confident answer on garbage, in a blocked or unbounded read, or in a
broken output file. Markup and escape sequences in a config's text are shown as text, not
interpreted. A closed output pipe keeps the verdict's exit code, and only a bug in the tool
itself gives 4.
"""

from __future__ import annotations

import errno
import json
import os
import re
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
from click.testing import CliRunner, Result

from checker.cli import main

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "examples" / "configs"
TINY_HF: dict[str, Any] = {
    "model_type": "llama",
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "max_position_embeddings": 128,
    "intermediate_size": 128,
    "vocab_size": 1000,
}
HUGE = "1180591620717411303424"  # 2**70


def invoke(*args: str) -> Result:
    return CliRunner().invoke(main, list(args), color=True)


def one_line(result: Result, *fragments: str) -> str:
    """Exit code 2, no traceback, and one ``error:`` line (last on stderr) holding ``fragments``."""
    shown = f"exit={result.exit_code} stdout={result.stdout[-500:]!r} stderr={result.stderr!r}"
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    assert result.exit_code == 2, shown
    assert "Traceback" not in result.output, shown
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and result.stderr.rstrip("\n").splitlines()[-1] == errors[0], shown
    for fragment in fragments:
        assert fragment in errors[0], (fragment, errors[0])
    return errors[0]


def write(tmp_path: Path, name: str, data: str | bytes) -> str:
    path = tmp_path / name
    path.write_bytes(data.encode("utf-8") if isinstance(data, str) else data)
    return str(path)


def tt_with(extra: str, name: str = "torchtitan_llama3_8b.toml") -> str:
    """A torchtitan example whose [parallelism] table starts with ``extra`` (lines it replaces removed)."""
    text = (CONFIGS / name).read_text()
    for line in extra.splitlines():
        text = re.sub(rf"^{re.escape(line.split('=')[0].strip())} = .*\n", "", text, flags=re.MULTILINE)
    return text.replace("[parallelism]\n", f"[parallelism]\n{extra}\n")


# --- files that are not text, or not a configuration ----------------------------------------


@pytest.mark.parametrize(
    ("option", "name", "args"),
    [
        ("--from", "ds.json", ()),
        ("--from", "tt.toml", ()),
        ("--from", "run.sh", ()),
        ("--model", "config.json", ("dp2",)),
        ("--strategies", "user.toml", ("dp2", "--params", "1e9")),
    ],
)
def test_a_binary_file_is_not_text(tmp_path: Path, option: str, name: str, args: tuple[str, ...]) -> None:
    path = write(tmp_path, name, b"\xff\xfe\x00\x01binary\x80")
    one_line(invoke(*args, option, path), "not UTF-8", name)


@pytest.mark.parametrize(
    ("option", "name", "text", "args"),
    [
        ("--from", "ds.json", "[" * 5000 + "]" * 5000, ()),  # beyond the parser's own recursion limit
        ("--from", "ds.json", '{"zero_optimization": ' + '{"a": ' * 40 + "1" + "}" * 41, ()),  # within it
        ("--model", "config.json", "[" * 100_000 + "]" * 100_000, ("dp2",)),
        ("--from", "tt.toml", "a = " + "[" * 5000 + "]" * 5000, ()),
        ("--from", "tt.toml", "[" + ".".join(["a"] * 60) + "]\n", ()),
        ("--strategies", "user.toml", "a = " + "[" * 5000 + "]" * 5000, ("dp2", "--params", "1e9")),
    ],
)
def test_deep_nesting_is_refused(tmp_path: Path, option: str, name: str, text: str, args: tuple[str, ...]) -> None:
    one_line(invoke(*args, option, write(tmp_path, name, text)), "nested too deeply")


def test_a_file_over_the_size_limit_is_refused(tmp_path: Path) -> None:
    path = write(tmp_path, "ds.json", b" " * (4 * 2**20 + 1))
    one_line(invoke("--from", path), "larger than")


@pytest.mark.parametrize("name", ["empty.sh", "empty.json", "empty.toml", "blank.sh"])
def test_an_empty_file_says_nothing(tmp_path: Path, name: str) -> None:
    one_line(invoke("--from", write(tmp_path, name, "\n \n" if name.startswith("blank") else "")), "empty")


@pytest.mark.parametrize(
    ("name", "text", "fragment"),
    [
        ("hello", "hello world\n", "no Megatron arguments"),
        (
            "passwd",
            "root:x:0:0:root:/root:/bin/bash\ndaemon:x:1:1:daemon:/usr/sbin:/usr/sbin/nologin\n",
            "no Megatron arguments",
        ),
        ("run.sh", "#!/bin/bash\necho starting\npython pretrain_gpt.py\n", "no Megatron arguments"),
        ("ds.yaml", "train_batch_size: 8\nzero_optimization:\n  stage: 2\n", "YAML is not read"),
        ("ds.yml", "zero_optimization: {stage: 3}\n", "YAML is not read"),
        ("tt.ini", "[parallelism]\ntensor_parallel_degree = 2\n", "unknown kind of file"),
        ("ds.json", "{}", "states nothing"),
        ("tt.toml", "# only a comment\n", "states nothing"),
    ],
)
def test_garbage_is_refused_not_read_as_an_empty_config(tmp_path: Path, name: str, text: str, fragment: str) -> None:
    """These used to come back dp64, PROVED, exit 0."""
    one_line(invoke("--from", write(tmp_path, name, text)), fragment)


def test_the_system_password_file_is_not_a_megatron_script() -> None:
    one_line(invoke("--from", "/etc/passwd"), "no Megatron arguments")


@pytest.mark.parametrize("device", ["/dev/null", "/dev/zero"])
def test_a_device_is_not_read(device: str) -> None:
    """/dev/null used to be an empty Megatron script (dp64, proved); /dev/zero was read without end."""
    one_line(invoke("--from", device), "a character device, not a regular file")
    one_line(invoke("dp2", "--params", "1e9", "--strategies", device), "a character device")


def test_a_directory_is_not_read(tmp_path: Path) -> None:
    folder = tmp_path / "dir.json"
    folder.mkdir()
    one_line(invoke("--from", str(folder)), "a directory, not a regular file")
    one_line(invoke("dp2", "--model", str(folder)), "a directory")
    one_line(invoke("dp2", "--params", "1e9", "--strategies", str(folder)), "a directory")


@pytest.mark.parametrize(
    ("option", "name", "args"),
    [
        ("--from", "fifo.json", ()),
        ("--model", "fifo.json", ("dp2",)),
        ("--strategies", "fifo.toml", ("dp2", "--params", "1e9")),
    ],
)
def test_a_fifo_is_refused_without_blocking(tmp_path: Path, option: str, name: str, args: tuple[str, ...]) -> None:
    fifo = tmp_path / name
    os.mkfifo(fifo)
    results: list[Result] = []
    reader = threading.Thread(target=lambda: results.append(invoke(*args, option, str(fifo))), daemon=True)
    reader.start()
    reader.join(timeout=60)
    if reader.is_alive():  # unblock the reader before failing, so the run can end
        with open(fifo, "wb"):
            pass
        pytest.fail("reading a FIFO blocked")
    one_line(results[0], "FIFO", "not a regular file")


# --- values of the wrong type or size -------------------------------------------------------


@pytest.mark.parametrize(
    ("change", "fragments"),
    [
        ({"head_dim": {}}, ("head_dim", "expected an integer")),
        ({"head_dim": [16]}, ("head_dim",)),
        ({"num_hidden_layers": "2"}, ("num_hidden_layers", "expected an integer")),
        ({"num_hidden_layers": True}, ("num_hidden_layers",)),
        ({"vocab_size": 1.5}, ("vocab_size",)),
        ({"model_type": ["llama"]}, ("model_type", "expected a string")),
        ({"_name_or_path": {"a": 1}}, ("_name_or_path", "expected a string")),
        ({"num_key_value_heads": -2}, ("num_key_value_heads",)),
        ({"max_position_embeddings": 10**12}, ("max_position_embeddings",)),
    ],
)
def test_hf_config_types(tmp_path: Path, change: dict[str, Any], fragments: tuple[str, ...]) -> None:
    path = write(tmp_path, "config.json", json.dumps(TINY_HF | change))
    one_line(invoke("dp2", "--model", path), *fragments)


@pytest.mark.parametrize("literal", ["9" * 400, "-" + "9" * 400, "9" * 5000, "1e400", "NaN", "Infinity", "-Infinity"])
def test_hf_numbers_beyond_any_arithmetic(tmp_path: Path, literal: str) -> None:
    text = json.dumps(TINY_HF).replace('"num_hidden_layers": 2', f'"num_hidden_layers": {literal}')
    one_line(invoke("dp2", "--model", write(tmp_path, "config.json", text)), "num_hidden_layers")


def test_a_huge_toml_integer_is_refused(tmp_path: Path) -> None:
    one_line(
        invoke("--from", write(tmp_path, "tt.toml", tt_with("tensor_parallel_degree = " + "9" * 400))),
        "tensor_parallel_degree",
        "out of range",
    )
    one_line(
        invoke("--from", write(tmp_path, "big.toml", tt_with("tensor_parallel_degree = " + "9" * 5000))),
        "not valid TOML",
    )
    one_line(
        invoke("--from", write(tmp_path, "nan.toml", tt_with("tensor_parallel_degree = nan"))), "tensor_parallel_degree"
    )


def test_markup_in_a_config_name_is_shown_as_text(tmp_path: Path) -> None:
    """``[/bold]`` used to raise rich's MarkupError."""
    path = write(tmp_path, "config.json", json.dumps(TINY_HF | {"_name_or_path": "[/bold][red]x"}))
    result = invoke("dp2", "--model", path)
    assert result.exit_code == 0, result.output
    assert "model [/bold][red]x (" in result.stdout


@pytest.mark.parametrize("chart", ["c.svg", "c.png"])
def test_dollars_in_a_config_name_are_not_mathematics(tmp_path: Path, chart: str) -> None:
    """matplotlib used to parse ``$...$`` in the chart title as mathematics and fail (exit 4)."""
    path = write(tmp_path, "config.json", json.dumps(TINY_HF | {"_name_or_path": "$\\frac{$ x^"}))
    for args in (("compare", "dp2", "tp2"), ("sweep", "tp{}", "--values", "1,2")):
        result = invoke(*args, "--model", path, "--chart", str(tmp_path / chart))
        assert result.exit_code == 0, result.output
        assert (tmp_path / chart).stat().st_size > 0


def test_ansi_escapes_in_a_config_name_never_reach_the_terminal(tmp_path: Path) -> None:
    name = "\x1b[31mred\x1b[0m\x1b]0;title\x07\r"
    path = write(tmp_path, "config.json", json.dumps(TINY_HF | {"_name_or_path": name}))
    for args in (("dp2",), ("dp2", "--json"), ("plan", "--devices", "2"), ("compare", "dp2", "tp2")):
        result = invoke(*args, "--model", path)
        assert result.exit_code in (0, 1, 3), result.output
        assert "\x1b" not in result.output and "\r" not in result.output and "\x07" not in result.output
    assert "\\x1b[31mred" in invoke("dp2", "--model", path).stdout


@pytest.mark.parametrize(
    ("key", "value", "fragment"),
    [
        ("zero_optimization", [], "zero_optimization=[]: expected an object"),
        ("zero_optimization", {"stage": [3]}, "zero_optimization.stage"),
        ("zero_optimization", {"stage": 3, "offload_optimizer": ["cpu"]}, "zero_optimization.offload_optimizer"),
        ("zero_optimization", {"stage": 3, "offload_param": {"device": ["cpu"]}}, "offload_param.device"),
        ("pipeline", [4], "pipeline"),
        ("pipeline", {"stages": [4]}, "pipeline.stages"),
        ("fp16", {"enabled": [True]}, "fp16.enabled"),
        ("bf16", "yes", "bf16"),
        ("tensor_parallel", {"autotp_size": {"a": 2}}, "tensor_parallel.autotp_size"),
        ("train_batch_size", [256], "train_batch_size"),
        ("train_batch_size", 10**9, "absurd"),  # dp = 1e9 / 8: more devices than any mesh
    ],
)
def test_deepspeed_wrong_types(tmp_path: Path, key: str, value: Any, fragment: str) -> None:
    """A list where DeepSpeed expects a mapping used to end in "unhashable type: 'list'"."""
    doc = json.loads((CONFIGS / "deepspeed_zero2.json").read_text()) | {key: value}
    if key == "train_batch_size" and value == 10**9:
        doc |= {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 8}
    one_line(invoke("--from", write(tmp_path, "ds.json", json.dumps(doc))), fragment)


@pytest.mark.parametrize(
    ("extra", "fragment"),
    [
        (
            'pipeline_parallel_split_points = 3\npipeline_parallel_schedule = "Interleaved1F1B"',
            "pipeline_parallel_split_points=3: expected a list of strings",
        ),
        ("pipeline_parallel_split_points = [1, 2]", "pipeline_parallel_split_points"),
        ('tensor_parallel_degree = "8"', "tensor_parallel_degree"),
        ("tensor_parallel_degree = 2000000", "absurd"),
        ("pipeline_parallel_schedule = 3", "pipeline_parallel_schedule"),
        ('enable_async_tensor_parallel = "yes"', "enable_async_tensor_parallel"),
    ],
)
def test_torchtitan_wrong_types(tmp_path: Path, extra: str, fragment: str) -> None:
    one_line(invoke("--from", write(tmp_path, "tt.toml", tt_with(extra)), "--devices", "8"), fragment)


def test_devices_zero_with_a_torchtitan_file() -> None:
    """Used to divide by zero."""
    one_line(invoke("--from", str(CONFIGS / "torchtitan_llama3_8b.toml"), "--devices", "0"), "--devices 0")


# --- numbers --------------------------------------------------------------------------------


@pytest.mark.parametrize("digit", ["²", "٣", "８", "Ⅷ", "8.0", "1e3", "0x8", "+8", "8_0", "-8", "8 8"])
def test_numbers_are_ascii_digits(tmp_path: Path, digit: str) -> None:
    """``int('²')`` used to raise; ``int('٣')`` used to be read as 3."""
    script = write(tmp_path, "run.sh", f"torchrun pretrain_gpt.py --tensor-model-parallel-size '{digit}' --bf16\n")
    one_line(invoke("--from", script, "--devices", "8"), "--tensor-model-parallel-size", digit)
    one_line(invoke("sweep", "tp{}", "--values", f"2,{digit}", "--params", "1e9"), "--values", digit)
    one_line(invoke("plan", "--params", "1e9", "--devices", "8", "--fix", f"tp={digit}"), "--fix", digit)
    one_line(invoke("zero3", "--devices", digit), "--devices", digit)
    one_line(invoke("zero3", "--micro-batch", digit), "--micro-batch", digit)
    one_line(invoke(f"tp{digit}xdp2"), f"tp{digit}".lower().split("x")[0])


@pytest.mark.parametrize("space", ["\x1c", "\x85", "\u2028", "\u3000", "\n"])
def test_unicode_whitespace_is_not_part_of_a_number(space: str) -> None:
    """Python's ``\\s`` takes these as whitespace: ``--params '1e9\\x1c'`` used to name the model
    with a raw control character."""
    one_line(invoke("dp2", "--params", f"1e9{space}"), "--params")
    one_line(invoke("dp2", "--params", "1e9", "--device-memory", f"80GB{space}"), "--device-memory")
    one_line(invoke("dp2", "--devices", f"8{space}"), "--devices")


def test_an_empty_number_is_refused() -> None:
    one_line(invoke("zero3", "--devices", ""), "--devices")
    one_line(invoke("plan", "--params", "1e9", "--devices", "8", "--fix", "tp="), "--fix")
    one_line(invoke("sweep", "tp{}", "--values", ",", "--params", "1e9"), "--values")


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (("zero3", "--devices", HUGE), "--devices"),
        (("zero3", "--micro-batch", "1" + "0" * 50), "--micro-batch"),
        (("zero3", "--seq", "1" + "0" * 50), "--seq"),
        (("plan", "--params", "1e9", "--micro-batch", HUGE), "--micro-batch"),
        (("plan", "--params", "1e9", "--devices", HUGE), "--devices"),
        (("plan", "--params", "1e9", "--global-batch", HUGE), "--global-batch"),
        (("plan", "--params", "1e9", "--device-flops", "1e400"), "--device-flops"),
        (("plan", "--params", "1e9", "--device-flops", "inf"), "--device-flops"),
        (("explain", "zero2", "--degree", HUGE), "--degree"),
        (("dp2", "--timeout-ms", HUGE), "--timeout-ms"),
        (("sweep", "tp{}", "--values", HUGE, "--params", "1e9"), "--values"),
        (("tp1000xpp1000xdp2",), "absurd"),  # every degree fine, their product two billion devices
        (("x".join(["dp1"] * 40),), "terms"),
    ],
)
def test_numbers_beyond_every_bound(args: tuple[str, ...], fragment: str) -> None:
    """``zero3 --devices 2**70`` used to be proved on 1.18e21 devices."""
    one_line(invoke(*args), fragment)


def test_a_global_batch_beyond_spellable_micro_batches_plans_nothing() -> None:
    """The planner used to fail on its own candidate (m1000000000: degree absurd) after planning."""
    result = invoke("plan", "--params", "1e9", "--devices", "8", "--global-batch", "1000000000")
    assert result.exit_code == 1 and "no composition fits" in result.stdout, result.output


def test_compare_is_bounded() -> None:
    one_line(invoke("compare", *["dp2"] * 65, "--params", "1e9"), "65 compositions")


def test_a_leftover_degree_is_bounded() -> None:
    """A term without a degree takes the devices left over, and those are bounded too."""
    one_line(invoke("zero3", "--devices", "1000001"), "--devices")
    result = invoke("zero3", "--devices", "1000000", "--params", "1e9", "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["composition"].startswith("zero31000000")


def test_megatron_launcher_world_is_bounded(tmp_path: Path) -> None:
    script = write(tmp_path, "run.sh", f"torchrun --nproc_per_node {HUGE} pretrain_gpt.py --bf16\n")
    one_line(invoke("--from", script), "nproc_per_node")


def test_an_empty_model_name_is_an_error() -> None:
    """``--model ''`` used to mean the default model."""
    one_line(invoke("zero3", "--model", ""), "--model ''")
    one_line(invoke("plan", "--model", " "), "--model")


def test_a_missing_config_json_is_named(tmp_path: Path) -> None:
    one_line(invoke("dp2", "--model", str(tmp_path / "config.json")), "cannot read")


# --- output files ---------------------------------------------------------------------------


def test_plan_csv_into_a_missing_directory_fails_before_planning(tmp_path: Path) -> None:
    """The whole plan used to be computed before the write failed with a traceback."""
    with mock.patch("checker._planner.plan", side_effect=AssertionError("planned anyway")):
        one_line(
            invoke("plan", "--params", "1e9", "--devices", "8", "--csv", str(tmp_path / "no" / "p.csv")),
            "--csv",
            "no such directory",
        )
        one_line(invoke("plan", "--params", "1e9", "--devices", "8", "--csv", str(tmp_path)), "a directory")


@pytest.mark.parametrize("option", ["--report", "--chart"])
def test_outputs_into_a_missing_directory(tmp_path: Path, option: str) -> None:
    target = str(tmp_path / "no" / ("r.html" if option == "--report" else "c.svg"))
    args = (
        ("dp2", "--params", "1e9", "--report", target)
        if option == "--report"
        else ("compare", "dp2", "zero22", "--params", "1e9", "--chart", target)
    )
    one_line(invoke(*args), option, "no such directory")


@pytest.mark.parametrize(
    "args",
    [
        ("dp2", "--params", "1e9", "--report", "{out}"),
        ("plan", "--params", "1e9", "--devices", "2", "--csv", "{out}"),
        ("sweep", "tp{}", "--values", "1,2", "--params", "1e9", "--chart", "{out}.svg"),
    ],
)
def test_a_write_that_fails_part_way_keeps_the_old_file(tmp_path: Path, args: tuple[str, ...]) -> None:
    """A failing --report write used to leave a truncated page in place of the previous one."""
    out = tmp_path / "out"
    argv = [a.replace("{out}", str(out)) for a in args]
    target = Path(argv[-1])
    target.write_bytes(b"the previous report\n")
    with mock.patch("os.fsync", side_effect=OSError(errno.ENOSPC, "No space left on device")):
        one_line(invoke(*argv), "No space left on device", "unchanged")
    assert target.read_bytes() == b"the previous report\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == [target.name]


def test_a_report_replaces_the_old_one_whole(tmp_path: Path) -> None:
    target = tmp_path / "r.html"
    target.write_text("old")
    os.chmod(target, 0o640)
    result = invoke("dp2", "--params", "1e9", "--report", str(target))
    assert result.exit_code == 0, result.output
    assert target.read_text().endswith("</html>\n")
    assert os.stat(target).st_mode & 0o777 == 0o640  # the file keeps its permissions
    assert [p.name for p in tmp_path.iterdir()] == ["r.html"]


# --- exit codes -----------------------------------------------------------------------------


def _closed_pipe_run(*args: str) -> subprocess.CompletedProcess[str]:
    read, write_end = os.pipe()
    os.close(read)  # nobody reads: the first write meets a broken pipe
    try:
        return subprocess.run(
            [sys.executable, "-m", "checker.cli", *args],
            stdout=write_end,
            stderr=subprocess.PIPE,
            text=True,
            timeout=300,
            check=False,
            cwd=ROOT,
        )
    finally:
        os.close(write_end)


@pytest.mark.parametrize(
    ("args", "code"),
    [
        (("dp2", "--params", "1e9"), 0),
        (("tp3",), 1),
        (("dp2", "--params", "1e9", "--json"), 0),
        (("explain", "--all"), 0),
        (("--help",), 0),
        (("zero4",), 2),
    ],
)
def test_a_closed_pipe_keeps_the_verdicts_exit_code(args: tuple[str, ...], code: int) -> None:
    """``check-composition ... | head`` used to exit 1 ("invalid") when head stopped reading."""
    done = _closed_pipe_run(*args)
    assert done.returncode == code, done.stderr
    assert "Traceback" not in done.stderr and "BrokenPipe" not in done.stderr
    assert len(done.stderr.splitlines()) == (1 if code == 2 else 0), done.stderr


def test_a_closed_pipe_keeps_unknown(z3_gives_up: None, monkeypatch: pytest.MonkeyPatch) -> None:
    import checker._output as output

    def closed(self: object, *args: object, **kwargs: object) -> None:
        raise BrokenPipeError(errno.EPIPE, "Broken pipe")

    monkeypatch.setattr(output._Terminal, "print", closed)
    result = invoke("dp2", "--params", "1e9")
    assert result.exit_code == 3, result.output
    assert result.stderr == ""


def test_an_internal_error_is_one_line_and_exit_4(monkeypatch: pytest.MonkeyPatch) -> None:
    import checker._command as command  # where the subcommands build their analysis

    def bug(*args: object, **kwargs: object) -> None:
        raise ZeroDivisionError("division by zero")

    monkeypatch.setattr(command, "analyze", bug)
    result = invoke("dp2", "--params", "1e9")
    assert result.exit_code == 4
    assert result.stderr == (
        "error: internal error: ZeroDivisionError: division by zero (run with --debug for the traceback)\n"
    )
    for args in (("--debug", "dp2", "--params", "1e9"), ("dp2", "--params", "1e9", "--debug")):
        raised = CliRunner().invoke(main, list(args))
        assert isinstance(raised.exception, ZeroDivisionError), raised.output


def test_exit_code_4_is_documented() -> None:
    import checker.cli as cli

    assert "4 internal error" in " ".join(invoke("--help").stdout.split())
    assert "4 internal error" in " ".join(invoke("check", "--help").stdout.split())
    assert "4" in (cli.__doc__ or "") and "internal error" in (cli.__doc__ or "")
    assert "4 internal error" in (ROOT / "README.md").read_text()
