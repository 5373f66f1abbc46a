"""Span-query IR and optimizer: JSON round trip, errors that name the node path, and each
rewrite rule's left and right sides (no model needed)."""
from __future__ import annotations

import pytest

from streamkv.spans import ir
from streamkv.spans.ir import SpanQueryError, fragment, gen, plus, seq, system, user
from streamkv.spans.rules import (OptimizerOptions, desugar_chat, desugar_retrieve, distribute_plus, flatten_plus,
                                  flatten_seq, locality_k, optimize)

OPTS = OptimizerOptions()


def test_json_round_trip_and_builder_agree():
    tree = {"kind": "gen", "max_tokens": 8, "temperature": 0, "stop": ["\n"],
            "input": {"kind": "seq", "children": [
                {"kind": "system", "text": "s"},
                {"kind": "plus", "children": [{"kind": "fragment", "text": "a"}, {"kind": "fragment", "text": "b"}]},
                {"kind": "user", "text": "q"}]}}
    node = ir.parse(tree)
    assert node == gen(seq(system("s"), plus(fragment("a"), fragment("b")), user("q")),
                       max_tokens=8, temperature=0, stop=["\n"])
    assert ir.parse(ir.to_json(node)) == node
    assert ir.to_json(node) == tree
    assert "plus" in ir.draw(node)


@pytest.mark.parametrize("tree, path, words", [
    ({"kind": "nope"}, "query", "unknown kind"),
    ({"kind": "gen", "max_tokens": 3}, "query", "needs an 'input'"),
    ({"kind": "gen", "input": {"kind": "seq", "children": [{"kind": "user"}]}}, "query.input.children[0]",
     "string 'text'"),
    ({"kind": "gen", "input": {"kind": "user", "text": "x"}, "max_tokens": -1}, "query", "max_tokens"),
    ({"kind": "gen", "input": {"kind": "user", "text": "x"}, "colour": 1}, "query", "unexpected"),
    ({"kind": "plus", "children": []}, "query.children", "must not be empty"),
    ({"kind": "retrieve", "corpus": "c"}, "query.ids", "must be a list"),
    ([1, 2], "query", "must be an object"),
])
def test_bad_trees_name_the_node_path(tree, path, words):
    with pytest.raises(SpanQueryError) as err:
        ir.parse(tree)
    assert err.value.path == path and words in str(err.value)
    assert str(err.value).startswith(path + ":")


def test_depth_and_cycles_are_bounded():
    deep: dict = {"kind": "user", "text": "x"}
    for _ in range(ir.MAX_DEPTH + 2):
        deep = {"kind": "seq", "children": [deep]}
    with pytest.raises(SpanQueryError, match="deeper than"):
        ir.parse(deep)
    cyclic: dict = {"kind": "seq", "children": []}
    cyclic["children"].append(cyclic)  # a Python dict can be cyclic; JSON cannot
    with pytest.raises(SpanQueryError, match="cycle"):
        ir.parse(cyclic)


def test_unknown_corpus_and_fragment_are_named():
    corpora = {"wiki": {"a": "text a"}}
    with pytest.raises(SpanQueryError, match=r"query.input.children\[1\]: unknown corpus 'web'"):
        optimize(gen(seq(user("q"), ir.retrieve("web", "a"))), OptimizerOptions(corpora=corpora))
    with pytest.raises(SpanQueryError, match=r"has no fragment\(s\) \['b'\]"):
        optimize(gen(ir.retrieve("wiki", "a", "b")), OptimizerOptions(corpora=corpora))


# ------------------------------------------------------------------- the rules, left -> right
def test_desugar_chat():
    assert desugar_chat(ir.chat(system("s"), user("u"), max_tokens=4), OPTS) == gen(seq(system("s"), user("u")),
                                                                                   max_tokens=4)
    assert desugar_chat(user("u"), OPTS) is None


def test_desugar_retrieve():
    opts = OptimizerOptions(corpora={"c": {"x": "text x", "y": "text y"}})
    assert desugar_retrieve(ir.retrieve("c", "y", "x"), opts) == plus(fragment("text y"), fragment("text x"))


def test_flatten_seq():
    a, b, c = user("a"), user("b"), user("c")
    assert flatten_seq(seq(a, seq(b, c)), OPTS) == seq(a, b, c)
    assert flatten_seq(seq(a), OPTS) == a
    assert flatten_seq(seq(a, b), OPTS) is None


