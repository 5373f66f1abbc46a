"""Offline API: ``LLM(model=None).generate(prompts, params)``."""
from __future__ import annotations

import itertools
from typing import TYPE_CHECKING, Any, Sequence as Seq

from streamkv.config import EngineConfig
from streamkv.engine.engine import Engine
from streamkv.engine.outputs import RequestOutput
from streamkv.errors import InvalidRequestError, is_int_in
from streamkv.sampling.params import SamplingParams

if TYPE_CHECKING:
    from streamkv.inputs.local import InputHandle
    from streamkv.sessions.local import LocalSession

Prompt = str | Seq[int]


class LLM:
    """Synchronous generation on one engine.

    Keyword options are the fields of the config dataclasses in ``streamkv.config``
    (``dtype``, ``max_num_seqs``, ``kv_cache_memory``, ``enable_prefix_caching``, ...).
    """

    def __init__(self, model: str | None = None, dtype: str = "auto", show_progress: bool = False,
                 **options: Any) -> None:
        self.config = EngineConfig.from_flat(model=model, dtype=dtype, **options)
        self.engine = Engine(self.config, show_progress=show_progress)
        self._ids = itertools.count()

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    def generate(self, prompts: Prompt | Seq[Prompt], params: SamplingParams | Seq[SamplingParams] | None = None,
                 priority: int | Seq[int] = 0, kv_write: dict[str, Any] | None = None,
                 kv_read: dict[str, Any] | None = None) -> list[RequestOutput]:
        """Generate for every prompt (strings or token-id lists); outputs keep input order.
        ``kv_write`` / ``kv_read``: KV policies for every prompt (``{"policy": ..., ...}``)."""
        batch = _as_batch(prompts)
        plist = _broadcast(params or SamplingParams(), len(batch), "params")
        prio = _broadcast(priority, len(batch), "priority")
        ids = [f"llm-{next(self._ids)}" for _ in batch]
        kv = {"kv_write": kv_write, "kv_read": kv_read}
        return self._run_together([lambda rid=rid, a=a, p=p, pr=pr: self.engine.add_request(rid, a, p, priority=pr, **kv)
                                   for rid, a, p, pr in zip(ids, batch, plist, prio)], ids)

    def _run_together(self, starts: list[Any], ids: list[str]) -> list[RequestOutput]:
        """Call every ``starts[i]()`` (which adds request ``ids[i]``), then step until all
        finish; outputs in order. If one start fails, those already added are aborted."""
        added: list[str] = []
        try:
            for start, rid in zip(starts, ids):
                start()
                added.append(rid)
        except Exception:
            for rid in added:
                self.engine.abort(rid)
            self.engine.step()
            raise
        done = self.engine.run_to_completion(ids)
        return [done[rid] for rid in ids]

    def session(self, system: str = "", **spec: Any) -> "LocalSession":
        """A live session (see :class:`streamkv.sessions.spec.SessionSpec` for the options)."""
        from streamkv.sessions.local import LocalSession
        from streamkv.sessions.spec import SessionSpec

        return LocalSession(self.engine, SessionSpec(system=system, **spec))

    def open_input(self, source: str | Seq[dict[str, str]] = "", params: SamplingParams | None = None,
                   priority: int = 0, kv_write: dict[str, Any] | None = None,
                   kv_read: dict[str, Any] | None = None) -> "InputHandle":
        """A streaming-input request: ``source`` is the prompt text so far, or chat messages whose
        last (user) message is the growing text. Returns a handle with ``append``, ``update``,
        ``finish``, ``result`` (and ``advance`` to prefill what has arrived). ``kv_write`` /
        ``kv_read``: KV policies, applied once the input is finished."""
        from streamkv.inputs.local import InputHandle

        rid = f"llm-in-{next(self._ids)}"
        if not isinstance(source, (str, list, tuple)):
            raise InvalidRequestError(f"open_input takes the text so far or a list of chat messages, "
                                      f"got {type(source).__name__}")
        prompt, messages = (source, None) if isinstance(source, str) else (None, list(source))
        self.engine.inputs.open(rid, prompt, messages, params, priority, kv_write=kv_write, kv_read=kv_read)
        self.engine.keep_output(rid)
        return InputHandle(self.engine, rid)

    def span_queries(self, queries: Any, locality_k: int | None = None,
                     priority: int = 0) -> list[RequestOutput]:
        """Run span queries (``streamkv.spans``: trees from ``streamkv.spans.ir`` or their JSON
        shape), together; each output's ``metrics["spans"]`` has its usage and inner outputs."""
        from streamkv.spans.ir import parse

        batch = list(queries) if isinstance(queries, (list, tuple)) else [queries]
        trees = [parse(q) if isinstance(q, dict) else q for q in batch]
        ids = [f"llm-span-{next(self._ids)}" for _ in trees]
        return self._run_together([lambda rid=rid, t=t: self.engine.spans.submit(rid, t, priority, locality_k)
                                   for rid, t in zip(ids, trees)], ids)

    def span_bulk(self, queries: Seq[Any], order: str = "clustered", concurrency: int = 4,
                  locality_k: int | None = None) -> tuple[list[RequestOutput], list[int]]:
        """Run many span queries, at most ``concurrency`` at a time, in ``order``: ``"given"``,
        or ``"clustered"`` (queries sharing spans run close together, ``streamkv.spans.bulk``).
        Returns the outputs in input order and the execution order."""
        from streamkv.spans.bulk import cluster_order
        from streamkv.spans.ir import parse

        if order not in ("clustered", "given") or not is_int_in(concurrency, 1):
            raise InvalidRequestError(f"order must be 'clustered' or 'given' and concurrency an integer >= 1, "
                                      f"got {order!r}, {concurrency!r}")
        if not isinstance(queries, (list, tuple)):
            raise InvalidRequestError(f"queries must be a list of span queries, got {type(queries).__name__}")
        trees = [parse(q) if isinstance(q, dict) else q for q in queries]
        plans = [self.engine.spans.plan(t, locality_k)[1] for t in trees]
        run = cluster_order(plans) if order == "clustered" else list(range(len(trees)))
        ids = {i: f"llm-span-{next(self._ids)}" for i in run}
        pending, live, done = list(run), set(), {}
        while pending or live:
            while pending and len(live) < concurrency:
                i = pending.pop(0)
                self.engine.spans.submit(ids[i], trees[i], 0, locality_k)
                live.add(ids[i])
            for out in self.engine.step():
                if out.finished and out.request_id in live:
                    live.discard(out.request_id)
                    done[out.request_id] = out
        return [done[ids[i]] for i in range(len(trees))], run

    def step(self) -> list[RequestOutput]:
        """Advance the engine one step (background ingestion of in-process sessions)."""
        return self.engine.step()

    def chat(self, messages: Seq[dict[str, str]] | Seq[Seq[dict[str, str]]],
             params: SamplingParams | Seq[SamplingParams] | None = None) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation or a list of them."""
        if not isinstance(messages, (list, tuple)) or not messages:
            raise InvalidRequestError("messages must be a non-empty list")
        convs = [messages] if isinstance(messages[0], dict) else list(messages)
        prompts = [self.tokenizer.apply_chat_template(list(c), add_generation_prompt=True) for c in convs]
        return self.generate(prompts, params)


def _as_batch(prompts: Prompt | Seq[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    if isinstance(prompts, (list, tuple)) and prompts and all(isinstance(t, int) for t in prompts):
        return [list(prompts)]  # type: ignore[arg-type]
    if not isinstance(prompts, (list, tuple)) or not prompts:
        raise InvalidRequestError("prompts must be a string, a list of token ids, or a non-empty list of those")
    return list(prompts)


def _broadcast(value: Any, n: int, name: str) -> list[Any]:
    if isinstance(value, (list, tuple)):
        if len(value) != n:
            raise InvalidRequestError(f"{name} has {len(value)} entries for {n} prompts")
        return list(value)
    return [value] * n
