"""The shared checks of ``devin_compile.validation``: what they accept and the messages they give."""
from dataclasses import dataclass

import pytest

from devin_compile import validation as v


@pytest.mark.parametrize("check, message", [
    (lambda: v.positive_int("n", 0), "n=0 must be a positive integer"),
    (lambda: v.positive_int("n", True), "n=True must be a positive integer"),
    (lambda: v.positive_int("n", None, optional=False), "n=None must be a positive integer"),
    (lambda: v.int_at_least("n", 1, 2, hint="tokens"), "n=1 must be an integer >= 2 (tokens)"),
    (lambda: v.int_at_least("n", -1, 0, optional=True), "n=-1 must be an integer >= 0 or None"),
    (lambda: v.fraction("f", 0, 0.0, 0.95), r"f=0 must be in (0, 0.95]"),
    (lambda: v.number_in("t", 1.0, 0.0, 1.0, hi_open=True), r"t=1.0 must be in [0, 1)"),
    (lambda: v.number_in("w", -1, 0), "w=-1 must be a number >= 0"),
    (lambda: v.number_in("w", "1", 0), "w='1' must be a number >= 0"),
    (lambda: v.number_in("u", 3, hi=2, hi_open=True), "u=3 must be a number < 2"),
    (lambda: v.flag("b", 1), "b=1 must be True or False"),
    (lambda: v.one_of("mode", "x", ("a", "b")), "mode='x' is unknown; valid: ['a', 'b']"),
    (lambda: v.one_of("bits", 3, (4,), "is unsupported"), "bits=3 is unsupported; valid: [4]"),
])
def test_checks_name_the_setting_and_what_is_valid(check, message):
    with pytest.raises(ValueError) as e:
        check()
    assert str(e.value) == message


def test_checks_accept_valid_values():
    v.positive_int("n", 1)
    v.positive_int("n", None, optional=True)
    v.int_at_least("n", 0, 0)
    v.fraction("f", 0.95, 0.0, 0.95)
    v.number_in("t", 0, 0.0, 1.0, hi_open=True)
    v.flag("b", False)
    v.one_of("mode", "a", ("a", "b"))


def test_from_mapping_lists_valid_keys():
    @dataclass
    class C:
        a: int = 1
        b: int = 2

    assert v.from_mapping(C, {"b": 3}, "thing") == C(1, 3)
    with pytest.raises(ValueError, match=r"thing got unknown keys \['c'\]; valid keys: \['a', 'b'\]"):
        v.from_mapping(C, {"c": 1}, "thing")
