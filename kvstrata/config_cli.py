"""Configuration dataclasses as command lines: one `--flag` per field, generated from the field's metadata.

`ServerArgs` (args.py) and `RouterArgs` (router/args.py) declare their fields with `cli_option(...)`
metadata; `add_dataclass_cli_args` turns them into argparse flags, `dataclass_from_cli_args` back into the
dataclass, and `check_choices` refuses a value outside a field's choices with a ConfigError naming the flag.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from typing import Any, Optional


class ConfigError(ValueError):
    """An invalid setting or combination of settings, raised at start-up."""


def cli_option(help: str, choices: Optional[list] = None, cli: bool = True, aliases: tuple[str, ...] = (),
               no_effect: Optional[str] = None) -> dict:
    """Field metadata read by `add_dataclass_cli_args`: help text, allowed values, extra flag names, and
    why a flag has no effect here (if so)."""
    return {"help": help, "choices": choices, "cli": cli, "aliases": aliases, "no_effect": no_effect}


def add_dataclass_cli_args(parser: argparse.ArgumentParser, cls: type, groups: Optional[dict[str, str]] = None,
                           argparse_choices: bool = True) -> None:
    """Add one `--flag-name` per field of the config dataclass `cls` (metadata from `_opt`).

    bool fields get `--flag/--no-flag`; tuple fields take any number of values; `aliases` in a field's
    metadata adds more flag names for the same field. `groups` maps the first field of each section to its
    `--help` heading (fields follow in declaration order). With `argparse_choices=False` a value outside a
    field's choices is left to `check_choices` (a ConfigError naming the flag, not argparse's exit).
    """
    target: Any = parser
    types_of = _field_types(cls)
    for f in dataclasses.fields(cls):
        if groups and f.name in groups:
            target = parser.add_argument_group(groups[f.name])
        if not f.metadata.get("cli", True):
            continue
        flags = ["--" + flag_name(f.name), *f.metadata.get("aliases", ())]
        kind = types_of[f.name]
        kwargs: dict[str, Any] = {"dest": f.name, "help": f.metadata.get("help"), "default": f.default}
        if kind is bool:
            target.add_argument(*flags, action=argparse.BooleanOptionalAction, **kwargs)
            continue
        choices = f.metadata.get("choices")
        if choices and argparse_choices:
            kwargs["choices"] = choices
        elif choices:
            kwargs["metavar"] = "{" + ",".join(map(str, choices)) + "}"
        if typing.get_origin(kind) is tuple:
            kind, kwargs["nargs"] = typing.get_args(kind)[0], "*"
        target.add_argument(*flags, type=kind, **kwargs)


def dataclass_from_cli_args(cls: type, ns: argparse.Namespace) -> Any:
    """Build the config dataclass `cls` from parsed CLI arguments (unknown attributes are ignored)."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    values = {k: v for k, v in vars(ns).items() if k in fields}
    for name, value in values.items():
        if isinstance(value, list):
            values[name] = tuple(value)
    return cls(**values)


def check_choices(config: Any) -> None:
    """Raise ConfigError for a field whose value is not one of its metadata `choices`."""
    for f in dataclasses.fields(config):
        choices = f.metadata.get("choices")
        value = getattr(config, f.name)
        if choices and value is not None and value not in choices:
            raise ConfigError(f"--{flag_name(f.name)} must be one of {choices}, got {value!r}")


def flag_name(name: str) -> str:
    """The flag of a field: `--` + its name with dashes."""
    return name.replace("_", "-")



def _field_types(cls: type) -> dict[str, Any]:
    """Each field's type, with `Optional[X]` and `X | None` as X (annotations resolved by typing, not eval)."""
    out = {}
    for name, tp in typing.get_type_hints(cls).items():
        if typing.get_origin(tp) in (typing.Union, types.UnionType):
            tp = [a for a in typing.get_args(tp) if a is not type(None)][0]
        out[name] = tp
    return out
