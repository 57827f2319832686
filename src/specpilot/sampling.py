"""Lossless sampling for speculative decoding: logits processing and draft verification.

Pure functions plus :class:`Sampler`, which owns one seeded ``torch.Generator`` per sequence.

Words (defined once, as in vLLM's rejection sampler):
  * p          - the target distribution at a verify row, *after* temperature, top-k and top-p;
                 speculative sampling reproduces sampling from p exactly, not from the raw softmax.
  * q          - the draft distribution a draft token was sampled from; a deterministic draft
                 (top-k, prompt lookup, suffix) is a point mass on its token.
  * accepted   - a draft token kept by the rejection test ``u < p(x) / q(x)``.
  * recovered  - the token resampled from the residual after every child of a node was rejected.
  * bonus      - the token sampled from p after the last accepted node when it has no children;
                 recovered and bonus tokens are both "the token the target adds".

Verification, all by one loop over siblings (children of the current node, in tree order):
  * chain (Leviathan et al. 2023; Chen et al. 2023): accept x with min(1, p(x)/q(x)), else
    resample from norm(max(0, p - q)).
  * tree, deterministic drafts: try the siblings in order, accepting x with probability p(x); on
    rejection zero p(x) and renormalize (the residual of a point mass) -- equivalent to sampling
    from p and matching the children.
  * tree, stochastic drafts (SpecInfer, Miao et al. 2024, recursive rejection sampling): sibling
    i was sampled from q_i independently; accept with min(1, p(x_i)/q_i(x_i)), else
    p <- norm(max(0, p - q_i)) and try the next sibling.
In each case the committed token at a node is distributed exactly as p (tests check it with a
chi-square test), so the output distribution equals plain sampling from the target.

Seeds. :class:`Sampler` gives each sequence its own generator and draws from it in a fixed order:
one uniform per committed token, turned into the token by the inverse CDF of p
(:func:`verify_tree_matching`: a deterministic draft is accepted when it is the token the target
samples there). The token at output position i is then a function of the seed, i and the prefix
alone - not of the draft trees, which change with the batch's composition and node budget - so a
seeded request gives the same text alone, in any batch, and with or without speculation. Drafts
that carry their sampling distribution q keep the rejection test above (more of them accepted);
their output is reproducible for the same trees only.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import torch
from torch import Tensor

from specpilot.errors import ConfigError
from specpilot.tree import Acceptance, DraftTree, verify_greedy

MAX_TEMPERATURE = 2.0
"""Largest temperature accepted (the OpenAI API's range is [0, 2])."""


@dataclass(frozen=True)
class SamplingParams:
    """How to turn the target's logits into the distribution p that is sampled."""

    temperature: float = 0.0
    """0 = greedy (argmax; bit-identical to plain greedy decoding); up to 2."""
    top_k: int = 0
    """Keep the k most likely tokens (0 = off)."""
    top_p: float = 1.0
    """Keep the smallest set of most likely tokens whose probability reaches top_p (1 = off)."""
    seed: int | None = None
    """Seed of the sequence's generator (None = a fresh random seed); same seed, same output."""

    def __post_init__(self) -> None:
        t = self.temperature
        if not isinstance(t, (int, float)) or not math.isfinite(t) or not 0 <= t <= MAX_TEMPERATURE:
            raise ConfigError(f"temperature must be in [0, {MAX_TEMPERATURE}], got {t!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ConfigError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        p = self.top_p
        if not isinstance(p, (int, float)) or not 0 < p <= 1:
            raise ConfigError(f"top_p must be in (0, 1], got {p!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def target_probs(logits: Tensor, params: SamplingParams) -> Tensor:
    """Temperature, top-k, top-p, softmax: (..., V) logits -> (..., V) float64 probabilities.

    >>> target_probs(torch.tensor([0.0, 1.0, 3.0]), SamplingParams(1.0, top_k=2)).round(
    ...     decimals=3).tolist()
    [0.0, 0.119, 0.881]
    """
    assert not params.greedy, "greedy decoding takes the argmax; there is no distribution"
    x = logits.double() / params.temperature  # (..., V)
    v = x.shape[-1]
    if 0 < params.top_k < v:
        kth = x.topk(params.top_k, dim=-1).values[..., -1:]  # (..., 1)
        x = x.masked_fill(x < kth, -math.inf)
    probs = torch.softmax(x, dim=-1)
    if params.top_p < 1:
        sp, idx = probs.sort(dim=-1, descending=True)
        drop = (sp.cumsum(dim=-1) - sp) >= params.top_p  # mass before this token already enough
        sp = sp.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, idx, sp)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def sample(probs: Tensor, gen: torch.Generator) -> int:
    """One token from ``probs`` (V,)."""
    return int(torch.multinomial(probs, 1, generator=gen))


def uniform(gen: torch.Generator) -> float:
    """u ~ U[0, 1) from the sequence's generator."""
    return float(torch.rand(1, generator=gen, dtype=torch.float64))


def inverse_cdf(probs: Tensor, u: float) -> int:
    """The token whose slice of the cumulative distribution holds ``u`` in [0, 1): a sample from
    ``probs`` (V,) when ``u`` is uniform; a token of zero probability is never returned.

    >>> [inverse_cdf(torch.tensor([0.25, 0.0, 0.75], dtype=torch.float64), u) for u in (0.1, 0.3)]
    [0, 2]
    """
    cdf = probs.cumsum(-1)
    x = torch.tensor([u * float(cdf[-1])], dtype=cdf.dtype)
    return min(int(torch.searchsorted(cdf, x, right=True)), probs.shape[-1] - 1)


def residual(p: Tensor, q: Tensor | None, token: int) -> Tensor:
    """norm(max(0, p - q)) after a rejection; a point-mass draft (q None) zeroes p(token).

    If the residual has no mass (p <= q everywhere, so the rejection had probability 0 and only
    rounding got here), p is returned unchanged.
    """
    if q is None:
        r = p.clone()
        r[token] = 0.0
    else:
        r = (p - q.to(p.dtype)).clamp_min(0.0)
    s = float(r.sum())
    return r / s if s > 0 else p


def accept_child(p: Tensor, token: int, q: Tensor | None, gen: torch.Generator) -> bool:
    """The rejection test for one draft token: accept with probability min(1, p(x) / q(x))."""
    qx = 1.0 if q is None else float(q[token])
    if qx <= 0:  # a token the draft could not have sampled: never accept
        return False
    return uniform(gen) * qx < float(p[token])


def verify_tree_sampling(
    tree: DraftTree, logits: Tensor, params: SamplingParams, gen: torch.Generator
) -> Acceptance:
    """Walk ``tree`` by rejection sampling; return the accepted path and committed tokens.

    logits: (N+1, V) target logits at the verify rows (row 0 = root, row i+1 = node i). Rows are
    turned into p lazily (only the rows on the walked path). ``tree.q`` (N, V) marks stochastic
    drafts; without it every draft is a point mass. A chain is the tree with one child per node.
    """
    assert logits.shape[0] == tree.size + 1, (logits.shape, tree.size)
    kids = tree.children()
    toks = tree.tokens.tolist()
    path: list[int] = []
    out: list[int] = []
    node = -1
    while True:
        p = target_probs(logits[node + 1], params)  # (V,)
        nxt = None
        for c in kids[node + 1]:
            q = None if tree.q is None else tree.q[c]
            if accept_child(p, toks[c], q, gen):
                nxt = c
                break
            p = residual(p, q, toks[c])
        if nxt is None:  # recovered (some child was rejected) or bonus (a leaf)
            out.append(sample(p, gen))
            return Acceptance(tuple(path), tuple(out))
        path.append(nxt)
        out.append(toks[nxt])
        node = nxt


def verify_tree_matching(
    tree: DraftTree, logits: Tensor, params: SamplingParams, gen: torch.Generator
) -> Acceptance:
    """Deterministic drafts, one draw of ``gen`` per committed token: at each node the target's
    own sample (:func:`inverse_cdf` of p at the next uniform) is committed, and the walk goes on
    into the child drafting that token, if any. Every committed token is distributed as p, so
    this is lossless (it accepts a point-mass draft x with probability p(x), as the rejection
    test does); and the tokens are those of plain sampling with the same draws, whatever the tree.
    """
    assert logits.shape[0] == tree.size + 1, (logits.shape, tree.size)
    kids = tree.children()
    toks = tree.tokens.tolist()
    path: list[int] = []
    out: list[int] = []
    node = -1
    while True:
        t = inverse_cdf(target_probs(logits[node + 1], params), uniform(gen))
        out.append(t)
        nxt = next((c for c in kids[node + 1] if toks[c] == t), None)
        if nxt is None:
            return Acceptance(tuple(path), tuple(out))
        path.append(nxt)
        node = nxt


def verify_chain_sampling(
    draft: list[int],
    logits: Tensor,
    params: SamplingParams,
    gen: torch.Generator,
    q: Tensor | None = None,
) -> Acceptance:
    """Chain speculative sampling: ``draft`` (k tokens), logits (k+1, V), q (k, V) or None."""
    return verify_tree_sampling(DraftTree.chain(draft, q=q), logits, params, gen)


class Sampler:
    """Per-sequence choice of tokens: greedy (argmax) or seeded lossless sampling from the
    sequence's own generator, one draw per committed token (see the module docstring)."""

    def __init__(self, params: SamplingParams | None = None) -> None:
        self.params = params or SamplingParams()
        seed = self.params.seed
        if seed is None:
            seed = random.SystemRandom().getrandbits(63)
        self.gen = torch.Generator().manual_seed(seed)

    @property
    def greedy(self) -> bool:
        return self.params.greedy

    def first(self, logits: Tensor) -> int:
        """The token after the prompt from its last row of logits (V,)."""
        if self.greedy:
            return int(logits.argmax())
        return inverse_cdf(target_probs(logits.cpu(), self.params), uniform(self.gen))

    def verify(self, tree: DraftTree, logits: Tensor) -> Acceptance:
        """Accept a path of ``tree`` from its verify logits (N+1, V)."""
        if self.greedy:
            return verify_greedy(tree, logits.argmax(-1).tolist())
        if tree.q is None:  # point-mass drafts: the same tokens whatever the tree
            return verify_tree_matching(tree, logits.cpu(), self.params, self.gen)
        return verify_tree_sampling(tree, logits.cpu(), self.params, self.gen)
