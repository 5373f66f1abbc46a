"""The decode cadence (``sched/cadence.py``): a step's prompt rows are capped while sequences
decode, from costs learned online; outputs stay those of the uncapped engine."""
from __future__ import annotations

import random

import pytest

from streamkv.config import SchedulerConfig
from streamkv.sampling.params import SamplingParams
from streamkv.sched.cadence import StepAllowance, StepCadence, chunk_cost, row_context
from tests.fakes import fake_engine


def _cap(c: StepCadence, budget: int) -> int:
    """Prompt rows at context 0 a step with decoders may carry (``budget``: uncapped)."""
    return budget if c.allowance(budget) is None else c.stats.cap


def test_the_cap_follows_the_learned_costs():
    c = StepCadence(3.0, min_tokens=16, alpha=1.0, fit_alpha=1.0)
    assert _cap(c, 2048) == 2048  # nothing learned yet: no cap
    c.observe(decode_rows=4, prompt_rows=0, seconds=0.010)   # d = 10 ms
    assert _cap(c, 2048) == 2048  # the row cost is still unknown
    c.observe(decode_rows=4, prompt_rows=100, seconds=0.030)  # (30 - 10) ms / 100 rows = 0.2 ms per row
    assert _cap(c, 2048) == 100   # (3 - 1) x 10 ms / 0.2 ms
    assert _cap(c, 50) == 50      # never above the step budget
    c.observe(decode_rows=0, prompt_rows=20, seconds=0.100)   # 5 ms per row (fixed cost charged to rows)
    assert _cap(c, 2048) == 16    # never below min_tokens: prompts always progress
    assert c.stats.decode_step_s == pytest.approx(0.010) and c.stats.row_s == pytest.approx(0.005)
    avg = StepCadence(3.0, alpha=0.5)
    for s in (0.010, 0.020):
        avg.observe(2, 0, s)
    assert avg.stats.decode_step_s == pytest.approx(0.015)


def test_under_steady_arrivals_the_decode_time_comes_from_mixed_steps():
    c = StepCadence(3.0, min_tokens=8, alpha=1.0)
    c.observe(decode_rows=0, prompt_rows=100, seconds=0.100)  # 1 ms per row (fixed cost included)
    c.observe(decode_rows=4, prompt_rows=50, seconds=0.070)   # no decode-only step yet: d = 70 - 50 = 20 ms
    assert c.stats.decode_step_s == pytest.approx(0.020)
    assert _cap(c, 2048) == 40  # (3 - 1) x 20 ms / 1 ms


def test_before_any_decode_the_floor_chunk_stands_for_the_decode_step():
    """Only prompts so far (sessions opening): the first step beside a decoder (or a question)
    is capped at (F - 1) floor chunks, not left whole (a 1,012-row chat prompt beside the first
    decoder made a 1,055 ms step, 16.8x the median, on the Zen 4)."""
    c = StepCadence(3.0, min_tokens=16, alpha=1.0)
    for _ in range(3):
        c.observe(decode_rows=0, prompt_rows=200, seconds=0.200)  # 1 ms per row, no decoder yet
    assert c.stats.decode_step_s == 0.0
    assert _cap(c, 2048) == 32  # (3 - 1) x the 16-row floor's 16 ms
    c.observe(decode_rows=4, prompt_rows=0, seconds=0.040)  # the first decode-only step takes over
    assert _cap(c, 2048) == 80


def test_one_row_steps_without_decoders_do_not_teach_the_row_cost():
    """A step of one prompt row and nothing else is mostly the step's fixed cost. Fitted, it
    priced one row after 4,500 tokens at the whole allowance, so the next step got one row again
    and taught the same (1,463 one-row steps in 40 s on the Zen 4). Now the chunk keeps its size."""
    c = StepCadence(3.0, min_tokens=16, alpha=1.0)
    c.observe(decode_rows=4, prompt_rows=0, seconds=0.020)   # d = 20 ms: 40 ms of prompt work a step
    for ctx in (0, 4_500):
        for _ in range(3):
            c.observe(4, 50, 0.020 + 0.001 * 50 * (1 + ctx / 2_400), row_context(50, ctx))
    before = c.allowance(2048).rows(4_500, 2048)
    for i in range(200):  # one bar row per step after 4,500 tokens, 25 ms each (20 ms fixed)
        c.observe(0, 1, 0.025, row_context(1, 4_500 + i))
    assert before >= 10 and c.allowance(2048).rows(4_500, 2048) == before


