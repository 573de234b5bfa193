"""Importers: a framework's configuration in, a composition (+ options) out, and what was not mapped.

DeepSpeed JSON (https://www.deepspeed.ai/docs/config-json/), torchtitan TOML
(``torchtitan/config/job_config.py``) and Megatron-LM arguments (``megatron/training/arguments.py``).
Every importer builds a ``Layout`` and returns the ``Composition`` it is (``Layout.composition``,
built from the strategy library, never from text) in an ``Imported``, with the settings it could
not map exactly (``Unmapped``: the setting as spelled and what was assumed). Unknown keys and
contradictions raise ``ConfigError`` (an ``InputError``): one line naming the key as the user
spelled it.

Files are read through ``formal._input`` (regular files only, bounded size, strict UTF-8,
bounded nesting and integers); each format declares the type of every key it reads
(``DEEPSPEED_SCHEMA``, ``TORCHTITAN_SCHEMA``), and every number in a Megatron script is read by
``parse_int``. A file of no known kind, or one that states nothing (an empty file, a script
without arguments), is refused rather than read as an empty configuration.

The importers live one format a module: ``checker._import_deepspeed``,
``checker._import_torchtitan`` and ``checker._import_megatron``, over what they share
(``checker._import_common``); this module picks one by the file's name, reads the file, and
re-exports the names the importers' users import.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from checker._import_common import ConfigError, Framework, Imported, Unmapped
from checker._import_deepspeed import DEEPSPEED_SCHEMA, import_deepspeed
from checker._import_megatron import import_megatron, launcher_world_size, megatron_tokens
from checker._import_shell import read_script
from checker._import_torchtitan import TORCHTITAN_SCHEMA, import_torchtitan
from formal._hf import seq_note
from formal._input import load_json, load_toml, printable, read_text
from formal._model import Model, Transformer
from formal.errors import InputError

# --- dispatch -------------------------------------------------------------------------------

_MEGATRON_SUFFIXES = ("", ".sh", ".bash", ".zsh", ".txt", ".args", ".slurm", ".sbatch", ".cmd")
_YAML_SUFFIXES = (".yaml", ".yml")


def detect(path: Path) -> Framework:
    """The format of a config from its name: ``.json`` DeepSpeed, ``.toml`` torchtitan, a shell
    script or arguments file (``.sh``, ``.txt``, no suffix, ...) Megatron; anything else is refused."""
    suffix = path.suffix.lower()
    match suffix:
        case ".json":
            return Framework.DEEPSPEED
        case ".toml":
            return Framework.TORCHTITAN
        case _ if suffix in _MEGATRON_SUFFIXES:
            return Framework.MEGATRON
        case _ if suffix in _YAML_SUFFIXES:
            raise ConfigError(
                f"--from {printable(str(path), 200)}: YAML is not read (give a DeepSpeed config as "
                ".json, a torchtitan config as .toml, or a Megatron launch script)"
            )
        case _:
            raise ConfigError(
                f"--from {printable(str(path), 200)}: unknown kind of file {printable(suffix, 20)!r} "
                "(expected a DeepSpeed .json, a torchtitan .toml, or a Megatron launch script such "
                "as .sh)"
            )


def load_config(
    path: Path,
    *,
    devices: int | None,
    model: Model | None = None,
    framework: Framework | None = None,
    seq: int | None = None,
) -> Imported:
    """Read ``path`` (format from its suffix unless given) and import it. ``seq``: the sequence
    length given beside it (``--seq``); when neither gives one and ``model``'s is its Hugging
    Face config's context window, the result says so."""
    result = _load(path, devices=devices, model=model, framework=framework)
    note = seq_note(model) if isinstance(model, Transformer) and seq is None and result.seq is None else None
    return result if note is None else replace(result, unmapped=(*result.unmapped, Unmapped("sequence length", note)))


def _load(path: Path, *, devices: int | None, model: Model | None, framework: Framework | None) -> Imported:
    where = printable(str(path), 200)
    kind = framework or detect(path)
    try:
        text = read_text(path, f"--from {where}")
        if not text.strip():
            raise ConfigError(f"--from {where}: empty file: states nothing to check")
        match kind:
            case Framework.DEEPSPEED:
                return import_deepspeed(load_json(text, where), devices=devices, model=model, where=where)
            case Framework.TORCHTITAN:
                return import_torchtitan(load_toml(text, where), devices=devices, model=model, where=where)
            case Framework.MEGATRON:
                launched = launcher_world_size(text, where)
                tokens = megatron_tokens(text, where)
                own = read_script(text, where).own_arguments
                if not tokens:
                    raise ConfigError(
                        f"--from {where}: no Megatron arguments (expected a launch line or script "
                        "with --tensor-model-parallel-size and the like; a DeepSpeed config is "
                        ".json, a torchtitan one .toml)"
                    )
                result = import_megatron(tokens, devices=devices, model=model, where=where, launcher=launched)
                if own:
                    why = "the script's own command-line arguments are not known: read as none"
                    result = replace(result, unmapped=(*result.unmapped, Unmapped("$@", why)))
                return result
            case _:
                raise AssertionError(kind)
    except ConfigError:
        raise
    except InputError as err:
        raise ConfigError(str(err)) from None


__all__ = [
    "DEEPSPEED_SCHEMA",
    "TORCHTITAN_SCHEMA",
    "ConfigError",
    "Framework",
    "Imported",
    "Unmapped",
    "detect",
    "import_deepspeed",
    "import_megatron",
    "import_torchtitan",
    "launcher_world_size",
    "load_config",
    "megatron_tokens",
]
