"""The in-process engine: fp32 log-probs that the trainer's recompute reproduces, batched decoding
equal to one prompt at a time, sampling controls, weight updates in place, bad input, and RL's mapping
of its results onto Samples (orthon.rl.sample.to_sample)."""
import math

import pytest
import torch

from hf_reference import small_model
from orthon.core.errors import ConfigError
from orthon.pretrain import GLMForCausalLM
from orthon.engine.in_process import EngineConfig, InProcessEngine
from orthon.engine.sampling import SamplingParams, filter_logits, inverse_cdf_sample, sample_step
from orthon.pretrain.logprobs import gather_log_probs, sequence_log_probs
from orthon.rl.logprobs import sample_log_probs
from orthon.rl.sample import Sample, SampleStatus, to_sample

LENGTHS = (3, 9, 14, 6)


pytestmark = pytest.mark.usefixtures("one_thread")


def _model(case="moe", **overrides):
    torch.manual_seed(0)
    return small_model(case, **overrides).eval()


def _prompts(lengths=LENGTHS, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, 257, (n,), generator=g).tolist() for n in lengths]


def _greedy(n, **kw):
    return SamplingParams(max_new_tokens=n, temperature=0.0, stop_token_ids=(), **kw)


# ---------------------------------------------------------------- engine vs trainer log-probs
@pytest.mark.parametrize("case,overrides", [
    ("moe", dict(sparse_attention=False)),
    ("dsa", dict(index_topk=8)),  # 24 new tokens after prompts of 3..14: decoding runs past index_topk
    ("indexshare", dict()),
])
def test_engine_log_probs_equal_trainer_recompute(case, overrides):
    model = _model(case, **overrides)
    engine = InProcessEngine(model)
    prompts = _prompts()
    results = engine.generate(prompts, SamplingParams(max_new_tokens=24, temperature=0.8, top_p=0.95, seed=7, stop_token_ids=()))
    assert all(len(r.tokens) == 24 and r.log_probs.dtype == torch.float32 for r in results)
    samples = [to_sample(r, Sample(f"p{i}", p)) for i, (r, p) in enumerate(zip(results, prompts))]
    with torch.no_grad():
        again = sample_log_probs(model, samples)
    for row, sample in enumerate(samples):
        diff = (again.log_probs[row, : sample.response_length] - sample.rollout_log_probs).abs().max()
        assert diff < 1e-5, (row, float(diff))
    assert again.mask.sum() == sum(s.response_length for s in samples)
    assert (again.log_probs[~again.mask] == 0).all()
    # The mismatch the loss logs each step: zero by construction.
    rho = (again.log_probs - torch.nn.utils.rnn.pad_sequence([s.rollout_log_probs for s in samples], batch_first=True)).exp()
    assert torch.allclose(rho[again.mask], torch.ones(()), atol=2e-5)


@pytest.mark.parametrize("case,overrides", [("moe", dict(sparse_attention=False)), ("dsa", dict(index_topk=8))])
def test_rescored_log_probs_equal_the_trainer_recompute_exactly(case, overrides):
    model = _model(case, **overrides)
    engine = InProcessEngine(model, EngineConfig(logprobs="rescore", max_batch_size=4))
    prompts = _prompts()
    results = engine.generate(prompts, SamplingParams(max_new_tokens=24, temperature=0.8, seed=7, stop_token_ids=()))
    decoded = InProcessEngine(model).generate(prompts, SamplingParams(max_new_tokens=24, temperature=0.8, seed=7,
                                                                      stop_token_ids=()))
    samples = [to_sample(r, Sample(f"p{i}", p)) for i, (r, p) in enumerate(zip(results, prompts))]
    # The trainer scores in another order and batch (reversed, all at once; the engine ran waves of 4),
    # with gradients on.
    again = sample_log_probs(model, samples[::-1])
    for row, sample in enumerate(samples[::-1]):
        assert torch.equal(again.log_probs[row, : sample.response_length].detach(), sample.rollout_log_probs)
    for a, b in zip(results, decoded):
        assert a.tokens == b.tokens  # rescoring changes the recorded log-probs only
        assert (a.log_probs - b.log_probs).abs().max() < 1e-5


