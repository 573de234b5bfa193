"""Benchmark (not a test): wall time of ``check-composition tp2xzero3xpp4``.

Measures the whole process (interpreter start, imports, parse, analysis, z3 verdict, report)
and, in-process, the analysis alone (parse -> placement -> step program -> exact costs) and
the JSON report. Prints medians over N runs.

    python benchmarks/bench_cli.py [-n 11] [COMPOSITION ...]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable


def timed(fn: Callable[[], object], runs: int) -> list[float]:
    out = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        out.append(time.perf_counter() - start)
    return out


def cli_command(composition: str) -> list[str]:
    script = shutil.which("check-composition")
    return [script, composition] if script else [sys.executable, "-m", "checker.cli", composition]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-n", "--runs", type=int, default=11)
    parser.add_argument("compositions", nargs="*", default=["tp2xzero3xpp4"])
    args = parser.parse_args()

    from checker._analysis import Analysis, analyze
    from checker._parse import parse
    from checker._report import to_json
    from formal._model import DEFAULT_PRECISION
    from formal._presets import DEFAULT_DEVICE_MEMORY, DEFAULT_DEVICES, DEFAULT_MODEL, PRESETS

    model = PRESETS[DEFAULT_MODEL]
    print(f"model {DEFAULT_MODEL}, {DEFAULT_DEVICES} devices, median of {args.runs} runs")
    for text in args.compositions:
        command = cli_command(text)

        def whole_process(command: list[str] = command) -> None:
            done = subprocess.run(command, capture_output=True, text=True, check=False, timeout=600)
            if done.returncode not in (0, 1):
                raise SystemExit(f"{' '.join(command)} failed: {done.stderr.strip()}")

        def analysis(text: str = text) -> Analysis:
            return analyze(parse(text, devices=DEFAULT_DEVICES), model, DEFAULT_PRECISION, DEFAULT_DEVICE_MEMORY)

        result = analysis()

        def report(result: Analysis = result) -> object:
            return to_json(result)

        whole_process()  # warm the file cache once
        rows = [
            ("whole process (check-composition)", timed(whole_process, args.runs)),
            ("in-process analysis (parse..costs)", timed(analysis, args.runs)),
            ("in-process JSON report", timed(report, args.runs)),
        ]
        print(text)
        for label, times in rows:
            print(
                f"  {label:<36} median {statistics.median(times) * 1000:8.1f} ms"
                f"  (min {min(times) * 1000:.1f}, max {max(times) * 1000:.1f})"
            )


if __name__ == "__main__":
    main()
