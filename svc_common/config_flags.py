"""Command-line flags generated from config dataclasses: each flag is declared once, as ``Flag`` metadata on its
field (``engine/config.py``: ``Flag``, ``flag(...)``).

From a dataclass whose fields carry ``{"flag": Flag(...)}`` metadata (nested config dataclasses walked in place,
in field order) this module generates the argparse flags (``add_flags``), the config of parsed flags
(``config_from_flags``) and the argv that passes the same values on (``flags_to_argv``). Type and default come
from the field unless the ``Flag`` gives them: a ``bool`` field is a switch, ``int | None`` parses an int, and a
``tuple[X, ...]`` field with ``nargs`` takes a list of X (the parser's default is the field's as a list, the
config gets a tuple). The engine flags (``svc_common/engine_args.py``) and the prefill and decode services' own
flags (``prefill_svc/config.py``, ``decode_svc/config.py``) are generated here. Nothing here imports the engine.
"""

from __future__ import annotations

import argparse
import types
from collections.abc import Collection, Iterator
from dataclasses import MISSING, Field, fields, is_dataclass
from pathlib import Path
from typing import Any, Union, get_args, get_origin, get_type_hints


def iter_flags(cls: type, skip: Collection[str] = ()) -> Iterator[tuple[Field, Any, Any]]:
    """(field, resolved type, flag) of every field of ``cls`` with a flag, nested configs in place, in field order;
    the fields named in ``skip`` (parts whose flags are added elsewhere) are left out."""
    hints = get_type_hints(cls)
    for f in fields(cls):
        if f.name in skip:
            continue
        if is_dataclass(hints[f.name]):
            yield from iter_flags(hints[f.name])
        elif "flag" in f.metadata:
            yield f, hints[f.name], f.metadata["flag"]


def flag_name(f: Field, spec: Any) -> str:
    return spec.name or "--" + f.name.replace("_", "-")


def flag_default(f: Field, spec: Any) -> Any:
    """The parsed value when the flag is not given."""
    if spec.has_default:
        return spec.default
    value = None if f.default is MISSING else f.default
    return list(value) if spec.nargs is not None and value is not None else value


def _scalar(kind: Any) -> Any:
    """``int | None`` -> int."""
    args = [t for t in get_args(kind) if t is not type(None)]
    return args[0] if get_origin(kind) in (Union, types.UnionType) and len(args) == 1 else kind


def argparse_kwargs(f: Field, kind: Any, spec: Any) -> dict[str, Any]:
    """``add_argument`` keywords of one field's flag (dest, default, help, type or switch, choices)."""
    kw: dict[str, Any] = {"dest": spec.attr(f.name), "default": flag_default(f, spec), "help": spec.help}
    kind = _scalar(kind)
    if spec.nargs is not None:
        kw["nargs"] = spec.nargs
        kind = get_args(kind)[0] if get_origin(kind) is tuple else kind  # tuple[str, ...] -> each value a str
    if spec.parse is None and kind is bool:
        kw["action"] = "store_true"
    else:
        kw["type"] = spec.parse or kind
    if spec.choices is not None:
        kw["choices"] = list(spec.choices() if callable(spec.choices) else spec.choices)
    if spec.metavar:
        kw["metavar"] = spec.metavar
    return kw


def add_flags(parser: argparse.ArgumentParser, cls: type, *, group: str | None = None,
              skip: Collection[str] = ()) -> None:
    """One flag per ``Flag`` of ``cls``'s fields, in field order. A flag with a ``group`` title goes into that
    argument group (created at its first flag); the others into ``group``, else onto the parser itself."""
    groups: dict[str, Any] = {}

    def target(title: str | None) -> Any:
        if not title:
            return parser
        if title not in groups:
            groups[title] = parser.add_argument_group(title)
        return groups[title]

    for f, kind, spec in iter_flags(cls, skip):
        target(spec.group or group).add_argument(flag_name(f, spec), *spec.aliases, **argparse_kwargs(f, kind, spec))


def _has_flags(cls: type) -> bool:
    return next(iter_flags(cls), None) is not None


def config_from_flags(cls: type, a: argparse.Namespace, given: dict[type, dict[str, Any]] | None = None) -> Any:
    """``cls`` of parsed flags. ``given[C]`` are field values of every ``C`` built (a nested config included)
    that come from elsewhere; they win over the flags' (their flags are not read). A field with neither a flag nor
    a given value keeps its default."""
    given = given or {}
    ours = given.get(cls, {})
    hints = get_type_hints(cls)
    kwargs: dict[str, Any] = {}
    for f in fields(cls):
        spec = f.metadata.get("flag")
        if f.name in ours:
            continue
        if is_dataclass(hints[f.name]):
            if _has_flags(hints[f.name]):
                kwargs[f.name] = config_from_flags(hints[f.name], a, given)
        elif spec is not None:
            value = getattr(a, spec.attr(f.name))
            if isinstance(value, list) and get_origin(_scalar(hints[f.name])) is tuple:
                value = tuple(value)
            kwargs.update(spec.to_fields(value) if spec.to_fields else {f.name: value})
    return cls(**{**kwargs, **ours})


def flags_to_argv(cls: type, a: argparse.Namespace, skip: Collection[str] = ()) -> list[str]:
    """The flags of ``cls`` in a parsed namespace as argv: what parses back to the same values (a switch that is
    off, a None and, for a flag that says so, the default are left out; a path is made absolute)."""
    out: list[str] = []
    for f, _, spec in iter_flags(cls, skip):
        value = getattr(a, spec.attr(f.name))
        if value is None or value is False or (not spec.forward_default and value == flag_default(f, spec)):
            continue
        name = flag_name(f, spec)
        if value is True:
            out.append(name)
        elif spec.nargs is not None:
            out += [name, *map(str, value)]
        else:  # the argv may be run elsewhere in the tree: a file is passed as an absolute path
            out += [name, str(Path(value).resolve()) if spec.is_path else str(value)]
    return out
