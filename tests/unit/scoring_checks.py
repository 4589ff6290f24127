"""Shared by the scoring tests: one micro-batch's scores, policy loss and adapter gradients, and
the check that two ways of scoring it agree."""

from __future__ import annotations

import torch

from marlow.algo.policy_loss import LossInputs, LossSettings, policy_loss
from marlow.policy.adapters import adapter_parameters, use_adapter
from marlow.training import logprobs
from marlow.training.batch import Chunk


class LossAndGrads:
    """Scores ``chunk`` under ``adapter`` with the policy loss ``loss_name`` against log-probs
    near the current ones (ratios inside and at the clip) and random advantages."""

    def __init__(self, model, chunk: Chunk, adapter: str, loss_name: str, temperature: float):
        self.model, self.chunk, self.adapter = model, chunk, adapter
        self.loss_name, self.temperature = loss_name, temperature
        self.params = adapter_parameters(model, adapter)
        gen = torch.Generator().manual_seed(2)
        with torch.no_grad(), use_adapter(model, adapter):
            now = logprobs.score_chunk(model, chunk, temperature).logp
        self.old = now + 0.2 * torch.randn(chunk.mask.shape, generator=gen)
        self.advantages = torch.randn(len(chunk.rows), generator=gen)

    def __call__(self):
        """(Scored, the loss, the adapter's gradients) of one forward and backward."""
        for p in self.params.values():
            p.grad = None
        with use_adapter(self.model, self.adapter):
            s = logprobs.score_chunk(self.model, self.chunk, self.temperature)
        inputs = LossInputs(s.logp, self.old, self.advantages)
        out = policy_loss(self.loss_name)(inputs, LossSettings())
        loss = (out.loss * self.chunk.mask).sum() / self.chunk.mask.sum()
        loss.backward()
        return s, loss.detach(), {k: p.grad.clone() for k, p in self.params.items()}


def assert_same_scoring(ours, theirs, mask: torch.Tensor, logp_atol: float) -> None:
    """Two :class:`LossAndGrads` results agree: log-probs and entropies within ``logp_atol``
    (0 off ``mask``), the loss within 1e-6 (and 1e-6 relative), every gradient within 1e-6 / 1e-5 relative; the
    gradients are real."""
    (s, loss, grads), (their_s, their_loss, their_grads) = ours, theirs
    torch.testing.assert_close(s.logp, their_s.logp, atol=logp_atol, rtol=0)
    torch.testing.assert_close(s.entropy, their_s.entropy, atol=logp_atol, rtol=0)
    assert (s.logp[~mask] == 0).all() and (s.entropy[~mask] == 0).all()
    torch.testing.assert_close(loss, their_loss, atol=1e-6, rtol=1e-6)
    assert any(float(g.abs().max()) > 1e-4 for g in their_grads.values())
    for name, g in their_grads.items():
        torch.testing.assert_close(grads[name], g, atol=1e-6, rtol=1e-5, msg=name)
