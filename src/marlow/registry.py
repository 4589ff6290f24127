"""Named things of one kind that code registers and settings name, in one shape for every
registry of marlow (policy losses, loss aggregations, rollout backends, workflows, stage kinds):
a name is registered once, and an unknown name is a one-line error that lists the valid ones.
Pure Python: a config can name what a registry holds without importing what fills it, and an
item may be registered as its ``"package.module:attribute"`` path, imported when first used
(:meth:`Registry.load`)."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    """``kind`` names the things in errors (``unknown policy loss 'x'; valid: ...``)."""

    def __init__(self, kind: str, items: dict[str, T] | None = None) -> None:
        self.kind = kind
        self._items: dict[str, T] = dict(items or {})

    def add(self, name: str, item: T) -> None:
        if name in self._items:
            raise ValueError(f"{self.kind} {name!r} is already registered")
        self._items[name] = item

    def register(self, name: str) -> Callable[[T], T]:
        """A decorator that adds what it decorates under ``name``."""

        def add(item: T) -> T:
            self.add(name, item)
            return item

        return add

    def names(self) -> list[str]:
        return sorted(self._items)

    def unknown(self, name: str) -> str:
        """The error message of a name not registered."""
        return f"unknown {self.kind} {name!r}; valid: {', '.join(self.names())}"

    def get(self, name: str) -> T:
        if name not in self._items:
            raise ValueError(self.unknown(name))
        return self._items[name]

    def load(self, name: str) -> T:
        """What ``name`` holds, its module imported now when it was registered as a
        ``"package.module:attribute"`` string (kept imported from then on)."""
        item = self.get(name)
        if isinstance(item, str):
            module, attr = item.split(":", 1)
            item = getattr(importlib.import_module(module), attr)
            self._items[name] = item
        return item

    def __contains__(self, name: object) -> bool:
        return name in self._items

    def __iter__(self) -> Iterator[str]:
        """The names in the order they were registered."""
        return iter(self._items)
