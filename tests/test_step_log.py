"""``--step-log PATH``: one JSON line per executed step, matching the plans the runner got."""
from __future__ import annotations

import dataclasses
import json

import pytest

from streamkv.config import RuntimeConfig
from streamkv.engine.engine import Engine
from streamkv.sampling.params import SamplingParams
from streamkv.sched.sequence import PriorityClass
from tests.fakes import fake_engine


def _logged(tmp_path, **kw) -> tuple[Engine, object]:
    engine, runner = fake_engine(**kw)
    config = dataclasses.replace(engine.config, runtime=RuntimeConfig(step_log=str(tmp_path / "steps.jsonl")))
    return Engine(config, engine.bundle), runner


def test_every_step_is_one_line_with_its_plan(tmp_path):
    engine, runner = _logged(tmp_path, budget=16, speculation="none")
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    engine.add_request("a", list(range(1, 41)), params)  # 40 prompt rows: three 16-row chunks
    engine.add_request("q", list(range(1, 7)), params, klass=PriorityClass.SESSION)
    engine.run_to_completion(["a", "q"])
    lines = [json.loads(x) for x in (tmp_path / "steps.jsonl").read_text().splitlines()]
    assert len(lines) == len(runner.plans) == engine.stats.steps > 0
    for line, plan in zip(lines, runner.plans, strict=True):
        assert line["s"] >= 0 and line["t"] > 1e9
        assert [s[:5] for s in line["seqs"]] == [[it.seq_id, it.start, len(it.token_ids), int(it.sample),
                                                 len(it.draft)] for it in plan.seqs]
    classes = {s[0]: s[5] for line in lines for s in line["seqs"]}
    assert sorted(classes.values()) == [int(PriorityClass.SESSION), int(PriorityClass.POOL)]
    assert sum(s[2] for line in lines for s in line["seqs"]) == 40 + 6 + 2 * 4  # prompts, then 4 decodes each


def test_an_unwritable_path_is_a_value_error(tmp_path):
    with pytest.raises(ValueError, match="step_log .* cannot be written"):
        _logged(tmp_path / "missing-dir" / "x")


def test_a_log_that_fails_later_fails_no_request(tmp_path, caplog):
    """The path becomes unwritable after start (here a directory takes its place): the steps and
    their requests go on, the log stops with one warning."""
    engine, _ = _logged(tmp_path, speculation="none")
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    path = tmp_path / "steps.jsonl"
    path.unlink()
    path.mkdir()
    engine.add_request("a", list(range(1, 9)), params)
    out = engine.run_to_completion(["a"])["a"]
    plain, _ = fake_engine(speculation="none")
    plain.add_request("a", list(range(1, 9)), params)
    assert out.error is None and out.token_ids == plain.run_to_completion(["a"])["a"].token_ids
    assert engine.step_log.failed and caplog.text.count("cannot be written") == 1
