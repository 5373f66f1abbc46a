"""Decode cadence: cap a step's prompt work so decoding sequences keep their inter-token gap.

A step that carries prompt chunks next to decodes takes longer than a decode-only step, and
every decoding sequence waits for it. With ``stall_factor`` F, while any sequence decodes or a
question prefills (``Proposing._allowance`` in ``propose.py``), the step's prompt chunks are
capped so the step is predicted to take at most F decode-only steps::

    step time  t  ~  d  +  sum over chunks of  cost(n, s)
    cost(n, s)    =  c * n  +  k * n * (s + n / 2)  +  m * s     n rows appended after s cached tokens
    allowance     =  max((F - 1) * d,  cost(min_tokens, 0))   (so prompts always progress)

    d: decode-only step (s)   c: s per row (the weights)   k: s per (row x context token) (attention)
    m: s per cached token a chunk reads once, whatever its rows (its KV, as a decode row reads it)

A row's cost grows with the context it attends to: on the AVX2-only EPYC (float32, SmolLM2-135M)
a 32-row chunk costs 2.0 ms per row after 0 cached tokens and 7.6 ms per row after 6,144
(``k / c`` ~ 1 / 2,400 tokens). A cap in rows alone let one bar appended to a long session
stall every decoder three times longer than a chat prompt's chunk of the same size. And a chunk
of a few rows still reads its whole context: on the Intel Xeon with AMX (bf16) ``m`` was ~2 us
per cached token, about what a decode row pays per context token, so four chunks of 2-48 rows
after 2,500-5,300 tokens (a question and three sessions' bars) made one 90 ms step beside 10 ms
decode steps while the two-term model priced them at a few ms (a step log of
``benchmarks/multitenant.py --configs cadence``, 2026-12-06).

``d`` is an exponential average of decode-only steps; ``c``, ``k`` and ``m`` an exponentially
weighted least-squares fit of the mixed steps (three features: rows, row x context, chunk
context), so the cap follows the machine, the model and the batch. Chunk sizes then depend on
timing; outputs do not (with ``numerics=invariant`` a chunk boundary never changes a bit). The
price is prefill throughput: small chunks run below the GEMMs' best rate and prompts wait longer
for their first token, which ``benchmarks/multitenant.py`` measures. Off by default.
"""
from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass
class CadenceStats:
    capped_steps: int = 0     # steps whose prompt rows the cap limited
    cap: int = 0              # prompt rows at context 0 the latest step with decoders allowed (0: none yet)
    decode_step_s: float = 0.0
    row_s: float = 0.0        # learned seconds per prompt row (c)
    row_context_s: float = 0.0  # learned seconds per (row x cached token it attends to) (k)
    read_s: float = 0.0       # learned seconds per cached token a chunk reads once (m)


def row_context(n: int, start: int) -> float:
    """The attention feature of a chunk: sum over its rows of the tokens each attends to."""
    return n * (start + n / 2)


def chunk_cost(n: int, start: int, row_s: float, row_context_s: float, read_s: float = 0.0) -> float:
    """Predicted seconds of ``n`` prompt rows appended after ``start`` cached tokens."""
    return row_s * n + row_context_s * row_context(n, start) + (read_s * start if n > 0 else 0.0)


