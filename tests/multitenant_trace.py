"""Replay one seed of the multi-tenant fuzz (``tests/test_multitenant_fuzz.py``) and print the
scheduler's state step by step through the drain: what to look at when a seed livelocks.

    .venv/bin/python -m tests.multitenant_trace 23061 --skip 3000 --steps 12
    .venv/bin/python -m tests.multitenant_trace 2475 --heavy --skip 3000 --steps 12

Per step: free blocks, each scheduled chunk ``(seq, start, end)``, the preempted, starved and
stalled sequences; then every sequence that holds KV or waits with rows computed (status,
pinned, partial, swapped, rows computed / high-water mark / tokens, blocks held, class,
forked rows) and every session (where its KV is, its stream and ready fork, queued records).
"""
from __future__ import annotations

import argparse
from typing import Any

from streamkv.engine.engine import Engine
from streamkv.sched.plan import StepPlan
from streamkv.sched.sequence import SeqStatus
from tests.test_multitenant_fuzz import setup


def show(step: int, engine: Engine, plan: StepPlan, sessions: list[Any]) -> None:
    sched, kv = engine.scheduler, engine.kv
    work = [(w.seq_id, w.start, w.start + len(w.token_ids)) for w in plan.seqs]
    print(f"--- step {step}: free {engine.pool.num_free}, work {work}, preempted {list(plan.preempted)}, "
          f"starved {sorted(sched.starved)}, stalled {sorted(sched.stalled)}")
    for s in sched.seqs.values():
        if s.status is SeqStatus.WAITING and not s.num_computed and not s.swapped and not s.reads_to:
            continue
        print(f"  seq {s.seq_id} {s.status.name.lower()} pinned={int(s.pinned)} partial={int(s.partial)} "
              f"swapped={int(s.swapped)} rows {s.num_computed}/{s.reads_to}/{len(s.tokens)} "
              f"blocks {kv.num_blocks_held(s.seq_id)} {s.klass.name} forked={s.forked_rows}")
    for ss in sessions:
        print(f"  session {ss.id[-6:]} {ss.where} stream={ss.stream.seq_id if ss.stream else None} "
              f"ready={ss.ready.seq_id if ss.ready else None} v{ss.data.data_version} "
              f"(ready v{ss.ready_version}) queued {len(ss.data.queue)}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("seed", type=int)
    ap.add_argument("--skip", type=int, default=0, help="drain steps to run before printing")
    ap.add_argument("--steps", type=int, default=20, help="drain steps to print")
    ap.add_argument("--heavy", action="store_true", help="the session-heavy small-pool variant")
    args = ap.parse_args()
    cfg, engine, sessions, _, _ = setup(args.seed, args.heavy)
    print("config", cfg)
    plans: list[StepPlan] = []
    schedule = engine.scheduler.schedule
    engine.scheduler.schedule = lambda: plans.append(schedule()) or plans[-1]  # type: ignore[method-assign]
    for step in range(args.skip + args.steps):
        if not engine.has_unfinished():
            print(f"drained after {step} steps")
            return
        engine.step()
        if step >= args.skip:
            show(step, engine, plans[-1], sessions)


if __name__ == "__main__":
    main()
