"""The main job's configuration as a TOML file: the tables of gw.config's sections (model, moe,
parallelism, training, optimizer, data, checkpoint, logging, launch) whose keys are their fields,
read with tomllib and written with tomli-w. Checked against the sections' own types: an unknown
section or key, or a value of the wrong type, is one GridError naming the key and the file."""
from __future__ import annotations

import tomllib
import types
import typing
from pathlib import Path

from . import config
from .config import LaunchSection, TrainConfig
from .errors import GridError
from .modes import Mode


def _typed_keys(section) -> dict:
    """A section's keys and their annotations (`tp`'s Mode resolved where the section is declared)."""
    hints = typing.get_type_hints(section)
    return {name: hints[name] for name in section.names()}


# Every table's typed keys, from the sections' declarations (launch: the launcher's, not TrainConfig's).
TABLES = {s.NAME: _typed_keys(s) for s in config.SECTIONS}
SECTIONS = {s.NAME: s.names() for s in config.JOB_SECTIONS}  # the job's tables: TrainConfig's fields
LAUNCH = TABLES[LaunchSection.NAME]


def _accepts(hint, value) -> bool:
    """Whether a TOML value fits a field's annotation (ints where floats go; a mode as its spec)."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        return any(_accepts(h, value) for h in typing.get_args(hint))
    if hint is type(None):
        return False  # TOML has no null: a key left out keeps the default
    if hint is bool:
        return isinstance(value, bool)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is str:
        return isinstance(value, str)
    if hint is Mode:
        return isinstance(value, str)  # "row:4", parsed by TrainConfig
    return isinstance(value, hint)


def _type_name(hint) -> str:
    args = typing.get_args(hint) if isinstance(hint, types.UnionType) else ()
    names = [a.__name__ for a in (args or (hint,)) if a is not type(None) and a is not Mode]
    return " or ".join(n if n != "str" else "string" for n in names)


def load(path) -> tuple:
    """(TrainConfig fields, launcher fields) of a TOML file, every key and type checked."""
    path = Path(path)
    try:
        doc = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise GridError(f"config file {path} does not exist") from None
    except tomllib.TOMLDecodeError as e:
        raise GridError(f"config file {path} is not TOML: {e}") from None
    fields, launch = {}, {}
    for section, keys in doc.items():
        if not isinstance(keys, dict):
            raise GridError(f"{path}: '{section}' must be a section ([{section}]) of keys; sections: {', '.join(TABLES)}")
        if section not in TABLES:
            raise GridError(f"{path}: unknown section [{section}]; sections: {', '.join(TABLES)}")
        known = TABLES[section]
        for key, value in keys.items():
            if key not in known:
                where = next((t for t, ks in TABLES.items() if key in ks), None)
                hint = f" (it belongs in [{where}])" if where else f"; [{section}] takes {', '.join(known)}"
                raise GridError(f"{path}: unknown key {section}.{key}{hint}")
            if not _accepts(known[key], value):
                raise GridError(f"{path}: {section}.{key} = {value!r} must be {_type_name(known[key])}")
            (launch if section == LaunchSection.NAME else fields)[key] = value
    return fields, launch


def dump(cfg: TrainConfig, launch: dict | None = None) -> str:
    """cfg (and the launcher's fields) as the TOML file `load` reads back to the same config."""
    import tomli_w

    doc = {}
    if launch:
        doc["launch"] = {k: v for k, v in launch.items() if v is not None}
    for section, keys in SECTIONS.items():
        values = {}
        for k in keys:
            v = getattr(cfg, k) if k != "tp" else cfg.mode.spec()
            if k == "max_grad_norm" and v is None:
                v = 0.0  # TrainConfig reads 0 as no clipping (its None)
            if v is not None:  # None is the default of every optional field: left out
                values[k] = v
        doc[section] = values
    return tomli_w.dumps(doc)
