"""SLO-aware step sizing: how many tokens the next step may compute so that the requests already
decoding keep their time per output token (TPOT) under a target.

A step's time (`StepCostModel`) is linear in what it computes and how it runs: a fixed part per
path (a replayed decode graph, a replayed prefill graph, or an eager step, whose ~500 kernel
launches cost the host ~10 ms on an H200 whatever the step's size), a cost per prompt token (the
projections), a cost per decoding sequence and per KV token the decodes read (a decode at context
1500 reads ~190 MiB of bf16 KV: ~45 us on an H200, more than its share of the projections), and a
cost per query-key pair of the prompt chunks' attention. The one-plane model (fixed + prompt
tokens + decodes) this replaces learned a prompt token at 0.5-1.5 ms on the H200 under a target
(its mixed steps were eager, its decode steps graphs: the launch cost went to the few prompt
tokens) and mispredicted steps by 16-31% under load (bench/results/2026-12-01-load-h200.md).
The fit is weighted least squares on relative error (what the bench reports) over exponentially
forgotten steps, with a small pull toward the last fit so that a feature no recent step had
keeps its value.

`SloBudget` turns a TPOT target into the step's token budget: with decodes running, the prefill
chunks get what fits in `target + credit - cost(decodes, their context, path)`; with none running,
the whole budget goes to first tokens. TPOT is a request's mean time between tokens, so the target
holds on the mean step, not on each: a decoding step under the target banks what it left unused
(the credit, capped at `burst` targets; a step over it draws the credit down), and the next mixed
step may spend it. Held to the target step by step, every mixed step was a small chunk on the
eager path (on the H200 ~15 ms of launches beside ~60 decodes: 20-26 ms for 64 prompt tokens,
bench/results/2026-12-02-load-h200.md), so a 15 ms target at 16 req/s gave TPOT p50 21 ms and
TTFT p50 266 ms, both worse than no target (10 / 46 ms). Picked once when the engine is built:
without a target the scheduler uses its fixed budget.

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

import numpy as np

PATHS = ("decode_graph", "prefill_graph", "eager", "mixed_graph")  # how the runner runs a step (ModelRunner.last_path)
# features, each scaled to be of order 1 on an 8B model's steps: 1, prompt tokens / 1e3, decodes / 1e2,
# KV tokens the decodes read / 1e5, query-key pairs of the prompt chunks / 1e7, prefill graph, eager,
# mixed graph
_N = 8
_SCALE = (1.0, 1e-3, 1e-2, 1e-5, 1e-7)


@dataclass(frozen=True)
class StepShape:
    """What one step computes, as the cost model sees it."""

    prefill_tokens: int = 0  # prompt tokens computed (chunks, prefix-hit remainders)
    decodes: int = 0  # decoding sequences, one token each
    decode_context: int = 0  # KV tokens the decodes attend to (the sum of their contexts)
    prefill_pairs: int = 0  # query-key pairs of the prompt chunks' causal attention
    path: str = "eager"  # decode_graph, prefill_graph, mixed_graph or eager

    @classmethod
    def of(cls, scheduled: list, num_decodes: int, path: str) -> StepShape:
        """The shape of a scheduled step (`SchedulerOutput.scheduled`: decodes first)."""
        ctx = sum(e.num_computed_tokens + 1 for e in scheduled[:num_decodes])
        tokens = pairs = 0
        for e in scheduled[num_decodes:]:
            n = e.num_new_tokens
            tokens += n
            pairs += n * e.num_computed_tokens + n * (n + 1) // 2
        return cls(tokens, num_decodes, ctx, pairs, path if path in PATHS else "eager")

    def features(self) -> np.ndarray:
        return np.array((1.0, self.prefill_tokens * _SCALE[1], self.decodes * _SCALE[2],
                         self.decode_context * _SCALE[3], self.prefill_pairs * _SCALE[4],
                         float(self.path == "prefill_graph"), float(self.path == "eager"),
                         float(self.path == "mixed_graph")))


class StepCostModel:
    """Seconds of a step, linear in its `StepShape.features()`, fitted online: least squares on
    relative error (each step weighted by 1 / its time squared) over steps forgotten by `forget`
    per step, pulled toward the last fit by `ridge` (relative to the data's weight)."""

    def __init__(self, forget: float = 0.99, ridge: float = 1e-6) -> None:
        self.forget = forget
        self.ridge = ridge
        self.theta = np.zeros(_N)  # ms per unit of each feature
        self._a = np.zeros((_N, _N))
        self._b = np.zeros(_N)
        self.observed = 0
        # the last step observed: its prompt tokens and decodes (SloBudget's sign of waiting prompts)
        self.last_prefill_tokens = 0
        self.last_decodes = 0
        # query-key pairs per prompt token of recent steps (SloBudget's cost of one more prompt token)
        self.pairs_per_token = 0.0
        # how well it predicts: |predicted - measured| / measured, summed over steps after the 8th
        self._rel_err_sum = 0.0
        self._rel_err_n = 0

    def observe_shape(self, shape: StepShape, seconds: float) -> None:
        """One measured step."""
        if shape.prefill_tokens + shape.decodes <= 0 or seconds <= 0:
            return
        self.last_prefill_tokens, self.last_decodes = shape.prefill_tokens, shape.decodes
        if shape.prefill_tokens:
            ppt = shape.prefill_pairs / shape.prefill_tokens
            self.pairs_per_token = ppt if self.observed == 0 else 0.9 * self.pairs_per_token + 0.1 * ppt
        x, y = shape.features(), seconds * 1e3
        if self.observed >= 8:
            self._rel_err_sum += abs(y - float(self.theta @ x)) / y
            self._rel_err_n += 1
        w = 1.0 / (y * y)
        self._a = self.forget * self._a + w * np.outer(x, x)
        self._b = self.forget * self._b + w * y * x
        r = self.ridge * max(float(np.trace(self._a)) / _N, 1e-12)
        self.theta = np.linalg.solve(self._a + r * np.eye(_N), self._b + r * self.theta)
        self.observed += 1

    def observe(self, prefill_tokens: int, seconds: float, decodes: int = 0, **shape: object) -> None:
        """One measured step: `prefill_tokens` prompt tokens and `decodes` decoding sequences
        (the rest of StepShape's fields by name)."""
        self.observe_shape(StepShape(prefill_tokens, decodes, **shape), seconds)  # type: ignore[arg-type]

    @property
    def mean_rel_error(self) -> float | None:
        """Mean |predicted - measured| / measured of the steps predicted so far (after 8 to learn on)."""
        return self._rel_err_sum / self._rel_err_n if self._rel_err_n else None

    def predict_shape(self, shape: StepShape) -> float:
        """Predicted seconds of a step, never below 0 (an early, underdetermined fit can go there,
        and a budget would read room from it)."""
        return max(0.0, float(self.theta @ shape.features()) / 1e3)

    def predict(self, prefill_tokens: int, decodes: int = 0, **shape: object) -> float:
        """Predicted seconds of a step (StepShape's fields)."""
        return self.predict_shape(StepShape(prefill_tokens, decodes, **shape))  # type: ignore[arg-type]

    def fixed_cost(self, path: str = "eager") -> float:
        """The per-step cost on `path` that does not depend on the work, never below 0."""
        extra = {"prefill_graph": self.theta[5], "eager": self.theta[6], "mixed_graph": self.theta[7]}.get(path, 0.0)
        return max(0.0, float(self.theta[0] + extra) / 1e3)

    @property
    def fixed_s(self) -> float:
        """The fixed cost of an eager step."""
        return self.fixed_cost("eager")

    @property
    def per_token_s(self) -> float:
        """The cost of one more prompt token (its projections and its attention at the recent
        steps' pairs per token), never below a nanosecond."""
        return max(1e-9, float(self.theta[1] * _SCALE[1] + self.theta[4] * _SCALE[4] * self.pairs_per_token) / 1e3)

    @property
    def per_decode_s(self) -> float:
        """The cost of one more decoding sequence, its context aside, never below 0."""
        return max(0.0, float(self.theta[2] * _SCALE[2]) / 1e3)

    @property
    def per_context_token_s(self) -> float:
        """The cost of one more KV token a decode reads, never below 0."""
        return max(0.0, float(self.theta[3] * _SCALE[3]) / 1e3)

    def coefficients(self) -> dict[str, float]:
        """The fit, for reports: ms, us and ns per unit."""
        t = self.theta
        return {"fixed_ms": float(t[0]), "prefill_graph_ms": float(t[5]), "eager_ms": float(t[6]),
                "mixed_graph_ms": float(t[7]),
                "per_token_us": float(t[1]), "per_decode_us": float(t[2] * 10), "per_context_ns": float(t[3] * 10),
                "per_pair_ps": float(t[4] * 100)}


@dataclass
class SloBudget:
    """The token budget of the next step under a TPOT target.

    `max_tokens`: the engine's budget (max_num_batched_tokens); `min_prefill`: prefill tokens a
    step may always take while decodes run (so a flood of decodes never starves first tokens);
    `warmup_steps`: steps measured before the model is trusted (until then: the full budget);
    `max_starve_s`: how long steps may use all of the target's prefill share before it grows
    (linearly, to the whole budget over as long again); `prefill_graph`: (tokens, sequences) up
    to which a mixed step replays a prefill graph (None: every mixed step is eager); `mixed_graph`:
    (prompt tokens, prompt chunks, decodes) up to which decodes beside chunks replay a mixed graph
    (None: none); `burst`:
    the most credit a step may bank or owe, in targets (0: every step under the target);
    `min_chunk` (0: never): while fewer prompt tokens than this fit and a decode-only step would bank
    credit (it is predicted under the target), the step decodes only, for up to `max_starve_s`
    (a mixed step's fixed cost is not paid for a few tokens; the credit soon pays for a chunk);
    `clock`: seconds, monotonic.
    """

    tpot_target_s: float
    max_tokens: int
    min_prefill: int = 64
    warmup_steps: int = 8
    model: StepCostModel | None = None
    max_starve_s: float = 0.25
    prefill_graph: tuple[int, int] | None = None
    mixed_graph: tuple[int, int, int] | None = None
    burst: float = 5.0
    min_chunk: int = 256
    clock: Callable[[], float] = field(default=time.monotonic, repr=False)
    _starved_since: float | None = field(default=None, init=False, repr=False)
    _held_since: float | None = field(default=None, init=False, repr=False)
    credit_s: float = field(default=0.0, init=False)  # what decoding steps left under the target

    def account(self, decodes: int, seconds: float) -> None:
        """A measured step: one with decodes banks (or owes) its difference from the target."""
        if decodes > 0:
            cap = self.burst * self.tpot_target_s
            self.credit_s = max(-cap, min(cap, self.credit_s + self.tpot_target_s - seconds))

    def reset(self) -> None:
        """Forget the credit and the starvation clock (a new target, say)."""
        self.credit_s = 0.0
        self._starved_since = self._held_since = None

    def __post_init__(self) -> None:
        if self.model is None:
            self.model = StepCostModel()

    def _share(self, num_decodes: int, decode_context: int) -> int:
        """Prompt tokens that fit beside the decodes under the target, on the best path."""
        m = self.model
        assert m is not None
        per_token = m.per_token_s

        allowance = self.tpot_target_s + self.credit_s

        def fits(path: str) -> int:
            rest = allowance - m.predict(0, num_decodes, decode_context=decode_context, path=path)
            return int(rest / per_token)

        share = fits("eager")
        pg = self.prefill_graph
        if pg is not None and num_decodes + 1 <= pg[1]:
            share = max(share, min(pg[0] - num_decodes, fits("prefill_graph")))
        mg = self.mixed_graph
        if mg is not None and 0 < num_decodes <= mg[2]:
            share = max(share, min(mg[0], fits("mixed_graph")))
        return share

    def __call__(self, num_decodes: int, decode_context: int = 0) -> int:
        """Tokens the next step may compute, `num_decodes` of them decodes reading
        `decode_context` KV tokens in all."""
        m = self.model
        assert m is not None
        if num_decodes == 0 or m.observed < self.warmup_steps:
            self._starved_since = self._held_since = None
            return self.max_tokens  # nobody is decoding: first tokens get everything
        share = self._share(num_decodes, decode_context)
        can_bank = self.credit_s < self.burst * self.tpot_target_s and (
            m.predict(0, num_decodes, decode_context=decode_context, path="decode_graph") < self.tpot_target_s
        )
        if self.min_chunk > 0 and share < self.min_chunk and self._starved_since is None and can_bank:
            now = self.clock()
            if self._held_since is None:
                self._held_since = now
            if now - self._held_since < self.max_starve_s:
                return num_decodes  # decodes alone, banking credit for a chunk worth its fixed cost
        else:
            self._held_since = None
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
