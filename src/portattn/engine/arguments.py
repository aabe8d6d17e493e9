"""Dataclass fields as the one source of keyword arguments and command-line flags.

A configuration dataclass declares each field once, with its help text in the field's metadata
(``field(default=..., metadata=doc("..."))``). From the fields come the keyword arguments a front
end accepts (:func:`check_keywords`, :func:`keyword_signature`, :func:`describe`) and its flags
(:func:`add_flags`, :func:`given`): ``--name-with-dashes``, typed by the annotation (``bool`` as
``--flag`` / ``--no-flag``; ``int``, ``float`` or ``str``; ``X | None`` takes an ``X``), with the
dataclass's own default. A field added to the dataclass is a keyword and a flag with no other edit.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import types
import typing

_FLAG_TYPES = (bool, int, float, str)


def doc(help: str, *, choices=None, parse=None) -> dict:
    """A field's metadata: its help text (and allowed values, shown as the flag's choices), as in
    ``page_size: int = field(default=16, metadata=doc("tokens per KV-cache page"))``. ``parse``: a
    function from the flag's text to the value (a ``ValueError`` names what was expected), for flags
    whose values the annotation's type cannot read (``--kv-cache-memory 4GiB``)."""
    meta = {"help": help}
    if choices is not None:
        meta["choices"] = tuple(choices)
    if parse is not None:
        meta["parse"] = parse
    return meta


def option(name: str) -> str:
    """A field as errors name it, keyword and flag: ``kv_cache_memory (--kv-cache-memory)``, so that a
    message reads right from Python and from the command line."""
    return f"{name} (--{name.replace('_', '-')})"


def names(cls: type) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(cls))


def check_keywords(cls: type, kwargs: dict, *, what: str) -> None:
    """Raise ``TypeError`` naming every field of ``cls`` if ``kwargs`` holds a name that is none of them."""
    unknown = sorted(set(kwargs) - set(names(cls)))
    if unknown:
        raise TypeError(f"expected {what} keyword arguments among {list(names(cls))}, got {unknown}")


def keyword_signature(cls: type, *, leading: tuple[str, ...] = ()) -> inspect.Signature:
    """``(leading..., *, field=default, ...)``: ``leading`` names positional-or-keyword parameters
    (``self``, or fields of ``cls``, in that order); every other field is keyword-only."""
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    empty = inspect.Parameter.empty

    def parameter(name: str, kind) -> inspect.Parameter:
        field = fields.get(name)
        default = empty if field is None or field.default is dataclasses.MISSING else field.default
        return inspect.Parameter(name, kind, default=default, annotation=hints.get(name, empty))

    positional = [parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD) for name in leading]
    keywords = [parameter(name, inspect.Parameter.KEYWORD_ONLY) for name in fields if name not in leading]
    return inspect.Signature(positional + keywords)


def describe(cls: type) -> str:
    """One line per field: ``name: help (default: value)``, for docstrings."""
    return "\n".join(f"{f.name}: {_help(f)}" for f in dataclasses.fields(cls))


def add_flags(parser: argparse.ArgumentParser, cls: type, *, exclude: tuple[str, ...] = ()) -> None:
    """One flag per field of ``cls`` not in ``exclude``. Flags that are not given stay out of the parsed
    namespace (``argparse.SUPPRESS``), so the dataclass applies its own defaults (see :func:`given`);
    a field without a default is a required flag."""
    hints = typing.get_type_hints(cls)
    for field in dataclasses.fields(cls):
        if field.name in exclude:
            continue
        flag = "--" + field.name.replace("_", "-")
        kind = flag_type(cls, field.name, hints)
        common = dict(dest=field.name, default=argparse.SUPPRESS, help=_help(field).replace("%", "%%"))
        if kind is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, **common)
        else:
            required = field.default is dataclasses.MISSING
            parse = field.metadata.get("parse")
            kind = kind if parse is None else _flag_parser(parse)
            parser.add_argument(flag, type=kind, choices=field.metadata.get("choices"), required=required, **common)


def _flag_parser(parse):
    """``parse`` as an argparse type: its ``ValueError`` becomes the flag's one-line usage error."""

    def convert(text: str):
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    convert.__name__ = parse.__name__
    return convert


def given(args: argparse.Namespace, cls: type) -> dict:
    """The fields of ``cls`` set on the command line, as keyword arguments."""
    return {name: getattr(args, name) for name in names(cls) if hasattr(args, name)}


def flag_type(cls: type, name: str, hints: dict | None = None) -> type:
    """The command-line type of field ``name``: bool, int, float or str, the annotation itself or the
    one such member of a union (``int | None`` -> int, ``str | torch.dtype`` -> str)."""
    annotation = (hints or typing.get_type_hints(cls))[name]
    union = typing.get_origin(annotation) in (typing.Union, types.UnionType)
    members = typing.get_args(annotation) if union else (annotation,)
    kinds = [kind for kind in _FLAG_TYPES if kind in members]
    if not kinds:
        raise TypeError(f"expected {cls.__name__}.{name} annotated with one of bool, int, float, str, got {annotation}")
    return kinds[0]


def _help(field: dataclasses.Field) -> str:
    text = field.metadata.get("help", "")
    if field.default is not dataclasses.MISSING and field.default is not None:
        text += f" (default: {field.default})"
    return text