def test_flatten_plus():
    a, b, c = fragment("a"), fragment("b"), fragment("c")
    assert flatten_plus(plus(a, plus(b, c)), OPTS) == plus(a, b, c)
    assert flatten_plus(plus(a), OPTS) == a
    assert flatten_plus(plus(a, seq(b, c)), OPTS) is None  # a seq operand is one piece, not two


def test_distribute_plus_moves_the_shared_prefix_in_front():
    p, a, b = system("p"), user("a"), user("b")
    left = plus(gen(seq(p, a), max_tokens=3), gen(seq(p, b), max_tokens=3))
    assert distribute_plus(left, OPTS) == seq(p, plus(gen(a, max_tokens=3), gen(b, max_tokens=3)))
    assert distribute_plus(plus(gen(seq(p, a)), gen(seq(user("other"), b))), OPTS) is None
    assert distribute_plus(plus(fragment("x"), gen(seq(p, a))), OPTS) is None


def test_locality_k_builds_a_k_way_tree_of_judges():
    gens = [gen(user(f"name {i}"), max_tokens=2) for i in range(4)]
    pre, post = system("judge"), user("list every name")
    left = gen(seq(pre, plus(*gens), post), max_tokens=9)
    right = locality_k(left, OptimizerOptions(locality_k=2))
    judge = lambda gs: gen(seq(plus(*gs), post), max_tokens=9)  # noqa: E731  (after pre: it reads pre once)
    assert right == gen(seq(pre, plus(judge(gens[:2]), judge(gens[2:])), post), max_tokens=9)
    assert [j.origin for j in right.input.children[1].children] == ["query.judge[0]", "query.judge[1]"]
    assert locality_k(left, OPTS) is None  # opt-in
    assert locality_k(right, OptimizerOptions(locality_k=2)) is None  # fixed point: no plus over > k gens
    # a plus is order-free: the same judges for any order of its gens
    shuffled = gen(seq(pre, plus(gens[2], gens[0], gens[3], gens[1]), post), max_tokens=9)
    assert locality_k(shuffled, OptimizerOptions(locality_k=2)) == right


