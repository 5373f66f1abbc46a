"""Span-query IR: an expression tree of generate calls over text pieces.

::

    gen(max_tokens=32)                      a generate: its input, joined, is the prompt
     └─ seq                                 non-commutative join (order matters)
         ├─ system "You answer from the documents."
         ├─ plus                            commutative join: operands do not see each other
         │   ├─ fragment "doc A ..."        and are reusable at any position
         │   └─ fragment "doc B ..."
         └─ user "Which document mentions owls?"

Sugar: ``chat`` (a ``gen`` over a ``seq`` of messages) and ``retrieve`` (fragments of a
named corpus joined by ``plus``); :mod:`streamkv.spans.rules` removes both.

Nodes are frozen (hashable) dataclasses. :func:`parse` turns the JSON shape of the HTTP API
into nodes and rejects bad trees before any work, naming the node's path
(``query.input.children[2]``); :func:`to_json` is its inverse.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Iterator, Mapping, Union

from streamkv.errors import InvalidRequestError
from streamkv.sampling.params import SamplingParams

MESSAGE_KINDS = ("system", "user", "assistant")
TEXT_KINDS = MESSAGE_KINDS + ("fragment",)
MAX_DEPTH = 32
MAX_NODES = 4096
# sampling fields a gen / chat node may carry (the fields of /v1/completions that SamplingParams knows)
SAMPLING_FIELDS = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "presence_penalty", "logprobs",
                   "frequency_penalty", "repetition_penalty", "seed", "stop", "ignore_eos", "min_tokens")


class SpanQueryError(InvalidRequestError):
    """A malformed span query; the message starts with the offending node's path."""

    def __init__(self, path: str, message: str) -> None:
        super().__init__(f"{path}: {message}")
        self.path, self.message = path, message

    def under(self, root: str) -> SpanQueryError:
        """The same error with the tree's root path ``query`` read as ``root`` (a bulk's ``queries[i]``)."""
        rest = self.path[len("query"):] if self.path.startswith("query") else f".{self.path}"
        return SpanQueryError(root + rest, self.message)


@dataclass(frozen=True)
class Text:
    """A message (``system`` / ``user`` / ``assistant``: one chat-template turn) or a ``fragment``
    (raw text, no template)."""

    kind: str
    text: str
    origin: str | None = field(default=None, repr=False, compare=False)  # its path in the client's tree


@dataclass(frozen=True)
class Seq:
    children: tuple["Node", ...]
    origin: str | None = field(default=None, repr=False, compare=False)  # its path in the client's tree


@dataclass(frozen=True)
class Plus:
    children: tuple["Node", ...]
    origin: str | None = field(default=None, repr=False, compare=False)  # its path in the client's tree


@dataclass(frozen=True)
class Gen:
    """Generate from ``input``; ``sampling`` holds (field, value) pairs, sorted (hashable)."""

    input: "Node"
    sampling: tuple[tuple[str, Any], ...] = ()
    origin: str | None = field(default=None, repr=False, compare=False)  # its path in the client's tree

    def params(self) -> SamplingParams:
        return SamplingParams(**dict(self.sampling))


@dataclass(frozen=True)
class Chat:
    messages: tuple["Node", ...]
    sampling: tuple[tuple[str, Any], ...] = ()
    origin: str | None = field(default=None, repr=False, compare=False)  # its path in the client's tree


@dataclass(frozen=True)
class Retrieve:
    corpus: str
    ids: tuple[str, ...]
    origin: str | None = field(default=None, repr=False, compare=False)  # its path in the client's tree


Node = Union[Text, Seq, Plus, Gen, Chat, Retrieve]


def kind_of(node: Node) -> str:
    """A node's ``kind`` as the JSON form spells it."""
    if isinstance(node, Text):
        return node.kind
    return {Seq: "seq", Plus: "plus", Gen: "gen", Chat: "chat"}.get(type(node), "retrieve")


# ---------------------------------------------------------------------- builder
def system(text: str) -> Text:
    return Text("system", text)


def user(text: str) -> Text:
    return Text("user", text)


def assistant(text: str) -> Text:
    return Text("assistant", text)


def fragment(text: str) -> Text:
    return Text("fragment", text)


def seq(*children: Node) -> Seq:
    return Seq(tuple(children))


def plus(*children: Node) -> Plus:
    return Plus(tuple(children))