def test_requests_that_read_no_log_probs_are_not_rescored(monkeypatch):
    """logprob_mode "none" (evaluation, an HTTP request without return_logprob): the same tokens, the
    decode's log-probs, and no rescoring forward for those rows."""
    import orthon.engine.in_process as in_process

    model = _model()
    prompts = _prompts()
    scored_rows = []
    real = in_process.sequence_log_probs
    monkeypatch.setattr(in_process, "sequence_log_probs",
                        lambda m, seqs, counts, **kw: scored_rows.append(len(seqs)) or real(m, seqs, counts, **kw))

    def run(mode, logprobs):
        engine = InProcessEngine(model, EngineConfig(logprobs=logprobs, max_batch_size=8))
        return engine.generate(prompts, SamplingParams(max_new_tokens=12, temperature=0.8, seed=3, stop_token_ids=(),
                                                       logprob_mode=mode))

    decoded = run("policy", "decode")
    assert scored_rows == []
    rescored = run("policy", "rescore")
    assert scored_rows == [len(prompts)]
    unread = run("none", "rescore")
    assert scored_rows == [len(prompts)]  # no second rescore
    for a, b, c in zip(decoded, rescored, unread):
        assert a.tokens == b.tokens == c.tokens
        assert torch.equal(c.log_probs, a.log_probs)


def test_recompute_has_gradients_and_entropy():
    model = _model()
    seqs = [[5, 6, 7, 8, 9], [10, 11, 12]]
    out = sequence_log_probs(model, seqs, [2, 1], with_entropy=True)
    assert out.log_probs.shape == (2, 2) and out.mask.tolist() == [[True, True], [True, False]]
    logits = model(torch.tensor([seqs[0]])).logits[0]
    expected = torch.log_softmax(logits.float(), -1)[[2, 3], [8, 9]]
    torch.testing.assert_close(out.log_probs[0], expected, atol=1e-6, rtol=0)
    p = torch.softmax(logits[2].float(), -1)
    torch.testing.assert_close(out.entropy[0, 0], -(p * p.log()).sum(), atol=1e-5, rtol=0)
    assert out.entropy[1, 1] == 0
    out.log_probs[out.mask].sum().backward()
    # The gradient is that of the same three log-probs computed one sequence at a time, by hand.
    second = torch.log_softmax(model(torch.tensor([seqs[1]])).logits[0].float(), -1)[1, 12]
    (direct,) = torch.autograd.grad(expected.sum() + second, model.lm_head.weight)
    assert direct.abs().max() > 0
    torch.testing.assert_close(model.lm_head.weight.grad, direct, atol=1e-5, rtol=1e-4)
    with pytest.raises(ValueError, match="non-empty prompt"):
        sequence_log_probs(model, [[1, 2]], [2])


# ---------------------------------------------------------------- batched decoding
@pytest.mark.parametrize("case,overrides", [("moe", dict()), ("dsa", dict(index_topk=8))])
def test_greedy_batch_equals_each_prompt_alone(case, overrides):
    engine = InProcessEngine(_model(case, **overrides))
    prompts = _prompts()
    batched = engine.generate(prompts, _greedy(20))
    for prompt, result in zip(prompts, batched):
        alone = engine.generate([prompt], _greedy(20))[0]
        assert alone.tokens == result.tokens
        torch.testing.assert_close(alone.log_probs, result.log_probs, atol=1e-5, rtol=0)
    assert len({tuple(r.tokens) for r in batched}) == len(prompts)


def test_waves_keep_request_order():
    model = _model()
    prompts = _prompts((4, 11, 2, 7, 9))
    one_wave = InProcessEngine(model).generate(prompts, _greedy(6))
    waves = InProcessEngine(model, EngineConfig(max_batch_size=2)).generate(prompts, _greedy(6))
    assert [r.tokens for r in waves] == [r.tokens for r in one_wave]
    assert [r.prompt for r in waves] == prompts


