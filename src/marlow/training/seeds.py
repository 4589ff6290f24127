"""The seeds a run derives from ``config.seed``: one per step for its rollout and one for its
update's shuffling, and one for every validation, so that a step's sampling is the same whether
the run went straight to it or resumed, and every validation samples the same way."""

from __future__ import annotations

ROLLOUT, SHUFFLE, VALIDATION = 0, 1, 2
"""The salts that keep a step's seeds apart."""


def step_seed(seed: int, step: int, salt: int = ROLLOUT) -> int:
    """The seed of step ``step`` (1-based) for the use ``salt`` names."""
    return (seed * 2_147_483_647 + step * 65_537 + salt * 101) % (2**62)


def validation_seed(seed: int) -> int:
    """The seed of every validation of a run, and of answering with its trained workflow: the
    same at every step, so validations differ only by the adapters."""
    return step_seed(seed, 0, VALIDATION)