def gen(input: Node, **sampling: Any) -> Gen:
    return Gen(input, _sampling(sampling, "gen"))


def chat(*messages: Node, **sampling: Any) -> Chat:
    return Chat(tuple(messages), _sampling(sampling, "chat"))


def retrieve(corpus: str, *ids: str) -> Retrieve:
    return Retrieve(corpus, tuple(ids))


def _sampling(fields: Mapping[str, Any], path: str) -> tuple[tuple[str, Any], ...]:
    unknown = sorted(set(fields) - set(SAMPLING_FIELDS))
    if unknown:
        raise SpanQueryError(path, f"unknown field(s) {unknown}; sampling fields are {list(SAMPLING_FIELDS)}")
    items = tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in fields.items()))
    try:
        SamplingParams(**dict(items))
    except (TypeError, ValueError) as exc:
        raise SpanQueryError(path, str(exc)) from None
    return items


# ------------------------------------------------------------------------ JSON
def parse(obj: Any, path: str = "query") -> Node:
    """Build a tree from its JSON shape; raises :class:`SpanQueryError` naming the node path."""
    counter = [0]
    return _parse(obj, path, 0, counter)


def _parse(obj: Any, path: str, depth: int, counter: list[int]) -> Node:
    _count_node(path, depth, counter)
    if not isinstance(obj, Mapping):
        raise SpanQueryError(path, f"a node must be an object with a 'kind', got {type(obj).__name__}")
    kind = obj.get("kind")
    fields = {k: v for k, v in obj.items() if k != "kind"}
    if kind in TEXT_KINDS:
        _only(fields, {"text"}, path)
        text = fields.get("text")
        if not isinstance(text, str):
            raise SpanQueryError(path, f"a {kind} node needs a string 'text'")
        return Text(kind, text)
    if kind in ("seq", "plus"):
        _only(fields, {"children"}, path)
        kids = _list(fields.get("children"), f"{path}.children", nonempty=True)
        nodes = tuple(_parse(c, f"{path}.children[{i}]", depth + 1, counter) for i, c in enumerate(kids))
        return Seq(nodes) if kind == "seq" else Plus(nodes)
    if kind == "gen":
        if "input" not in fields or fields["input"] is None:
            raise SpanQueryError(path, "a gen node needs an 'input'")
        _only(fields, {"input", *SAMPLING_FIELDS}, path)
        inner = _parse(fields.pop("input"), f"{path}.input", depth + 1, counter)
        return Gen(inner, _sampling(fields, path))
    if kind == "chat":
        _only(fields, {"messages", *SAMPLING_FIELDS}, path)
        msgs = _list(fields.pop("messages", None), f"{path}.messages", nonempty=True)
        nodes = tuple(_parse(m, f"{path}.messages[{i}]", depth + 1, counter) for i, m in enumerate(msgs))
        return Chat(nodes, _sampling(fields, path))
    if kind == "retrieve":
        _only(fields, {"corpus", "ids"}, path)
        corpus, ids = fields.get("corpus"), _list(fields.get("ids"), f"{path}.ids", nonempty=True)
        if not isinstance(corpus, str) or not corpus:
            raise SpanQueryError(path, "a retrieve node needs a 'corpus' name")
        if not all(isinstance(i, str) for i in ids):
            raise SpanQueryError(f"{path}.ids", "fragment ids must be strings")
        return Retrieve(corpus, tuple(ids))
    raise SpanQueryError(path, f"unknown kind {kind!r}; kinds are "
                               f"{list(TEXT_KINDS) + ['seq', 'plus', 'gen', 'chat', 'retrieve']}")


def _only(fields: Mapping[str, Any], allowed: set[str], path: str) -> None:
    extra = sorted(set(fields) - allowed)
    if extra:
        raise SpanQueryError(path, f"unexpected field(s) {extra}")


def with_origins(node: Node, path: str = "query") -> Node:
    """``node`` with every node's ``origin`` set to its path in this tree (the client's): the
    optimizer moves and merges nodes, and an inner gen's report or an error must still name
    the node the client wrote. Origins never take part in equality, hashing or ``repr``.
    Checks what :func:`parse` checks of JSON, for trees built in Python (a bare ``plus()`` or
    a tree 3,000 levels deep failed deep inside): SpanQueryError naming the node."""
    return _stamp(node, path, 0, [0])


