"""The span-query optimizer: small named rewrite rules, applied to a fixed point.

Each rule maps one node to its rewrite (or ``None``: does not apply). :func:`optimize` walks
the tree bottom-up and applies every rule until nothing changes::

    desugar_chat          chat(m1..mn, s)                  -> gen(seq(m1..mn), s)
    desugar_retrieve      retrieve(c, i1..in)              -> plus(fragment(c[i1]) .. fragment(c[in]))
    flatten_seq           seq(a, seq(b, c), d) / seq(a)    -> seq(a, b, c, d) / a
    flatten_plus          plus(a, plus(b, c)) / plus(a)    -> plus(a, b, c) / a
    distribute_plus       plus(gen(seq(p, a)), gen(seq(p, b)))
                                                           -> seq(p, plus(gen(a), gen(b)))
    locality_k (opt-in)   gen(seq(pre, plus(g1..gn), post)), n > k
                                                           -> gen(seq(pre, plus(J1..Jm), post)),
                                                              Jj = gen(seq(plus(k of the g), post))
                                                              (an operand after pre: it reads pre once)

``distribute_plus`` resolves the dual-output paradox. An inner ``gen`` has two outputs: its
text (returned in ``inner``) and its span (its input and output, with the KV it computed).
A parent reuses the span exactly as the KV stored it, so the inner generation must have
seen the context the parent places it in: the operands' common prefix moves in front of
the ``plus``, every inner gen runs after it, and the parent's operands are their spans.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from typing import Callable, Mapping

from streamkv.spans.ir import Chat, Gen, Node, Plus, Retrieve, Seq, SpanQueryError, Text

Corpora = Mapping[str, Mapping[str, str]]


@dataclass(frozen=True)
class OptimizerOptions:
    """``locality_k``: split a gen over more than k inner gens into a k-way tree of judges
    (None: off). ``corpora``: name -> fragment id -> text, for ``retrieve``."""

    locality_k: int | None = None
    corpora: Corpora = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.locality_k is not None and (not isinstance(self.locality_k, int) or isinstance(self.locality_k, bool)
                                           or self.locality_k < 2):
            raise ValueError(f"locality_k must be an integer >= 2, got {self.locality_k!r}")


Rule = Callable[[Node, OptimizerOptions], "Node | None"]


def desugar_chat(node: Node, opts: OptimizerOptions) -> Node | None:
    if isinstance(node, Chat):
        return Gen(Seq(node.messages, origin=node.origin), node.sampling, origin=node.origin)
    return None


def desugar_retrieve(node: Node, opts: OptimizerOptions) -> Node | None:
    if isinstance(node, Retrieve):
        corpus = opts.corpora[node.corpus]  # checked by check_refs before optimizing
        at = node.origin or "retrieve"
        return Plus(tuple(Text("fragment", corpus[i], origin=f"{at}.ids[{k}]") for k, i in enumerate(node.ids)),
                    origin=node.origin)
    return None


def flatten_seq(node: Node, opts: OptimizerOptions) -> Node | None:
    return _flatten(node, Seq)


def flatten_plus(node: Node, opts: OptimizerOptions) -> Node | None:
    return _flatten(node, Plus)


def _flatten(node: Node, kind: type[Seq] | type[Plus]) -> Node | None:
    """A join of one child is the child; a join inside a join of the same kind is spliced in."""
    if not isinstance(node, kind):
        return None
    if len(node.children) == 1:
        return node.children[0]
    if any(isinstance(c, kind) for c in node.children):
        return replace(node, children=tuple(g for c in node.children
                                            for g in (c.children if isinstance(c, kind) else (c,))))
    return None


def distribute_plus(node: Node, opts: OptimizerOptions) -> Node | None:
    if not isinstance(node, Plus) or len(node.children) < 2:
        return None
    if not all(isinstance(c, Gen) and isinstance(c.input, Seq) and len(c.input.children) > 1
               for c in node.children):
        return None
    inputs = [c.input.children for c in node.children]  # type: ignore[union-attr]
    common = 0
    while (common < min(len(i) for i in inputs) - 1
           and all(i[common] == inputs[0][common] for i in inputs)):
        common += 1
    if not common:
        return None
    rest = tuple(replace(c, input=_join(i[common:], c.input.origin))  # type: ignore[union-attr]
                 for i, c in zip(inputs, node.children))
    return Seq(tuple(inputs[0][:common]) + (replace(node, children=rest),), origin=node.origin)


def locality_k(node: Node, opts: OptimizerOptions) -> Node | None:
    """A gen over a plus of more than k gens (its input, or a part of its input) becomes a
    k-way tree of judge gens over the same instruction (README "Attention locality")."""
    k = opts.locality_k
    if k is None or not isinstance(node, Gen):
        return None
    kids = node.input.children if isinstance(node.input, Seq) else (node.input,)  # a bare plus too
    at = next((i for i, c in enumerate(kids) if isinstance(c, Plus)
               and len(c.children) > k and all(isinstance(g, Gen) for g in c.children)), None)
    if at is None:
        return None
    pre, group, post = kids[:at], kids[at], kids[at + 1:]
    # a plus is order-free: which gens share a judge must not depend on the order they came in
    gens = tuple(sorted(group.children, key=repr))  # type: ignore[union-attr]
    # judges are new nodes, named after the gen they serve, one name per level of the tree
    # (judges over judges were named like the judges under them: a cached plus then kept one
    # judge's text for both, and a hit reported it twice)
    level = 1 + max(_judge_level(g.origin, node.origin) for g in gens)
    name = f"{node.origin or 'query'}.judge{level if level > 1 else ''}"
    # a judge is an operand after pre, so it reads pre once, as its gens do (with pre in its
    # own input too, distribute_plus moved that copy in front of the plus: pre twice, every
    # gen below it running after both, and twice again per level)
    # the gen's sampling, less logprobs: an inner gen returns text only (a client's inner gen
    # with logprobs is a 400), and logprobs would only keep a judge from drafting
    sampling = tuple((f, v) for f, v in node.sampling if f != "logprobs")
    judges = tuple(Gen(Seq((Plus(gens[j:j + k]),) + post), sampling, origin=f"{name}[{j // k}]")
                   for j in range(0, len(gens), k))
    return replace(node, input=Seq(pre + (replace(group, children=judges),) + post, origin=node.input.origin))


def _judge_level(origin: str | None, parent: str | None) -> int:
    """The level of a judge that :func:`locality_k` made for ``parent`` (0: not one)."""
    match = re.fullmatch(re.escape(f"{parent or 'query'}.judge") + r"(\d*)\[\d+\]", origin or "")
    return 0 if match is None else int(match.group(1) or 1)


def _join(children: tuple[Node, ...], origin: str | None = None) -> Node:
    return children[0] if len(children) == 1 else Seq(children, origin=origin)


RULES: tuple[Rule, ...] = (desugar_chat, desugar_retrieve, flatten_seq, flatten_plus, distribute_plus, locality_k)
MAX_PASSES = 64


def optimize(node: Node, opts: OptimizerOptions | None = None) -> Node:
    """Apply :data:`RULES` bottom-up until the tree stops changing."""
    opts = opts or OptimizerOptions()
    check_refs(node, opts.corpora)
    for _ in range(MAX_PASSES):
        new = _pass(node, opts)
        if new == node:
            return new
        node = new
    raise SpanQueryError("query", f"the optimizer did not converge in {MAX_PASSES} passes")


def _pass(node: Node, opts: OptimizerOptions) -> Node:
    # joins are spliced into their parents first (top-down), so a plus inside a plus is one plus
    # before any rule rewrites it: distribute_plus turned the inner plus of plus(plus(g1, g2), c)
    # into a seq, and the query differed from plus(g1, g2, c) (review)
    while True:  # (a one-child join among the children is its child first: plus(seq(plus(..)), c) too)
        if isinstance(node, (Seq, Plus)) and any(_single(c) for c in node.children):
            node = replace(node, children=tuple(_unwrapped(c) for c in node.children))
        flat = _flatten(node, Seq) or _flatten(node, Plus)
        if flat is None:
            break
        node = flat
    if isinstance(node, (Seq, Plus)):
        node = replace(node, children=tuple(_pass(c, opts) for c in node.children))
    elif isinstance(node, Gen):
        node = replace(node, input=_pass(node.input, opts))
    elif isinstance(node, Chat):
        node = replace(node, messages=tuple(_pass(m, opts) for m in node.messages))
    for rule in RULES:
        new = rule(node, opts)
        if new is not None:
            return new
    return node


def _single(node: Node) -> bool:
    return isinstance(node, (Seq, Plus)) and len(node.children) == 1


def _unwrapped(node: Node) -> Node:
    """``seq(x)`` and ``plus(x)``, at any depth, are ``x``."""
    while _single(node):
        node = node.children[0]  # type: ignore[union-attr]
    return node


def check_refs(node: Node, corpora: Corpora, path: str = "query") -> None:
    """Every ``retrieve`` names a known corpus and fragments; a ``gen``/``chat`` is not empty."""
    if isinstance(node, Retrieve):
        if node.corpus not in corpora:
            raise SpanQueryError(path, f"unknown corpus {node.corpus!r}")
        missing = [i for i in node.ids if i not in corpora[node.corpus]]
        if missing:
            raise SpanQueryError(path, f"corpus {node.corpus!r} has no fragment(s) {missing}")
    elif isinstance(node, (Seq, Plus)):
        for i, c in enumerate(node.children):
            check_refs(c, corpora, f"{path}.children[{i}]")
    elif isinstance(node, Gen):
        check_refs(node.input, corpora, f"{path}.input")
    elif isinstance(node, Chat):
        for i, m in enumerate(node.messages):
            check_refs(m, corpora, f"{path}.messages[{i}]")
