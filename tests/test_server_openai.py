"""The HTTP server driven by the official openai and anthropic SDKs (strict validation)."""
from __future__ import annotations

import asyncio

import httpx
import pytest

from tests.server_harness import ServerProcess, metric

openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")


@pytest.fixture(scope="module")
def server():
    srv = ServerProcess("--dtype", "float32", "--max-waiting", "64")
    yield srv
    assert srv.stop() == 0


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", _strict_response_validation=True)


@pytest.fixture(scope="module")
def model(client):
    return client.models.list().data[0].id


MSG = [{"role": "user", "content": "What is the capital of France?"}]
T0 = {"temperature": 0}  # anthropic 2.x dropped the temperature argument; the API field remains


def test_models(client):
    models = client.models.list()
    assert len(models.data) == 1 and models.data[0].object == "model"


def test_chat_plain_and_stream_agree(client, model):
    plain = client.chat.completions.create(model=model, messages=MSG, temperature=0, max_tokens=24)
    assert "Paris" in plain.choices[0].message.content
    assert plain.usage.completion_tokens > 0 and plain.usage.prompt_tokens > 0
    stream = client.chat.completions.create(model=model, messages=MSG, temperature=0, max_tokens=24, stream=True,
                                            stream_options={"include_usage": True})
    text, finishes, usage = "", [], None
    for chunk in stream:
        if chunk.usage:
            usage = chunk.usage
        for c in chunk.choices:
            text += c.delta.content or ""
            if c.finish_reason:
                finishes.append(c.finish_reason)
    assert text == plain.choices[0].message.content
    assert finishes == [plain.choices[0].finish_reason]
    assert usage.completion_tokens == plain.usage.completion_tokens
    # the second time, the prompt's full blocks came from the prefix cache (OpenAI's usage field)
    assert usage.prompt_tokens_details.cached_tokens >= 16, usage


def test_completions_n2_logprobs(client, model):
    res = client.completions.create(model=model, prompt="The three primary colors are", max_tokens=8,
                                    temperature=0, n=2, logprobs=3)
    assert len(res.choices) == 2 and res.choices[0].text == res.choices[1].text
    lp = res.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == 8 and all(len(t) <= 3 for t in lp.top_logprobs)
    assert res.usage.completion_tokens == 16
    # The SDK types CompletionChoice.finish_reason as non-optional, yet the OpenAI API (and we)
    # send null on every streamed chunk but the last; strict validation cannot parse any real
    # completions stream, so this one part uses a non-strict client.
    lax = openai.OpenAI(base_url=client.base_url, api_key="unused")
    stream = lax.completions.create(model=model, prompt="The three primary colors are", max_tokens=8,
                                    temperature=0, n=2, stream=True, logprobs=3)
    texts, finishes, offsets = {0: "", 1: ""}, {0: 0, 1: 0}, {0: [], 1: []}
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.text
            finishes[c.index] += c.finish_reason is not None
            offsets[c.index] += c.logprobs.text_offset if c.logprobs else []
    assert texts[0] == texts[1] == res.choices[0].text and finishes == {0: 1, 1: 1}
    # streamed offsets continue across chunks (each chunk restarted at 0), as the whole answer's
    assert offsets[0] == offsets[1] == lp.text_offset and lp.text_offset[-1] > 0


def test_chat_logprobs_and_token_prompt(client, model):
    res = client.chat.completions.create(model=model, messages=MSG, temperature=0, max_tokens=5, logprobs=True,
                                         top_logprobs=2)
    content = res.choices[0].logprobs.content
    assert len(content) == res.usage.completion_tokens and len(content[0].top_logprobs) == 2
    stream = client.chat.completions.create(model=model, messages=MSG, temperature=0, max_tokens=5, logprobs=True,
                                            top_logprobs=2, stream=True)
    streamed = [e for chunk in stream for c in chunk.choices if c.logprobs for e in c.logprobs.content]
    assert [e.token for e in streamed] == [e.token for e in content]
    res = client.completions.create(model=model, prompt=[504, 3575, 282], max_tokens=4, temperature=0)
    assert res.usage.prompt_tokens == 3


def test_anthropic_plain_and_stream(server, model):
    c = anthropic.Anthropic(base_url=server.url, api_key="unused", _strict_response_validation=True)
    msg = c.messages.create(model=model, max_tokens=24, messages=MSG, extra_body=T0)
    assert msg.content[0].text and "Paris" in msg.content[0].text and msg.stop_reason in ("end_turn", "max_tokens")
    with c.messages.stream(model=model, max_tokens=24, messages=MSG, extra_body=T0) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == msg.content[0].text and final.stop_reason == msg.stop_reason
    stopped = c.messages.create(model=model, max_tokens=24, messages=MSG, stop_sequences=["Paris"], extra_body=T0)
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == "Paris"