def test_a_row_costs_more_after_a_long_context_and_gets_a_smaller_chunk():
    """A chunk appended to a long session attends to all of it: c per row plus k per (row x
    cached token). Steps at two contexts separate the two, and the long one's chunk shrinks."""
    c = StepCadence(3.0, min_tokens=4, alpha=1.0)
    c.observe(decode_rows=4, prompt_rows=0, seconds=0.010)   # d = 10 ms: 20 ms of prompt work a step
    for _ in range(3):
        c.observe(4, 100, 0.010 + 0.020, row_context(100, 0))        # 0.2 ms per row after nothing
        c.observe(4, 100, 0.010 + 0.080, row_context(100, 5_000))    # 0.8 ms per row after 5,000 tokens
    k = 0.060 / (row_context(100, 5_000) - row_context(100, 0))  # the 60 ms the 5,000 tokens add
    assert c.stats.row_context_s == pytest.approx(k, rel=1e-6)
    assert c.stats.row_s == pytest.approx((0.020 - k * row_context(100, 0)) / 100, rel=1e-6)
    allow = c.allowance(2048)
    short, long = allow.rows(0, 2048), allow.rows(5_000, 2048)
    assert short == c.stats.cap and 95 <= short <= 100 and 24 <= long <= 26
    assert chunk_cost(long, 5_000, allow.row_s, allow.row_context_s) <= 0.020 < chunk_cost(
        long + 1, 5_000, allow.row_s, allow.row_context_s)
    # one context only: the two cannot be told apart, and the ratio learned above is kept
    same = StepCadence(3.0, alpha=1.0, fit_alpha=1.0)
    same.observe(4, 0, 0.010)
    same.observe(4, 100, 0.030, row_context(100, 0))
    assert same.stats.row_context_s == 0 and same.stats.row_s == pytest.approx(0.0002)


def test_a_chunk_pays_for_reading_its_context_whatever_its_rows():
    """A chunk reads its whole context once, however few its rows (m per cached token), as a
    decode row does. Without that term four chunks of 2-48 rows after 2,500-5,300 tokens were
    priced at a few ms and took 90 ms beside 10 ms decode steps (AMX Xeon, multitenant step
    log). Steps at several (rows, context) pairs separate c, k and m; a second long-context
    chunk then waits for the next step, and the step's first chunk still moves."""
    c_, k_, m_ = 0.0002, 2e-8, 2e-6  # 0.2 ms per row, 0.02 us per row x token, 2 us per cached token
    c = StepCadence(3.0, min_tokens=4, alpha=1.0)
    c.observe(decode_rows=4, prompt_rows=0, seconds=0.010)   # d = 10 ms: 20 ms of prompt work a step
    for n, s in [(100, 0), (8, 5_000), (100, 5_000), (32, 2_000), (4, 3_000), (64, 500)] * 2:
        c.observe(4, n, 0.010 + chunk_cost(n, s, c_, k_, m_), row_context(n, s), s)
    assert (c.stats.row_s, c.stats.row_context_s, c.stats.read_s) == pytest.approx((c_, k_, m_), rel=1e-6)
    allow = c.allowance(2048)
    assert allow.read_s == pytest.approx(m_) and allow.rows(0, 2048) == c.stats.cap
    first = allow.rows(5_000, 4)  # 4 bar rows after 5,000 tokens: ~10.8 ms of the 20
    assert first == 4
    allow.take(5_000, first)
    assert allow.rows(5_000, 4) == 0  # a second such chunk would take the step to ~31 ms
    assert allow.rows(0, 2048) > 0    # a chat prompt's rows still fit what is left
    lone = StepAllowance(seconds=0.005, row_s=c_, row_context_s=k_, read_s=m_)
    assert lone.rows(5_000, 4) == 1   # its read alone is over the allowance, but the first chunk moves