@dataclass
class StepAllowance:
    """Prompt work one step with decoders may still carry (mutable, one per step)."""
    seconds: float
    row_s: float
    row_context_s: float
    read_s: float = 0.0
    taken: bool = False
    questions_whole: bool = True  # a question's rows are charged, never cut (else cut like any prompt's)

    def rows(self, start: int, n: int) -> int:
        """Most rows (<= n) of a chunk after ``start`` cached tokens that fit what is left; the
        step's first chunk gets at least one row."""
        # the largest m with c m + k m (start + m / 2) <= left, where left = seconds - read_s
        # start (the chunk reads its cached context once, whatever m): the positive root of
        # (k / 2) m^2 + b m - left, b = c + k start, in the form that does not cancel when
        # k << b (the textbook (sqrt(b^2 + 2 k left) - b) / k rounds to 0 rows for k ~ 1e-20)
        b, left = self.row_s + self.row_context_s * start, max(self.seconds - self.read_s * start, 0.0)
        den = math.sqrt(b * b + 2 * self.row_context_s * left) + b
        fit = 2 * left / den if den > 0 else (math.inf if left > 0 else 0.0)
        m = n if fit >= n else int(fit + 1e-9)
        return max(m, min(n, 1)) if not self.taken else m

    def take(self, start: int, n: int) -> None:
        self.seconds -= chunk_cost(n, start, self.row_s, self.row_context_s, self.read_s)
        self.taken = True


class StepCadence:
    """:meth:`observe` learns from each step; :meth:`allowance` answers for the next."""

    def __init__(self, factor: float, min_tokens: int = 32, alpha: float = 0.2, fit_alpha: float = 0.05) -> None:
        if not 1.0 < factor < math.inf:  # (NaN fails too: it would reach int() in the row count)
            raise ValueError(f"stall_factor must be a finite number > 1, got {factor}")
        if min_tokens < 1 or not 0.0 < alpha <= 1.0 or not 0.0 < fit_alpha <= 1.0:
            raise ValueError(f"need min_tokens >= 1 and alpha, fit_alpha in (0, 1], got {min_tokens}, "
                             f"{alpha}, {fit_alpha}")
        self.factor = factor
        self.min_tokens = min_tokens
        self.alpha = alpha
        self.fit_alpha = fit_alpha
        self.stats = CadenceStats()
        self._d: float | None = None  # decode-only step time
        self._fit = _CostFit()

    def _avg(self, old: float | None, new: float) -> float:
        return new if old is None else old + self.alpha * (new - old)

    def observe(self, decode_rows: int, prompt_rows: int, seconds: float, context: float = 0.0,
                reads: float = 0.0) -> None:
        """One executed step: its decode rows (one token each), prompt rows, their ``context``
        (sum of :func:`row_context` over its chunks), ``reads`` (sum of the chunks' cached
        tokens) and wall time."""
        if prompt_rows == 0:
            if decode_rows:
                self._d = self.stats.decode_step_s = self._avg(self._d, seconds)
            return
        if decode_rows and self._d is None and self._fit.known:
            # every step so far carried prompt rows (steady arrivals): the decode part of this
            # one, at the row costs learned so far, stands for d until a decode-only step comes
            prompt_s = self._fit.c * prompt_rows + self._fit.k * context + self._fit.m * reads
            self._d = self.stats.decode_step_s = max(seconds - prompt_s, 0.05 * seconds)
            return
        if not decode_rows and prompt_rows < self.min_tokens:
            # mostly the step's fixed cost: charged to a few rows it made one row after 4,500
            # tokens look as dear as the whole allowance, the next step got one row again, and
            # so on (1,463 one-row steps in 40 s, Zen 4); such steps teach nothing about rows
            return
        # a step without decoders still has the fixed cost: charging it to the rows errs on the
        # side of smaller chunks until a mixed step corrects it
        base = self._d if decode_rows and self._d is not None else 0.0
        self._fit.add(prompt_rows, context, reads, max(seconds - base, 0.0), self.fit_alpha)
        self.stats.row_s, self.stats.row_context_s, self.stats.read_s = self._fit.c, self._fit.k, self._fit.m

    def allowance(self, budget: int) -> StepAllowance | None:
        """Prompt work a step a decoder or a question waits on may carry (None until the row
        costs are known). Before any step with decoders has been seen, the floor chunk's cost
        (``min_tokens`` rows after no context) stands for ``d``, so the first step beside a
        decoder is capped too: it ran a whole chunk (a 1,012-row chat prompt beside the first
        decoder: 1,055 ms, 16.8x the median step, Zen 4)."""
        fit = self._fit
        if not fit.known:
            return None
        floor = chunk_cost(self.min_tokens, 0, fit.c, fit.k)
        d = self._d if self._d is not None else floor
        allow = StepAllowance(max((self.factor - 1.0) * d, floor), fit.c, fit.k, fit.m)
        self.stats.cap = min(budget, allow.rows(0, budget))
        return allow