def test_locality_k_reads_the_prefix_once_at_every_level_and_names_each_level_apart():
    # judges carried pre in their own input too: distribute_plus moved that copy in front of
    # the plus, so the root read pre twice (8 gens), 32 times (64 gens), and every inner gen ran
    # after the copies; and judges over judges took the names of the judges under them
    pre, post = system("judge"), user("list every name")
    for n in (3, 8, 64):
        gens = [gen(user(f"name {i}"), max_tokens=2) for i in range(n)]
        right = optimize(gen(seq(pre, plus(*gens), post), max_tokens=9), OptimizerOptions(locality_k=2))
        assert ir.draw(right).count("system 'judge'") == 1, ir.draw(right)
        judges = [g.origin for g in ir.inner_gens(right) if g not in gens]
        assert len(judges) == len(set(judges)) == sum(-(-n // 2 ** lv) for lv in range(1, n.bit_length() + 1)
                                                       if -(-n // 2 ** (lv - 1)) > 2)
        assert "query.judge[0]" in judges and (n < 8 or "query.judge2[0]" in judges)
    # judges take the gen's sampling but logprobs, which an inner gen never returns
    gens = [gen(user(f"name {i}"), max_tokens=2) for i in range(3)]
    right = optimize(gen(seq(pre, plus(*gens), post), max_tokens=9, logprobs=2), OptimizerOptions(locality_k=2))
    assert right.sampling == (("logprobs", 2), ("max_tokens", 9))
    assert {j.sampling for j in ir.inner_gens(right) if j not in gens} == {(("max_tokens", 9),)}


def test_locality_k_applies_to_a_gen_whose_input_is_the_plus_itself():
    # seq(plus(gens)) flattens to the bare plus, which the rule never matched: k was ignored
    gens = [gen(user(f"name {i}"), max_tokens=2) for i in range(5)]
    opts = OptimizerOptions(locality_k=2)
    for left in (gen(plus(*gens), max_tokens=9), gen(seq(plus(*gens)), max_tokens=9)):
        right = optimize(left, opts)
        judges = [g for g in ir.inner_gens(right) if g not in gens]
        assert len(judges) >= 3, ir.draw(right)  # ceil(5 / 2) judges (and judges over them)
        assert all(len(p.children) <= 2 for p in _pluses(right))


def _pluses(node):
    if isinstance(node, ir.Plus):
        yield node
    for child in getattr(node, "children", ()) or ((node.input,) if isinstance(node, ir.Gen) else ()):
        yield from _pluses(child)


def test_origins_keep_the_clients_paths_through_the_optimizer():
    # distribute_plus moved the shared system message in front of the plus, so an inner gen at
    # query.input.children[0].children[1] was reported as query.input.children[1].children[1]
    ig = lambda t: gen(seq(system("Summarize."), fragment(t), user("Summary:")), max_tokens=4)  # noqa: E731
    tree = ir.with_origins(gen(seq(plus(ig("cat"), ig("rain")), user("Which?")), max_tokens=4))
    right = optimize(tree)
    assert right == optimize(gen(seq(plus(ig("cat"), ig("rain")), user("Which?")), max_tokens=4))  # no effect on equality
    assert sorted(g.origin for g in ir.inner_gens(right)) == [
        "query.input.children[0].children[0]", "query.input.children[0].children[1]"]
    assert all(repr(g).count("origin") == 0 for g in ir.inner_gens(right))  # nor on repr (cache keys, order)


def test_optimize_reaches_a_fixed_point():
    tree = ir.chat(system("s"), seq(user("u"), plus(plus(fragment("a")), fragment("b"))), max_tokens=2)
    out = optimize(tree)
    assert out == gen(seq(system("s"), user("u"), plus(fragment("a"), fragment("b"))), max_tokens=2)
    assert optimize(out) == out
    with pytest.raises(ValueError, match="locality_k"):
        OptimizerOptions(locality_k=1)


@pytest.mark.parametrize("tree, path", [
    (gen(seq(user("a"), plus()), max_tokens=3), "query.input.children[1].children"),  # IndexError
    (None, "query"), ("text", "query"), (gen(seq("raw")), "query.input.children[0]"),  # TypeError
    (gen(fragment(None)), "query.input"),  # AttributeError
])
def test_trees_built_in_python_are_checked_like_json_ones(tree, path):
    with pytest.raises(SpanQueryError) as exc:
        ir.with_origins(tree)
    assert exc.value.path == path
    deep = user("x")
    for _ in range(3000):  # RecursionError
        deep = seq(deep)
    with pytest.raises(SpanQueryError, match="deeper than"):
        ir.with_origins(gen(deep))
    with pytest.raises(ValueError, match="locality_k must be an integer"):
        OptimizerOptions(locality_k="2")  # TypeError


def test_equal_sampling_settings_make_one_span_cache_key():
    """``temperature: 0`` and ``0.0`` (or a top_p of 1 and 1.0) are one setting: one key, so a
    query written either way hits the other's cached answer."""
    from streamkv.spans.lower import GenSpec, gen_key

    def key(**sampling) -> bytes:
        return gen_key(GenSpec(gen(user("q"), **sampling).sampling, (1, 2)))

    assert key(temperature=0, top_p=1, max_tokens=4) == key(temperature=0.0, top_p=1.0, max_tokens=4)
    assert key(temperature=0, max_tokens=4) != key(temperature=0.5, max_tokens=4)
    assert key(stop=["\n"], max_tokens=4) == key(stop=("\n",), max_tokens=4) == key(stop="\n", max_tokens=4)
    assert key(max_tokens=4) == key(max_tokens=4, temperature=1.0, top_k=0)  # left out = sent at its default
    assert key(seed=5, max_tokens=4) != key(seed=6, max_tokens=4)


def test_a_plus_inside_a_plus_is_the_same_query_as_one_plus():
    """flatten_plus: plus(a, plus(b, c)) is plus(a, b, c). Rules ran bottom-up, so the inner
    plus of two gens on one prefix was distributed into a seq first and the two spellings gave
    different queries (37 against 43 prompt tokens, review)."""
    p = system("p")
    g1 = gen(seq(p, fragment("a")), max_tokens=2, temperature=0)
    g2 = gen(seq(p, fragment("b")), max_tokens=2, temperature=0)
    nested = gen(seq(system("s"), plus(plus(g1, g2), fragment("c")), user("q")), max_tokens=2, temperature=0)
    flat = gen(seq(system("s"), plus(g1, g2, fragment("c")), user("q")), max_tokens=2, temperature=0)
    assert optimize(nested, OPTS) == optimize(flat, OPTS)
    wrapped = gen(seq(system("s"), plus(seq(plus(g1, g2)), fragment("c")), user("q")), max_tokens=2, temperature=0)
    assert optimize(wrapped, OPTS) == optimize(flat, OPTS)  # seq(x) is x: one wrapper deeper too
