"""stream_all(): a streamed request's choices are all accepted by the engine before a response
starts, so a refusal raises with its own type (the route turns it into its 4xx), the other
choices are aborted, and in-band errors after the start keep their status."""
from __future__ import annotations

import asyncio
from typing import Any

import pytest

from streamkv.engine.outputs import RequestOutput
from streamkv.errors import InvalidRequestError, QueueFullError
from streamkv.server.errors import APIError, status_of
from streamkv.server.generation import stream_all


class FakeEngine:
    """generate() of choice ``refuse`` raises before accepting; the others accept, then wait for
    ``go`` and give two outputs. Records which choices were closed before their end."""

    def __init__(self, refuse: int | None) -> None:
        self.refuse, self.go, self.aborted, self._reserved = refuse, asyncio.Event(), [], 0

    def admit(self, n: int) -> Any:
        from streamkv.engine.async_engine import Admission

        return Admission(self, n)  # type: ignore[arg-type]

    async def generate(self, rid: str, prompt: Any, params: Any, priority: int = 0, kv: Any = None,
                       on_accept: Any = None, admitted: bool = False):
        i = int(rid.rsplit("-", 1)[1])
        if i == self.refuse:
            await asyncio.sleep(0.01)          # the others are accepted first
            raise InvalidRequestError(f"choice {i} refused")
        on_accept()
        done = False
        try:
            await self.go.wait()
            yield RequestOutput(rid, None, [1], [1], "a")
            yield RequestOutput(rid, None, [1], [1, 2], "ab", finished=True)
            done = True
        finally:
            if not done:
                self.aborted.append(i)


def test_a_refusal_raises_before_any_output_and_aborts_the_other_choices():
    async def run():
        engine = FakeEngine(refuse=1)
        with pytest.raises(InvalidRequestError, match="choice 1 refused"):
            await stream_all(engine, "r", [[1]] * 3, [None] * 3, 0)
        await asyncio.sleep(0.01)
        return engine.aborted

    assert sorted(asyncio.run(run())) == [0, 2]


def test_accepted_choices_stream_every_output():
    async def run():
        engine = FakeEngine(refuse=None)
        outputs = await stream_all(engine, "r", [[1]] * 2, [None] * 2, 0)   # returns once both are accepted
        engine.go.set()
        return [(i, out.text, out.finished) async for i, out in outputs]

    got = asyncio.run(run())
    assert sorted(got) == [(0, "a", False), (0, "ab", True), (1, "a", False), (1, "ab", True)]


def test_in_band_errors_keep_their_status():
    assert status_of(InvalidRequestError("bad kv_write")) == (400, "bad kv_write")
    assert status_of(QueueFullError("full"))[0] == 429
    assert status_of(APIError(404, "gone")) == (404, "gone")
    assert status_of(RuntimeError("boom")) == (500, "RuntimeError: boom")


def test_a_full_kv_cache_is_a_retryable_503_not_a_bad_request():
    # a session query whose fork finds no free block got a 400 "the KV cache is full; retry
    # later" (KVCacheFullError is an InvalidRequestError) with no Retry-After
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from streamkv.errors import KVCacheFullError
    from streamkv.server.errors import install_error_handlers

    assert status_of(KVCacheFullError("the KV cache is full; retry later"))[0] == 503  # in-band (SSE)
    app = FastAPI()
    install_error_handlers(app)

    @app.get("/full")
    async def full() -> None:
        raise KVCacheFullError("the KV cache is full; retry later")

    resp = TestClient(app).get("/full")
    assert resp.status_code == 503 and resp.headers["retry-after"] == "1"
    assert resp.json()["error"]["type"] == "service_unavailable"


def test_an_engine_refusal_that_names_its_field_is_a_400_with_that_param():
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from streamkv.errors import InvalidRequestError
    from streamkv.server.errors import install_error_handlers

    app = FastAPI()
    install_error_handlers(app)

    @app.get("/bad/{param}")
    async def bad(param: str) -> None:
        raise InvalidRequestError("kv_write: never fits", param=None if param == "none" else param)

    client = TestClient(app)
    named, unnamed = client.get("/bad/kv_write"), client.get("/bad/none")
    assert named.status_code == unnamed.status_code == 400
    assert named.json()["error"]["param"] == "kv_write" and unnamed.json()["error"]["param"] is None


