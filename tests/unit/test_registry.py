"""The one shape of marlow's registries: a name once, an unknown name listing the valid ones."""

from __future__ import annotations

import pytest

from marlow.registry import Registry


def test_a_registry_takes_each_name_once_and_names_the_valid_ones():
    reg: Registry[int] = Registry("colour", {"red": 1})
    assert reg.register("blue")(2) == 2  # a decorator returns what it registers
    with pytest.raises(ValueError, match="colour 'red' is already registered"):
        reg.add("red", 3)
    with pytest.raises(ValueError, match=r"^unknown colour 'green'; valid: blue, red$"):
        reg.get("green")
    assert reg.get("blue") == 2 and "red" in reg and "green" not in reg
    assert list(reg) == ["red", "blue"] and reg.names() == ["blue", "red"]


def test_an_item_registered_as_its_path_is_imported_when_first_loaded():
    reg: Registry[object] = Registry("thing", {"join": "os.path:join", "n": 3})
    assert reg.get("join") == "os.path:join"  # nothing imported yet
    import os.path

    assert reg.load("join") is os.path.join and reg.get("join") is os.path.join
    assert reg.load("n") == 3
    reg.add("gone", "marlow.no_such_module:x")
    with pytest.raises(ModuleNotFoundError):
        reg.load("gone")
