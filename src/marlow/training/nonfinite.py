"""Non-finite updates never land: undo, count, and stop after a streak.

An adapter's update of a step is *skipped* when its loss or gradient is NaN/inf in any of its
mini-batches (:class:`~marlow.training.grpo.NonFiniteLoss`), or when the updated adapter gives
non-finite log-probabilities on the step's own turns (the post-update rescoring of a diagnostics
step, else its shortest turn per adapter: a finite but exploded update such as ``optim.lr=1e30``
gives NaN logits on any input). Skipped means undone: the adapter's
weights and AdamW state go back to where the step found them, so the earlier mini-batches of the
step are undone too. The price is one copy of each adapter's LoRA weights and AdamW moments per
step, kept on their device (:meth:`~marlow.training.optim.AdapterOptimizers.snapshot`). The schedule clock
still advances: a skipped step uses up its schedule turn, so a resumed run stays in step.

Counting: ``train/<adapter>/nonfinite_skips`` is 1 in a step where the adapter was skipped and 0
otherwise; each skip is logged and written to ``events.jsonl`` (``action: nonfinite_skip``).
After ``train.max_nonfinite`` consecutive skipped steps of one adapter the run stops with
:class:`NonFiniteRun` and writes no checkpoint for that step; since skipped updates never land,
the checkpoints written before hold good weights (``marlow.training.checkpoint`` also refuses to
write or load a non-finite one). The streak is not checkpointed: a resumed run counts from zero.
"""

from __future__ import annotations

from collections.abc import Callable

from marlow.training.grpo import NonFiniteLoss
from marlow.training.optim import AdapterOptimizers


class NonFiniteRun(RuntimeError):
    """The run stopped because an adapter's updates stayed non-finite; one line."""


class NonFiniteGuard:
    """Per step: snapshot each adapter before its update, undo it when it turns out non-finite.
    Across steps: consecutive skips per adapter, their metrics, log lines and events."""

    def __init__(
        self,
        optim: AdapterOptimizers,
        limit: int,
        log: Callable[[str], None],
        event: Callable[[dict], None],
    ) -> None:
        self.optim = optim
        self.limit = limit
        self.log = log
        self.event = event
        self.streak = dict.fromkeys(optim.params, 0)
        self.last: dict[str, str] = {}  # adapter -> why its latest update was skipped
        self._snapshots: dict[str, dict] = {}  # this step's, until count()
        self._skipped: dict[str, str] = {}  # this step's: adapter -> reason

    def update(self, adapter: str, update: Callable[[], None]) -> None:
        """Run every update of ``adapter`` in this step; undo them on a non-finite loss or
        gradient (the adapter's schedule turn is still taken)."""
        self._snapshots[adapter] = self.optim.snapshot(adapter)
        try:
            update()
        except NonFiniteLoss as err:
            self._undo(adapter, str(err))
            self.optim.end_role_update(adapter)

    def check_policy(self, adapter: str, finite: bool) -> None:
        """Undo ``adapter``'s update unless its updated policy scored the step's tokens (all of
        them, or one turn's on steps without the post-update rescoring) ``finite`` (on every
        data-parallel rank: each rank then undoes the same updates)."""
        if adapter in self._skipped or adapter not in self._snapshots:
            return
        if not finite:
            self._undo(adapter, "log-probabilities after the update are not finite")

    def _undo(self, adapter: str, reason: str) -> None:
        self.optim.restore(adapter, self._snapshots[adapter])
        self._skipped[adapter] = reason

    def count(self, step: int) -> dict[str, float]:
        """Close the step: log and record its skips; returns its ``nonfinite_skips`` metrics."""
        skipped, self._skipped, self._snapshots = self._skipped, {}, {}
        for adapter in self.streak:
            self.streak[adapter] = self.streak[adapter] + 1 if adapter in skipped else 0
        for adapter, reason in skipped.items():
            n = self.streak[adapter]
            self.last[adapter] = reason
            self.event(
                {
                    "step": step,
                    "action": "nonfinite_skip",
                    "adapter": adapter,
                    "reason": reason,
                    "consecutive": n,
                }
            )
            self.log(
                f"WARNING step {step}: update of adapter {adapter!r} skipped ({reason}); "
                f"{n} in a row, the run stops at train.max_nonfinite={self.limit}"
            )
        return {f"train/{a}/nonfinite_skips": float(a in skipped) for a in self.streak}

    def check(self, step: int, last_checkpoint: str) -> None:
        """Raise :class:`NonFiniteRun` when an adapter has been skipped ``limit`` steps running."""
        for adapter, n in self.streak.items():
            if n >= self.limit:
                self.event({"step": step, "action": "nonfinite_stop", "adapter": adapter})
                raise NonFiniteRun(
                    f"stopped at step {step}: adapter {adapter!r} had a non-finite update "
                    f"{n} steps in a row ({self.last[adapter]}); each was undone and the last "
                    f"checkpoint, {last_checkpoint}, is intact. Lower optim.lr or check the "
                    "rewards (train.max_nonfinite sets how many skips in a row are tolerated)"
                )
