"""SLO-aware step sizing: how many tokens the next step may compute so that the requests already
decoding keep their time per output token (TPOT) under a target.

A step's time is about `a + b * prefill_tokens + c * decodes`: a fixed part (launch, weights read
once), a compute cost per prompt token, and a cost per decoding sequence (its one token plus
reading its KV context). The two per-item costs differ (on an H200, ~24 us per prefill token
against ~12 us per decode at batch 256; on a CPU the ratio is another), so one slope over all
tokens mispredicts steps that mix them. `StepCostModel` fits a, b and c online from the steps the
engine measures (recursive least squares, older steps forgotten geometrically), and `SloBudget`
turns a TPOT target into the step's token budget: with decodes running, the prefill chunks get
what fits in `target - a - c * decodes`; with none running, the whole budget goes to first tokens.
Picked once when the engine is built: without a target the scheduler uses its fixed budget.

A target never starves admission: when the steps keep using all of the prefill share the target
leaves (prompts are waiting) for longer than `max_starve_s`, the share grows to the whole budget
over as long again, and falls back once a step leaves some of it unused. At a load the target
cannot sustain, TTFT stays bounded and TPOT gives way (at 231bf73 a 20 ms target at 32 req/s on
the H200 held TPOT p50 at 16 ms while TTFT p50 grew to 37 s: the queue only grew).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

_N = 3  # features: 1, prefill tokens, decodes


class StepCostModel:
    """seconds ~= a + b * prefill_tokens + c * decodes, fitted online (recursive least squares
    with forgetting)."""

    def __init__(self, forget: float = 0.98, prior: tuple[float, float, float] = (0.0, 0.0, 0.0)) -> None:
        self.forget = forget
        self.theta = list(prior)
        self._p = [[1e3 if i == j else 0.0 for j in range(_N)] for i in range(_N)]  # the prior gives way at once
        self.observed = 0
        # the last step observed: its prompt tokens and decodes (SloBudget's sign of waiting prompts)
        self.last_prefill_tokens = 0
        self.last_decodes = 0
        # how well it predicts: |predicted - measured| / measured, summed over steps after the 8th
        self._rel_err_sum = 0.0
        self._rel_err_n = 0

    def observe(self, prefill_tokens: int, seconds: float, decodes: int = 0) -> None:
        """One measured step: `prefill_tokens` prompt tokens and `decodes` decoding sequences."""
        if prefill_tokens + decodes <= 0 or seconds <= 0:
            return
        self.last_prefill_tokens, self.last_decodes = prefill_tokens, decodes
        x = (1.0, float(prefill_tokens), float(decodes))
        p, th = self._p, self.theta
        px = [sum(p[i][j] * x[j] for j in range(_N)) for i in range(_N)]
        denom = self.forget + sum(x[i] * px[i] for i in range(_N))
        k = [v / denom for v in px]
        err = seconds - sum(th[i] * x[i] for i in range(_N))
        if self.observed >= 8:
            self._rel_err_sum += abs(err) / seconds
            self._rel_err_n += 1
        self.theta = [th[i] + k[i] * err for i in range(_N)]
        xp = [sum(x[i] * p[i][j] for i in range(_N)) for j in range(_N)]  # x^T P (P is symmetric)
        self._p = [[(p[i][j] - k[i] * xp[j]) / self.forget for j in range(_N)] for i in range(_N)]
        self.observed += 1

    @property
    def mean_rel_error(self) -> float | None:
        """Mean |predicted - measured| / measured of the steps predicted so far (after 8 to learn on)."""
        return self._rel_err_sum / self._rel_err_n if self._rel_err_n else None

    def predict(self, prefill_tokens: int, decodes: int = 0) -> float:
        """Predicted seconds of a step."""
        return self.theta[0] + self.theta[1] * prefill_tokens + self.theta[2] * decodes

    @property
    def fixed_s(self) -> float:
        """The per-step cost that does not depend on the work (a), never below 0."""
        return max(0.0, self.theta[0])

    @property
    def per_token_s(self) -> float:
        """The cost of one more prompt token (b), never below a nanosecond."""
        return max(1e-9, self.theta[1])

    @property
    def per_decode_s(self) -> float:
        """The cost of one more decoding sequence (c), never below 0."""
        return max(0.0, self.theta[2])


@dataclass
class SloBudget:
    """The token budget of the next step under a TPOT target.

    `max_tokens`: the engine's budget (max_num_batched_tokens); `min_prefill`: prefill tokens a
    step may always take while decodes run (so a flood of decodes never starves first tokens);
    `warmup_steps`: steps measured before the model is trusted (until then: the full budget);
    `max_starve_s`: how long steps may use all of the target's prefill share before it grows
    (linearly, to the whole budget over as long again); `clock`: seconds, monotonic.
    """

    tpot_target_s: float
    max_tokens: int
    min_prefill: int = 64
    warmup_steps: int = 8
    model: StepCostModel | None = None
    max_starve_s: float = 0.25
    clock: Callable[[], float] = field(default=time.monotonic, repr=False)
    _starved_since: float | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.model is None:
            self.model = StepCostModel()

    def __call__(self, num_decodes: int) -> int:
        """Tokens the next step may compute, `num_decodes` of them decodes."""
        m = self.model
        assert m is not None
        if num_decodes == 0 or m.observed < self.warmup_steps:
            self._starved_since = None
            return self.max_tokens  # nobody is decoding: first tokens get everything
        share = int((self.tpot_target_s - m.fixed_s - m.per_decode_s * num_decodes) / m.per_token_s)
        share = max(self.min_prefill, min(self.max_tokens - num_decodes, share))
        # the last step filled its share beside decodes: prompts are waiting behind the target
        if m.last_decodes > 0 and m.last_prefill_tokens >= 0.9 * share:
            now = self.clock()
            if self._starved_since is None:
                self._starved_since = now
            over = (now - self._starved_since) / self.max_starve_s - 1.0
            if over > 0:
                share += int((self.max_tokens - num_decodes - share) * min(1.0, over))
        else:
            self._starved_since = None
        return max(num_decodes + self.min_prefill, min(self.max_tokens, num_decodes + share))

    @property
    def starving(self) -> bool:
        """Steps have used all of the target's prefill share since some time (prompts wait)."""
        return self._starved_since is not None
