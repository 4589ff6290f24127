"""Routing: the map role -> policy (a named LoRA adapter, or the frozen base).

Sharing is a routing map, not a branch: the trainer and the engines only ask the router which
adapter a role uses. Nothing else in marlow tests "shared or isolated".

* ``sp``: every role -> one adapter named ``shared``.
* ``ip``: each role *type* -> its own adapter named after the role; slots of one role share it.
* ``map``: an explicit role -> adapter dict (several roles may share an adapter; ``__base__``
  leaves a role on the frozen base, untrained).
* ``base``: every role on the frozen base (the base control).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import get_args

from marlow.choices import RoutingKind
from marlow.types import BASE

ROUTINGS: tuple[str, ...] = get_args(RoutingKind)
SHARED = "shared"


@dataclass(frozen=True)
class Routing:
    """A resolved role -> adapter map for one workflow."""

    kind: str
    role_to_adapter: Mapping[str, str]

    def adapter_for(self, role: str) -> str:
        try:
            return self.role_to_adapter[role]
        except KeyError:
            known = ", ".join(sorted(self.role_to_adapter))
            raise ValueError(
                f"role {role!r} has no adapter in this routing; roles: {known}"
            ) from None

    @property
    def adapters(self) -> list[str]:
        """The trainable adapters, in first-role order (BASE excluded)."""
        seen: list[str] = []
        for adapter in self.role_to_adapter.values():
            if adapter != BASE and adapter not in seen:
                seen.append(adapter)
        return seen

    def roles_of(self, adapter: str) -> list[str]:
        return [r for r, a in self.role_to_adapter.items() if a == adapter]


def make_routing(
    kind: str, roles: Sequence[str], mapping: Mapping[str, str] | None = None
) -> Routing:
    """Build the routing of ``kind`` for a workflow with ``roles``."""
    if kind == "sp":
        return Routing(kind, {r: SHARED for r in roles})
    if kind == "ip":
        return Routing(kind, {r: r for r in roles})
    if kind == "base":
        return Routing(kind, {r: BASE for r in roles})
    if kind == "map":
        if not mapping:
            raise ValueError("policy.routing 'map' needs policy.role_map (role -> adapter name)")
        missing = [r for r in roles if r not in mapping]
        extra = [r for r in mapping if r not in roles]
        if missing or extra:
            raise ValueError(
                f"policy.role_map must name exactly the workflow's roles {list(roles)}; "
                f"missing {missing}, unknown {extra}"
            )
        return Routing(kind, {r: mapping[r] for r in roles})
    raise ValueError(f"policy.routing {kind!r} is unknown; valid: {', '.join(ROUTINGS)}")
