"""absl flags generated from a study's ``Plan`` dataclass: one edit per setting.

A Plan field declared with :func:`setting` carries its flag's help (and, where the
command line spells it differently, a parser); :func:`define_flags` defines one flag
per such field, named after it, typed from its annotation, defaulting to its
default; :func:`plan_from_flags` builds the Plan back from the parsed flags::

    @dataclasses.dataclass(frozen=True)
    class Plan:
      budget: float = plan_flags.setting(0.25, "Budget: the share of tokens kept.")

    plan_flags.define_flags(Plan)           # --budget=0.25
    plan = plan_flags.plan_from_flags(Plan)  # Plan(budget=FLAGS.budget).check()
"""

from __future__ import annotations

import dataclasses
import sys
import types
import typing
from typing import Any, Callable, Optional

from absl import flags

_SCALARS = (bool, int, float, str)


def setting(default, help: str, *,  # pylint: disable=redefined-builtin
            parse: Optional[Callable] = None, choices: Optional[tuple] = None):
  """A Plan field with a flag: ``help`` its text; ``parse`` maps the flag's value (a
  list of strings for a tuple field) to the field's when the element type is not
  enough; ``choices`` makes a string flag an enum."""
  if not help:
    raise ValueError("setting: help must be a non-empty string")
  return dataclasses.field(default=default,
                           metadata={"help": help, "parse": parse, "choices": choices})


def flag_fields(plan_cls) -> list:
  """The fields of ``plan_cls`` declared with :func:`setting`, in order."""
  if not dataclasses.is_dataclass(plan_cls):
    raise TypeError(f"plan_cls must be a dataclass, got {plan_cls!r}")
  return [f for f in dataclasses.fields(plan_cls) if "help" in f.metadata]


def _kind(plan_cls, field) -> tuple[type, bool]:
  """``(scalar type or tuple, optional)`` of ``field`` from its annotation."""
  hint = typing.get_type_hints(plan_cls)[field.name]
  args = typing.get_args(hint)
  optional = (typing.get_origin(hint) in (typing.Union, types.UnionType)
              and type(None) in args)
  if optional:
    hint = next(a for a in args if a is not type(None))
  base = typing.get_origin(hint) or hint
  if base not in _SCALARS + (tuple,):
    raise TypeError(f"{plan_cls.__name__}.{field.name}: a flag needs a bool, int, float, str "
                    f"or tuple field, got {hint!r}")
  return base, optional


def _item_type(plan_cls, field) -> type:
  """Element type of a tuple field: from its annotation (``tuple[int, ...]``), else that of
  its default's first entry (str if empty or None)."""
  hint = typing.get_type_hints(plan_cls)[field.name]
  for h in (hint,) + typing.get_args(hint):  # Optional[tuple[int, ...]] too
    args = typing.get_args(h)
    if typing.get_origin(h) is tuple and args and args[0] in _SCALARS:
      return args[0]
  items = field.default or ()
  return type(items[0]) if items else str


def define_flags(plan_cls, flag_values: flags.FlagValues = flags.FLAGS, *, skip=(),
                 defaults=None) -> None:
  """Defines ``--<field>`` for every :func:`setting` field of ``plan_cls`` not in ``skip``,
  as the calling module's flags (so that its ``--help`` lists them); ``defaults`` maps
  field names to the command line's default where it differs from the field's."""
  caller = sys._getframe(1).f_globals.get("__name__")  # pylint: disable=protected-access
  fields = flag_fields(plan_cls)
  defaults = dict(defaults or {})
  unknown = sorted(set(defaults) - {f.name for f in fields})
  if unknown:
    raise ValueError(f"defaults: {unknown} are not settings of {plan_cls.__name__}")
  for f in fields:
    if f.name in skip:
      continue
    kind, _ = _kind(plan_cls, f)
    meta, default = f.metadata, defaults.get(f.name, f.default)
    kw = dict(flag_values=flag_values,
              module_name=sys.argv[0] if caller == "__main__" else caller)
    if kind is tuple:
      items = None if default is None else [
          str(x) if meta.get("parse") is None else x for x in default]
      flags.DEFINE_list(f.name, items, meta["help"], **kw)
    elif meta.get("choices") is not None:
      flags.DEFINE_enum(f.name, default, list(meta["choices"]), meta["help"], **kw)
    else:
      define = {bool: flags.DEFINE_bool, int: flags.DEFINE_integer,
                float: flags.DEFINE_float, str: flags.DEFINE_string}[kind]
      define(f.name, default, meta["help"], **kw)


def plan_from_flags(plan_cls, flag_values: flags.FlagValues = flags.FLAGS, *, skip=(),
                    **given: Any):
  """The Plan of the parsed flags; ``given`` fields (and those in ``skip``) are not read
  from flags. Calls the Plan's ``check`` when it has one."""
  values = {}
  for f in flag_fields(plan_cls):
    if f.name in given or f.name in skip:
      continue
    raw = flag_values[f.name].value
    kind, _ = _kind(plan_cls, f)
    if raw is None:  # an Optional field left unset
      values[f.name] = None
    elif f.metadata.get("parse") is not None:
      values[f.name] = f.metadata["parse"](raw)
    elif kind is tuple:
      item = _item_type(plan_cls, f)
      values[f.name] = tuple(_convert(item, x, f.name) for x in raw)
    else:
      values[f.name] = raw
  plan = plan_cls(**values, **given)
  return plan.check() if hasattr(plan, "check") else plan


def _convert(item: type, text: str, name: str):
  try:
    if item is bool:
      if text.lower() not in ("true", "false"):
        raise ValueError(text)
      return text.lower() == "true"
    return item(text)
  except ValueError:
    raise ValueError(f"--{name} entries must be {item.__name__}s, got {text!r}") from None