def test_the_read_term_is_kept_through_steps_that_say_nothing_of_it():
    """Before any chunk after a cached context, m is 0 and c, k come from the two-term fit;
    learned, it stays through a long run of chat prompts (chunks after no context)."""
    c = StepCadence(3.0, min_tokens=4, alpha=1.0, fit_alpha=0.5)
    c.observe(4, 0, 0.010)
    c.observe(4, 100, 0.030, row_context(100, 0), 0)
    assert c.stats.read_s == 0 and c.stats.row_s == pytest.approx(0.0002)
    for n, s in [(100, 0), (8, 5_000), (100, 5_000), (32, 2_000)] * 2:
        c.observe(4, n, 0.010 + chunk_cost(n, s, 0.0002, 2e-8, 2e-6), row_context(n, s), s)
    for n in (50, 100, 200) * 20:
        c.observe(4, n, 0.010 + chunk_cost(n, 0, 0.0002, 2e-8), row_context(n, 0), 0)
    assert (c.stats.row_s, c.stats.row_context_s, c.stats.read_s) == pytest.approx((0.0002, 2e-8, 2e-6), rel=1e-3)


def test_the_allowance_is_spent_chunk_by_chunk_and_the_first_chunk_always_moves():
    a = StepAllowance(seconds=8.0, row_s=1.0, row_context_s=0.0)
    assert a.rows(0, 5) == 5
    a.take(0, 5)
    assert a.rows(0, 10) == 3 and a.rows(0, 2) == 2
    a.take(0, 3)
    assert a.rows(0, 10) == 0  # spent: the next prompt waits for the next step
    tight = StepAllowance(seconds=1.0, row_s=1.0, row_context_s=0.01)
    assert tight.rows(10_000, 64) == 1  # one row costs 101 s here, but the step's first chunk moves


@pytest.mark.parametrize("k", [0.0, 1e-30, 1e-20, 1e-12])
def test_a_negligible_context_cost_does_not_round_the_rows_away(k):
    # (sqrt(b^2 + 2 k s) - b) / k cancels to 0 when k << b: a fit with a vanishing k gave every
    # chunk after the first no rows (and the first one row), whatever the allowance
    a = StepAllowance(seconds=0.0325, row_s=0.001, row_context_s=k, taken=True)
    assert a.rows(0, 2048) == 32 and a.rows(1000, 2048) == 32


# nan and inf passed the old "<= 1" check and the engine died at its first step (int(nan) in prompt_rows)
@pytest.mark.parametrize("bad", [1.0, 0.5, -2.0, float("nan"), float("inf")])
def test_a_factor_of_one_or_less_is_refused(bad):
    with pytest.raises(ValueError, match="stall_factor"):
        SchedulerConfig(stall_factor=bad)
    with pytest.raises(ValueError, match="stall_factor"):
        StepCadence(bad)


