"""Flag fields: a config dataclass field that carries its own command-line flag.

    @dataclass(frozen=True)
    class Config:
        use_tis: bool = flag(False, help="Multiply the policy loss by IS weights.")
        tis_mode: Literal["truncate", "clip"] = flag("truncate", help="How IS weights are bounded.")

    add_flags(parser.add_argument_group("title"), Config, ("use_tis", "tis_mode"))

The flag's shape comes from the annotation: `bool` is a switch (a False default: `--x` turns it on; a True default:
`option` turns it off, or `--x/--no-x` without one), `int`, `float` and `str` take a value (also as `X | None`), and a
`Literal` gives the choices. The flag's default is the field's. A config module imports only `flag`: its fields
hold metadata, no argparse.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import types
import typing
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Literal

FLAG = "slime_corr.flag"  # the metadata key


@dataclasses.dataclass(frozen=True)
class FlagSpec:
    """What a field's flag shows besides its default: help, choices (default: a `Literal`'s), metavar, the option
    when it is not `--field-name`, and the namespace attribute (`dest`) when it is not the field's name."""

    help: str | None
    choices: Sequence[Any] | None = None
    metavar: str | None = None
    option: str | None = None
    dest: str | None = None


def flag(default: Any, *, help: str | None, choices: Sequence[Any] | None = None, metavar: str | None = None,
         option: str | None = None, dest: str | None = None) -> Any:
    """A dataclass field with `default` whose command-line flag has this help, choices, metavar, option and dest."""
    return dataclasses.field(default=default, metadata={FLAG: FlagSpec(help, choices, metavar, option, dest)})


def flag_fields(cls: type) -> dict[str, dataclasses.Field]:
    """The fields of dataclass `cls` that are flags, by name, in declaration order."""
    return {f.name: f for f in dataclasses.fields(cls) if FLAG in f.metadata}


def option_of(field: dataclasses.Field) -> str:
    """The field's flag as typed: its `option`, else `--` + the name with `-` for `_`."""
    return field.metadata[FLAG].option or "--" + field.name.replace("_", "-")


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _value_type(hint: Any) -> tuple[type, tuple[Any, ...] | None]:
    """(the value's type, the `Literal`'s choices or None) of an annotation; `X | None` is X."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        (hint,) = [arg for arg in typing.get_args(hint) if arg is not type(None)]
    if typing.get_origin(hint) is Literal:
        values = typing.get_args(hint)
        return type(values[0]), values
    return hint, None


def flag_kwargs(cls: type, name: str) -> tuple[str, dict[str, Any]]:
    """(the option, `add_argument`'s keywords) of field `name` of `cls`."""
    field = flag_fields(cls)[name]
    spec: FlagSpec = field.metadata[FLAG]
    kind, literal = _value_type(_hints(cls)[name])
    kw: dict[str, Any] = {"dest": spec.dest or name, "default": field.default, "help": spec.help}
    if kind is bool:
        if not field.default:
            kw["action"] = "store_true"
        else:
            kw["action"] = "store_false" if spec.option else argparse.BooleanOptionalAction
        return option_of(field), kw
    if kind is not str:  # argparse keeps a string as typed
        kw["type"] = kind
    choices = spec.choices if spec.choices is not None else literal
    if choices is not None:
        kw["choices"] = choices
    if spec.metavar is not None:
        kw["metavar"] = spec.metavar
    return option_of(field), kw


def add_flags(group: Any, cls: type, names: Iterable[str],
              add: Callable[..., Any] | None = None) -> None:
    """Add the flags of fields `names` of `cls` to `group` (an argparse group or parser), in that order; `add`
    (option, **keywords) replaces `group.add_argument`, e.g. to compose with a host parser."""
    for name in names:
        option, kw = flag_kwargs(cls, name)
        (add or group.add_argument)(option, **kw)


__all__ = ["FLAG", "FlagSpec", "add_flags", "flag", "flag_fields", "flag_kwargs", "option_of"]