def test_32_concurrent_streams_match_solo(server, model):
    prompts = [f"Count from {i} to {i + 5}:" for i in range(32)]
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x")
    solo = [client.completions.create(model=model, prompt=p, max_tokens=12, temperature=0).choices[0].text
            for p in prompts[:8]]

    async def run():
        ac = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)

        async def one(p):
            text = ""
            async for chunk in await ac.completions.create(model=model, prompt=p, max_tokens=12, temperature=0,
                                                           stream=True):
                text += chunk.choices[0].text if chunk.choices else ""
            return text

        return await asyncio.gather(*(one(p) for p in prompts))

    outs = asyncio.run(run())
    assert outs[:8] == solo
    solo_rest = [client.completions.create(model=model, prompt=p, max_tokens=12, temperature=0).choices[0].text
                 for p in prompts[8:]]
    assert outs[8:] == solo_rest


def test_disconnect_aborts_and_frees_blocks(server, model):
    import time

    idle = metric(server.url, "streamkv_kv_blocks_used")
    body = {"model": model, "prompt": "Write a very long story about a dragon.", "max_tokens": 2000,
            "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=30) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i > 6:
                break
    assert metric(server.url, "streamkv_kv_blocks_used") >= idle
    deadline = time.time() + 20
    while time.time() < deadline and metric(server.url, "streamkv_kv_blocks_used") > idle:
        time.sleep(0.2)
    assert metric(server.url, "streamkv_kv_blocks_used") == idle
    assert metric(server.url, "streamkv_requests_running") == 0


def test_structured_outputs_through_the_sdk(client, model):
    """response_format json_schema (the SDK's parse() helper, strict), json_object, and vLLM's
    guided_choice / guided_regex extras; a bad schema is a 400 naming the field."""
    pydantic = pytest.importorskip("pydantic")
    pytest.importorskip("xgrammar")

    class City(pydantic.BaseModel):  # bounded: a 135M model can ramble inside an unbounded string
        name: str = pydantic.Field(max_length=24)
        country: str = pydantic.Field(max_length=24)
        population: int = pydantic.Field(ge=0, le=100_000_000)

    ask = [{"role": "user", "content": "Tell me about Paris as JSON."}]
    parsed = client.chat.completions.parse(model=model, messages=ask, temperature=0, max_tokens=80,
                                           response_format=City)
    assert isinstance(parsed.choices[0].message.parsed, City)
    assert parsed.choices[0].finish_reason == "stop"
    obj = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Describe a cat as a "
                                                                "JSON object."}],
                                         temperature=0, max_tokens=160, response_format={"type": "json_object"})
    import json
    assert isinstance(json.loads(obj.choices[0].message.content), dict)
    pick = client.completions.create(model=model, prompt="The capital of France is", max_tokens=8, temperature=0,
                                     extra_body={"guided_choice": ["Paris", "Lyon", "Nice"]})
    assert pick.choices[0].text in ("Paris", "Lyon", "Nice")
    code = client.completions.create(model=model, prompt="A product code:", max_tokens=12, temperature=1, seed=3,
                                     extra_body={"guided_regex": "[A-Z]{2}[0-9]{3}"})
    import re
    assert re.fullmatch("[A-Z]{2}[0-9]{3}", code.choices[0].text)
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model=model, messages=ask, max_tokens=8, response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "properties": {
                "a": {"type": "nonsense"}}}}})
    assert "response_format" in str(bad.value) and "Unsupported type" in str(bad.value)
    for extra in ({"guided_regex": "(ab"}, {"guided_choice": []}, {"guided_choice": ["a"], "guided_regex": "a"},
                  {"response_format": {"type": "xml"}}, {"response_format": {"type": "json_schema"}}):
        with pytest.raises(openai.BadRequestError):
            client.completions.create(model=model, prompt="x", max_tokens=4, extra_body=extra)


WEATHER = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}},
           {"type": "function", "function": {"name": "get_time", "description": "Local time in a city",
                                             "parameters": {"type": "object", "properties": {
                                                 "city": {"type": "string", "maxLength": 30}},
                                                 "required": ["city"]}}}]