@pytest.mark.parametrize(("per_context", "read"), [(0.0, 0.0), (0.01, 0.0), (0.0, 0.04)])
def test_steps_with_decoders_carry_at_most_the_cap_and_outputs_stay(per_context, read):
    """An allowance of 8 s at 1 s per row (+ ``per_context`` s per row x cached token, +
    ``read`` s per cached token a chunk reads): with either context term, chunks of the long
    prompts shrink as their context grows."""
    rng = random.Random(4)
    short = [[rng.randrange(1, 64) for _ in range(6)] for _ in range(3)]
    long = [[rng.randrange(1, 64) for _ in range(150)] for _ in range(2)]
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)

    def run(engine):
        for i, p in enumerate(short):
            engine.add_request(f"s{i}", p, params)
        for _ in range(3):  # the short ones are decoding when the long prompts arrive
            engine.step()
        for i, p in enumerate(long):
            engine.add_request(f"l{i}", p, params)
        done = engine.run_to_completion([f"s{i}" for i in range(3)] + ["l0", "l1"])
        engine.check_integrity()
        return {k: v.token_ids for k, v in done.items()}

    plain, _ = fake_engine(num_blocks=256, budget=64, speculation="none")
    want = run(plain)
    engine, runner = fake_engine(num_blocks=256, budget=64, speculation="none", stall_factor=3.0)
    seen = []
    cadence = engine.scheduler.cadence
    cadence.allowance = lambda budget: StepAllowance(8.0, 1.0, per_context, read)  # timing-free
    observe = cadence.observe
    cadence.observe = lambda d, p, s, a=0.0, r=0.0: (seen.append((d, p, a, r)), observe(d, p, s, a, r))
    assert run(engine) == want
    mixed, shrunk = 0, 0
    for plan, (decode, prompt, context, reads) in zip(runner.plans, seen, strict=True):
        dec = [it for it in plan.seqs if it.sample and it.start >= it.num_prompt and it.num_tokens == 1]
        chunks = [it for it in plan.seqs if it not in dec]
        assert (decode, prompt) == (len(dec), sum(it.num_tokens for it in chunks))
        assert context == pytest.approx(sum(row_context(it.num_tokens, it.start) for it in chunks))
        assert reads == sum(it.start for it in chunks)
        if decode and chunks:
            mixed += 1
            cost = sum(chunk_cost(it.num_tokens, it.start, 1.0, per_context, read) for it in chunks if it.num_tokens > 1)
            assert cost <= 8.0 + 1e-9 or len(chunks) == 1, [(it.start, it.num_tokens) for it in chunks]
            shrunk += any(it.start >= 100 and 1 < it.num_tokens <= 3 for it in chunks)
    assert mixed > 0 and cadence.stats.capped_steps > 0
    assert (shrunk > 0) == (per_context + read > 0)  # 100 cached tokens double a row's cost, or cost 4 s
    # the long prompts alone (nobody decoding) take whole chunks
    assert max(sum(it.num_tokens for it in plan.seqs) for plan in runner.plans) > 8


@pytest.mark.parametrize("question_chunks", ["whole", "capped"])
def test_a_question_beside_decoders_is_charged_whole_or_cut_as_configured(question_chunks):
    """A session-class question beside decodes. ``whole`` (the default): its 40 prompt rows go
    in one step (its latency is what the cadence protects; 8-row chunks made it five steps long),
    and a stateless prompt ranked after it gets what the question left of the allowance (here
    nothing). ``capped``: 8 a step, as any prompt's (whole, a question's prefill was 3-7 lone
    decode steps for every decoder beside it: 223 of 1,650 gaps over 3x the median step at 0.25
    req/s, Zen 4); it still ranks first, so the chat prompt waits until it is done. Same tokens
    as the uncapped engine either way."""
    from streamkv.sched.sequence import PriorityClass

    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)

    def run(engine, runner):
        rng = random.Random(5)
        for i in range(3):
            engine.add_request(f"s{i}", [rng.randrange(1, 64) for _ in range(6)], params)
        for _ in range(3):
            engine.step()
        question = engine.add_request("q", [rng.randrange(1, 64) for _ in range(40)], params,
                                      klass=PriorityClass.SESSION)
        chat = engine.add_request("c", [rng.randrange(1, 64) for _ in range(40)], params)
        start = len(runner.plans)
        done = engine.run_to_completion(["s0", "s1", "s2", "q", "c"])
        engine.check_integrity()
        rows = [{it.seq_id: it.num_tokens for it in p.seqs} for p in runner.plans[start:]]
        return rows, question.seq_id, chat.seq_id, {k: v.token_ids for k, v in done.items()}

    *_, want = run(*fake_engine(num_blocks=256, budget=64, speculation="none"))
    engine, runner = fake_engine(num_blocks=256, budget=64, speculation="none", stall_factor=3.0,
                                 question_chunks=question_chunks)
    engine.scheduler.cadence.allowance = lambda budget: StepAllowance(8.0, 1.0, 0.0)  # timing-free
    rows, q, c, got = run(engine, runner)
    assert got == want
    question = [r[q] for r in rows if r.get(q, 0) > 1]
    assert question == {"whole": [40], "capped": [8] * 5}[question_chunks]
    assert all(r.get(q, 0) > 1 and c not in r for r in rows[:len(question)])  # first, every step until done
    chat = [r[c] for r in rows if r.get(c, 0) > 1]
    assert chat and max(chat) <= 8 < sum(chat)  # the stateless prompt: capped, chunk by chunk


