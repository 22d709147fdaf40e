"""Command-line flags derived from the frozen config dataclasses.

A config field declares its flag with option(): default, help text and bounds
are written once, on the field. Each daemon's __main__ turns each dataclass
into an argparse group (add_config_group) and builds it back from the parsed
namespace (config_from_args), so no default is repeated in the parser. Flag
spellings are vLLM's; a field named like its flag needs no spelling of its own.
Shared by controlplane/config.py and workerd/config.py, which never import
each other.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import typing
from typing import Any

_KEY = "kvloom.option"


@dataclasses.dataclass(frozen=True)
class Option:
    help: str
    flag: str = ""  # "" = --field-name
    aliases: tuple[str, ...] = ()
    choices: tuple[Any, ...] | None = None
    # A flag the daemon cannot start without (argparse's own error when absent).
    required: bool = False
    # Bounds, named as pydantic's (and so vLLM's config): >=, >, <=.
    ge: float | None = None
    gt: float | None = None
    le: float | None = None


def option(default: Any, help: str, **spec: Any) -> Any:
    """A config field with its command-line flag; spec is Option's fields."""
    return dataclasses.field(default=default, metadata={_KEY: Option(help, **spec)})


def flag_of(field: dataclasses.Field) -> str:
    return field.metadata[_KEY].flag or "--" + field.name.replace("_", "-")


def option_fields(cls: type) -> list[dataclasses.Field]:
    """The fields of cls that are flags; the others are resolved at start-up."""
    return [f for f in dataclasses.fields(cls) if _KEY in f.metadata]


class BadValue(argparse.ArgumentTypeError, ValueError):
    """argparse prints it after the flag's name, EnvArgumentParser after the
    KVLOOM_* variable's (it catches ValueError), so the message names either."""


def _int_tuple(raw: str) -> tuple[int, ...]:
    return tuple(int(x) for x in raw.split(",") if x.strip())


def _check_bounds(value: Any, opt: Option) -> None:
    bounded = (opt.ge, opt.gt, opt.le) != (None, None, None)
    for v in value if isinstance(value, tuple) else (value,):
        # float() takes "nan" and "inf"; NaN passes every comparison, so a
        # bounded value must be finite (an unbounded one is taken as given).
        if bounded and isinstance(v, float) and not math.isfinite(v):
            raise BadValue(f"must be a finite number, got {v}")
        if opt.ge is not None and v < opt.ge:
            raise BadValue(f"must be >= {opt.ge}, got {v}")
        if opt.gt is not None and v <= opt.gt:
            raise BadValue(f"must be > {opt.gt}, got {v}")
        if opt.le is not None and v > opt.le:
            raise BadValue(f"must be <= {opt.le}, got {v}")


def _converter(hint: Any, opt: Option):
    parse = _int_tuple if hint == tuple[int, ...] else hint
    if parse not in (str, int, float, _int_tuple):
        raise TypeError(f"no command-line form for a {hint} field")

    def convert(raw: str):
        value = parse(raw)
        _check_bounds(value, opt)
        return value

    # argparse names the type in its own errors ("invalid int value: 'x'").
    convert.__name__ = "comma-separated int" if parse is _int_tuple else parse.__name__
    return convert


def add_config_group(parser: argparse.ArgumentParser, cls: type, title: str):
    """One flag per option field of cls, each stored under the field's name.
    Returns the argument group, for flags that are no field of cls."""
    group = parser.add_argument_group(title)
    hints = typing.get_type_hints(cls)
    for field in option_fields(cls):
        opt: Option = field.metadata[_KEY]
        flag = flag_of(field)
        kwargs: dict[str, Any] = {"dest": field.name, "default": field.default, "help": opt.help}
        if hints[field.name] is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        else:
            kwargs["type"] = _converter(hints[field.name], opt)
            kwargs["choices"] = opt.choices
            # Named after the flag, not the dest (--step-timeout, not STEP_TIMEOUT_S).
            kwargs["metavar"] = None if opt.choices else flag[2:].replace("-", "_").upper()
        if opt.required:
            kwargs["required"] = True
        group.add_argument(flag, *opt.aliases, **kwargs)
    return group


def config_from_args(cls: type, args: argparse.Namespace, **resolved: Any) -> Any:
    """cls built from the parsed flags and the values only known at start-up.
    A field that is no flag must be resolved: its dataclass default is for
    configs built in code and would silently stand in for the real value."""
    values = {f.name: getattr(args, f.name) for f in option_fields(cls)}
    unresolved = {f.name for f in dataclasses.fields(cls)} - values.keys() - resolved.keys()
    if unresolved:
        raise TypeError(f"{cls.__name__}: resolve {sorted(unresolved)} at start-up")
    return cls(**{**values, **resolved})
