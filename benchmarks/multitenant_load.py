"""The multi-tenant workload of ``benchmarks/multitenant.py``: live sessions that ingest market
bars and answer questions, plus stateless chat traffic replayed from the Azure trace.

Everything here is client side (httpx, asyncio); one phase runs both loads at once::

    t=0 ............................................. duration
    session i:  push bar .. push bar .. ask (timed) .. push bar ...   (each session, own phase)
    stateless:  |  |    | ||   |     |   (Azure conversation-trace inter-arrival gaps, scaled)
"""
from __future__ import annotations

import asyncio
import collections
import csv
import datetime as dt
import json
import random
import statistics
import time
from dataclasses import dataclass, field

import httpx

from common import REPO, nearest_rank as pct, prompt_text
from market_data import make_bars, make_question

TRACE = REPO / "benchmarks" / "data" / "azure_conv_2023_first1000.csv"
SESSION_SYSTEM = ("You watch a market data feed. Each record is one hourly bar: time, open, high, low, "
                  "close, volume. Answer the question with a single word or number.")
TOOLS = [{"type": "function", "function": {
    "name": name, "description": f"{desc} Use it only when the user asks for it; never guess its output.",
    "parameters": {"type": "object", "properties": {p: {"type": "string", "description": f"the {p}"} for p in params},
                   "required": list(params[:1])}}}
    for name, desc, params in [
        ("get_weather", "Current weather for a city.", ("city", "unit")),
        ("search_flights", "Flights between two airports on a date.", ("origin", "destination", "date", "cabin")),
        ("book_hotel", "Book a hotel room.", ("city", "check_in", "check_out", "guests", "room_type")),
        ("convert_currency", "Convert an amount between currencies.", ("amount", "from", "to")),
        ("lookup_order", "Status of a customer order.", ("order_id", "email")),
        ("create_ticket", "Open a support ticket.", ("title", "body", "priority", "component")),
    ]]


def tool_system_prompt(salt: str = "") -> str:
    """About 600 tokens: instructions and the tool schemas (``salt`` makes a cold copy)."""
    head = f"{salt}You are the support assistant of an online travel shop. Be brief and exact.\n"
    return head + "You can call these tools (JSON schemas):\n" + json.dumps(TOOLS, separators=(",", ":"))


@dataclass(frozen=True)
class Request:
    at: float            # seconds after the phase start
    messages: list[dict]
    max_tokens: int
    shared: bool         # carries the shared tool system prompt


def trace_requests(rate: float, duration: float, seed: int, shared_share: float, system: str,
                   scale: float = 0.25, max_prompt: int = 1024, max_output: int = 128) -> list[Request]:
    """Stateless requests for one phase: arrival gaps, prompt and output lengths from the trace
    (a random window of consecutive rows), the gaps scaled so the mean rate is ``rate``."""
    if rate <= 0:
        return []
    with open(TRACE) as f:
        rows = [(dt.datetime.fromisoformat(r["TIMESTAMP"][:26]), int(r["ContextTokens"]), int(r["GeneratedTokens"]))
                for r in csv.DictReader(f)]
    rng = random.Random(seed)
    n = max(2, int(rate * duration * 1.5))
    start = rng.randrange(0, max(1, len(rows) - n))
    window = rows[start:start + n]
    gaps = [max(0.0, (b[0] - a[0]).total_seconds()) for a, b in zip(window, window[1:])]
    k = (1.0 / rate) / max(1e-9, statistics.mean(gaps))
    text = prompt_text(400_000)
    out, at = [], 0.0
    for (_, ctx, gen), gap in zip(window[1:], gaps):
        at += gap * k
        if at >= duration:
            break
        words = max(4, min(max_prompt, round(ctx * scale)))
        off = rng.randrange(0, len(text) - 8 * words)
        user = text[off:off + 4 * words]  # ~4 characters per token
        shared = rng.random() < shared_share
        msgs = ([{"role": "system", "content": system}] if shared else []) + [{"role": "user", "content": user}]
        out.append(Request(at, msgs, max(1, min(max_output, round(gen * scale))), shared))
    return out


@dataclass
class Stream:
    sent: float
    stamps: list[float] = field(default_factory=list)
    error: str | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0  # from usage: a chunk may carry several tokens (accepted drafts)


