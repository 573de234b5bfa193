"""An on-disk cache of the planner's z3 verdicts, one file per structural family.

A verdict depends on the composition, the model and the code that derives the program and
asks z3 (``formal``, the planner's family-to-composition route): the cache lives under the
user's cache directory (``$PLACEMENT_SEMANTICS_CACHE``, else ``$XDG_CACHE_HOME`` or
``~/.cache``, then ``placement-semantics/z3-verdicts``) in a folder named by a hash of that code,
the z3 version and the package version, so a change to any of them starts a fresh cache and
never reads a stale verdict. Each family (``checker._plan_space.Family`` of one model) is one
JSON file mapping a candidate (its composition text and micro-batch size) to its verdict's
obligations and violations. Files are replaced atomically (written beside, then renamed); a
file that cannot be read is treated as empty.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any

from formal._verdict import Condition, Obligation, Status, Verdict, Violation

_ROOT = Path(__file__).resolve().parent.parent
_CODE = ("formal", "checker/_plan_space.py", "checker/_planner.py", "checker/_plan_rules.py")


def version_hash() -> str:
    """A hash of the code a verdict depends on, the z3 version and the package version."""
    digest = hashlib.sha256()
    for entry in _CODE:
        path = _ROOT / entry
        files = sorted(path.rglob("*.py")) if path.is_dir() else [path]
        for f in files:
            digest.update(str(f.relative_to(_ROOT)).encode())
            digest.update(f.read_bytes())
    try:
        import z3

        digest.update(z3.get_version_string().encode())
    except ImportError:
        digest.update(b"no z3")
    return digest.hexdigest()[:20]


def default_dir() -> Path:
    env = os.environ.get("PLACEMENT_SEMANTICS_CACHE")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "placement-semantics"


def _verdict_json(v: Verdict) -> dict[str, Any]:
    return {
        "obligations": [[o.name, o.condition.name, o.status.name, o.reason_unknown] for o in v.obligations],
        "violations": [
            [x.rule, x.condition.name, x.state, x.group, x.axis, x.explanation, x.witness] for x in v.violations
        ],
        "notes": list(v.notes),
        "units": v.units,
        "rlimit": v.rlimit,
    }


def _verdict_of(doc: dict[str, Any]) -> Verdict:
    return Verdict(
        obligations=tuple(
            Obligation(name, Condition[c], Status[s], reason) for name, c, s, reason in doc["obligations"]
        ),
        violations=tuple(
            Violation(rule, Condition[c], state, group, axis, why, witness)
            for rule, c, state, group, axis, why, witness in doc["violations"]
        ),
        notes=tuple(doc["notes"]),
        units=int(doc["units"]),
        rlimit=int(doc["rlimit"]),
    )


class VerdictCache:
    """z3 verdicts per structural family, on disk; ``hits`` and ``misses`` count lookups."""

    def __init__(self, directory: Path | None = None) -> None:
        self.directory = (directory or default_dir()) / "z3-verdicts" / version_hash()
        self.hits = 0
        self.misses = 0
        self._families: dict[str, dict[str, Any]] = {}

    def _file(self, family: str) -> Path:
        return self.directory / (hashlib.sha256(family.encode()).hexdigest()[:24] + ".json")

    def _load(self, family: str) -> dict[str, Any]:
        if family not in self._families:
            try:
                doc = json.loads(self._file(family).read_text(encoding="utf-8"))
                entries = doc["verdicts"] if doc.get("family") == family else {}
            except (OSError, ValueError, KeyError, TypeError):
                entries = {}
            self._families[family] = dict(entries)
        return self._families[family]

    @staticmethod
    def family_key(family: object, model: object) -> str:
        return f"{family} | {model!r}"

    def get(self, family: str, candidate: str) -> Verdict | None:
        doc = self._load(family).get(candidate)
        if doc is None:
            self.misses += 1
            return None
        try:
            verdict = _verdict_of(doc)
        except (KeyError, ValueError, TypeError):
            self.misses += 1
            return None
        self.hits += 1
        return verdict

    def put(self, family: str, candidate: str, verdict: Verdict) -> None:
        """Record a verdict; unwritable storage leaves the run uncached, never failed."""
        entries = self._load(family)
        try:
            entries[candidate] = json.loads(json.dumps(_verdict_json(verdict)))
        except (TypeError, ValueError):
            return  # a witness that is not JSON: not cached
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.directory, suffix=".tmp")
            with os.fdopen(fd, "w", encoding="utf-8") as out:
                json.dump({"family": family, "verdicts": entries}, out)
            os.replace(tmp, self._file(family))
        except OSError:
            return