class _CostFit:
    """Exponentially weighted least squares of ``y ~ c * p + k * a + m * r`` (all >= 0).

    The three together when the steps seen separate them; otherwise ``m`` stays as last
    fitted (0 before any) and ``c``, ``k`` are fitted to what is left. When the steps cannot
    separate those two either (every chunk at about the same context), the last separable
    ratio ``k / c`` is kept and only the scale is fitted (``k = 0`` before any)."""

    def __init__(self) -> None:
        self.s = [0.0] * 9  # decayed sums: pp, pa, aa, py, ay, pr, ar, rr, ry
        self.c = 0.0
        self.k = 0.0
        self.m = 0.0
        self._ratio = 0.0   # k / c of the last separable fit
        self.known = False

    def add(self, p: float, a: float, r: float, y: float, alpha: float) -> None:
        keep = 1.0 - alpha
        self.s = [keep * v for v in self.s]
        for i, v in enumerate((p * p, p * a, a * a, p * y, a * y, p * r, a * r, r * r, r * y)):
            self.s[i] += v
        pp, pa, aa, py, ay, pr, ar, rr, ry = self.s
        three = _solve3(((pp, pa, pr), (pa, aa, ar), (pr, ar, rr)), (py, ay, ry))
        if three is not None and min(three) >= 0 and three[0] + three[1] > 0:
            self.c, self.k, self.m = three
            self._ratio, self.known = (self.k / self.c if self.c > 0 else self._ratio), True
            return
        self._fit2(pp, pa, aa, py - self.m * pr, ay - self.m * ar)

    def _fit2(self, pp: float, pa: float, aa: float, py: float, ay: float) -> None:
        """``c`` and ``k`` from the sums, ``m``'s part already taken out of ``py`` and ``ay``."""
        det = pp * aa - pa * pa
        if aa > 0 and det > 1e-2 * pp * aa:  # separable: rows and context vary independently enough
            c, k = (py * aa - ay * pa) / det, (ay * pp - py * pa) / det
            if c >= 0 and k >= 0:
                self.c, self.k, self._ratio, self.known = c, k, (k / c if c > 0 else self._ratio), c + k > 0
                return
        r = self._ratio  # one feature: p + r * a, at the ratio kept
        den = pp + 2 * r * pa + r * r * aa
        scale = (py + r * ay) / den if den > 0 else 0.0
        self.c, self.k = max(scale, 0.0), max(scale, 0.0) * r
        self.known = self.c > 0


def _solve3(g: tuple[tuple[float, float, float], ...], b: tuple[float, float, float]) -> tuple[float, float, float] | None:
    """``g x = b`` for a symmetric 3x3 ``g`` (Cramer's rule), or None when a feature is
    (nearly) a combination of the others: det(g) <= 1e-3 x the product of its diagonal."""
    (a11, a12, a13), (_, a22, a23), (_, _, a33) = g

    def det(c1: tuple[float, ...], c2: tuple[float, ...], c3: tuple[float, ...]) -> float:
        return (c1[0] * (c2[1] * c3[2] - c3[1] * c2[2]) - c2[0] * (c1[1] * c3[2] - c3[1] * c1[2])
                + c3[0] * (c1[1] * c2[2] - c2[1] * c1[2]))

    cols = ((a11, a12, a13), (a12, a22, a23), (a13, a23, a33))
    d = det(*cols)
    if min(a11, a22, a33) <= 0 or d <= 1e-3 * a11 * a22 * a33:
        return None
    return (det(b, cols[1], cols[2]) / d, det(cols[0], b, cols[2]) / d, det(cols[0], cols[1], b) / d)