def test_stop_token_ends_its_row_and_is_kept_with_its_log_prob():
    model = _model()
    engine = InProcessEngine(model)
    prompts = _prompts()
    free = engine.generate(prompts, _greedy(16))
    stop = free[1].tokens[4]  # row 1 must stop at its 5th token (or earlier if it appears before)
    first = free[1].tokens.index(stop)
    stopped = engine.generate(prompts, SamplingParams(max_new_tokens=16, temperature=0.0, stop_token_ids=(stop,)))
    for row, (a, b) in enumerate(zip(free, stopped)):
        if stop in a.tokens:
            end = a.tokens.index(stop) + 1
            assert b.tokens == a.tokens[:end] and b.finish_reason == "stop"
        else:
            end = 16
            assert b.tokens == a.tokens and b.finish_reason == "length"
        # Rows that left the batch early do not disturb the rest (KVCache.select).
        torch.testing.assert_close(b.log_probs, a.log_probs[:end], atol=1e-5, rtol=0)
    assert len(stopped[1].tokens) == first + 1 and stopped[1].tokens[-1] == stop
    # The stop token's recorded log-prob is the model's own for that token after the row's prefix.
    with torch.no_grad():
        rescored = sequence_log_probs(model, [prompts[1] + stopped[1].tokens], [first + 1]).log_probs[0]
    assert float(stopped[1].log_probs[-1]) == pytest.approx(float(rescored[-1]), abs=1e-5)
    assert -math.log(model.config.vocab_size) <= float(rescored[-1]) < 0  # a greedy pick: at least 1 / V


class HexTokenizer:
    """A byte-level tokenizer's decode with two characters a token (id 10 -> "0a"): stop strings can
    then begin inside one token and end inside a later one."""

    @staticmethod
    def decode(ids):
        return "".join(f"{i % 256:02x}" for i in ids)


def _first_stop_end(tokens, stop):
    """How many tokens of ``tokens`` a response keeps that ends once its text contains ``stop``."""
    return next((n for n in range(1, len(tokens) + 1) if stop in HexTokenizer.decode(tokens[:n])), len(tokens))


def test_stop_strings_end_rows_at_the_token_completing_them():
    model = _model()
    engine = InProcessEngine(model, tokenizer=HexTokenizer())
    prompts = _prompts()
    free = engine.generate(prompts, _greedy(24))
    spanning = HexTokenizer.decode(free[1].tokens)[7:10]  # token 3's 2nd character on (or earlier)
    long = HexTokenizer.decode(free[3].tokens)[20:47]  # 27 characters over 14 tokens, the last one half
    stopped = engine.generate(prompts, [_greedy(24), _greedy(24, stop=("zz", spanning)), _greedy(24),
                                        _greedy(24, stop=(long,))])
    for row, (a, b) in enumerate(zip(free, stopped)):
        stop = {1: spanning, 3: long}.get(row)
        end = _first_stop_end(a.tokens, stop) if stop else 24
        assert b.tokens == a.tokens[:end]
        # Rows that left the batch early do not disturb the rest, nor their own log-probs.
        torch.testing.assert_close(b.log_probs, a.log_probs[:end], atol=1e-5, rtol=0)
        hit = stop is not None and stop in HexTokenizer.decode(b.tokens)
        assert (b.finish_reason, b.matched_stop) == (("stop", stop) if hit else ("length", None))
    assert len(stopped[1].tokens) <= 5 and stopped[1].matched_stop == spanning
    assert len(stopped[3].tokens) <= 24 and stopped[3].matched_stop == long
    # A stop token ends a row first: the token completing the string, made a stop token, names no string.
    last = free[1].tokens[_first_stop_end(free[1].tokens, spanning) - 1]
    token = engine.generate(prompts[1:2], SamplingParams(max_new_tokens=24, temperature=0.0, stop=(spanning,),
                                                        stop_token_ids=(last,)))[0]
    end = free[1].tokens.index(last) + 1
    assert (token.tokens, token.finish_reason, token.matched_stop) == (free[1].tokens[:end], "stop", None)
    # Without a tokenizer an engine cannot read text: such a request is rejected, the others run.
    bare = InProcessEngine(model).generate(prompts[:2], [_greedy(4, stop=("ab",)), _greedy(4)])
    assert bare[0].finish_reason == "rejected" and "tokenizer" in bare[0].error and bare[1].tokens == free[1].tokens[:4]


