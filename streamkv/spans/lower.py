"""Lowering: an optimized tree becomes token pieces and ``plus`` groups (no tensors, no engine).

The layout of a generate, and where each span's KV is computed vs placed::

    computed at   [ prefix 0..P | A: P..P+a | B: P..P+b | tail ]   each operand right after the prefix
    placed at     [ prefix 0..P | A: P..P+a | B: P+a..P+a+b | P+a+b.. ]   keys rotated by their delta
    attends to      causal        prefix + A   prefix + B     everything before it

Operands are put in a canonical order (by content hash), so permuting a ``plus`` changes
nothing, token for token. Each state of the computation has a key that depends only on how
it was built (``state_key``): the span cache stores states under it.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, fields
from typing import Any, Callable, Union

from streamkv.errors import InvalidRequestError, check_unicode
from streamkv.sampling.params import SamplingParams
from streamkv.spans.ir import Gen, Node, Plus, Seq, SpanQueryError, Text

ROOT_KEY = b"streamkv-span-root"


def digest(*parts: Any) -> bytes:
    return hashlib.blake2b(repr(parts).encode(), digest_size=16).digest()


@dataclass(frozen=True)
class Piece:
    """Text tokens computed causally after the current state."""

    ids: tuple[int, ...]
    path: str

    @property
    def key(self) -> bytes:
        return digest("t", self.ids)


@dataclass(frozen=True)
class GenSpec:
    """A generate at the end of a span: the generation prompt, then sampled tokens."""

    sampling: tuple[tuple[str, Any], ...]
    prompt: tuple[int, ...]

    @property
    def params(self) -> SamplingParams:
        return SamplingParams(**dict(self.sampling))

    @property
    def cacheable(self) -> bool:
        """A sampled output is reused only if it is reproducible (greedy or seeded)."""
        p = self.params
        return p.temperature == 0.0 or p.seed is not None


@dataclass(frozen=True)
class PlusPlan:
    operands: tuple["SpanPlan", ...]  # canonical order: by content key
    path: str

    @property
    def key(self) -> bytes:
        return digest("p", tuple(o.key for o in self.operands))

    @property
    def reproducible(self) -> bool:
        return all(o.reproducible for o in self.operands)


Segment = Union[Piece, PlusPlan]


@dataclass(frozen=True)
class SpanPlan:
    """Segments computed one after the other from a base state, then (``gen``) a generate."""

    segments: tuple[Segment, ...]
    path: str
    gen: GenSpec | None = None

    @property
    def key(self) -> bytes:
        return digest("s", tuple(s.key for s in self.segments), None if self.gen is None else gen_key(self.gen))

    @property
    def reproducible(self) -> bool:
        """Every generate inside is greedy or seeded: its states may be cached and reused."""
        return ((self.gen is None or self.gen.cacheable)
                and all(s.reproducible for s in self.segments if isinstance(s, PlusPlan)))

    def max_len(self) -> int:
        """Tokens this span adds to its base state at most (outputs at ``max_tokens``)."""
        n = sum(len(s.ids) if isinstance(s, Piece) else sum(o.max_len() for o in s.operands)
                for s in self.segments)
        return n + (len(self.gen.prompt) + self.gen.params.max_tokens if self.gen else 0)


def inner_paths(plus: PlusPlan) -> list[str]:
    """The paths of every generate inside ``plus``, its operands in their canonical order, each
    operand's segments first, then its own gen: one order for every query with the same key."""
    out: list[str] = []
    for op in plus.operands:
        for seg in op.segments:
            if isinstance(seg, PlusPlan):
                out += inner_paths(seg)
        if op.gen is not None:
            out.append(op.path)
    return out


def state_key(parent: bytes, item: bytes) -> bytes:
    """Key of the state reached from ``parent`` by one more segment or generate."""
    return digest(parent, item)


def gen_key(gen: GenSpec) -> bytes:
    """One key per generation prompt and sampling setting, however the query spelled it (a
    field left out or sent at its default, ``0`` or ``0.0``, ``"x"`` or ``["x"]``)."""
    params = gen.params
    settings = tuple((f.name, _same_spelling(getattr(params, f.name))) for f in fields(params) if f.compare)
    return digest("g", settings, gen.prompt)


def _same_spelling(value: Any) -> Any:
    """Numbers as floats (exact: sampling fields are small), so ``0`` and ``0.0`` are one value."""
    return float(value) if isinstance(value, int) and not isinstance(value, bool) and abs(value) <= 1 << 53 else value