def test_question_chunks_is_whole_or_capped():
    from streamkv.config import SchedulerConfig

    assert SchedulerConfig().question_chunks == "whole"
    with pytest.raises(ValueError, match="question_chunks must be whole or capped"):
        SchedulerConfig(question_chunks="split")


@pytest.mark.parametrize("beside", ["question", "session", "nothing"])
def test_a_step_someone_waits_on_caps_its_prompts_when_nothing_decodes(beside):
    """Nobody decodes; a long stateless prompt arrives. Beside a question, whose first token
    waits for the whole step, it gets only what the question left of the allowance (before: its
    whole chunk; a 682-row chat prompt beside a question made a 2.1 s step on 2 cores, where the
    question alone took 0.25 s). Beside a live session (an idle open stream), which may ask but
    has not, or nothing, it takes its whole chunk (capping it beside a live session cost more
    stateless throughput than it bought on the Zen 4). Same tokens as the uncapped engine in
    every case."""
    from streamkv.sched.sequence import PriorityClass

    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)

    def run(engine, runner):
        rng = random.Random(6)
        ids = ["c"]
        if beside == "session":
            stream = engine.seq_ops.open([1 + i % 60 for i in range(16)])
            while stream.num_computed < len(stream.tokens):
                engine.step()
        if beside == "question":
            engine.add_request("q", [rng.randrange(1, 64) for _ in range(30)], params, klass=PriorityClass.SESSION)
            ids.append("q")
        engine.add_request("c", [rng.randrange(1, 64) for _ in range(60)], params)
        engine.step()
        first = sorted(it.num_tokens for it in runner.plans[-1].seqs)
        done = engine.run_to_completion(ids)
        engine.check_integrity()
        return first, {k: v.token_ids for k, v in done.items()}

    _, want = run(*fake_engine(num_blocks=256, budget=128, speculation="none"))
    engine, runner = fake_engine(num_blocks=256, budget=128, speculation="none", stall_factor=3.0)
    engine.scheduler.cadence.allowance = lambda budget: StepAllowance(8.0, 1.0, 0.0)  # timing-free
    first, got = run(engine, runner)
    assert got == want
    # the question whole and the chat prompt nothing; the whole chunk beside an idle session or nothing
    assert first == {"question": [30], "session": [60], "nothing": [60]}[beside]


@pytest.mark.parametrize("long_is", ["stateless", "question"])
def test_the_embedded_model_answers_alike_with_and_without_the_cadence(long_is):
    """The real engine under a tight cadence (F = 1.5: real step times, a long prompt arriving
    beside three decodes; a stateless one, or a session-class question with
    ``question_chunks="capped"``) gives the tokens the uncapped engine gives: chunk boundaries
    set by timing never change a bit (logprobs compared exactly). The uncapped run reuses the
    engine with the cadence removed."""
    import torch

    from streamkv.config import EngineConfig
    from streamkv.engine.engine import Engine
    from streamkv.sched.sequence import PriorityClass

    engine = Engine(EngineConfig.from_flat(num_blocks=160, stall_factor=1.5, question_chunks="capped",
                                           threads=torch.get_num_threads()))
    klass = PriorityClass.SESSION if long_is == "question" else PriorityClass.POOL
    rng = random.Random(7)
    short = [[rng.randrange(100, 40_000) for _ in range(12)] for _ in range(3)]
    long = [rng.randrange(100, 40_000) for _ in range(700)]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=2)

    def run(tag: str) -> dict[str, list]:
        for i, p in enumerate(short):
            engine.add_request(f"{tag}s{i}", p, params)
        for _ in range(4):
            engine.step()
        engine.add_request(f"{tag}l", long, params, klass=klass)
        done = engine.run_to_completion([f"{tag}s{i}" for i in range(3)] + [f"{tag}l"])
        return {k.removeprefix(tag): [(lp.token_id, lp.logprob, lp.top) for lp in v.logprobs]  # bit for bit
                for k, v in done.items()}

    capped = run("a")
    cadence = engine.scheduler.cadence
    assert cadence is not None and cadence.stats.capped_steps > 0 and cadence.stats.row_s > 0
    engine.scheduler.cadence = None
    engine.pool.reset_prefix_cache()  # the uncapped run computes its prompts too
    assert run("b") == capped