def test_a_cancelled_request_ends_aborted_with_its_tokens_so_far_and_listeners_see_each_prefix():
    from orthon.engine.control import RequestControl

    engine = InProcessEngine(_model())
    prompts = _prompts()
    free = engine.generate(prompts, _greedy(12))
    seen = {1: [], 2: []}

    def cancel_after_five(tokens):
        seen[2].append(tokens)
        if len(tokens) == 5:
            controls[2].cancel("enough")

    controls = [None, RequestControl(on_tokens=seen[1].append), RequestControl(on_tokens=cancel_after_five),
                RequestControl()]
    controls[3].cancel()  # before its wave: nothing runs
    got = engine.generate(prompts, _greedy(12), controls=controls)
    assert [r.finish_reason for r in got] == ["length", "length", "abort", "abort"]
    assert (got[2].tokens, got[2].error) == (free[2].tokens[:5], "enough")
    assert (got[3].tokens, got[3].error) == ([], "aborted by request")
    for a, b in zip(free[:3], got[:3]):  # the others run on, as without controls
        assert b.tokens == a.tokens[:len(b.tokens)]
        torch.testing.assert_close(b.log_probs, a.log_probs[:len(b.tokens)], atol=1e-5, rtol=0)
    # Each listener saw its response grow a token a step while it ran: row 1 to the step before its last
    # (the step that ends a request gives its result), row 2 to the cancel.
    assert seen[1] == [free[1].tokens[:n] for n in range(1, 12)]
    assert seen[2] == [free[2].tokens[:n] for n in range(1, 6)]
    with pytest.raises(ValueError, match="2 controls for 4 prompts"):
        engine.generate(prompts, _greedy(2), controls=[None, None])


def test_a_finished_request_is_handed_over_the_step_it_ends():
    """on_finish gets a short request's result while the long one beside it still decodes (what lets a
    server answer it at once); the result is the one generate returns. Under rescoring it waits."""
    from orthon.engine.control import RequestControl

    model = _model()
    prompts = _prompts()[:2]
    long_seen, handed = [], []
    controls = [RequestControl(on_finish=lambda r: handed.append((r, len(long_seen)))),
                RequestControl(on_tokens=long_seen.append)]
    got = InProcessEngine(model).generate(prompts, [_greedy(3), _greedy(12)], controls=controls)
    assert len(handed) == 1 and handed[0][0] is got[0] and len(got[0].tokens) == 3
    assert handed[0][1] == 3 and len(long_seen) == 11  # the long row had made 3 of its 12 tokens
    assert got[0].tokens == InProcessEngine(model).generate(prompts[:1], _greedy(3))[0].tokens
    handed.clear()
    InProcessEngine(model, EngineConfig(logprobs="rescore")).generate(prompts, [_greedy(3), _greedy(12)], controls=controls)
    assert handed == []


@pytest.mark.parametrize("case,overrides,fused", [("moe", dict(sparse_attention=False), True),
                                                 ("dsa", dict(index_topk=8), True), ("dsa", dict(index_topk=8), False)])
def test_requests_joining_a_running_wave_decode_as_they_would_alone(case, overrides, fused):
    """Continuous batching: as rows finish, waiting requests join the wave (prefilled on their own, their
    cache entries placed to end where the wave's do) and decode as they would alone: the same greedy and
    seeded tokens, log-probs to float round-off; a request that does not fit yet (a prompt longer than
    what is cached) stays waiting; each joined one is answered through on_finish."""
    from orthon.engine.control import RequestControl

    model = _model(case, **overrides)
    first = _prompts((9, 6))
    waiting = [(_prompts((5,), seed=3)[0], _greedy(7)),
               (_prompts((30,), seed=4)[0], _greedy(3)),  # longer than the tokens cached when rows free up
               (_prompts((3,), seed=5)[0], SamplingParams(max_new_tokens=8, temperature=0.9, seed=11, stop_token_ids=()))]
    answered, calls = {}, []

    def joins(room, fits):
        calls.append(room)
        taken = [i for i, (prompt, params) in enumerate(waiting) if i not in answered and fits(len(prompt), params.max_new_tokens)]
        taken = taken[:room]
        for i in taken:
            answered[i] = None
        return [(waiting[i][0], waiting[i][1], RequestControl(on_finish=lambda r, i=i: answered.__setitem__(i, r)))
                for i in taken]

    engine = InProcessEngine(model, EngineConfig(max_batch_size=2, fused_decode=fused))
    got = engine.generate(first, [_greedy(14), _greedy(3)], controls=[RequestControl(), RequestControl()], joins=joins)
    alone = InProcessEngine(model)
    for result, prompt, n in zip(got, first, (14, 3)):
        assert result.tokens == alone.generate([prompt], _greedy(n))[0].tokens
    # A row had to free up first (step 3: the 5-token prompt, 7 tokens); the 3-token one joined when that
    # finished (step 10: its 8 tokens outlast the wave's 14 steps, so the cache grew); the 30-token prompt
    # never fit (no more than 26 tokens were ever cached).
    assert set(answered) == {0, 2} and calls[0] == 1
    for i in (0, 2):
        ref = alone.generate([waiting[i][0]], waiting[i][1])[0]
        assert answered[i].tokens == ref.tokens and answered[i].finish_reason == ref.finish_reason
        torch.testing.assert_close(answered[i].log_probs, ref.log_probs, atol=2e-5, rtol=0)
    assert engine.stats.requests == 4 and engine.stats.finished["length"] == 4