class Renderer:
    """Token ids of messages (one chat-template turn each), fragments and generation prompts."""

    _PROBE = {"role": "system", "content": "x"}

    def __init__(self, tokenizer: Any) -> None:
        self.tok = tokenizer
        self.has_template = getattr(tokenizer, "chat_template", None) is not None
        self.bos = tuple(tokenizer.encode("", add_special_tokens=True))

    def text(self, node: Text) -> tuple[int, ...]:
        check_unicode(node.text)  # before the template: the offset is the node's own
        if node.kind == "fragment" or not self.has_template:
            return tuple(self.tok.encode(node.text))
        head = self.tok.apply_chat_template([self._PROBE], add_generation_prompt=False)
        full = self.tok.apply_chat_template([self._PROBE, {"role": node.kind, "content": node.text}],
                                            add_generation_prompt=False)
        return tuple(self.tok.encode(full[len(head):]))

    def generation_prompt(self) -> tuple[int, ...]:
        if not self.has_template:
            return ()
        msgs = [self._PROBE, {"role": "user", "content": "x"}]
        plain = self.tok.apply_chat_template(msgs, add_generation_prompt=False)
        full = self.tok.apply_chat_template(msgs, add_generation_prompt=True)
        return tuple(self.tok.encode(full[len(plain):]))


def lower(root: Node, renderer: Renderer, max_len: int) -> SpanPlan:
    """The plan of an optimized tree whose root is a ``gen``; raises SpanQueryError."""
    if not isinstance(root, Gen):
        raise SpanQueryError("query", f"the root must be a gen or chat node, got {type(root).__name__.lower()}")
    plan = _gen(root, "query", renderer)
    if renderer.bos:
        plan = SpanPlan((Piece(renderer.bos, "bos"),) + plan.segments, plan.path, plan.gen)
    total = plan.max_len()
    if total >= max_len:
        raise SpanQueryError("query", f"the query needs up to {total} tokens (prompt and max_tokens of "
                                      f"every gen) but the context is {max_len}")
    return plan


def lower_prepare(prefix: Node | None, fragments: dict[str, str], renderer: Renderer,
                  max_len: int) -> tuple[SpanPlan, list[SpanPlan]]:
    """A corpus preparation: the prefix's plan and one operand per fragment, each to be
    computed right after the prefix, as a ``plus`` in a query with that prefix computes it."""
    segments = _segments(prefix, "prefix", renderer) if prefix is not None else ()
    if any(not isinstance(s, Piece) for s in segments):
        raise SpanQueryError("prefix", "a preparation prefix must be text (messages or fragments)")
    plan = SpanPlan(((Piece(renderer.bos, "bos"),) if renderer.bos else ()) + segments, "prefix")
    ops = [SpanPlan((Piece(renderer.text(Text("fragment", t)), f"fragments[{fid!r}]"),), f"fragments[{fid!r}]")
           for fid, t in fragments.items()]
    longest = plan.max_len() + max((o.max_len() for o in ops), default=0)
    if longest >= max_len:
        raise SpanQueryError("prefix", f"prefix and fragment need {longest} tokens; the context is {max_len}")
    return plan, ops


def _gen(node: Gen, path: str, r: Renderer) -> SpanPlan:
    path = node.origin or path  # the client's path (the optimizer moves nodes)
    try:
        node.params()
    except (TypeError, ValueError) as exc:
        raise SpanQueryError(path, str(exc)) from None
    segments = _segments(node.input, f"{path}.input", r)
    if not segments:
        raise SpanQueryError(path, "a gen needs a non-empty input")
    return SpanPlan(segments, path, GenSpec(node.sampling, r.generation_prompt()))


def _segments(node: Node, path: str, r: Renderer) -> tuple[Segment, ...]:
    items = node.children if isinstance(node, Seq) else (node,)
    paths = [f"{path}.children[{i}]" for i in range(len(items))] if isinstance(node, Seq) else [path]
    out: list[Segment] = []
    for item, p in zip(items, paths):
        p = item.origin or p
        if isinstance(item, Text):
            try:
                ids = r.text(item)
            except InvalidRequestError as exc:  # e.g. a lone surrogate: name the node
                raise SpanQueryError(p, str(exc)) from None
            if ids:
                _append_piece(out, Piece(ids, p))
        elif isinstance(item, Seq):
            for seg in _segments(item, p, r):
                _append_piece(out, seg) if isinstance(seg, Piece) else out.append(seg)
        elif isinstance(item, Plus):
            ops = [_operand(c, f"{p}.children[{i}]", r) for i, c in enumerate(item.children)]
            out.append(PlusPlan(tuple(sorted(ops, key=lambda o: o.key)), p))
        elif isinstance(item, Gen):  # an inner gen in sequence: a plus of one operand
            out.append(PlusPlan((_gen(item, p, r),), p))
        else:
            raise SpanQueryError(p, f"{type(item).__name__.lower()} must be optimized away before lowering")
    return tuple(out)


