"""The prefix cache (orthon.engine.prefix_cache): the radix tree against a brute-force longest common
prefix, and the engine reusing what it ran: a multi-turn continuation and a GRPO group prefill only
what is new and decode as an engine without the cache does; entries never outlive their weights."""
import random

import pytest
import torch

from hf_reference import small_model
from orthon.engine.in_process import EngineConfig, InProcessEngine, _shared_prefixes
from orthon.engine.prefix_cache import PrefixCache
from orthon.engine.sampling import SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")


def _entries_of(seq):
    """Entries that depend on the whole prefix (as a token's KV does): each token's a running hash of
    the tokens up to it, and its position."""
    h, values = 0, []
    for t in seq:
        h = (h * 1_000_003 + t + 1) % 2_147_483_647
        values.append(h)
    values = torch.tensor(values, dtype=torch.float64)
    return values, torch.stack([values, torch.arange(len(seq), dtype=torch.float64)], dim=1)


def _insert(cache, seq):
    a, b = _entries_of(seq)
    return cache.insert(seq, lambda start, end: (a[start:end].clone(), b[start:end].clone()))


def _lcp(a, b):
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_the_tree_finds_the_longest_held_prefix_and_its_entries():
    rng = random.Random(0)
    cache, held = PrefixCache(10**6), []
    for _ in range(200):  # small alphabet, shared prefixes: many splits
        base = rng.choice(held) if held and rng.random() < 0.7 else []
        seq = base[: rng.randint(0, len(base))] + [rng.randint(0, 3) for _ in range(rng.randint(1, 12))]
        added = _insert(cache, seq)
        assert added == len(seq) - max([_lcp(seq, s) for s in held] + [0])
        held.append(seq)
    assert cache.tokens == len({tuple(s[:i]) for s in held for i in range(1, len(s) + 1)})
    for _ in range(300):
        query = [rng.randint(0, 3) for _ in range(rng.randint(1, 15))]
        limit = rng.randint(0, len(query))
        n, entries = cache.match(query, limit=limit)
        assert n == min(max(_lcp(query, s) for s in held), limit)
        if n:
            want = _entries_of(query[:n])
            assert torch.equal(entries[0], want[0]) and torch.equal(entries[1], want[1])
        else:
            assert entries is None


def test_the_tree_evicts_least_recently_used_leaves_to_its_budget():
    cache = PrefixCache(20)
    _insert(cache, [1, 2, 3, 4, 5, 6, 7, 8])
    _insert(cache, [1, 2, 3, 9, 9, 9, 9, 9])  # shares 3 tokens: 13 held
    cache.match([1, 2, 3, 4, 5])  # the first branch is now the more recently used
    _insert(cache, [7, 7, 7, 7, 7, 7, 7, 7, 7, 7])  # 23 > 20: the [9 ...] leaf goes
    assert cache.tokens == 18
    assert cache.match([1, 2, 3, 9, 9])[0] == 3 and cache.match([1, 2, 3, 4, 5, 6, 7, 8])[0] == 8
    assert cache.bytes == 18 * (8 + 16)
    asked = []
    long = list(range(100, 130))  # longer than the budget: its first 20 tokens are held, the rest never made
    cache.insert(long, lambda start, end: asked.append((start, end)) or tuple(p[start:end] for p in _entries_of(long)))
    assert asked == [(0, 20)] and cache.tokens == 20 and cache.match(long)[0] == 20
    assert torch.equal(cache.match(long)[1][0], _entries_of(long[:20])[0])
    with pytest.raises(ValueError, match="entries for"):
        cache.insert([5, 5, 5], lambda start, end: (torch.zeros(2),))
    assert PrefixCache(0).insert([1, 2], lambda start, end: (torch.zeros(2),)) == 0


def test_shared_prefixes_are_runs_of_sorted_prompts_with_a_long_common_start():
    a = [1] * 40
    prompts = [a + [2, 3], [7] * 50, a + [2, 4, 4], a[:35] + [9] * 10, [7] * 50 + [1], [8] * 31 + [1]]
    found = {tuple(m): len(p) for p, m in _shared_prefixes(prompts)}
    # 0, 2, 3 share 35 tokens; 1 and 4 share 50, but 1 must keep a token of its own: 49; 5 shares none.
    assert found == {(0, 2, 3): 35, (1, 4): 49}
    assert _shared_prefixes([a + [1], a + [1, 2]], min_len=41) == []


