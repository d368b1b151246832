"""SLO-aware step sizing: how many tokens the next step may compute so that the requests already
decoding keep their time per output token (TPOT) under a target.

A step's time grows about linearly with the tokens it computes (`seconds ~= a + b * tokens`:
weights read once, then compute per token). `StepCostModel` fits a and b online from the steps
the engine measures (recursive least squares, older steps forgotten geometrically), and
`SloBudget` turns a TPOT target into the step's token budget: with decodes running, the prefill
chunks get what fits in `target - a`; with none running, the whole budget goes to first tokens.
Picked once when the engine is built: without a target the scheduler uses its fixed budget.
"""

from __future__ import annotations

from dataclasses import dataclass


class StepCostModel:
    """seconds ~= a + b * tokens, fitted online (recursive least squares with forgetting)."""

    def __init__(self, forget: float = 0.98, prior_a: float = 0.0, prior_b: float = 0.0) -> None:
        self.forget = forget
        self.theta = [prior_a, prior_b]
        self._p = [[1e3, 0.0], [0.0, 1e3]]  # large: the prior gives way to the first steps
        self.observed = 0
        # how well it predicts: |predicted - measured| / measured, summed over steps after the 8th
        self._rel_err_sum = 0.0
        self._rel_err_n = 0

    def observe(self, tokens: int, seconds: float) -> None:
        """One measured step."""
        if tokens <= 0 or seconds <= 0:
            return
        x = (1.0, float(tokens))
        p = self._p
        px = (p[0][0] * x[0] + p[0][1] * x[1], p[1][0] * x[0] + p[1][1] * x[1])
        denom = self.forget + x[0] * px[0] + x[1] * px[1]
        k = (px[0] / denom, px[1] / denom)
        err = seconds - (self.theta[0] * x[0] + self.theta[1] * x[1])
        if self.observed >= 8:
            self._rel_err_sum += abs(err) / seconds
            self._rel_err_n += 1
        self.theta = [self.theta[0] + k[0] * err, self.theta[1] + k[1] * err]
        xp = (x[0] * p[0][0] + x[1] * p[1][0], x[0] * p[0][1] + x[1] * p[1][1])
        self._p = [[(p[i][j] - k[i] * xp[j]) / self.forget for j in range(2)] for i in range(2)]
        self.observed += 1

    @property
    def mean_rel_error(self) -> float | None:
        """Mean |predicted - measured| / measured of the steps predicted so far (after 8 to learn on)."""
        return self._rel_err_sum / self._rel_err_n if self._rel_err_n else None

    def predict(self, tokens: int) -> float:
        """Predicted seconds of a step of `tokens` tokens."""
        return self.theta[0] + self.theta[1] * tokens

    @property
    def fixed_s(self) -> float:
        """The per-step cost that does not depend on tokens (a), never below 0."""
        return max(0.0, self.theta[0])

    @property
    def per_token_s(self) -> float:
        """The cost of one more token (b), never below a nanosecond."""
        return max(1e-9, self.theta[1])


@dataclass
class SloBudget:
    """The token budget of the next step under a TPOT target.

    `max_tokens`: the engine's budget (max_num_batched_tokens); `min_prefill`: prefill tokens a
    step may always take while decodes run (so a flood of decodes never starves first tokens);
    `warmup_steps`: steps measured before the model is trusted (until then: the full budget).
    """

    tpot_target_s: float
    max_tokens: int
    min_prefill: int = 64
    warmup_steps: int = 8
    model: StepCostModel | None = None

    def __post_init__(self) -> None:
        if self.model is None:
            self.model = StepCostModel()

    def __call__(self, num_decodes: int) -> int:
        """Tokens the next step may compute, `num_decodes` of them decodes."""
        m = self.model
        assert m is not None
        if num_decodes == 0 or m.observed < self.warmup_steps:
            return self.max_tokens  # nobody is decoding: first tokens get everything
        fits = int((self.tpot_target_s - m.fixed_s) / m.per_token_s)
        return max(num_decodes + self.min_prefill, min(self.max_tokens, fits))
