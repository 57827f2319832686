"""Training-free drafters: prompt lookup, suffix decoding, draft model, and the factory."""

from __future__ import annotations

import random

import pytest
import tokenizers
import torch
from tokenizers.models import WordLevel

from specpilot.config import ModelConfig
from specpilot.drafters import (
    DRAFTERS,
    Drafter,
    DraftModelDrafter,
    PromptLookupDrafter,
    SuffixDrafter,
    make_drafter,
)
from specpilot.drafters.base import DraftContext
from specpilot.drafters.prompt_lookup import continuation, merge_continuations
from specpilot.drafters.suffix import SuffixTrie
from specpilot.errors import ContextLengthError, DrafterError
from specpilot.model import Transformer, causal_mask, init_weights
from specpilot.tokenizer import Tokenizer
from specpilot.tree import DraftTree, TreeSpec, select_best

CHAIN5 = TreeSpec("chain", k=5)
STATIC = TreeSpec("static", paths=((0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)))
DYNAMIC = TreeSpec("dynamic", budget=10, topk=3, depth=4)
SPECS = (CHAIN5, STATIC, DYNAMIC, TreeSpec("dynamic", budget=3, topk=2, depth=6))


def propose(
    d: Drafter, tokens: list[int], spec: TreeSpec, prompt_len: int | None = None
) -> DraftTree:
    return d.propose(
        DraftContext(list(tokens), len(tokens) if prompt_len is None else prompt_len, spec)
    )


def assert_valid(tree: DraftTree, spec: TreeSpec) -> None:
    """Topological order, consistent depths, within the spec, scores non-increasing on paths."""
    assert tree.size <= spec.max_nodes
    parents, depths = tree.parents.tolist(), tree.depths.tolist()
    scores = tree.scores.tolist()
    for i, p in enumerate(parents):
        assert -1 <= p < i
        assert depths[i] == (1 if p < 0 else depths[p] + 1)
        assert depths[i] <= spec.max_depth
        if p >= 0:
            assert scores[i] <= scores[p] + 1e-6
    for kids in tree.children():  # no duplicate siblings
        toks = [int(tree.tokens[c]) for c in kids]
        assert len(toks) == len(set(toks))
    if spec.kind == "chain":
        assert parents == list(range(-1, tree.size - 1))


def at_rank(tree: DraftTree, path: tuple[int, ...]) -> int:
    """Token of the node a rank path names (children ranked by score, best first)."""
    kids = tree.children()
    node = -1
    for r in path:
        node = sorted(kids[node + 1], key=lambda c: (-float(tree.scores[c]), c))[r]
    return int(tree.tokens[node])


def best_path(tree: DraftTree) -> list[int]:
    """Tokens from the root following the best-scored child."""
    kids = tree.children()
    out, node = [], -1
    while kids[node + 1]:
        node = max(kids[node + 1], key=lambda c: (float(tree.scores[c]), -c))
        out.append(int(tree.tokens[node]))
    return out


# -- prompt lookup ---------------------------------------------------------------------------


def test_continuation_copies_past_the_end():
    assert continuation([7, 1, 2, 3, 1, 2], 3, 5) == [3, 1, 2, 3, 1]
    assert continuation([4, 4, 4], 2, 3) == [4, 4, 4]
    assert continuation([1, 2, 3], 3, 4) == []


def test_lookup_most_recent_occurrence_wins():
    toks = [1, 2, 3, 4, 9, 1, 2, 3, 5, 8, 2, 3]
    d = PromptLookupDrafter(min_n=1, max_n=2)
    d.begin(toks)
    tree = propose(d, toks, CHAIN5)
    assert tree.tokens.tolist() == [5, 8, 2, 3, 5]
    assert_valid(tree, CHAIN5)