# ---------------------------------------------------------------- the engine
def _model(case="dsa", **overrides):
    torch.manual_seed(0)
    return small_model(case, **overrides).eval()


def _prompts(lengths, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, 257, (n,), generator=g).tolist() for n in lengths]


def _greedy(n):
    return SamplingParams(max_new_tokens=n, temperature=0.0, stop_token_ids=())


def _same(got, want):
    assert [r.tokens for r in got] == [r.tokens for r in want]
    for a, b in zip(got, want):
        torch.testing.assert_close(a.log_probs, b.log_probs, atol=2e-5, rtol=0)


def _prefill_rows(model):
    """The rows and tokens of each prefill forward (more than one token a row) the model runs."""
    seen, forward = [], model.hidden_states

    def counting(ids, *args, **kwargs):
        if ids.shape[1] > 1:
            seen.append(tuple(ids.shape))
        return forward(ids, *args, **kwargs)

    model.hidden_states = counting
    return seen


@pytest.mark.parametrize("case,overrides", [("dsa", dict(index_topk=8)), ("moe", dict(sparse_attention=False))])
def test_a_next_turn_prefills_only_its_new_tokens_and_decodes_as_without_the_cache(case, overrides):
    """Turn 2's prompts are turn 1's prompts, responses and a tool's answer of a few tokens (DSA with
    top-k 8: the selection spans cached and new keys). Each takes every token turn 1 ran from the cache,
    and the rows run only the longest new part; tokens and log-probs are those of an engine without it."""
    model = _model(case, **overrides)
    cached, plain = InProcessEngine(model), InProcessEngine(model, EngineConfig(prefix_cache_tokens=0))
    first = _prompts((9, 14, 5))
    turn1 = cached.generate(first, _greedy(10))
    _same(turn1, plain.generate(first, _greedy(10)))
    assert [r.cached_tokens for r in turn1] == [0, 0, 0]
    answers = _prompts((3, 6, 4), seed=2)
    second = [p + r.tokens + a for p, r, a in zip(first, turn1, answers)]
    rows = _prefill_rows(model)
    turn2 = cached.generate(second, _greedy(8))
    # Held: each prompt and its response but the last token (sampled, never run). The batch runs the
    # longest new part, 6 answer tokens and the last response token, on every row: the other rows run
    # a few held tokens again at no extra cost, and take the rest.
    assert rows == [(3, 7)]
    assert [r.cached_tokens for r in turn2] == [len(s) - 7 for s in second]
    _same(turn2, plain.generate(second, _greedy(8)))
    stats = cached.stats
    assert stats.cached_tokens == sum(len(s) - 7 for s in second)
    assert stats.prompt_tokens == sum(map(len, first)) + sum(map(len, second))
    assert cached.health()["prefix_cache"]["tokens"] > 0 and plain.health()["prefix_cache"]["tokens"] == 0


def test_a_groups_identical_prompts_are_prefilled_once_and_sample_as_without_the_cache():
    model = _model("dsa", index_topk=8)
    cached, plain = InProcessEngine(model), InProcessEngine(model, EngineConfig(prefix_cache_tokens=0))
    prompt, other = _prompts((12, 7))
    prompts = [prompt] * 4 + [other] * 2
    params = [SamplingParams(max_new_tokens=9, temperature=1.0, seed=100 + k, stop_token_ids=()) for k in range(6)]
    rows = _prefill_rows(model)
    got = cached.generate(prompts, params)
    assert rows == [(2, 12)]  # two distinct prompts, one forward
    assert [r.cached_tokens for r in got] == [0, 12, 12, 12, 0, 7]
    assert len({tuple(r.tokens) for r in got[:4]}) > 1  # the samples do differ
    _same(got, plain.generate(prompts, params))