def test_tool_calls_round_trip_through_the_sdk(client, model):
    """A forced call (required / named) always parses and validates; the call and its result
    go back into the conversation; streaming delivers the same call as one tool_calls delta."""
    pytest.importorskip("xgrammar")
    jsonschema = pytest.importorskip("jsonschema")
    import json

    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = client.chat.completions.create(model=model, messages=ask, tools=WEATHER, tool_choice="required",
                                           temperature=0, max_tokens=80)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    call = choice.message.tool_calls[0]
    params = {t["function"]["name"]: t["function"]["parameters"] for t in WEATHER}
    jsonschema.validate(json.loads(call.function.arguments), params[call.function.name])
    named = client.chat.completions.create(model=model, messages=ask, tools=WEATHER, temperature=1, seed=4,
                                           max_tokens=80, tool_choice={"type": "function",
                                                                       "function": {"name": "get_time"}})
    assert named.choices[0].message.tool_calls[0].function.name == "get_time"
    follow = ask + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                    {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 18, "sky": "clear"}'}]
    answer = client.chat.completions.create(model=model, messages=follow, tools=WEATHER, tool_choice="none",
                                            temperature=0, max_tokens=24)
    assert answer.choices[0].message.content and not answer.choices[0].message.tool_calls
    chunks = list(client.chat.completions.create(model=model, messages=ask, tools=WEATHER, tool_choice="required",
                                                 temperature=0, max_tokens=80, stream=True))
    streamed = [tc for c in chunks for ch in c.choices for tc in (ch.delta.tool_calls or [])]
    assert [(t.function.name, t.function.arguments) for t in streamed] == [(call.function.name,
                                                                            call.function.arguments)]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    auto = client.chat.completions.create(model=model, messages=ask, tools=WEATHER, temperature=0, max_tokens=60)
    assert auto.choices[0].finish_reason in ("stop", "tool_calls", "length")
    for bad in ({"tool_choice": {"type": "function", "function": {"name": "nope"}}},
                {"tool_choice": "sometimes"}, {"tools": [{"type": "function", "function": {"name": "bad name"}}]},
                {"response_format": {"type": "json_object"}, "tool_choice": "required"}):
        kwargs = {"tools": WEATHER, **bad}
        with pytest.raises(openai.BadRequestError):
            client.chat.completions.create(model=model, messages=ask, max_tokens=8, **kwargs)


def test_anthropic_tool_use_round_trip(server, model):
    """Anthropic tools: a forced call ("any") is a tool_use block whose input validates; the
    tool_use / tool_result pair goes back; streaming gives the same block via input_json_delta."""
    pytest.importorskip("xgrammar")
    jsonschema = pytest.importorskip("jsonschema")
    client = anthropic.Anthropic(base_url=server.url, api_key="unused")
    tools = [{"name": t["function"]["name"], "description": t["function"]["description"],
              "input_schema": t["function"]["parameters"]} for t in WEATHER]
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    msg = client.messages.create(model=model, max_tokens=80, messages=ask, tools=tools, tool_choice={"type": "any"},
                                 extra_body=T0)
    assert msg.stop_reason == "tool_use"
    use = [b for b in msg.content if b.type == "tool_use"][0]
    jsonschema.validate(use.input, {t["name"]: t["input_schema"] for t in tools}[use.name])
    with client.messages.stream(model=model, max_tokens=80, messages=ask, tools=tools, tool_choice={"type": "any"},
                                extra_body=T0) as stream:
        final = stream.get_final_message()
    streamed = [b for b in final.content if b.type == "tool_use"][0]
    assert (streamed.name, streamed.input) == (use.name, use.input) and final.stop_reason == "tool_use"
    follow = ask + [{"role": "assistant", "content": [b.model_dump() for b in msg.content]},
                    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                                  "content": "18 degrees, clear"}]}]
    reply = client.messages.create(model=model, max_tokens=24, messages=follow, tools=tools,
                                   tool_choice={"type": "none"}, extra_body=T0)
    assert reply.stop_reason in ("end_turn", "max_tokens") and reply.content[0].type == "text"
    named = client.messages.create(model=model, max_tokens=80, messages=ask, tools=tools, extra_body=T0,
                                   tool_choice={"type": "tool", "name": "get_time"})
    assert [b.name for b in named.content if b.type == "tool_use"] == ["get_time"]
    with pytest.raises(anthropic.BadRequestError):
        client.messages.create(model=model, max_tokens=8, messages=ask, tools=tools,
                               tool_choice={"type": "tool", "name": "nope"})


def test_startup_banner_names_url_model_dtype_and_kernels(server, model):
    text = server.log_text()
    assert f"streamkv serving {model} at {server.url}" in text
    assert "dtype float32" in text and "kernels: " in text
    assert "scheduling: speculation pld (draft budget 6, up to 4 each), chunking adaptive, admission none" in text
    assert "process: thread switch interval 0.5 ms, " in text and " objects frozen out of the collector" in text
