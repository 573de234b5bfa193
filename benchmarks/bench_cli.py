"""Benchmark (not a test): wall time of ``check-composition tp2xzero3xpp4``.

First the goal's ratio, in one run: N fresh processes each of ``python -c "import sympy"`` and
of the default check, interleaved so that a busy machine slows both alike, their medians and
the check's median over sympy's (the goal: at most 1). The tree's bytecode is compiled first
(``python -m compileall -q formal checker``), so that neither side pays for compiling, also where
``PYTHONDONTWRITEBYTECODE=1`` keeps Python from writing it. Then, per composition, the whole
process (interpreter start, imports, parse, analysis, z3 verdict, report) and, in-process, the
analysis alone (parse -> placement -> step program -> exact costs) and the JSON report.

    python benchmarks/bench_cli.py [-n 11] [--ratio-only] [COMPOSITION ...]
"""

from __future__ import annotations

import argparse
import os
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


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def fresh_process(command: list[str]) -> float:
    """Seconds of one fresh process running ``command`` (which must exit 0 or 1: valid, invalid)."""
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, check=False, timeout=600)
    elapsed = time.perf_counter() - start
    if done.returncode not in (0, 1):
        raise SystemExit(f"{' '.join(command)} failed ({done.returncode}): {done.stderr.strip()}")
    return elapsed


def sympy_ratio(composition: str, runs: int) -> None:
    """The medians of ``import sympy`` and of the check, each a fresh process, and their ratio."""
    subprocess.run([sys.executable, "-m", "compileall", "-q", "formal", "checker"], cwd=ROOT, check=True)
    sympy = [sys.executable, "-c", "import sympy"]
    check = cli_command(composition)
    fresh_process(sympy), fresh_process(check)  # warm the file cache once
    baseline: list[float] = []
    ours: list[float] = []
    for _ in range(runs):
        baseline.append(fresh_process(sympy))
        ours.append(fresh_process(check))
    a, b = statistics.median(baseline), statistics.median(ours)
    bytecode = "PYTHONDONTWRITEBYTECODE=1 set" if os.environ.get("PYTHONDONTWRITEBYTECODE") else "bytecode writable"
    print(f"fresh processes, median of {runs} (compiled with compileall; {bytecode}): {' '.join(check)}")
    print(f"  python -c 'import sympy'            median {a * 1000:8.1f} ms")
    print(f"  {' '.join(['check-composition', composition]):<35} median {b * 1000:8.1f} ms")
    print(f"  ratio check / import sympy           {b / a:8.2f}  (goal: at most 1)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-n", "--runs", type=int, default=11)
    parser.add_argument("--ratio-only", action="store_true", help="Only the check against import sympy.")
    parser.add_argument("compositions", nargs="*", default=["tp2xzero3xpp4"])
    args = parser.parse_args()
    sympy_ratio(args.compositions[0], args.runs)
    if args.ratio_only:
        return

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