def _count_node(path: str, depth: int, counter: list[int]) -> None:
    """One more node at ``depth``: SpanQueryError past MAX_DEPTH levels or MAX_NODES nodes."""
    if depth > MAX_DEPTH:
        raise SpanQueryError(path, f"the tree is deeper than {MAX_DEPTH} levels (or has a cycle)")
    counter[0] += 1
    if counter[0] > MAX_NODES:
        raise SpanQueryError(path, f"the tree has more than {MAX_NODES} nodes")


def _stamp(node: Node, path: str, depth: int, counter: list[int]) -> Node:
    _count_node(path, depth, counter)
    if isinstance(node, (Seq, Plus)):
        _nonempty(node.children, f"{path}.children")
        kids = tuple(_stamp(c, f"{path}.children[{i}]", depth + 1, counter) for i, c in enumerate(node.children))
        return replace(node, children=kids, origin=path)
    if isinstance(node, Gen):
        return replace(node, input=_stamp(node.input, f"{path}.input", depth + 1, counter), origin=path)
    if isinstance(node, Chat):
        _nonempty(node.messages, f"{path}.messages")
        msgs = tuple(_stamp(m, f"{path}.messages[{i}]", depth + 1, counter) for i, m in enumerate(node.messages))
        return replace(node, messages=msgs, origin=path)
    if isinstance(node, Text):
        if node.kind not in TEXT_KINDS or not isinstance(node.text, str):
            raise SpanQueryError(path, f"a text node needs a kind in {list(TEXT_KINDS)} and a string text")
    elif not isinstance(node, Retrieve) or not isinstance(node.corpus, str) or not all(
            isinstance(i, str) for i in node.ids):
        raise SpanQueryError(path, f"a node must be text, seq, plus, gen, chat or retrieve, got {type(node).__name__}")
    return replace(node, origin=path)


def _nonempty(items: object, path: str) -> None:
    if not isinstance(items, tuple) or not items:
        raise SpanQueryError(path, "must be a non-empty sequence of nodes")


def inner_gens(node: Node, root: bool = True) -> Iterator[Gen | Chat]:
    """Every gen and chat below the root ``node``."""
    if isinstance(node, (Gen, Chat)) and not root:
        yield node
    for child in (node.children if isinstance(node, (Seq, Plus)) else (node.input,) if isinstance(node, Gen)
                  else node.messages if isinstance(node, Chat) else ()):
        yield from inner_gens(child, root=False)


def _list(value: Any, path: str, nonempty: bool) -> list[Any]:
    if not isinstance(value, list):
        raise SpanQueryError(path, f"must be a list, got {type(value).__name__}")
    if nonempty and not value:
        raise SpanQueryError(path, "must not be empty")
    return value


def to_json(node: Node) -> dict[str, Any]:
    """The JSON shape of ``node`` (``parse(to_json(n)) == n``)."""
    if isinstance(node, Text):
        return {"kind": node.kind, "text": node.text}
    if isinstance(node, (Seq, Plus)):
        return {"kind": kind_of(node), "children": [to_json(c) for c in node.children]}
    if isinstance(node, Gen):
        return {"kind": "gen", "input": to_json(node.input), **_json_sampling(node.sampling)}
    if isinstance(node, Chat):
        return {"kind": "chat", "messages": [to_json(m) for m in node.messages], **_json_sampling(node.sampling)}
    return {"kind": "retrieve", "corpus": node.corpus, "ids": list(node.ids)}


def _json_sampling(items: tuple[tuple[str, Any], ...]) -> dict[str, Any]:
    return {k: list(v) if isinstance(v, tuple) else v for k, v in items}


def draw(node: Node, indent: str = "") -> str:
    """An indented text drawing of the tree (one node per line)."""
    if isinstance(node, Text):
        text = node.text if len(node.text) <= 48 else node.text[:45] + "..."
        return f"{indent}{node.kind} {text!r}\n"
    if isinstance(node, (Seq, Plus)):
        return f"{indent}{kind_of(node)}\n" + "".join(draw(c, indent + "  ") for c in node.children)
    if isinstance(node, Gen):
        args = ", ".join(f"{k}={v}" for k, v in node.sampling)
        return f"{indent}gen({args})\n" + draw(node.input, indent + "  ")
    if isinstance(node, Chat):
        return f"{indent}chat\n" + "".join(draw(m, indent + "  ") for m in node.messages)
    return f"{indent}retrieve {node.corpus}:{','.join(node.ids)}\n"
