"""Per-token statistics of a policy on its sampled tokens: the estimators behind the per-role
metrics.

With m_it in {0, 1} the mask and M = sum_it m_it the number of counted tokens:

    masked_mean(x)    = (1 / M) * sum_it m_it * x_it                      (0 when M = 0)
    logp_it           = log softmax(z_it / tau)[y_it]                      tau = sampling temperature
    entropy_it        = -sum_v p_itv * log p_itv,  p_it = softmax(z_it / tau)
    chi2_token        = (1 / M) * sum_it m_it * rho_it^2 - 1,  rho = exp(log_ratio)
    kl_k3             = (1 / M) * sum_it m_it * (exp(d_it) - d_it - 1),  d = ref_logp - logp
    perplexity        = exp(-(1 / M) * sum_it m_it * logp_it)
    clip fractions    = (1 / M) * sum_it m_it * clipped_low_it   (and likewise for clipped_high)
    max_ratio         = max_{it: m_it = 1} r_it

chi2_token is the chi-square divergence of the sampling distribution q from p estimated on tokens
drawn from q: E_q[(p/q)^2] - 1 = E_q[rho^2] - 1, so it is >= 0 in expectation (not per batch).
k3 (Schulman's "Approximating KL divergence") is unbiased for KL(pi || ref) on tokens sampled from
pi, and is >= 0 term by term.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, NamedTuple

import torch
from torch import Tensor

from marlow.algo.matmul import mm

if TYPE_CHECKING:
    from marlow.algo.losses import SurrogateOut

__all__ = [
    "EAGER_HEAD",
    "HeadOps",
    "chi2_token",
    "chunk_logit_grads",
    "chunk_logprobs",
    "chunk_logprobs_and_slopes",
    "clip_fractions",
    "head_logprobs_and_entropy",
    "k3_tokens",
    "kl_k3",
    "masked_mean",
    "max_ratio",
    "perplexity",
    "recomputed_head",
    "token_logprobs_and_entropy",
]


def _float_mask(mask: Tensor, like: Tensor) -> Tensor:
    if mask.shape != like.shape:
        raise ValueError(
            f"mask shape {tuple(mask.shape)} does not match value shape {tuple(like.shape)}"
        )
    dtype = like.dtype if like.is_floating_point() else torch.float32
    return mask.detach().to(dtype)


def masked_mean(x: Tensor, mask: Tensor) -> Tensor:
    """Mean of x over positions where mask is 1; a 0-dim tensor, 0.0 when the mask is empty.

    Masked-out values are dropped with `where` (not multiplied by 0), so NaN/inf padding is safe.
    """
    m = _float_mask(mask, x)  # same shape as x
    kept = torch.where(m != 0, x, torch.zeros_like(x))
    count = m.sum()  # ()
    return (kept * m).sum() / torch.where(count > 0, count, torch.ones_like(count))  # ()


def token_logprobs_and_entropy(
    logits: Tensor, targets: Tensor, temperature: float, entropy: bool = True
) -> tuple[Tensor, Tensor | None]:
    """Log-prob of each target token and the entropy of each next-token distribution.

    Args:
        logits: (T, L, V) raw logits aligned with targets (logits[:, t] predicts targets[:, t]).
        targets: (T, L) long token ids. Padded positions may hold any valid id; mask them later.
        temperature: the sampling temperature tau; logits are divided by tau when tau > 0, so the
            log-probs are those of the distribution the sampler drew from. tau = 0 (greedy)
            leaves the logits unscaled.
        entropy: False: not computed (None returned), for callers that do not read it.

    Returns:
        logp (T, L) with gradient, and entropy (T, L) *detached*: entropy is a diagnostic here,
        and computing it outside autograd saves keeping extra (T, L, V) tensors for backward.

    Memory: besides the input, one (T, L, V) scaled copy (only when tau is not 0 or 1), one
    (T, L, V) log-softmax (kept by autograd for logp's backward) and one (T, L, V) temporary for the
    entropy, computed in place. Low-precision logits (bf16/fp16) are upcast to float32 first,
    which is one more copy but keeps log-probs of likely tokens from rounding to 0.
    """
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0 (0 means greedy), got {temperature}")
    if logits.dim() != 3 or logits.shape[:2] != targets.shape:
        raise ValueError(
            f"logits must be (T, L, V) and targets (T, L); got {tuple(logits.shape)} and "
            f"{tuple(targets.shape)}"
        )
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()  # (T, L, V)
    if temperature > 0 and temperature != 1.0:
        logits = logits / temperature  # (T, L, V)
    log_probs = torch.log_softmax(logits, dim=-1)  # (T, L, V)
    logp = log_probs.gather(-1, targets.long().unsqueeze(-1)).squeeze(-1)  # (T, L)
    if not entropy:
        return logp, None
    with torch.no_grad():
        # -sum_v p log p. exp() makes the one temporary; entr(p) = -p log p is then taken in
        # place and is 0 at p = 0, where the naive p * log_probs would give 0 * -inf = NaN
        # (a vocabulary masked with -inf logits).
        neg_plogp = log_probs.exp()  # (T, L, V) p
        torch.special.entr(neg_plogp, out=neg_plogp)  # (T, L, V) -p log p
        return logp, neg_plogp.sum(dim=-1)  # (T, L)


HEAD_CHUNK_BYTES = 256 * 2**20
"""The float32 logits :func:`head_logprobs_and_entropy` holds at once, per chunk of tokens."""


def head_logprobs_and_entropy(
    hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    targets: Tensor,
    temperature: float,
    chunk_tokens: int | None = None,
    entropy: bool = True,
    ops: HeadOps | None = None,
) -> tuple[Tensor, Tensor | None]:
    """:func:`token_logprobs_and_entropy` of the logits ``hidden @ weight.T + bias`` (an LM head),
    computed ``chunk_tokens`` tokens at a time, so that the (tokens, vocabulary) logits never
    exist at once, in the forward or the backward (Liger-Kernel's fused linear cross-entropy,
    in plain torch).

    Where only ``hidden`` needs a gradient (the head frozen, as a LoRA run leaves it, and
    gradients enabled), each chunk's forward also takes each token's slope, the gradient of its
    log-prob with respect to its hidden state (:func:`chunk_logprobs_and_slopes`: one product of
    the chunk's softmax with the head's weight), and autograd keeps the (N, H) slopes, in the
    hidden state's dtype, in its place; the backward multiplies them by the incoming gradient. A
    log-prob is a scalar a token, so its gradient is known before the loss is: the backward
    computes no logits, where recomputing them would cost the head's product and its log-softmax
    once more per chunk. Where the head's weight or bias needs a gradient, the backward computes
    each chunk's logits again and takes the hidden state's and the head's gradients from them
    (:func:`chunk_logit_grads`). A choice of marlow; the same values to float round-off (tests).

    Args:
        hidden: (N, H) the last hidden state at each scored token's predicting position.
        weight, bias: the head's (V, H) weight and (V,) bias or None.
        targets: (N,) long token ids.
        temperature, as :func:`token_logprobs_and_entropy`.
        chunk_tokens: tokens a chunk; None: as many as :data:`HEAD_CHUNK_BYTES` of float32 logits
            hold.
        entropy: False: not computed (None returned): three passes over each chunk's logits
            fewer, for the passes that do not read it (the update's where logp_old was scored
            before it, the base's log-probs, the adapter-sync check's).
        ops: what computes a chunk (:class:`HeadOps`); None: :data:`EAGER_HEAD`, else the same
            functions compiled (``marlow.models.compile_layers``).

    Returns:
        logp (N,) with gradient, entropy (N,) detached (or None); float32. Each chunk makes the
        operations of :func:`token_logprobs_and_entropy` in its order (the head in its dtype,
        the upcast, the temperature, the log-softmax), so the two agree to float round-off.
        Peak memory beyond the inputs: two (chunk, V) float32 tensors, and the (N, H) slopes
        where they are taken.
    """
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0 (0 means greedy), got {temperature}")
    if hidden.dim() != 2 or targets.shape != hidden.shape[:1]:
        raise ValueError(
            f"hidden must be (N, H) and targets (N,); got {tuple(hidden.shape)} and "
            f"{tuple(targets.shape)}"
        )
    if chunk_tokens is None:
        chunk_tokens = max(1, HEAD_CHUNK_BYTES // (4 * weight.shape[0]))
    # only the hidden state needs a gradient (a frozen head): its slopes, from the forward
    slopes = (
        not _RECOMPUTED
        and torch.is_grad_enabled()
        and hidden.requires_grad
        and not weight.requires_grad
        and (bias is None or not bias.requires_grad)
    )
    logp, ent = _HeadLogprobs.apply(
        hidden,
        weight,
        bias,
        targets.long(),
        temperature,
        chunk_tokens,
        entropy,
        ops or EAGER_HEAD,
        slopes,
    )
    return logp, ent if entropy else None


_RECOMPUTED: list[bool] = []


@contextmanager
def recomputed_head() -> Iterator[None]:
    """Inside the ``with`` block, a frozen head's backward computes each chunk's logits again
    (:func:`chunk_logit_grads`) instead of scaling the slopes its forward took (the same values:
    so that the two can be timed side by side, ``bench/gpu_check.py``)."""
    _RECOMPUTED.append(True)
    try:
        yield
    finally:
        _RECOMPUTED.pop()


def _chunk_log_softmax(
    h: Tensor, weight: Tensor, bias: Tensor | None, temperature: float
) -> Tensor:
    """(c, V) float32 log-softmax of one chunk's temperature-scaled logits."""
    z = torch.nn.functional.linear(h, weight, bias)
    if z.dtype in (torch.float16, torch.bfloat16):
        z = z.float()  # the half-precision logits freed before the log-softmax
    if _scales(temperature):
        z.div_(temperature)  # in place: the float32 logits are this function's own
    return torch.log_softmax(z, dim=-1)


def _scales(temperature: float) -> bool:
    """Whether a chunk's logits are divided by ``temperature``: at every temperature above 0
    but 1, where eager skips the pass (dividing by 1 changes no bit); while compiled at 1 too,
    where the division fuses into the reduction, so that one compilation serves the sampling
    temperature and the sync probe's 1."""
    return temperature > 0 and (torch.compiler.is_compiling() or temperature != 1.0)


def chunk_logprobs(
    h: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    targets: Tensor,
    temperature: float,
    with_entropy: bool,
) -> tuple[Tensor, Tensor | None]:
    """One chunk's forward for :func:`head_logprobs_and_entropy`: the (c,) float32 log-probs of
    ``targets`` under the head's tempered logits of ``h`` (c, H), and their entropies where
    ``with_entropy`` (else None). The chunk's (c, V) float32 log-softmax is freed on return."""
    log_probs = _chunk_log_softmax(h, weight, bias, temperature)
    logp = log_probs.gather(-1, targets[:, None])[:, 0]
    if not with_entropy:
        return logp, None
    p = log_probs.exp_()  # (c, V), in place: the chunk's log-softmax is done with
    return logp, torch.special.entr(p, out=p).sum(-1)


def chunk_logit_grads(
    h: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    targets: Tensor,
    grad_logp: Tensor,
    temperature: float,
) -> Tensor:
    """One chunk's backward for :func:`head_logprobs_and_entropy` where the head takes a
    gradient: the gradient of the head's (c, V) logits, in the head's dtype, from ``grad_logp``
    (c,), the log-probs' (float32): the chunk's logits computed again,
    ``(onehot(target) - softmax) * grad_logp / temperature``."""
    p = _chunk_log_softmax(h, weight, bias, temperature).exp_()  # (c, V) softmax
    # d logp / d logits = onehot(target) - softmax, times the incoming gradient
    dz = p.mul_(-grad_logp[:, None])
    dz.scatter_add_(-1, targets[:, None], grad_logp[:, None].float())
    if _scales(temperature):
        dz.div_(temperature)
    return dz.to(weight.dtype)  # the upcast's backward: back to the head's dtype


def chunk_logprobs_and_slopes(
    h: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    targets: Tensor,
    temperature: float,
    with_entropy: bool,
) -> tuple[Tensor, Tensor | None, Tensor]:
    """:func:`chunk_logprobs` and each token's slope: the gradient of its log-prob with respect
    to its hidden state, ``((onehot(target) - softmax) / temperature) @ weight`` (c, H), in the
    head's dtype. The logits' gradient of :func:`chunk_logit_grads` is this bracket times the
    incoming gradient, so the hidden state's gradient is the incoming gradient times the slope:
    taken from the forward's own softmax, the backward needs no logits at all. While compiled,
    the entropies are taken whatever ``with_entropy`` says (a reduction fused into the kernel
    that writes the logits' gradient), so that one compilation serves the update passes that
    read them and those that do not; the caller drops what it did not ask for."""
    log_probs = _chunk_log_softmax(h, weight, bias, temperature)
    logp = log_probs.gather(-1, targets[:, None])[:, 0]
    p = log_probs.exp_()  # (c, V) softmax, in place: the chunk's log-softmax is done with
    ent = None  # compiling is asked first: no guard on with_entropy
    if torch.compiler.is_compiling() or with_entropy:
        ent = torch.special.entr(p).sum(-1)
    dz = p.neg_()
    dz.scatter_add_(-1, targets[:, None], torch.ones_like(logp)[:, None])
    if _scales(temperature):
        dz.div_(temperature)
    return logp, ent, mm(dz.to(weight.dtype), weight)


class HeadOps(NamedTuple):
    """What computes one chunk of :func:`head_logprobs_and_entropy`: its forward (as
    :func:`chunk_logprobs`), its logits' gradient (as :func:`chunk_logit_grads`) and its forward
    with the slopes (as :func:`chunk_logprobs_and_slopes`)."""

    forward: Callable[..., tuple[Tensor, Tensor | None]]
    backward: Callable[..., Tensor]
    slopes: Callable[..., tuple[Tensor, Tensor | None, Tensor]]


EAGER_HEAD = HeadOps(chunk_logprobs, chunk_logit_grads, chunk_logprobs_and_slopes)
"""The chunk functions run as they are (``marlow.models.compile_layers`` compiles them)."""


class _HeadLogprobs(torch.autograd.Function):
    """:func:`head_logprobs_and_entropy`'s forward and its chunked backward."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature, chunk, with_entropy, ops, slopes):  # noqa: D102
        n = hidden.shape[0]
        # the chunk functions take no part in autograd: detached, whatever needs a gradient
        # outside (one compilation for every pass where they are compiled)
        h, w = hidden.detach(), weight.detach()
        b = None if bias is None else bias.detach()
        logp = hidden.new_empty(n, dtype=torch.float32)
        entropy = hidden.new_empty(n if with_entropy else 0, dtype=torch.float32)
        slope = hidden.new_empty(n, hidden.shape[1]) if slopes else None
        for start in range(0, n, chunk):
            end = min(n, start + chunk)
            args = (h[start:end], w, b, targets[start:end], temperature, with_entropy)
            if slopes:
                lp, ent, slope[start:end] = ops.slopes(*args)
            else:
                lp, ent = ops.forward(*args)
            logp[start:end] = lp
            if with_entropy:
                entropy[start:end] = ent
            del lp, ent  # freed before the next chunk's logits are made, not after
        if slopes:  # the backward scales them: the hidden state, the head and targets not kept
            ctx.save_for_backward(slope)
        else:
            ctx.save_for_backward(hidden, weight, bias, targets)
        ctx.temperature, ctx.chunk, ctx.ops, ctx.slopes = temperature, chunk, ops, slopes
        ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, _grad_entropy):  # noqa: D102
        if ctx.slopes:
            (slope,) = ctx.saved_tensors
            # computed in float32 and rounded once into the slopes' dtype, without a float32 copy
            grad_h = torch.mul(slope, grad_logp[:, None], out=torch.empty_like(slope))
            return grad_h, None, None, None, None, None, None, None, None
        hidden, weight, bias, targets = (
            None if t is None else t.detach() for t in ctx.saved_tensors
        )
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        grad_h = torch.zeros_like(hidden) if need_h else None
        grad_w = torch.zeros_like(weight) if need_w else None
        grad_b = torch.zeros_like(bias) if need_b else None
        for start in range(0, hidden.shape[0], ctx.chunk):
            end = min(hidden.shape[0], start + ctx.chunk)
            h = hidden[start:end]
            dz = ctx.ops.backward(
                h, weight, bias, targets[start:end], grad_logp[start:end], ctx.temperature
            )
            if need_h:
                grad_h[start:end] = mm(dz, weight)
            if need_w:
                grad_w += mm(dz.T, h)
            if need_b:
                grad_b += dz.sum(0)
            del dz  # freed before the next chunk's
        return grad_h, grad_w, grad_b, None, None, None, None, None, None


def chi2_token(log_ratio: Tensor, mask: Tensor) -> Tensor:
    """Token-level chi-square: masked mean of rho^2, minus 1, with rho = exp(log_ratio).

    log_ratio is log p - log q per sampled token, e.g. trainer vs sampler log-probs
    (`chi2_rollout`) or new vs old policy (`chi2_update`). Returns 0 for an empty mask.
    """
    m = _float_mask(mask, log_ratio)
    rho_sq = torch.exp(2.0 * log_ratio)  # rho^2 in one exp
    non_empty = (m.sum() > 0).to(rho_sq.dtype)  # () 1, or 0 so an empty mask gives 0 - 0
    return masked_mean(rho_sq, m) - non_empty


def k3_tokens(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """Per token, exp(d) - d - 1 with d = ref - pi: Schulman's k3 term of KL(pi || ref) on tokens
    sampled from pi (non-negative; its gradient flows through ``logp``)."""
    if logp.shape != ref_logp.shape:
        raise ValueError(f"logp {tuple(logp.shape)} and ref_logp {tuple(ref_logp.shape)} differ")
    d = ref_logp - logp
    return torch.exp(d) - d - 1.0


def kl_k3(logp: Tensor, ref_logp: Tensor, mask: Tensor) -> Tensor:
    """k3 estimate of KL(pi || ref): the masked mean of :func:`k3_tokens`. Returns 0 for an
    empty mask."""
    return masked_mean(k3_tokens(logp, ref_logp), mask)


def perplexity(logp: Tensor, mask: Tensor) -> Tensor:
    """exp(mean NLL) of the masked tokens: exp(-masked_mean(logp)). 1.0 for an empty mask."""
    return torch.exp(-masked_mean(logp, mask))


def clip_fractions(out: SurrogateOut, mask: Tensor) -> tuple[Tensor, Tensor]:
    """(low_frac, high_frac): fractions of masked tokens whose clipped branch was active.

    low: r < 1 - clip_low with A < 0; high: r > 1 + clip_high with A > 0. 0 for an empty mask.
    """
    m = _float_mask(mask, out.ratio)
    low = masked_mean(out.clipped_low.to(m.dtype), m)
    high = masked_mean(out.clipped_high.to(m.dtype), m)
    return low.detach(), high.detach()


def max_ratio(ratio: Tensor, mask: Tensor) -> Tensor:
    """Largest ratio r over masked tokens (detached); 1.0 (no policy change) for an empty mask."""
    m = _float_mask(mask, ratio)
    if not bool((m != 0).any()):  # also covers numel() == 0, where max() would raise
        return ratio.new_ones(())
    return torch.where(m != 0, ratio.detach(), float("-inf")).max()