def _operand(node: Node, path: str, r: Renderer) -> SpanPlan:
    path = node.origin or path
    if isinstance(node, Gen):
        return _gen(node, path, r)
    segments = _segments(node, path, r)
    if not segments:
        raise SpanQueryError(path, "a plus operand must not be empty")
    return SpanPlan(segments, path)


def _append_piece(out: list[Segment], piece: Piece) -> None:
    # one state per text node (not merged with its neighbours): a piece is reusable wherever
    # the same nodes precede it, e.g. a prepared fragment after the same system message
    out.append(piece)


def layout(plan: SpanPlan, cached: Callable[[bytes], bool]) -> list[dict[str, Any]]:
    """Where every span of ``plan`` is computed and placed, and whether its state is cached."""
    rows: list[dict[str, Any]] = []
    _walk(plan, ROOT_KEY, 0, 0, 0, rows, cached)
    return rows


def _walk(plan: SpanPlan, key: bytes, computed: int, placed: int, depth: int,
          rows: list[dict[str, Any]], cached: Callable[[bytes], bool]) -> tuple[bytes, int]:
    """Appends rows for ``plan`` run from state ``key`` at ``computed`` (placed at ``placed``);
    returns the end state's key and length."""
    n = 0
    for seg in plan.segments:
        if isinstance(seg, Piece):
            key = state_key(key, seg.key)
            rows.append({"path": seg.path, "kind": "text", "depth": depth, "tokens": len(seg.ids),
                         "computed_at": computed + n, "placed_at": placed + n, "cached": cached(key)})
            n += len(seg.ids)
            continue
        plus_key = state_key(key, seg.key)
        off = 0
        for op in seg.operands:
            rows.append({"path": op.path, "kind": "gen" if op.gen else "operand", "depth": depth,
                         "tokens": op.max_len(), "computed_at": computed + n, "placed_at": placed + n + off,
                         "cached": cached(plus_key) or cached(_end_key(op, key))})
            if op.gen is None and len(op.segments) == 1 and isinstance(op.segments[0], Piece):
                off += len(op.segments[0].ids)  # one piece: its row above says it all
                continue
            _, used = _walk(op, key, computed + n, placed + n + off, depth + 1, rows, cached)
            off += used
        key, n = plus_key, n + off
    if plan.gen is not None:
        rows.append({"path": plan.path, "kind": "generate", "depth": depth,
                     "tokens": len(plan.gen.prompt) + plan.gen.params.max_tokens,
                     "computed_at": computed + n, "placed_at": placed + n, "cached": False})
        key, n = state_key(key, gen_key(plan.gen)), n + len(plan.gen.prompt) + plan.gen.params.max_tokens
    return key, n


def _end_key(plan: SpanPlan, key: bytes) -> bytes:
    for seg in plan.segments:
        key = state_key(key, seg.key)
    return state_key(key, gen_key(plan.gen)) if plan.gen is not None else key


def draw_layout(rows: list[dict[str, Any]]) -> str:
    lines = []
    for r in rows:
        mark = "hit " if r["cached"] else "miss"
        lines.append(f"{'  ' * r['depth']}{r['kind']:<8} {r['path']:<40} {r['tokens']:>6} tok  "
                     f"computed@{r['computed_at']:<6} placed@{r['placed_at']:<6} {mark}")
    return "\n".join(lines) + "\n"


def check_ids(plan: SpanPlan, vocab: int) -> None:
    for seg in plan.segments:
        if isinstance(seg, Piece):
            bad = next((t for t in seg.ids if not 0 <= t < vocab), None)
            if bad is not None:
                raise InvalidRequestError(f"{seg.path}: token id {bad} is outside the vocabulary")
        else:
            for op in seg.operands:
                check_ids(op, vocab)
