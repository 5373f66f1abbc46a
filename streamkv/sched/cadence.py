"""Decode cadence: cap a step's prompt rows so decoding sequences keep their inter-token gap.

A step that carries prompt chunks next to decodes takes longer than a decode-only step, and
every decoding sequence waits for it. With ``stall_factor`` F, while any sequence decodes, the
step's prompt rows are capped so the step is predicted to take at most F decode-only steps::

    step time  t  ~  d  +  c * p          d: decode-only step (s), c: s per prompt row, p: prompt rows
    cap        p <=  (F - 1) * d / c      (at least ``min_tokens``, so prompts always progress)

``d`` and ``c`` are learned online (exponential averages) from the engine's step times, so the
cap follows the machine, the model and the batch. Chunk sizes then depend on timing; outputs do
not (with ``numerics=invariant`` a chunk boundary never changes a bit). The price is prefill
throughput: small chunks run below the GEMMs' best rate and prompts wait longer for their
first token, which ``benchmarks/multitenant.py`` measures. Off by default.
"""
from __future__ import annotations

import math

from dataclasses import dataclass


@dataclass
class CadenceStats:
    capped_steps: int = 0     # steps whose prompt rows the cap limited
    cap: int = 0              # prompt rows allowed in the latest step with decoders (0: no cap yet)
    decode_step_s: float = 0.0
    row_s: float = 0.0        # learned seconds per prompt row


class StepCadence:
    """:meth:`observe` learns from each step; :meth:`prompt_rows` answers for the next."""

    def __init__(self, factor: float, min_tokens: int = 32, alpha: float = 0.2) -> None:
        if not 1.0 < factor < math.inf:  # (NaN fails too: it would reach int() in prompt_rows)
            raise ValueError(f"stall_factor must be a finite number > 1, got {factor}")
        if min_tokens < 1 or not 0.0 < alpha <= 1.0:
            raise ValueError(f"need min_tokens >= 1 and alpha in (0, 1], got {min_tokens}, {alpha}")
        self.factor = factor
        self.min_tokens = min_tokens
        self.alpha = alpha
        self.stats = CadenceStats()
        self._d: float | None = None  # decode-only step time
        self._c: float | None = None  # seconds per prompt row

    def _avg(self, old: float | None, new: float) -> float:
        return new if old is None else old + self.alpha * (new - old)

    def observe(self, decode_rows: int, prompt_rows: int, seconds: float) -> None:
        """One executed step: its decode rows (one token each), prompt rows and wall time."""
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
        self._c = self.stats.row_s = self._avg(self._c, max(seconds - base, 0.0) / prompt_rows)

    def prompt_rows(self, budget: int) -> int:
        """Most prompt rows a step with decoders may carry (``budget`` until both costs are known)."""
        if self._d is None or not self._c:
            return budget
        cap = int((self.factor - 1.0) * self._d / self._c)
        self.stats.cap = max(self.min_tokens, min(budget, cap))
        return self.stats.cap
