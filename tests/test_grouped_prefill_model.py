"""Grouped prefill on the embedded model: a burst of chats that share a long system prompt
computes it once, and every answer is bit-identical to the same chat's answer alone."""
from __future__ import annotations

from streamkv import LLM
from streamkv.sampling.params import SamplingParams
from streamkv.server.metrics import _scheduler_metrics

SYSTEM = ("You are the assistant of a weather service. Answer briefly and in plain words. "
          + " ".join(f"Station s{i} reports {20 + i % 7} degrees and {40 + i % 13}% humidity." for i in range(24)))
QUESTIONS = ["Which station is warmest?", "Is s3 humid?", "What does s10 report?", "Name two cool stations.",
             "Summarise the data in one sentence.", "Which station reports 45% humidity?"]


def _burst(llm: LLM, params: SamplingParams, questions: list[str] = QUESTIONS):
    return llm.chat([[{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}] for q in questions],
                    params)


def test_a_burst_sharing_a_system_prompt_aliases_it_and_answers_alike():
    """The reference runs each chat alone (the system prompt computed once, then prefix-cache
    hits: the cheap way to an ungrouped answer, equal to an ungrouped burst's by batch invariance)."""
    plain, grouped = LLM(grouped_prefill=False), LLM()
    for params in (SamplingParams(max_tokens=24, temperature=0.0),
                   SamplingParams(max_tokens=24, temperature=0.7, seed=5)):
        want = [_burst(plain, params, [q])[0] for q in QUESTIONS]
        got = _burst(grouped, params)
        for w, g in zip(want, got):
            assert (g.token_ids, g.text, g.finish_reason) == (w.token_ids, w.text, w.finish_reason)
        grouped.engine.pool.reset_prefix_cache()  # the next burst groups again
        plain.engine.pool.reset_prefix_cache()
    stats = grouped.engine.scheduler.groups.stats
    assert stats.followers == 2 * (len(QUESTIONS) - 1) and stats.tokens_saved > 0
    shared = len(grouped.engine.tokenizer.encode(SYSTEM))
    assert stats.tokens_saved >= 2 * (len(QUESTIONS) - 1) * (shared - 16)
    metrics = {f.name: f.samples[0].value for f in _scheduler_metrics(grouped.engine.scheduler) if f.samples}
    assert metrics["streamkv_grouped_prefill_tokens_saved"] == stats.tokens_saved
