"""``--seq`` and learned position tables: the table is a parameter of its own size (GPT-3's
2,048 positions, Brown et al. 2020, table 2.1), so training at another length neither resizes it
nor, beyond its rows, has a position embedding to use."""

from __future__ import annotations

import json

from click.testing import CliRunner

from checker.cli import main
from formal._model import Transformer
from formal._presets import PRESETS


def _preset(name: str) -> Transformer:
    model = PRESETS[name]
    assert isinstance(model, Transformer)
    return model


GPT = _preset("gpt3-1.3b")


def run(*args: str) -> tuple[int, str, str]:
    r = CliRunner().invoke(main, list(args))
    assert "Traceback" not in r.output, r.output
    return r.exit_code, r.stdout, r.stderr


def test_a_shorter_sequence_keeps_the_position_table() -> None:
    assert GPT.learned_positions and GPT.seq == 2048
    code, out, _ = run("check", "dp8", "--devices", "8", "--model", "gpt3-1.3b", "--seq", "1024", "--json")
    assert code == 0
    doc = json.loads(out)
    assert doc["model"]["seq"] == 1024
    assert doc["model"]["parameters"] == GPT.parameter_count()  # 2,048 x h position rows, as the preset


def test_a_sequence_longer_than_the_table_is_refused_in_one_line() -> None:
    code, _, err = run("check", "dp8", "--devices", "8", "--model", "gpt3-1.3b", "--seq", "8192")
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "learned position table of 2,048 positions" in lines[0]


def test_rotary_models_take_any_sequence() -> None:
    llama = _preset("llama2-7b")
    assert not llama.learned_positions
    code, out, _ = run("check", "dp8", "--devices", "8", "--seq", "8192", "--json")
    assert code == 0 and json.loads(out)["model"]["parameters"] == llama.parameter_count()