@pytest.mark.parametrize("share,first_join", [(0.0, (3, 1)), (0.5, (4, 2)), (1.0, None)])
def test_waiting_requests_join_once_the_share_of_free_rows_is_reached(share, first_join):
    """A full batch of 4 whose rows make 3, 4, 5 and 6 tokens: with join_free_share 0 waiting requests
    join once the first row has ended (the longest row has made 3 tokens; one row free), with 0.5 once
    two have (4 tokens; two free), with 1 never while a row decodes."""
    from orthon.engine.control import RequestControl

    model = _model("moe", sparse_attention=False)
    engine = InProcessEngine(model, EngineConfig(max_batch_size=4, join_free_share=share))
    made, asked = [0], []  # the longest row's tokens so far; when joins was asked, and with what room
    waiting = _prompts((3, 3, 3, 3), seed=4)

    def joins(room, fits):
        asked.append((made[0], room))
        take = [waiting.pop() for _ in range(min(room, len(waiting)))]
        return [(prompt, _greedy(2), RequestControl(on_finish=lambda r: None)) for prompt in take]

    controls = [None, None, None, RequestControl(on_tokens=lambda tokens: made.__setitem__(0, len(tokens)))]
    engine.generate(_prompts((5, 6, 7, 8)), [_greedy(n) for n in (3, 4, 5, 6)], controls=controls, joins=joins)
    assert (asked[0] if asked else None) == first_join  # (tokens the longest row had made, free rows)
    assert all(room >= max(1, share * 4) for _, room in asked)


def test_a_long_lived_wave_drops_the_slots_no_row_uses_and_decodes_on_unchanged():
    """Requests keep joining after the wave's first rows end: the slots before every live row's context
    are dropped from the cache (KVCache.drop_front), and each joined request still decodes as alone."""
    from orthon.engine.control import RequestControl
    from orthon.pretrain.cache import KVCache

    model = _model("dsa", index_topk=8)
    waiting = [(p, _greedy(40)) for p in _prompts((5, 7, 4, 6, 5, 3), seed=9)]
    answered, dropped = {}, []
    real_drop = KVCache.drop_front

    def joins(room, fits):
        taken = [i for i, (prompt, params) in enumerate(waiting) if i not in answered][:room]
        for i in taken:
            answered[i] = None
        return [(waiting[i][0], waiting[i][1], RequestControl(on_finish=lambda r, i=i: answered.__setitem__(i, r)))
                for i in taken]

    def drop_front(cache, slots):
        dropped.append(slots)
        real_drop(cache, slots)

    KVCache.drop_front = drop_front
    try:
        engine = InProcessEngine(model, EngineConfig(max_batch_size=2))
        engine.generate(_prompts((9, 6)), [_greedy(100), _greedy(2)], controls=[RequestControl(), RequestControl()],
                        joins=joins)
    finally:
        KVCache.drop_front = real_drop
    assert dropped and all(slots >= 64 for slots in dropped) and set(answered) == set(range(6))
    alone = InProcessEngine(model)
    for i, (prompt, params) in enumerate(waiting):
        ref = alone.generate([prompt], params)[0]
        assert answered[i].tokens == ref.tokens
        torch.testing.assert_close(answered[i].log_probs, ref.log_probs, atol=2e-5, rtol=0)


def test_default_stop_is_eos_and_immediate_stop_gives_one_token():
    model = _model()
    engine = InProcessEngine(model)
    prompt = _prompts((5,))[0]
    first = engine.generate([prompt], _greedy(1))[0].tokens[0]
    model.config.eos_token_id = first
    result = engine.generate([prompt], SamplingParams(max_new_tokens=10, temperature=0.0))[0]
    assert result.tokens == [first] and result.finish_reason == "stop" and result.log_probs.shape == (1,)
    sample = to_sample(result, Sample("a", prompt))
    assert sample.response_length == 1 and sample.status is SampleStatus.COMPLETED


