"""Small checks that configuration dataclasses share (bottom floor: imports nothing from the package).

Each check raises ``ValueError`` naming the setting, the value given and what is valid,
e.g. ``max_num_seqs=0 must be a positive integer``; ``hint`` adds a parenthesised remark.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Iterable, Mapping


def from_mapping(cls, value: Mapping[str, Any], what: str):
    """Build the dataclass ``cls`` from a dict, rejecting unknown keys with the list of valid ones."""
    valid = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(value) - set(valid))
    if unknown:
        raise ValueError(f"{what} got unknown keys {unknown}; valid keys: {valid}")
    return cls(**value)


def is_int(value: Any) -> bool:
    """An int that is not a bool."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    """An int or float that is not a bool."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _fail(name: str, value: Any, must: str, hint: str, optional: bool) -> None:
    tail = " or None" if optional else ""
    note = f" ({hint})" if hint else ""
    raise ValueError(f"{name}={value!r} must be {must}{tail}{note}")


def int_at_least(name: str, value: Any, lo: int = 1, *, optional: bool = False, hint: str = "") -> None:
    """``value`` is an integer >= ``lo`` (or None when ``optional``)."""
    if optional and value is None:
        return
    if not is_int(value) or value < lo:
        _fail(name, value, "a positive integer" if lo == 1 else f"an integer >= {lo}", hint, optional)


def positive_int(name: str, value: Any, *, optional: bool = False, hint: str = "") -> None:
    """``value`` is an integer >= 1 (or None when ``optional``)."""
    int_at_least(name, value, 1, optional=optional, hint=hint)


def number_in(name: str, value: Any, lo: float | None = None, hi: float | None = None, *, lo_open: bool = False,
              hi_open: bool = False, optional: bool = False, hint: str = "") -> None:
    """``value`` is a number in the interval given by ``lo``/``hi`` (None: unbounded; ``*_open``: excluded)."""
    if optional and value is None:
        return
    ok = is_number(value)
    if ok and lo is not None:
        ok = value > lo if lo_open else value >= lo
    if ok and hi is not None:
        ok = value < hi if hi_open else value <= hi
    if ok:
        return
    if lo is not None and hi is not None:
        must = f"in {'(' if lo_open else '['}{lo:g}, {hi:g}{')' if hi_open else ']'}"
    elif lo is not None:
        must = f"a number {'>' if lo_open else '>='} {lo:g}"
    elif hi is not None:
        must = f"a number {'<' if hi_open else '<='} {hi:g}"
    else:
        must = "a number"
    _fail(name, value, must, hint, optional)


def fraction(name: str, value: Any, lo: float = 0.0, hi: float = 1.0, *, optional: bool = False,
             hint: str = "") -> None:
    """``value`` is a number in ``(lo, hi]``, the usual range of a share of something."""
    number_in(name, value, lo, hi, lo_open=True, optional=optional, hint=hint)


def flag(name: str, value: Any) -> None:
    """``value`` is True or False."""
    if not isinstance(value, bool):
        raise ValueError(f"{name}={value!r} must be True or False")


def one_of(name: str, value: Any, choices: Iterable[Any], problem: str = "is unknown") -> None:
    """``value`` is one of ``choices``; the error lists them."""
    choices = list(choices)
    if value not in choices:
        raise ValueError(f"{name}={value!r} {problem}; valid: {choices}")