def test_lookup_longest_ngram_wins_and_max_n_caps_it():
    toks = [1, 2, 3, 4, 7, 3, 6, 1, 2, 3]
    long = PromptLookupDrafter(min_n=1, max_n=3)
    long.begin(toks)
    assert propose(long, toks, CHAIN5).tokens.tolist() == [4, 7, 3, 6, 1]
    short = PromptLookupDrafter(min_n=1, max_n=1)  # only (3,): most recent is at index 5
    short.begin(toks)
    assert propose(short, toks, CHAIN5).tokens.tolist() == [6, 1, 2, 3, 6]


def test_lookup_min_n_and_no_match_give_empty_tree():
    toks = [5, 9, 1, 7, 5]  # only the 1-gram (5,) occurred before
    d = PromptLookupDrafter(min_n=2, max_n=3)
    d.begin(toks)
    assert propose(d, toks, CHAIN5).size == 0
    d1 = PromptLookupDrafter(min_n=1, max_n=3)
    d1.begin(toks)
    assert propose(d1, toks, CHAIN5).tokens.tolist() == [9, 1, 7, 5, 9]
    fresh = [1, 2, 3, 4]
    d1.begin(fresh)
    for spec in SPECS:
        assert propose(d1, fresh, spec).size == 0


def test_lookup_tree_merges_matches_by_support():
    # (5, 1) occurred three times: followed by 6, 7, 6 (most recent: 6, 9, ...)
    toks = [5, 1, 6, 5, 1, 7, 5, 1, 6, 9, 5, 1]
    d = PromptLookupDrafter(min_n=1, max_n=2, discount=1.0)
    d.begin(toks)
    assert propose(d, toks, CHAIN5).tokens.tolist() == [6, 9, 5, 1, 6]
    one = propose(d, toks, TreeSpec("dynamic", budget=2, topk=2, depth=1))
    assert one.tokens.tolist() == [6, 7]
    assert one.scores.tolist() == pytest.approx(
        [torch.tensor(2 / 3).log().item(), torch.tensor(1 / 3).log().item()]
    )
    static = propose(d, toks, TreeSpec("static", paths=((0,), (1,), (0, 0), (0, 1))))
    assert static.size == 4
    assert [at_rank(static, (0,)), at_rank(static, (1,))] == [6, 7]  # rank 0 = best supported
    # after 6: 5 (end 2) or 9 (end 8), equally supported
    assert {at_rank(static, (0, 0)), at_rank(static, (0, 1))} == {5, 9}
    for spec in SPECS:
        assert_valid(propose(d, toks, spec), spec)


def test_lookup_budgeted_merge_is_select_best():
    rng = random.Random(4)
    for _ in range(200):
        conts = [
            ([rng.randrange(3) for _ in range(rng.randrange(1, 6))], float(rng.randrange(1, 4)))
            for _ in range(rng.randrange(1, 8))
        ]
        discount, budget = rng.choice([1.0, 0.9]), rng.randrange(1, 12)
        got = merge_continuations(conts, discount, budget)
        want = select_best(merge_continuations(conts, discount), budget)
        assert got.tokens.tolist() == want.tokens.tolist()
        assert got.parents.tolist() == want.parents.tolist()