def test_max_new_tokens_and_context_limit():
    engine = InProcessEngine(_model(), EngineConfig(max_length=20))
    prompts = _prompts((4, 15))
    results = engine.generate(prompts, _greedy(8))
    assert len(results[0].tokens) == 8 and results[0].finish_reason == "length"
    assert len(results[1].tokens) == 5 and results[1].finish_reason == "context"
    assert all(to_sample(r, Sample("s", p)).status is SampleStatus.TRUNCATED for r, p in zip(results, prompts))
    empty = engine.generate(prompts[:1], _greedy(0))[0]
    assert empty.tokens == [] and empty.log_probs.numel() == 0 and empty.finish_reason == "length"
    sample = to_sample(empty, Sample("e", prompts[0]))
    assert sample.response_length == 0 and sample.rollout_log_probs.numel() == 0
    assert sample.status is SampleStatus.TRUNCATED


# ---------------------------------------------------------------- sampling
def test_top_k_one_equals_greedy_and_its_sampling_log_prob_is_zero():
    engine = InProcessEngine(_model("dsa", index_topk=8))
    prompts = _prompts()
    greedy = engine.generate(prompts, _greedy(12))
    top1 = engine.generate(prompts, SamplingParams(max_new_tokens=12, temperature=1.3, top_k=1, seed=3, stop_token_ids=()))
    assert [r.tokens for r in top1] == [r.tokens for r in greedy]
    torch.testing.assert_close(torch.cat([r.log_probs for r in top1]), torch.cat([r.log_probs for r in greedy]))
    mode = SamplingParams(max_new_tokens=12, temperature=1.3, top_k=1, seed=3, stop_token_ids=(), logprob_mode="sampling")
    assert all((r.log_probs == 0).all() for r in engine.generate(prompts, mode))


def test_sampling_log_prob_mode_at_temperature_one_equals_policy():
    engine = InProcessEngine(_model())
    prompts = _prompts()
    policy = engine.generate(prompts, SamplingParams(max_new_tokens=10, seed=5, stop_token_ids=()))
    sampled = engine.generate(prompts, SamplingParams(max_new_tokens=10, seed=5, stop_token_ids=(), logprob_mode="sampling"))
    assert [r.tokens for r in policy] == [r.tokens for r in sampled]
    torch.testing.assert_close(torch.cat([r.log_probs for r in policy]), torch.cat([r.log_probs for r in sampled]),
                               atol=1e-6, rtol=0)


def test_seeds_reproduce_regardless_of_batch():
    engine = InProcessEngine(_model())
    prompts = _prompts()
    params = [SamplingParams(max_new_tokens=15, temperature=1.0, top_p=0.9, seed=100 + i, stop_token_ids=())
              for i in range(len(prompts))]
    a = engine.generate(prompts, params)
    b = engine.generate(prompts, params)
    assert [r.tokens for r in a] == [r.tokens for r in b]
    alone = engine.generate([prompts[2]], [params[2]])[0]
    mixed = engine.generate([prompts[0], prompts[2]] + _prompts((20,), seed=9), [params[0], params[2], params[1]])[1]
    assert alone.tokens == a[2].tokens == mixed.tokens
    other_seed = engine.generate([prompts[2]], [SamplingParams(max_new_tokens=15, seed=1, stop_token_ids=())])[0]
    assert other_seed.tokens != alone.tokens
    # A shared SamplingParams with a seed gives request i the seed s + i.
    shared = engine.generate(prompts, SamplingParams(max_new_tokens=15, top_p=0.9, seed=100, stop_token_ids=()))
    assert [r.tokens for r in shared] == [r.tokens for r in a] and [r.seed for r in shared] == [100, 101, 102, 103]