async def chat_stream(client: httpx.AsyncClient, url: str, req: Request, t0: float) -> Stream:
    await asyncio.sleep(max(0.0, t0 + req.at - time.perf_counter()))
    s = Stream(time.perf_counter())
    body = {"messages": req.messages, "max_tokens": req.max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    try:
        async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                s.error = f"HTTP {r.status_code}"
                return s
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("choices") and chunk["choices"][0].get("delta", {}).get("content"):
                    s.stamps.append(time.perf_counter())
                if chunk.get("usage"):
                    u = chunk["usage"]
                    s.prompt_tokens = u.get("prompt_tokens", 0)
                    s.cached_tokens = (u.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
                    s.completion_tokens = u.get("completion_tokens", 0)
    except httpx.HTTPError as exc:
        s.error = f"{type(exc).__name__}: {exc}"
    if s.error is None and not s.stamps:  # a 200 without one content chunk has no TTFT to count
        s.error = f"no content chunk ({s.completion_tokens} completion tokens in usage)"
    return s


@dataclass
class LiveSession:
    sid: str
    context: int
    bars: list
    next_bar: int
    rng: random.Random


async def create_sessions(client: httpx.AsyncClient, url: str, contexts: list[int], seed: int) -> list[LiveSession]:
    """One session per context size (tokens), filled with ~context / 36 bars (one bar is
    about 36 tokens), all created and pushed concurrently."""
    async def one(i: int, ctx: int) -> LiveSession:
        bars = make_bars(ctx // 36 + 4000, seed + i)
        n0 = max(8, ctx // 36)
        r = await client.post(url + "/v1/sessions", json={"system": SESSION_SYSTEM, "retention_tokens": ctx})
        r.raise_for_status()
        sid = r.json()["id"]
        r = await client.post(f"{url}/v1/sessions/{sid}/data", json={"records": [b.text() for b in bars[:n0]]})
        r.raise_for_status()
        return LiveSession(sid, ctx, bars, n0, random.Random(seed * 1000 + i))
    return list(await asyncio.gather(*(one(i, c) for i, c in enumerate(contexts))))


async def wait_filled(client: httpx.AsyncClient, url: str, sessions: list[LiveSession], timeout: float) -> None:
    """Until every session has ingested its queue and computed its whole stream."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        infos = await asyncio.gather(*(client.get(f"{url}/v1/sessions/{s.sid}") for s in sessions))
        if all(i.json()["records"]["queued"] == 0 and i.json()["tokens"]["computed"] == i.json()["tokens"]["total"]
               for i in infos):
            return
        await asyncio.sleep(1.0)
    raise TimeoutError("the sessions did not finish ingesting")


async def session_loop(client: httpx.AsyncClient, url: str, s: LiveSession, duration: float, t0: float,
                       record_every: float, question_every: float,
                       max_tokens: int) -> tuple[list[tuple[float, float]], int]:
    """Push a bar every ``record_every`` s and ask a question every ``question_every`` s
    (first ones at a random phase); returns the questions' (round trip, the server's own
    ``latency_ms``) in ms and how many pushes and questions the server refused (a 429/503 is retryable: the loop goes on, as a client
    would, and the phase reports them instead of the run dying on the first one)."""
    out: list[tuple[float, float]] = []
    refused = 0
    next_rec = t0 + s.rng.uniform(0, record_every)
    next_q = t0 + s.rng.uniform(0, question_every)
    end = t0 + duration
    while True:
        now = time.perf_counter()
        wake = min(next_rec, next_q)
        if wake >= end:
            return out, refused
        await asyncio.sleep(max(0.0, wake - now))
        if next_rec <= next_q:
            bar = s.bars[s.next_bar % len(s.bars)]
            s.next_bar += 1
            r = await client.post(f"{url}/v1/sessions/{s.sid}/data", json={"records": [bar.text()]})
            refused += _refused(r)
            next_rec += record_every
            continue
        kind = s.rng.choice(["trend", "high", "volume", "retrieval"])
        q = make_question(kind, s.bars[max(0, s.next_bar - 48):s.next_bar], s.rng)["question"]
        q0 = time.perf_counter()
        r = await client.post(f"{url}/v1/sessions/{s.sid}/query",
                              json={"question": q, "max_tokens": max_tokens, "temperature": 0.0})
        no = _refused(r)
        refused += no
        if not no:
            out.append(((time.perf_counter() - q0) * 1e3, r.json()["latency_ms"]))
        next_q += question_every


def _refused(r: httpx.Response) -> int:
    """1 for a retryable refusal (429, 503); any other error stops the run."""
    if r.status_code in (429, 503):
        return 1
    r.raise_for_status()
    return 0


def stream_stats(streams: list[Stream], wall: float) -> dict:
    """TTFT / TPOT percentiles (s, ms), output tokens/s and chunks/s, and decode stalls: every
    gap between two streamed chunks of one request (ms); the median gap stands for the median
    step. TPOT is per token (usage's completion tokens), not per chunk: with speculation one
    chunk carries every accepted draft, so per-chunk figures would charge PLD for its wins."""
    ok = [s for s in streams if s.stamps and not s.error]
    ttft = [s.stamps[0] - s.sent for s in ok]
    tpot = [(s.stamps[-1] - s.stamps[0]) / (s.completion_tokens - 1) * 1e3 for s in ok
            if len(s.stamps) > 1 and s.completion_tokens > 1]
    per_stream = [[(b - a) * 1e3 for a, b in zip(s.stamps, s.stamps[1:])] for s in ok if len(s.stamps) > 1]
    gaps = [g for one in per_stream for g in one]
    worst = [max(one) for one in per_stream]
    med = statistics.median(gaps) if gaps else float("nan")
    top = max(worst, default=float("nan"))
    return {"requests": len(streams), "errors": len(streams) - len(ok),
            "error_kinds": dict(collections.Counter(s.error[:200] for s in streams if s.error)),
            "ttft_p50_s": pct(ttft, 50),
            "ttft_p99_s": pct(ttft, 99), "tpot_p50_ms": pct(tpot, 50), "tpot_p99_ms": pct(tpot, 99),
            "gap_median_ms": med, "gap_max_ms": top, "gap_worst_p99_ms": pct(worst, 99), "gap_p99_ms": pct(gaps, 99),
            "stall_ratio": top / med if gaps else float("nan"),
            "output_chunks_per_s": sum(len(s.stamps) for s in ok) / wall if wall else 0.0,
            "output_tokens_per_s": sum(s.completion_tokens for s in ok) / wall if wall else 0.0}


async def run_phase(url: str, sessions: list[LiveSession], requests: list[Request], duration: float,
                    record_every: float, question_every: float, answer_tokens: int) -> dict:
    """Both loads for ``duration`` s; session latencies and the stateless streams' statistics."""
    limits = httpx.Limits(max_connections=len(requests) + len(sessions) + 8)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600), limits=limits) as client:
        t0 = time.perf_counter()
        sess = [session_loop(client, url, s, duration, t0, record_every, question_every, answer_tokens)
                for s in sessions]
        stateless = [chat_stream(client, url, r, t0) for r in requests]
        results = await asyncio.gather(*sess, *stateless)
        wall = time.perf_counter() - t0
    lat = [ms for r in results[:len(sessions)] for ms in r[0]]
    client, server = [c for c, _ in lat], [s for _, s in lat]
    streams = results[len(sessions):]
    # server: the query handler's own time (from its start to the answer); the round trip minus
    # it is HTTP, the event loop before the handler runs, and the client
    return {"session_queries": len(lat), "session_errors": sum(r[1] for r in results[:len(sessions)]),
            "session_p50_ms": pct(client, 50), "session_p99_ms": pct(client, 99),
            "session_server_p50_ms": pct(server, 50), "session_server_p99_ms": pct(server, 99),
            "session_outside_p50_ms": pct([c - s for c, s in lat], 50),
            "wall_s": wall, **stream_stats(list(streams), wall)}


async def burst(url: str, n: int, salt: str, user_tokens: int = 40, busy_tokens: int = 4096,
                busy_lead_s: float = 0.2) -> dict:
    """``n`` requests with one fresh (cold) shared tool system prompt, sent at once while the
    engine prefills a ``busy_tokens``-token prompt of its own (sent ``busy_lead_s`` before them;
    0 = none), so that the burst waits together, as it does on a busy server. On an idle engine
    the first arrival starts alone and the others find its blocks in the prefix cache with or
    without grouping (on 2026-12-02 both computed ~1,090 of ~5,800 tokens). Returns the prompt
    tokens the ``n`` computed (prompt - cached) and the time until the last one's first token."""
    system = tool_system_prompt(salt)
    text = prompt_text(50_000)
    reqs = [Request(busy_lead_s, [{"role": "system", "content": system},
                                  {"role": "user", "content": text[i * 500:i * 500 + 4 * user_tokens]}], 8, True)
            for i in range(n)]
    busy = [Request(0.0, [{"role": "user", "content": salt + text[10_000:10_000 + 4 * busy_tokens]}], 1, False)
            ] if busy_tokens else []
    async with httpx.AsyncClient(timeout=httpx.Timeout(600)) as client:
        t0 = time.perf_counter()
        streams = await asyncio.gather(*(chat_stream(client, url, r, t0) for r in [*busy, *reqs]))
        wall = time.perf_counter() - t0
    streams = streams[len(busy):]
    return {"requests": n, "busy_tokens": busy_tokens, "errors": sum(1 for s in streams if s.error),
            "prompt_tokens": sum(s.prompt_tokens for s in streams),
            "computed_tokens": sum(s.prompt_tokens - s.cached_tokens for s in streams),
            "ttft_max_s": max((s.stamps[0] - s.sent for s in streams if s.stamps), default=float("nan")),
            "wall_s": wall}
