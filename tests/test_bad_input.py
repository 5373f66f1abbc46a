"""Bad input gets a typed error and the engine keeps serving (acceptance 4 of issue 2)."""
from __future__ import annotations

import pytest

from streamkv import LLM, SamplingParams
from streamkv.errors import InvalidRequestError, ModelLoadError

OK = SamplingParams(max_tokens=4, temperature=0.0)


@pytest.mark.parametrize("prompt,match", [
    ("", "empty"), ([], "non-empty"), ([[]], "empty"), ([10 ** 9], "vocabulary"), ([-5], "vocabulary"),
    ([1.5], None), ([None], "token ids"),
])
def test_bad_prompts(smol_fp32, prompt, match):
    with pytest.raises(InvalidRequestError, match=match):
        smol_fp32.generate(prompt, OK)
    assert smol_fp32.generate("Hello", OK)[0].token_ids


def test_prompt_longer_than_context(smol_fp32):
    too_long = [42] * smol_fp32.engine.max_model_len
    with pytest.raises(InvalidRequestError, match="context"):
        smol_fp32.generate([too_long], OK)
    assert smol_fp32.generate("Hello", OK)[0].finish_reason == "length"


def test_invalid_sampling_values(smol_fp32):
    for kw in (dict(temperature=-1.0), dict(top_p=2.0), dict(max_tokens=0), dict(logprobs=100)):
        with pytest.raises(InvalidRequestError):
            smol_fp32.generate("Hello", SamplingParams(**kw))
    with pytest.raises(InvalidRequestError, match="SamplingParams"):
        smol_fp32.generate("Hello", {"temperature": 0})  # type: ignore[arg-type]
    assert smol_fp32.generate("Hello", OK)[0].token_ids


def test_one_bad_prompt_in_a_batch_queues_nothing(smol_fp32):
    with pytest.raises(InvalidRequestError):
        smol_fp32.generate(["fine", ""], OK)
    assert not smol_fp32.engine.has_unfinished()
    smol_fp32.engine.check_integrity()
    assert len(smol_fp32.generate(["a", "b"], OK)) == 2


def test_unknown_model_path(tmp_path):
    with pytest.raises(ModelLoadError, match="does-not-exist"):
        LLM(model=str(tmp_path / "does-not-exist.gguf"))


def test_corrupt_model_file(tmp_path):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + b"\x00" * 64)
    with pytest.raises(ModelLoadError):
        LLM(model=str(bad))


def test_bad_engine_options():
    with pytest.raises(ValueError, match="unknown engine option"):
        LLM(kv_cache_size=3)
    with pytest.raises(ValueError, match="dtype"):
        LLM(dtype="float8")


@pytest.mark.parametrize("option, value, words", [
    ("spec_max_draft", 2.5, "spec_max_draft must be an integer"),  # accepted, then every step failed
    ("spec_draft_budget", float("nan"), "spec_draft_budget must be an integer"),  # the cap silently off
    ("seed_from_prompt", "false", "seed_from_prompt must be true or false"),  # turned it on
    ("grouped_prefill", "no", "grouped_prefill must be true or false"),
    ("kv_cache_memory", float("nan"), "kv_cache_memory must be an integer"),  # a 1-block pool
    ("max_num_seqs", "4", "max_num_seqs must be an integer"),  # TypeError
    ("chunk_min_tokens", 1.5, "chunk_min_tokens must be an integer"),  # TypeError at the first step
    ("stall_factor", float("nan"), "stall_factor must be a number"),
    ("queue_policy", ["fcfs"], "queue_policy must be a string"),
    ("kv_write", {"policy": "snapstream"}, "kv_write must be a string"),  # TypeError in json.loads
])
def test_engine_options_of_the_wrong_kind_are_value_errors(option, value, words):
    with pytest.raises(ValueError, match=words):
        LLM(**{option: value})