def test_top_p_and_top_k_filter_by_hand():
    logits = torch.tensor([[0.125, 0.5, 0.125, 0.25]]).log()  # token 1 (0.5), 3 (0.25), then 0 and 2 tie
    kept = lambda **kw: torch.isfinite(filter_logits(logits, **kw))[0].nonzero().squeeze(-1).tolist()
    assert kept(top_p=0.5) == [1]
    assert kept(top_p=0.51) == [1, 3]
    assert kept(top_p=0.7) == [1, 3]
    assert kept(top_p=0.8) == [0, 1, 2, 3]  # the prefix ends on a 0.125: its tie comes along
    assert kept(top_p=1.0) == [0, 1, 2, 3]
    assert kept(top_k=1) == [1]
    assert kept(top_k=2) == [1, 3]
    assert kept(top_k=3) == [0, 1, 2, 3]  # ties at the k-th value are kept, as transformers' top-k
    assert kept(top_k=3, top_p=0.7) == [1, 3]
    # top-p after top-k renormalises over what top-k kept: {1: 2/3, 3: 1/3}.
    assert kept(top_k=2, top_p=0.6) == [1]
    assert kept(top_k=2, top_p=0.7) == [1, 3]
    # Surviving logits are unchanged; per-row settings.
    torch.testing.assert_close(filter_logits(logits, top_k=2)[0, [1, 3]], logits[0, [1, 3]])
    rows = filter_logits(logits.expand(3, 4), top_k=torch.tensor([1, 0, 2]), top_p=torch.tensor([1.0, 0.51, 1.0]))
    assert torch.isfinite(rows).tolist() == [[False, True, False, False], [False, True, False, True],
                                             [False, True, False, True]]


def test_top_p_nucleus_wider_than_the_first_look():
    # 300 equal tokens and a tail: the nucleus of p = 0.9 is wider than the first 64 looked at.
    logits = torch.cat([torch.zeros(300), torch.full((700,), -20.0)])[None]
    kept = torch.isfinite(filter_logits(logits, top_p=0.9))
    assert kept[0, :300].all() and not kept[0, 300:].any()
    order = torch.randperm(1000)
    assert torch.equal(torch.isfinite(filter_logits(logits[:, order], top_p=0.9)), kept[:, order])


def test_inverse_cdf_sampling_by_hand():
    logits = torch.tensor([0.5, 0.25, 0.125, 0.125]).log().expand(6, 4)
    u = torch.tensor([0.0, 0.49, 0.51, 0.74, 0.8, 0.99])
    assert inverse_cdf_sample(logits, u).tolist() == [0, 0, 1, 1, 2, 3]
    # Probability-0 entries are never drawn, even at a boundary.
    blocked = torch.tensor([[0.0, float("-inf"), 0.0]]).expand(3, 3)
    assert inverse_cdf_sample(blocked, torch.tensor([0.0, 0.5, 0.999])).tolist() == [0, 2, 2]
    # A uniform grid of draws reproduces the probabilities exactly.
    n = 1000
    grid = (torch.arange(n) + 0.5) / n
    draws = inverse_cdf_sample(torch.tensor([[0.1, 0.2, 0.3, 0.4]]).log().expand(n, 4), grid)
    assert torch.bincount(draws, minlength=4).tolist() == [100, 200, 300, 400]


def test_sample_step_rows_keep_their_own_settings():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0]]).expand(3, 4)
    tokens, lp = sample_step(logits, temperature=torch.tensor([0.0, 1.0, 1.0]), top_k=torch.tensor([0, 1, 0]),
                             top_p=torch.tensor([1.0, 1.0, 1.0], dtype=torch.float64),
                             uniforms=torch.tensor([0.99, 0.99, 0.99], dtype=torch.float64), want_sampling_log_probs=True)
    assert tokens.tolist() == [1, 1, 3]  # greedy; top-1; u = 0.99 lands in the last token's share
    torch.testing.assert_close(lp, torch.stack([torch.tensor(0.0), torch.tensor(0.0), gather_log_probs(logits[2], tokens[2])]))


def test_sampling_params_are_checked():
    for bad in (dict(temperature=-1.0), dict(top_p=0.0), dict(top_p=1.5), dict(top_k=-1), dict(max_new_tokens=-2),
                dict(stop_token_ids=(-3,)), dict(logprob_mode="nope"), dict(seed=1.5)):
        with pytest.raises(ConfigError, match=next(iter(bad))):
            SamplingParams(**bad)


