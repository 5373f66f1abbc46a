"""Error bodies without a server: the 400's ``param`` names the field at fault, as OpenAI's do."""
from __future__ import annotations

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from streamkv.server.errors import APIError, install_error_handlers
from streamkv.server.generation import make_params
from streamkv.server.protocol import ChatCompletionRequest, CompletionRequest


@pytest.mark.parametrize("field, value", [("temperature", -1), ("top_p", 2), ("seed", 2**64), ("stop", [""]),
                                          ("stop", ["a"] * 17), ("frequency_penalty", 9), ("min_tokens", 99)])
def test_a_bad_sampling_value_names_its_field(field, value):
    # SamplingParams' checks came back as 400s with param null (review)
    with pytest.raises(APIError) as err:
        make_params(max_tokens=4, **{field: value})
    assert err.value.status == 400 and err.value.param == field, err.value.message


def test_a_validation_error_names_the_field_not_the_union_branch():
    # the whole pydantic loc was joined: "prompt.str", "temperature.int", and a body that is
    # not JSON was param "1" (its offset)
    app = FastAPI()
    install_error_handlers(app)

    @app.post("/completions")
    async def completions(body: CompletionRequest) -> dict:
        return {}

    @app.post("/chat")
    async def chat(body: ChatCompletionRequest) -> dict:
        return {}

    client = TestClient(app)
    for path, body, param in (("/completions", {"prompt": 5}, "prompt"),
                              ("/completions", {"prompt": "x", "temperature": "0.5"}, "temperature"),
                              ("/completions", {"prompt": "x", "stop": 5}, "stop"),
                              ("/chat", {"messages": [{"role": "user", "content": 5}]}, "messages.0.content")):
        r = client.post(path, json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.json())
        assert r.json()["error"]["message"].startswith(f"{param}: ")
    r = client.post("/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["param"] is None
    assert r.json()["error"]["message"].startswith("the request body is not valid JSON")
