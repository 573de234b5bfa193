"""``explain precisions``: the named ``--precision`` recipes, each with its bytes per element."""

from __future__ import annotations

import json

from click.testing import CliRunner

from checker.cli import main
from formal._model import PRECISIONS


def test_explain_precisions_lists_every_recipe_with_its_bytes() -> None:
    result = CliRunner().invoke(main, ["explain", "precisions", "--json"])
    assert result.exit_code == 0, result.output
    rows = {r["precision"]: r for r in json.loads(result.output)}
    assert set(rows) == set(PRECISIONS)
    # ZeRO paper (Rajbhandari et al. 2020, section 3.1): mixed-precision Adam holds 2 + 2 + K
    # bytes per parameter with K = 12 (fp32 master, momentum, variance): 16 in all.
    assert (rows["zero"]["P"], rows["zero"]["G"], rows["zero"]["O"], rows["zero"]["sum"]) == (2, 2, 12, 16)
    for name, row in rows.items():
        assert row["sum"] == row["P"] + row["G"] + row["O"], name


def test_explain_precisions_fits_80_columns() -> None:
    result = CliRunner(env={"COLUMNS": "80"}).invoke(main, ["explain", "precisions"])
    assert result.exit_code == 0
    assert max(len(line) for line in result.output.splitlines()) <= 80
    assert "megatron-fp16" in result.output