# ---------------------------------------------------------------- weights
def test_update_weights_in_place_changes_outputs_and_bumps_version():
    model = _model()
    engine = InProcessEngine(model)
    prompts = _prompts()
    before = engine.generate(prompts, _greedy(10))
    ptrs = {name: p.data_ptr() for name, p in model.named_parameters()}
    other = GLMForCausalLM(model.config)
    other.reset_parameters(seed=123)
    version = engine.update_weights(other.state_dict())
    assert version == 1 == engine.weight_version
    assert {name: p.data_ptr() for name, p in model.named_parameters()} == ptrs
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), other.parameters()))
    after = engine.generate(prompts, _greedy(10))
    assert [r.tokens for r in after] != [r.tokens for r in before]
    assert all(r.weight_version == 1 for r in after)
    assert all(to_sample(r, Sample("s", p)).policy_version == 1 for r, p in zip(after, prompts))
    # The new weights are the whole story: a fresh engine on `other` agrees.
    assert [r.tokens for r in InProcessEngine(other.eval()).generate(prompts, _greedy(10))] == [r.tokens for r in after]
    # Partial updates (buckets) as (name, tensor) pairs, explicit version.
    assert engine.update_weights([("lm_head.weight", other.lm_head.weight * 2)], version=5) == 5


def test_weights_named_as_the_hf_layout_land_in_the_expert_stacks():
    """Routed experts one tensor each (what the streamed sync sends, and SGLang takes) write the rows of
    the model's stacks in place; a strict update counts a stack given when all its experts are."""
    from orthon.pretrain.hf_io import experts_to_hf

    model = _model()
    engine = InProcessEngine(model)
    other = GLMForCausalLM(model.config)
    other.reset_parameters(seed=123)
    hf = experts_to_hf(other.state_dict())
    stack = "model.layers.1.mlp.experts.gate_up_proj"
    assert "model.layers.1.mlp.experts.0.up_proj.weight" in hf and stack not in hf
    ptr, before = model.get_parameter(stack).data_ptr(), model.get_parameter(stack).detach().clone()
    up = hf["model.layers.1.mlp.experts.2.up_proj.weight"]
    assert engine.update_weights({"model.layers.1.mlp.experts.2.up_proj.weight": up}) == 1
    after, half = model.get_parameter(stack).detach(), up.shape[0]
    assert torch.equal(after[2, half:], up) and not torch.equal(before[2, half:], up)
    assert torch.equal(after[2, :half], before[2, :half]) and torch.equal(after[[0, 1, 3]], before[[0, 1, 3]])
    with pytest.raises(KeyError, match="missing.*experts.down_proj"):
        engine.update_weights({k: v for k, v in hf.items() if k != "model.layers.1.mlp.experts.3.down_proj.weight"},
                              strict=True)
    assert engine.update_weights(hf, strict=True) == 2
    assert model.get_parameter(stack).data_ptr() == ptr
    assert all(torch.equal(v, other.state_dict()[k]) for k, v in model.state_dict().items())


def test_bad_weight_update_changes_nothing():
    model = _model()
    engine = InProcessEngine(model)
    snapshot = {k: v.clone() for k, v in model.state_dict().items()}
    good = torch.zeros_like(model.lm_head.weight)
    with pytest.raises(KeyError, match="not_a_param"):
        engine.update_weights({"lm_head.weight": good, "not_a_param": good})
    with pytest.raises(ValueError, match="shape"):
        engine.update_weights({"lm_head.weight": good, "model.norm.weight": torch.ones(3)})
    with pytest.raises(KeyError, match="missing"):
        engine.update_weights({"lm_head.weight": good}, strict=True)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in snapshot.items())
    assert engine.weight_version == 0


# ---------------------------------------------------------------- bad input
def test_bad_prompts_are_counted_and_reported_not_raised():
    engine = InProcessEngine(_model(), EngineConfig(max_length=32))
    good = _prompts((5,))[0]
    prompts = [list(range(2, 34)), [], [3, 4, 999], [5, -1], good, ["a", "b"]]
    results = engine.generate(prompts, _greedy(6))
    assert [r.finish_reason for r in results] == ["rejected"] * 4 + ["length", "rejected"]
    assert [r.ok for r in results] == [False] * 4 + [True, False]
    assert len(results[4].tokens) == 6 and all(r.tokens == [] for r in results[:4])
    assert results[4].tokens == engine.generate([good], _greedy(6))[0].tokens
    assert "32 tokens" in results[0].error and "empty" in results[1].error
    assert "999" in results[2].error and "-1" in results[3].error and "integers" in results[5].error
    assert engine.stats.rejected == {"prompt_too_long": 1, "empty_prompt": 1, "token_out_of_vocab": 2, "bad_token_type": 1}
    failed = to_sample(results[0], Sample("x", prompts[0]))
    assert failed.status is SampleStatus.FAILED and failed.response_length == 0 and "32 tokens" in failed.metadata["error"]
    assert engine.stats.as_dict()["requests"] == 6 + 1