def test_choices_whose_response_never_started_are_aborted():
    """A client that leaves while its request is being accepted: the response body never starts,
    so nothing iterates the choices; dropping them must still abort every one (they ran to their
    end unread before)."""
    import gc

    async def run():
        engine = FakeEngine(refuse=None)
        outputs = await stream_all(engine, "r", [[1]] * 2, [None] * 2, 0)
        del outputs
        gc.collect()
        await asyncio.sleep(0.01)
        engine.go.set()
        await asyncio.sleep(0.01)
        return engine.aborted

    assert sorted(asyncio.run(run())) == [0, 1]


def test_closing_the_choices_mid_stream_aborts_the_rest():
    async def run():
        engine = FakeEngine(refuse=None)
        outputs = await stream_all(engine, "r", [[1]] * 2, [None] * 2, 0)
        await outputs.aclose()
        await asyncio.sleep(0.01)
        return engine.aborted

    assert sorted(asyncio.run(run())) == [0, 1]


@pytest.mark.parametrize("streamed", [False, True])
def test_a_request_is_queued_whole_or_refused_whole_by_max_waiting(streamed):
    # the limit was checked choice by choice: a request of more choices than --max-waiting got a
    # 429 ("4 requests are already waiting") on every retry, on an idle server
    from streamkv import SamplingParams
    from streamkv.engine.async_engine import AsyncEngine
    from streamkv.server.generation import run_all
    from tests.fakes import fake_engine

    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    engine = AsyncEngine(fake_engine()[0], max_waiting=4).start()

    ids = iter(range(100))

    async def request(n: int) -> list[Any]:
        rid = f"r{next(ids)}"
        if not streamed:
            return await run_all(engine, rid, [[5, 6]] * n, [params] * n, 0, client=None)
        outputs = await stream_all(engine, rid, [[5, 6]] * n, [params] * n, 0)
        return [out async for _, out in outputs if out.finished]

    async def run() -> None:
        assert len(await request(4)) == 4
        with pytest.raises(InvalidRequestError, match="queues at most 4"):  # never fits: a 400
            await request(5)
        # admitted at once, before any choice runs: the places are reserved at admission (checked
        # one by one, 12 concurrent requests past a limit of 2 were all let in)
        results = await asyncio.gather(*(request(2) for _ in range(4)), return_exceptions=True)
        assert [len(r) if isinstance(r, list) else type(r) for r in results] == [2, 2, QueueFullError, QueueFullError]
        assert engine.num_queued == engine._reserved == 0  # every place given back
        assert len(await request(4)) == 4

    try:
        asyncio.run(run())
    finally:
        engine.shutdown()


def test_an_engine_with_nothing_it_can_run_waits_instead_of_spinning():
    # every request waits for blocks a pinned stream holds: each step runs nothing, and the loop
    # stepped again at once, a core at 100% (thousands of empty steps a second) for as long as
    # it lasted; it now waits a moment for a command between empty steps
    import time

    from streamkv import SamplingParams
    from streamkv.engine.async_engine import AsyncEngine
    from tests.fakes import slot_engine

    core, _ = slot_engine(num_blocks=32, block_size=4)
    hog = core.seq_ops.open(list(range(1, 4 * 30)))  # 30 of the 32 blocks, pinned
    while not core.seq_ops.is_idle(hog):
        core.step()
    core.add_request("waits", list(range(1, 40)), SamplingParams(max_tokens=2, temperature=0.0))
    steps = [0]
    step = core.step
    core.step = lambda: steps.__setitem__(0, steps[0] + 1) or step()
    engine = AsyncEngine(core).start()
    try:
        time.sleep(0.5)
        assert 1 <= steps[0] < 300, steps[0]  # at most one per 5 ms wait (spinning: thousands)
        assert core.has_unfinished()  # still waiting: the state this is about
    finally:
        engine.shutdown(timeout=0.1)


def test_a_failed_output_for_want_of_room_is_a_503_on_every_route():
    # check_output (completions, chat, messages, an input stream's finish) answered 500 for an
    # output the engine marked retryable; spans and sessions answered 503 through their own copies
    from streamkv.server.generation import check_output, failure

    def failed(retry: bool) -> RequestOutput:
        return RequestOutput("r", None, [1], [], "", finished=True, finish_reason="error", error="no KV block",
                             retry=retry)

    with pytest.raises(APIError) as exc:
        check_output(failed(True))
    assert exc.value.status == 503 and exc.value.headers == {"Retry-After": "1"}
    assert exc.value.message == "generation failed, retry later: no KV block"
    with pytest.raises(APIError) as exc:
        check_output(failed(False))
    assert exc.value.status == 500 and not exc.value.headers and exc.value.message == "generation failed: no KV block"
    assert failure(failed(True), "query failed").message == "query failed, retry later: no KV block"
