"""A parent for the tests' ``streamkv serve`` processes that has already imported what a
server imports (torch, the app, uvicorn: ~3.7 s of each start on a 2-vCPU AMD EPYC Zen 3).

The harness (``tests/server_harness.py``) starts one per test run and speaks JSON lines on
its stdin/stdout; each ``spawn`` forks a child that runs ``streamkv.cli.main(argv)`` exactly
as ``python -m streamkv.cli`` would (its output to the log file, stdin from /dev/null), and
the zygote reaps it::

    harness ──{"op": "spawn", "argv": [...], "log": path}──▶ zygote ──fork──▶ server child
            ◀─{"pid": N}──────────────────────────────────┘
    harness ──{"op": "poll", "pid": N}──▶ zygote (waitpid WNOHANG) ──▶ {"rc": null | code}

Invariant: the zygote never runs a torch op, starts no thread of its own and holds no lock
when it forks. Importing torch starts OpenBLAS's worker thread, which OpenBLAS's own
``pthread_atfork`` handlers stop and restart around a fork; nothing else runs.
"""
from __future__ import annotations

import json
import os
import sys
import traceback


def _child(argv: list[str], log: str) -> None:
    """In the forked child: the server's stdio, then the CLI; exits like ``python -m``."""
    out = os.open(log, os.O_WRONLY | os.O_APPEND)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(out, 1)
    os.dup2(out, 2)
    os.close(out)
    os.close(null)
    sys.argv = ["streamkv", *argv]
    from streamkv.cli import main

    try:
        code = main(argv)
    except Exception:  # as ``python -m`` would: the traceback, exit status 1
        traceback.print_exc()
        code = 1
    sys.exit(code)  # propagates out of the zygote's loop: a normal interpreter exit


def _reply(pid: int, op: str, known: dict[int, int]) -> dict:
    if op == "poll":
        if pid not in known:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                known[pid] = os.waitstatus_to_exitcode(status)
        return {"rc": known.get(pid)}
    raise ValueError(f"unknown op {op!r}")


def main() -> None:
    import uvicorn  # noqa: F401
    import streamkv.cli  # noqa: F401
    import streamkv.server.app  # noqa: F401
    import streamkv.server.run  # noqa: F401

    known: dict[int, int] = {}  # reaped child -> its exit code (negative: killed by that signal)
    print(json.dumps({"ready": os.getpid()}), flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        try:
            if req["op"] == "spawn":
                pid = os.fork()
                if pid == 0:
                    _child(req["argv"], req["log"])
                reply = {"pid": pid}
            else:
                reply = _reply(int(req["pid"]), req["op"], known)
        except Exception as exc:  # an answer, never a dead zygote
            reply = {"error": f"{type(exc).__name__}: {exc}"}
        print(json.dumps(reply), flush=True)


if __name__ == "__main__":
    main()