def test_held_rows_beside_a_long_new_prompt_prefill_as_a_batch_of_their_own():
    """One batch runs every row's last T tokens: beside a new 120-token prompt, the continuations would
    run 120 tokens each, all but a few held. They run apart (two forwards, 120 + 3 x 5 tokens instead of
    4 x 120) and take nearly everything held; the tokens are those of an engine without the cache."""
    model = _model("dsa", index_topk=8)
    cached, plain = InProcessEngine(model), InProcessEngine(model, EngineConfig(prefix_cache_tokens=0))
    first = _prompts((40, 52, 47))
    turn1 = cached.generate(first, _greedy(6))
    new = _prompts((120,), seed=5)[0]
    second = [p + r.tokens + a for p, r, a in zip(first, turn1, _prompts((4, 2, 3), seed=6))] + [new]
    rows = _prefill_rows(model)
    got = cached.generate(second, _greedy(5))
    assert sorted(rows) == [(1, 120), (3, 5)]
    # Each continuation runs its batch's longest new part (an answer of 4 and the last response token).
    assert [r.cached_tokens for r in got] == [len(s) - 5 for s in second[:3]] + [0]
    _same(got, plain.generate(second, _greedy(5)))


def test_a_prefix_distinct_prompts_share_runs_once_even_on_an_empty_cache():
    """RL's prompts after a weight update (the cache empty): four tasks after one 40-token system prompt.
    The shared prefix runs once as a batch of its own, then each prompt runs only its task; the tokens
    are those of an engine without the cache, and the 40 tokens run once are counted once."""
    model = _model("dsa", index_topk=8)
    cached, plain = InProcessEngine(model), InProcessEngine(model, EngineConfig(prefix_cache_tokens=0))
    system = _prompts((40,), seed=7)[0]
    tails = [[first] + tail for first, tail in zip((3, 4, 5, 6), _prompts((9, 11, 7, 10), seed=8))]
    prompts = [system + t for t in tails]
    rows = _prefill_rows(model)
    got = cached.generate(prompts, _greedy(6))
    assert rows == [(1, 40), (4, 12)]
    _same(got, plain.generate(prompts, _greedy(6)))
    # Each row takes what its batch does not run (the longest task, 12 tokens, runs on every row), but
    # the first, for which the shared prefix ran here.
    assert [r.cached_tokens for r in got] == [0] + [len(p) - 12 for p in prompts[1:]]
    rows.clear()
    cached.generate([system + [9, 9, 9]], _greedy(2))  # held now: only the new tokens run
    assert rows == [(1, 3)]


def test_a_request_joining_a_running_batch_takes_what_a_finished_row_left():
    """Continuous batching: a row ends, and the request that takes its place continues that row's
    conversation; it prefills only its new tokens and decodes as without the cache."""
    from orthon.engine.control import RequestControl

    model = _model("dsa", index_topk=8)
    plain = InProcessEngine(model, EngineConfig(prefix_cache_tokens=0))
    first, long = _prompts((12, 9))
    reply = plain.generate([first], _greedy(3))[0].tokens
    follow = first + reply + [7, 8]
    answered = []

    def joins(room, fits):
        if answered or not fits(len(follow), 4):
            return []
        answered.append(None)
        return [(follow, _greedy(4), RequestControl(on_finish=lambda r: answered.__setitem__(0, r)))]

    engine = InProcessEngine(model, EngineConfig(max_batch_size=2, join_free_share=0))
    engine.generate([first, long], [_greedy(3), _greedy(20)], controls=[RequestControl(), RequestControl()], joins=joins)
    joined = answered[0]
    assert joined.cached_tokens == len(first) + 2  # the finished row's prompt and all but its last token
    _same([joined], plain.generate([follow], _greedy(4)))


def test_entries_are_dropped_when_the_weights_or_the_attention_mode_change():
    model = _model("dsa", index_topk=8)
    engine = InProcessEngine(model)
    prompt = _prompts((10,))[0]
    first = engine.generate([prompt], _greedy(4))[0]
    again = prompt + first.tokens

    def cached():
        return engine.generate([again], _greedy(2))[0].cached_tokens

    assert cached() == 13
    engine.update_weights({"lm_head.weight": model.lm_head.weight.detach() * 1.5})  # a weight update
    assert cached() == 0 and cached() == 13
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(1.01)  # a colocated trainer's step: in place, no update call
    assert cached() == 0 and cached() == 13
    model.runtime.sparse_attention = False  # mid-training's phase switch: other keys, other entries
    assert cached() == 0
    engine.flush()
    assert engine.health()["prefix_cache"]["tokens"] == 0