def _lookup_brute(toks: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    size = len(toks)
    for n in range(min(max_n, size), min_n - 1, -1):
        for e in range(size - 1, n - 1, -1):
            if toks[e - n : e] == toks[size - n :]:
                return continuation(toks, e, k)
    return []


def test_lookup_incremental_index_matches_a_rescan():
    rng = random.Random(0)
    toks = [rng.randrange(6) for _ in range(30)]
    d = PromptLookupDrafter(min_n=2, max_n=4)
    d.begin(toks[:10])
    while len(toks) < 300:
        assert propose(d, toks, CHAIN5, 10).tokens.tolist() == _lookup_brute(toks, 2, 4, 5)
        for spec in SPECS:
            assert_valid(propose(d, toks, spec, 10), spec)
        toks += [rng.randrange(6) for _ in range(rng.randrange(1, 5))]
    # a changed history (not an extension) is re-indexed, not trusted
    other = [*toks[:50], 0, 1, 2, 3, 4, 5, 0, 1]
    assert propose(d, other, CHAIN5, 10).tokens.tolist() == _lookup_brute(other, 2, 4, 5)


# -- suffix ----------------------------------------------------------------------------------


def _count(trie: SuffixTrie, pattern: list[int]) -> int:
    pos = (trie.root, 0)
    for t in pattern:
        pos = trie.walk(pos, t)
        if pos is None:
            return 0
    node, off = pos
    return 1 if off else node.count


def _occurrences(buf: list[int], pattern: list[int]) -> int:
    n = len(pattern)
    return sum(buf[i : i + n] == pattern for i in range(len(buf) - n + 1))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_suffix_trie_counts_every_substring(seed: int):
    rng = random.Random(seed)
    depth = 6
    docs = [[rng.randrange(3) for _ in range(rng.randrange(1, 40))] for _ in range(3)]
    live = SuffixTrie(depth)
    buf: list[int] = []
    for tok in docs[0]:
        buf.append(tok)
        live.append(buf)
        # pending = the suffixes that occurred earlier, longest first
        want = [
            k for k in range(min(len(buf), depth - 1), 0, -1) if _occurrences(buf, buf[-k:]) >= 2
        ]
        assert [n.depth for n in live.pending] == want
    corpus = SuffixTrie(depth)
    for d in docs:
        corpus.add(d)
    for trie, bufs in ((live, docs[:1]), (corpus, docs)):
        for length in range(1, depth + 1):
            for b in bufs:
                for i in range(len(b) - length + 1):
                    pat = b[i : i + length]
                    assert _count(trie, pat) == sum(_occurrences(x, pat) for x in bufs), pat
        assert _count(trie, [7]) == 0


def _dump(trie: SuffixTrie) -> dict[tuple[int, ...], int]:
    """Every string (<= depth) -> count, through materialized nodes and tails alike."""
    out: dict[tuple[int, ...], int] = {}
    stack = [((), (trie.root, 0))]
    while stack:
        path, pos = stack.pop()
        for tok, count, child in trie.next_tokens(pos):
            out[(*path, tok)] = count
            stack.append(((*path, tok), child))
    return out


def test_suffix_trie_remove_restores_the_trie_of_the_rest():
    rng = random.Random(3)
    docs = [[rng.randrange(4) for _ in range(50)] for _ in range(3)]
    docs.append(docs[1][10:30] * 2)
    trie = SuffixTrie(8)
    for d in docs:
        trie.add(d)
    trie.remove(docs[0])
    trie.remove(docs[2])
    ref = SuffixTrie(8)
    for d in (docs[1], docs[3]):
        ref.add(d)
    assert _dump(trie) == _dump(ref)


def test_suffix_proposes_continuation_from_the_sequence():
    toks = [1, 2, 3, 4, 5, 9, 1, 2, 3]
    d = SuffixDrafter()
    d.begin(toks)
    tree = propose(d, toks, CHAIN5)
    assert tree.tokens.tolist() == [4, 5, 9, 1, 2]
    assert tree.scores.tolist() == [0.0] * 5  # one occurrence: probability 1 each
    assert propose(d, [1, 2, 3, 6], CHAIN5).size == 0  # new history, nothing follows 6


def test_suffix_scores_are_frequencies():
    toks = [7, 9, 1, 7, 9, 2, 7, 8, 3, 7]  # 7 was followed by 9, 9, 8
    d = SuffixDrafter()
    d.begin(toks)
    tree = propose(d, toks, TreeSpec("dynamic", budget=4, topk=4, depth=2))
    assert tree.tokens.tolist()[:2] == [9, 8]
    lp = torch.tensor([2 / 3, 1 / 3, 1 / 3, 1 / 3]).log().tolist()
    assert tree.scores.tolist()[:2] == pytest.approx(lp[:2])
    # below 9 (p 2/3): 1 and 2, each 1/2
    assert sorted(tree.tokens.tolist()[2:]) == [1, 2]
    assert tree.parents.tolist()[2:] == [0, 0]
    assert tree.scores.tolist()[2:] == pytest.approx([lp[0] + torch.tensor(0.5).log().item()] * 2)
    assert propose(d, toks, CHAIN5).tokens.tolist()[:2] == [9, 1]  # most frequent, then 1 < 2
    for spec in SPECS:
        assert_valid(propose(d, toks, spec), spec)


def test_suffix_learns_from_finished_outputs_and_evicts_the_oldest():
    d = SuffixDrafter(max_corpus_tokens=12)
    p1 = [30, 31, 32, 33]
    d.begin(p1)
    d.finish([*p1, 20, 21, 22, 23, 24, 25])  # output 20..25; the prompt is not learned
    p2 = [40, 41, 20, 21]
    d.begin(p2)
    assert propose(d, p2, CHAIN5).tokens.tolist() == [22, 23, 24, 25]
    assert propose(d, [40, 30, 31], CHAIN5).size == 0
    # the longest matching suffix wins: (5, 20, 21) over (20, 21)
    d.finish([*p2, 5, 20, 21, 26, 27])
    d.begin([5, 20, 21])
    assert propose(d, [5, 20, 21], CHAIN5).tokens.tolist() == [26, 27]
    assert propose(d, [6, 20, 21], CHAIN5).tokens.tolist() == [22, 23, 24, 25]
    # a third output overflows 12 tokens: the first (20..25) is evicted
    d.begin(p2)
    d.finish([*p2, 50, 51, 52])
    assert propose(d, [6, 20, 21], CHAIN5).tokens.tolist() == [26, 27]
    assert propose(d, [6, 51], CHAIN5).tokens.tolist() == [52]


@pytest.mark.parametrize("where", ["sequence", "corpus"])
def test_suffix_max_pattern_caps_the_matched_suffix(where: str):
    text = [1, 2, 3, 9, 8, 2, 3, 7]  # (1, 2, 3) -> 9; (2, 3) -> 9 or 7
    for max_pattern, want in (
        (3, [9, 8, 2, 3, 7]),
        (2, [7] if where == "corpus" else [7, 5, 1, 2, 3]),
    ):
        d = SuffixDrafter(max_pattern=max_pattern)
        if where == "corpus":
            d.begin([])
            d.finish(text)
            head = [5]
        else:
            head = [*text, 5]
        d.begin(head)
        toks = head
        for tok in (1, 2, 3):  # committed one by one: the incremental path
            toks = [*toks, tok]
            propose(d, toks, CHAIN5, 1)
        assert propose(d, toks, CHAIN5, 1).tokens.tolist() == want


def test_suffix_prefers_the_sequence_on_a_tie():
    d = SuffixDrafter()
    d.begin([])
    d.finish([20, 21, 22, 23, 26, 27, 28])
    toks = [20, 21, 24, 25, 0, 20, 21]  # five tokens follow (20, 21) in both
    d.begin(toks)
    assert propose(d, toks, CHAIN5).tokens.tolist() == [24, 25, 0, 20, 21]
    toks = [20, 21, 24, 0, 20, 21]  # the corpus' continuation is longer: it wins
    d.begin(toks)
    assert propose(d, toks, CHAIN5).tokens.tolist() == [22, 23, 26, 27, 28]


def test_suffix_incremental_matches_a_fresh_drafter():
    rng = random.Random(5)
    corpus = [[rng.randrange(5) for _ in range(60)] for _ in range(2)]
    inc = SuffixDrafter(max_depth=6, max_pattern=8)
    for c in corpus:
        inc.begin([])
        inc.finish(c)
    toks = [rng.randrange(5) for _ in range(20)]
    inc.begin(toks)
    while len(toks) < 200:
        fresh = SuffixDrafter(max_depth=6, max_pattern=8)
        for c in corpus:
            fresh.begin([])
            fresh.finish(c)
        fresh.begin(toks)
        for spec in SPECS:
            got = propose(inc, toks, spec, 20)
            assert_valid(got, spec)
            want = propose(fresh, toks, spec, 20)
            assert got.tokens.tolist() == want.tokens.tolist()
            assert got.parents.tolist() == want.parents.tolist()
        toks += [rng.randrange(5) for _ in range(rng.randrange(1, 4))]


# -- draft model -----------------------------------------------------------------------------

CFG = ModelConfig(
    arch="llama", vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, intermediate_size=64
)


def tiny(std: float = 0.02) -> Transformer:
    """Seeded tiny model, batch-invariant on CPU (oneDNN linears, fp64 attention)."""
    m = Transformer(CFG)
    init_weights(m, seed=0, std=std)
    m.eval()
    m.prepack("onednn")
    m.setup_cache(8, attention="exact")
    return m


@torch.no_grad()
def ref_log_probs(m: Transformer, seq: list[int]) -> torch.Tensor:
    """Log-probs after ``seq`` from one full forward (no cache reuse)."""
    n = len(seq)
    m.setup_cache(n + 1)
    out = m(torch.tensor([seq]), torch.arange(n)[None], 0, n, causal_mask(0, n, n, m.device))
    return torch.log_softmax(out.logits[0, -1], -1)


@torch.no_grad()
def greedy_scored(m: Transformer, seq: list[int], k: int) -> tuple[list[int], list[float]]:
    """Plain AR loop (prefill, then one token per forward): tokens and cumulative log-probs."""
    n = len(seq)
    m.setup_cache(n + k + 1)
    out = m(torch.tensor([seq]), torch.arange(n)[None], 0, n, causal_mask(0, n, n, m.device))
    res: list[int] = []
    scores: list[float] = []
    for i in range(k):
        lp = torch.log_softmax(out.logits[0, -1], -1)
        res.append(int(lp.argmax()))
        scores.append((scores[-1] if scores else 0.0) + float(lp[res[-1]]))
        out = m(torch.tensor([[res[-1]]]), torch.tensor([[n + i]]), n + i, n + i + 1)
    return res, scores


def greedy(m: Transformer, seq: list[int], k: int) -> list[int]:
    return greedy_scored(m, seq, k)[0]


def assert_greedy(tree: DraftTree, ref: Transformer, seq: list[int]) -> list[int]:
    """The chain is the reference's greedy continuation, with its log-probs as scores."""
    want, scores = greedy_scored(ref, seq, tree.size)
    assert tree.tokens.tolist() == want
    assert tree.scores.tolist() == pytest.approx(scores, abs=1e-5)
    return want


def test_draft_model_chain_is_greedy_across_partial_acceptance():
    draft, ref = tiny(), tiny()
    rng = random.Random(1)
    toks = [rng.randrange(64) for _ in range(9)]
    d = DraftModelDrafter(draft, 256)
    d.begin(toks)
    for accepted in (2, 0, 5, 1, 3, 4, 0):
        tree = propose(d, toks, CHAIN5, 9)
        assert tree.size == 5
        want = assert_greedy(tree, ref, toks)
        assert_valid(tree, CHAIN5)
        # commit the accepted prefix, then a bonus token the drafter did not predict
        bonus = [(want[accepted] + 1) % 64] if accepted < 5 else [rng.randrange(64)]
        toks = toks + want[:accepted] + bonus
    # a cache reallocated behind the drafter's back is detected and refilled
    draft.setup_cache(1024)
    assert_greedy(propose(d, toks, CHAIN5, 9), ref, toks)
    # so is a history that does not extend the cached one
    other = [*toks[:12], 3, 4]
    assert_greedy(propose(d, other, CHAIN5, 9), ref, other)


def test_draft_model_dynamic_tree_scores_are_the_models_log_probs():
    draft, ref = tiny(std=1.0), tiny(std=1.0)  # std 1: peaked, far from ties
    rng = random.Random(2)
    toks = [rng.randrange(64) for _ in range(7)]
    d = DraftModelDrafter(draft, 256)
    d.begin(toks)
    toks = toks + greedy(ref, toks, 3)[:2] + [11]  # some committed output first
    propose(d, toks[:8], CHAIN5, 7)
    spec = TreeSpec("dynamic", budget=40, topk=3, depth=5)  # budget keeps every candidate
    tree = propose(d, toks, spec, 7)
    assert_valid(tree, spec)
    assert tree.size == 3 + 3 * 3 * 4
    assert best_path(tree) == greedy(ref, toks, 5)
    kids = tree.children()
    assert [int(tree.tokens[c]) for c in kids[0]] == ref_log_probs(ref, toks).topk(
        3
    ).indices.tolist()
    # EAGLE-2: the nodes expanded at each depth are the topk best-scored ones of that depth
    scores, depths = tree.scores.tolist(), tree.depths.tolist()
    for depth in range(1, spec.depth):
        level = [i for i in range(tree.size) if depths[i] == depth]
        expanded = {i for i in level if kids[i + 1]}
        assert len(expanded) == 3
        assert expanded == set(sorted(level, key=lambda i: -scores[i])[:3])
    toks_l, par = tree.tokens.tolist(), tree.parents.tolist()
    for i in range(tree.size):
        path, j = [], i
        while j >= 0:
            path.append(toks_l[j])
            j = par[j]
        path.reverse()
        lp = ref_log_probs(ref, toks + path[:-1])
        base = float(tree.scores[par[i]]) if par[i] >= 0 else 0.0
        assert float(tree.scores[i]) == pytest.approx(base + float(lp[path[-1]]), abs=1e-4)
    small = TreeSpec("dynamic", budget=6, topk=3, depth=5)
    assert_valid(propose(d, toks, small, 7), small)
    chain_like = TreeSpec("dynamic", budget=5, topk=1, depth=5)
    assert_greedy(propose(d, toks, chain_like, 7), ref, toks)


def test_draft_model_static_tree_follows_ranks():
    draft, ref = tiny(std=1.0), tiny(std=1.0)
    toks = [3, 14, 15, 9, 26, 5]
    d = DraftModelDrafter(draft, 256)
    d.begin(toks)
    tree = propose(d, toks, STATIC)
    assert_valid(tree, STATIC)
    assert tree.size == len(STATIC.paths)
    r0 = ref_log_probs(ref, toks).topk(2).indices.tolist()
    r00 = ref_log_probs(ref, [*toks, r0[0]]).topk(2).indices.tolist()
    r10 = ref_log_probs(ref, [*toks, r0[1]]).argmax().item()
    r000 = ref_log_probs(ref, [*toks, r0[0], r00[0]]).argmax().item()
    tok = {p: at_rank(tree, p) for p in STATIC.paths}
    assert [tok[(0,)], tok[(1,)]] == r0
    assert [tok[(0, 0)], tok[(0, 1)]] == r00
    assert tok[(1, 0)] == r10 and tok[(0, 0, 0)] == r000


def test_draft_model_errors():
    m = tiny()
    with pytest.raises(DrafterError):
        DraftModelDrafter(m, 1)
    with pytest.raises(DrafterError):
        DraftModelDrafter("not a model", 64)  # type: ignore[arg-type]
    d = DraftModelDrafter(m, 12)
    toks = list(range(10))
    d.begin(toks)
    assert propose(d, toks, TreeSpec("chain", k=3)).size == 3  # 10 + 2 scratch slots fit
    with pytest.raises(ContextLengthError):
        propose(d, toks, CHAIN5)  # 10 + 4 scratch slots do not
    limited = DraftModelDrafter(m, 64, vocab_size=8)
    limited.begin(toks)
    assert max(propose(limited, toks, DYNAMIC).tokens.tolist()) < 8


# -- factory ---------------------------------------------------------------------------------


def _tokenizer(words: list[str]) -> Tokenizer:
    vocab = {w: i for i, w in enumerate(words)}
    return Tokenizer(tokenizers.Tokenizer(WordLevel(vocab, unk_token=words[0])))


def test_factory_builds_each_drafter():
    assert set(DRAFTERS) == {"none", "lookup", "suffix", "model", "head", "head+suffix"}
    assert make_drafter("none") is None
    look = make_drafter("lookup", min_n=2, max_n=3)
    assert isinstance(look, PromptLookupDrafter) and (look.min_n, look.max_n) == (2, 3)
    assert isinstance(make_drafter("suffix", max_depth=4), SuffixDrafter)
    words = ["<unk>", "a", "b", "c"]
    target, draft = tiny(), tiny()
    d = make_drafter(
        "model", target=target, tokenizer=_tokenizer(words), draft=(draft, _tokenizer(words))
    )
    assert isinstance(d, DraftModelDrafter) and d.model is draft
    for x in (look, d):
        assert isinstance(x, Drafter)


def test_factory_rejects_bad_requests():
    with pytest.raises(DrafterError, match="unknown drafter"):
        make_drafter("medusa")
    with pytest.raises(DrafterError):
        make_drafter("lookup", min_n=0)
    with pytest.raises(DrafterError):
        make_drafter("lookup", min_n=3, max_n=2)
    with pytest.raises(DrafterError, match="bad option"):
        make_drafter("lookup", depth=3)
    with pytest.raises(DrafterError):
        make_drafter("suffix", max_depth=0)
    with pytest.raises(DrafterError, match="needs a draft model"):
        make_drafter("model")
    target, draft = tiny(), tiny()
    with pytest.raises(DrafterError, match="drafter tokenizer differs from the target's"):
        make_drafter(
            "model",
            target=target,
            tokenizer=_tokenizer(["<unk>", "a", "b"]),
            draft=(draft, _tokenizer(["<unk>", "b", "a"])),
        )
    with pytest.raises(DrafterError, match="target model itself"):
        make_drafter("model", target=target, draft=target)


def test_is_tiered_answers_like_isinstance_and_caches_per_class() -> None:
    from specpilot.drafters.base import _TIERED, Tiered, is_tiered
    from specpilot.drafters.suffix import SuffixDrafter

    class Cheap:
        def __init__(self) -> None:
            self.last_cheap = DraftTree.empty()

        def propose_cheap(self, ctx: DraftContext) -> DraftTree:
            return self.last_cheap

    for d in (Cheap(), SuffixDrafter()):
        assert is_tiered(d) == isinstance(d, Tiered)
        assert _TIERED[type(d)] == isinstance(d, Tiered)
    assert is_tiered(Cheap()) and not is_tiered(SuffixDrafter())


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_suffix_tree_of_a_chain_is_the_best_first_tree(seed: int):
    """suffix_tree builds a continuation that does not branch within the budget directly; it
    must be the general builder's tree, bit for bit, at every position (branching or not)."""
    from specpilot.drafters.suffix import suffix_tree, trie_children
    from specpilot.tree import build_tree, shape_tree

    rng = random.Random(seed)
    alphabet = 2 + seed  # few tokens: many branches; more: long single continuations
    base = [rng.randrange(alphabet) for _ in range(30)]
    buf = base + base[5:25] + [rng.randrange(alphabet) for _ in range(20)] + base[:15]
    trie = SuffixTrie(12)
    trie.add(buf)
    chains = 0
    for budget, depth in ((4, 3), (10, 8), (16, 12)):
        spec = TreeSpec(kind="dynamic", budget=budget, topk=3, depth=depth)
        for start in range(len(buf)):
            pos = (trie.root, 0)
            for tok in buf[start : start + 3]:
                nxt = trie.walk(pos, tok)
                if nxt is None:
                    break
                pos = nxt
            fast = suffix_tree(trie, pos, spec, 10)
            ref = shape_tree(
                build_tree(trie_children(trie, pos), spec, max_depth=10, width=budget), spec
            )
            for a, b in zip(
                (fast.tokens, fast.parents, fast.depths, fast.scores),
                (ref.tokens, ref.parents, ref.depths, ref.scores),
                strict=True,
            ):
                assert torch.equal(a, b)
            is_chain = (fast.parents == torch.arange(-1, fast.size - 1)).all()
            chains += fast.size > 0 and bool(is_chain)
    assert chains > 0 or alphabet == 2  # two tokens branch everywhere
