"""Decode cadence: cap a step's prompt rows so decoding sequences keep their inter-token gap.

A step that carries prompt chunks next to decodes takes longer than a decode-only step, and
every decoding sequence waits for it. With ``stall_factor`` F, while any sequence decodes, the
step's prompt chunks are limited so the step is predicted to take at most F decode-only steps::

    step time  t  ~  d  +  a * P  +  b * A     d: decode-only step (s)
                                               P: prompt rows, a: s per row (weights, norms)
                                               A: keys those rows attend to, b: s per key
    a chunk of n rows from context s costs  a n + b (n s + n (n + 1) / 2)
    the step's chunks share  (F - 1) * d  of time (at least ``min_tokens`` rows in all, so
    prompts always progress)

The attention term matters for appends to a long context (a record pushed to a 6,000-token
session costs several times a chat prompt's row). ``d``, ``a`` and ``b`` are learned online
from the engine's step times: ``d`` and a per-row cost as exponential averages, ``(a, b)`` by
exponentially weighted least squares over the mixed steps, used once it is well conditioned
and non-negative (before that: ``b = 0`` and the per-row cost). Chunk sizes then depend on
timing; outputs do not (with ``numerics=invariant`` a chunk boundary never changes a bit). The
price is prefill throughput: small chunks run below the GEMMs' best rate and prompts wait
longer for their first token, which ``benchmarks/multitenant.py`` measures. Off by default.
"""
from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass
class CadenceStats:
    capped_steps: int = 0     # steps whose prompt rows the cap limited
    cap: int = 0              # prompt rows a chunk at the start of a context may carry (0: no cap yet)
    decode_step_s: float = 0.0
    row_s: float = 0.0        # learned seconds per prompt row
    key_s: float = 0.0        # learned seconds per key a prompt row attends to (0: not fitted)


@dataclass
class PromptAllowance:
    """One step's time for prompt chunks; :meth:`take` grants each chunk what fits."""

    seconds: float
    row_s: float
    key_s: float
    min_rows: int
    granted: int = 0

    def cost(self, start: int, n: int) -> float:
        """Predicted seconds of ``n`` prompt rows from context position ``start``."""
        return self.row_s * n + self.key_s * (n * start + n * (n + 1) / 2)

    def take(self, start: int, n: int) -> int:
        """Rows (<= ``n``) of a chunk from ``start`` this step may carry; charges them."""
        left = max(self.seconds, 0.0)
        if self.key_s > 0.0:
            lin = self.row_s + self.key_s * (start + 0.5)
            fit = int((-lin + math.sqrt(lin * lin + 2.0 * self.key_s * left)) / self.key_s)
        else:
            fit = int(left / self.row_s) if self.row_s > 0.0 else n
        m = min(n, max(fit, self.min_rows - self.granted))
        m = max(m, 0)
        self.seconds -= self.cost(start, m)
        self.granted += m
        return m


class StepCadence:
    """:meth:`observe` learns from each step; :meth:`allowance` answers for the next."""

    def __init__(self, factor: float, min_tokens: int = 32, alpha: float = 0.2) -> None:
        if factor <= 1.0:
            raise ValueError(f"stall_factor must be > 1, got {factor}")
        if min_tokens < 1 or not 0.0 < alpha <= 1.0:
            raise ValueError(f"need min_tokens >= 1 and alpha in (0, 1], got {min_tokens}, {alpha}")
        self.factor = factor
        self.min_tokens = min_tokens
        self.alpha = alpha
        self.stats = CadenceStats()
        self._d: float | None = None  # decode-only step time
        self._c: float | None = None  # seconds per prompt row (attention folded in)
        self._s = [0.0] * 5           # decayed sums: PP, PA, AA, Py, Ay (mixed steps)

    def _avg(self, old: float | None, new: float) -> float:
        return new if old is None else old + self.alpha * (new - old)

    def observe(self, decode_rows: int, prompt_rows: int, seconds: float, prompt_keys: int = 0) -> None:
        """One executed step: its decode rows (one token each), prompt rows, the keys those
        prompt rows attended to in all (``prompt_keys``), and its wall time."""
        if prompt_rows == 0:
            if decode_rows:
                self._d = self.stats.decode_step_s = self._avg(self._d, seconds)
            return
        if decode_rows and self._d is None and self._c is not None:
            # every step so far carried prompt rows (steady arrivals): the decode part of this
            # one, at the row cost learned so far, stands for d until a decode-only step comes
            self._d = self.stats.decode_step_s = max(seconds - self._c * prompt_rows, 0.05 * seconds)
            return
        # a step without decoders still has the fixed cost: charging it to the rows errs on the
        # side of smaller chunks until a mixed step corrects it
        base = self._d if decode_rows and self._d is not None else 0.0
        y = max(seconds - base, 0.0)
        self._c = self.stats.row_s = self._avg(self._c, y / prompt_rows)
        keep = 1.0 - self.alpha
        p, a = float(prompt_rows), float(prompt_keys)
        self._s = [keep * s + x for s, x in zip(self._s, (p * p, p * a, a * a, p * y, a * y))]

    def costs(self) -> tuple[float, float] | None:
        """(seconds per prompt row, seconds per attended key), or None before a row cost is known."""
        if self._c is None:
            return None
        pp, pa, aa, py, ay = self._s
        det = pp * aa - pa * pa
        if aa > 0.0 and det > 1e-6 * pp * aa:  # the rows' contexts varied enough to tell a from b
            row, key = (aa * py - pa * ay) / det, (pp * ay - pa * py) / det
            if row >= 0.0 and key > 0.0:
                self.stats.key_s = key
                return row, key
        self.stats.key_s = 0.0
        return self._c, 0.0

    def allowance(self, budget: int) -> PromptAllowance | None:
        """This step's prompt-chunk allowance while sequences decode (None until ``d`` and the
        row cost are known: no cap)."""
        costs = self.costs()
        if self._d is None or costs is None or not self._c:
            return None
        allow = PromptAllowance((self.factor - 1.0) * self._d, costs[0], costs[1], self.min_tokens)
        probe = PromptAllowance(allow.seconds, allow.row_s, allow.key_s, self.min_tokens)
        self.stats.cap = probe.take(0, budget)
        return allow

    def prompt_rows(self, budget: int) -> int:
        """Rows one chunk at the start of a context may carry in a step with decoders
        (``budget`` until both costs are known)."""
        allow = self.allowance(budget)
        return budget if allow is None else allow.take(0, budget)
