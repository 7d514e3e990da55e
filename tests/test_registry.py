"""grpo.core.registry: names -> entries, registered once, each unknown name a one-line error."""

from __future__ import annotations

import pytest

from grpo.core.registry import Registry


def make() -> Registry:
    reg = Registry("train.thing", "thing", also=("auto",))
    reg.register("a")(len)
    reg.register("b")(sum)
    return reg


def test_names_entries_and_lookup_in_registration_order():
    reg = make()
    assert reg.names() == ("a", "b") and list(reg) == ["a", "b"] and len(reg) == 2
    assert reg.accepted() == ("auto", "a", "b")
    assert reg["b"] is sum and "a" in reg and "auto" not in reg  # `also` names are accepted, not entries
    assert reg.get("zz") is None


def test_unknown_names_are_one_line_errors_naming_the_param():
    reg = make()
    with pytest.raises(ValueError, match=r"^train.thing: no thing 'c'; known: a, b$"):
        reg["c"]
    with pytest.raises(ValueError, match=r"^train.thing: must be one of auto, a, b; got 'c'$"):
        reg.check("c")
    with pytest.raises(ValueError, match=r"^sent.thing: must be one of"):
        reg.check("c", "sent.thing")
    assert reg.check("auto") == "auto" and reg.check("a") == "a"


def test_a_name_answers_to_one_entry():
    reg = make()
    reg.register("a")(len)  # the same object again (a module imported twice) is no conflict
    with pytest.raises(ValueError, match="'a' is already taken"):
        reg.register("a")(max)
    with pytest.raises(ValueError, match="'auto' is already taken"):
        reg.register("auto")(max)


def test_registered_lasts_for_the_block():
    reg = make()
    with reg.registered("c", max) as entry:
        assert entry is max and reg["c"] is max and reg.names() == ("a", "b", "c")
    assert "c" not in reg
    with pytest.raises(RuntimeError), reg.registered("d", min):
        raise RuntimeError("the block fails")
    assert "d" not in reg


def test_monkeypatch_setitem_adds_an_entry_for_the_block_only(monkeypatch):
    """``monkeypatch.setitem`` reads the old entry with ``get`` (``None`` for an unknown name, where
    ``[]`` raises the one-line ``ValueError``) and deletes the new one afterwards."""
    reg = make()
    with monkeypatch.context() as patch:
        patch.setitem(reg, "c", max)
        assert reg["c"] is max
    assert "c" not in reg and reg.names() == ("a", "b")


def test_an_entry_declares_its_options_by_its_options_attribute():
    class Opts:
        pass

    class WithOptions:
        Options = Opts

    reg = make()
    reg.register("c")(WithOptions)
    assert reg.options("c") is Opts and reg.options("a") is None and reg.options("zz") is None
    assert reg.with_options() == ("c",)
