"""HTTP client for a running ``streamkv serve``: live sessions (``push``/``query``/``events``).

    from streamkv.client import Client
    client = Client("http://127.0.0.1:8000")
    s = client.create_session(system="You watch sensor data.", retention_tokens=4096)
    s.push(["t=1 temp=20.5", "t=2 temp=20.7"])
    print(s.query("What is the latest temperature?").answer)
    for event in s.events():          # data_updated, evicted, dropped, offloaded ...
        ...
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Iterator

import httpx


class APIStatusError(Exception):
    """The server answered 4xx/5xx; ``status`` and the OpenAI-style ``body`` are attached."""

    def __init__(self, status: int, body: Any) -> None:
        message = body.get("error", {}).get("message") if isinstance(body, dict) else str(body)
        super().__init__(f"HTTP {status}: {message}")
        self.status = status
        self.body = body


@dataclass
class Answer:
    answer: str
    data_version: int
    usage: dict[str, int]
    latency_ms: float
    finish_reason: str | None
    source: str
    raw: dict[str, Any]


class Client:
    def __init__(self, base_url: str = "http://127.0.0.1:8000", api_key: str | None = None,
                 timeout: float = 120.0) -> None:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.base_url = base_url.rstrip("/")
        self.http = httpx.Client(base_url=self.base_url, headers=headers, timeout=timeout)

    def request(self, method: str, path: str, **kwargs: Any) -> Any:
        resp = self.http.request(method, path, **kwargs)
        if resp.status_code >= 400:
            try:
                body = resp.json()
            except ValueError:
                body = resp.text
            raise APIStatusError(resp.status_code, body)
        return resp.json()

    def create_session(self, system: str = "", **spec: Any) -> RemoteSession:
        info = self.request("POST", "/v1/sessions", json={"system": system, **spec})
        return RemoteSession(self, info["id"])

    def session(self, session_id: str) -> RemoteSession:
        return RemoteSession(self, session_id)

    def list_sessions(self) -> list[dict[str, Any]]:
        return self.request("GET", "/v1/sessions")["data"]

    def close(self) -> None:
        self.http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class RemoteSession:
    def __init__(self, client: Client, session_id: str) -> None:
        self.client = client
        self.id = session_id

    def push(self, records: list[str]) -> dict[str, Any]:
        """Queue records; returns at once with ``data_version`` (the version they will become)."""
        return self.client.request("POST", f"/v1/sessions/{self.id}/data", json={"records": records})

    def query(self, question: str, max_tokens: int = 64, temperature: float = 0.0, **sampling: Any) -> Answer:
        body = self.client.request("POST", f"/v1/sessions/{self.id}/query",
                                   json={"question": question, "max_tokens": max_tokens,
                                         "temperature": temperature, **sampling})
        return Answer(body["answer"], body["data_version"], body["usage"], body["latency_ms"],
                      body.get("finish_reason"), body.get("source", "session"), body)

    def migrate(self, to: str | None = None) -> dict[str, Any]:
        """Move the session to another replica (a ``streamkv serve --replicas N`` cluster)."""
        return self.client.request("POST", f"/v1/sessions/{self.id}/migrate", json={"to": to} if to else {})

    def stats(self, include_tokens: bool = False) -> dict[str, Any]:
        return self.client.request("GET", f"/v1/sessions/{self.id}",
                                   params={"include_tokens": str(include_tokens).lower()})

    def delete(self) -> None:
        self.client.request("DELETE", f"/v1/sessions/{self.id}")

    def events(self, timeout: float | None = None) -> Iterator[dict[str, Any]]:
        """Server-sent events of this session, as dicts with an ``event`` key (blocking)."""
        with self.client.http.stream("GET", f"/v1/sessions/{self.id}/events",
                                     timeout=httpx.Timeout(10.0, read=timeout)) as resp:
            if resp.status_code >= 400:
                resp.read()
                raise APIStatusError(resp.status_code, resp.json())
            for data in _sse_data(resp.iter_lines()):
                yield json.loads(data)


def _sse_data(lines: Iterator[str]) -> Iterator[str]:
    buf: list[str] = []
    for line in lines:
        if not line:
            if buf:
                yield "\n".join(buf)
                buf = []
        elif line.startswith("data:"):
            buf.append(line[5:].lstrip())
