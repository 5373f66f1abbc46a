"""LangChain's standard chat-model integration tests (``langchain-tests``) against
``langchain_openai.ChatOpenAI`` pointed at a live ``streamkv serve`` of the embedded model.

Optional: skipped with a reason when ``langchain-tests`` / ``langchain-openai`` are absent (the
dev extras install them). Tests that need inputs this text-only server does not take (images,
audio, PDF) are switched off by the suite's own capability flags.
"""
from __future__ import annotations

import pytest

pytest.importorskip("langchain_tests", reason="langchain-tests is not installed (pip install -e '.[dev]')")
pytest.importorskip("langchain_openai", reason="langchain-openai is not installed (pip install -e '.[dev]')")
pytest.importorskip("xgrammar", reason="structured output and tool choice need xgrammar")

from langchain_openai import ChatOpenAI  # noqa: E402
from langchain_tests.integration_tests import ChatModelIntegrationTests  # noqa: E402

from tests.server_harness import ServerProcess  # noqa: E402

_LIVE: dict[str, str] = {}


@pytest.fixture(scope="module", autouse=True)
def live_server():
    srv = ServerProcess("--max-waiting", "64")
    import httpx

    _LIVE["url"] = srv.url
    _LIVE["model"] = httpx.get(srv.url + "/v1/models").json()["data"][0]["id"]
    yield srv
    assert srv.stop() == 0


class TestStreamkvChatOpenAI(ChatModelIntegrationTests):
    @property
    def chat_model_class(self) -> type[ChatOpenAI]:
        return ChatOpenAI

    @property
    def chat_model_params(self) -> dict:
        # max_tokens: without it the server allows the whole context, and a 135M model rambles to it;
        # frequency_penalty: at greedy it otherwise loops inside unbounded JSON strings (structured output)
        return {"model": _LIVE["model"], "base_url": _LIVE["url"] + "/v1", "api_key": "unused",
                "stream_usage": True, "temperature": 0, "max_tokens": 256, "frequency_penalty": 0.5}

    @property
    def has_tool_choice(self) -> bool:
        return True

    @property
    def supports_json_mode(self) -> bool:
        return True

    @property
    def supported_usage_metadata_details(self) -> dict:
        return {"invoke": [], "stream": []}

    # Two standard tests ask for what the embedded 135M model cannot do on its own; the server
    # side of each is covered (tool calls: forced-choice tests above and in test_server_openai.py;
    # JSON mode: any JSON object). They stay visible as expected failures, not skipped.
    @pytest.mark.xfail(reason="SmolLM2-135M does not call a tool unasked (tool_choice auto); "
                              "forced tool calls pass in test_tool_choice / test_tool_calling", strict=False)
    @pytest.mark.parametrize("model", [{}, {"output_version": "v1"}], indirect=True)
    def test_agent_loop(self, model) -> None:  # type: ignore[override]
        super().test_agent_loop(model)

    @pytest.mark.xfail(reason="JSON mode guarantees an object, not its keys; the 135M model leaves out one the "
                              "prompt asks for (json_schema mode passes in test_structured_output)", strict=False)
    def test_json_mode(self, model) -> None:  # type: ignore[override]
        super().test_json_mode(model)
