"""Logits processing on the device: logit_bias, repetition_penalty, frequency and presence
penalties, min_tokens; in transformers' order (SequenceBias, RepetitionPenalty, then the OpenAI
penalties, which transformers lacks, then MinNewTokensLength), with no host sync in a step.

The penalties depend on the tokens so far, and under async scheduling the host does not know the
last one yet: each penalised request has a slot in two device tables, `seen` (its prompt's tokens
and its outputs: repetition_penalty) and `counts` (its outputs: frequency and presence), and each
step adds its sampled tokens to them on the device, in stream order, before the next step reads
them. logit_bias and min_tokens need only host facts (the request's bias, its output count,
pending tokens included), sent with the step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from workers.engine.sequence import Request


@dataclass
class LogitsPlan:
    """One step's processing of the rows that need it, on the device."""

    rows: torch.Tensor  # [P] int64: rows of the step's sampling logits
    # the C rows with penalties: (their plan rows [C], their slots in the tables [C]); None: none
    counted: tuple[torch.Tensor, torch.Tensor] | None
    repetition: torch.Tensor | None  # [C] fp32 (1: none)
    frequency: torch.Tensor | None  # [C] fp32
    presence: torch.Tensor | None  # [C] fp32
    bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None  # (plan row, token, value) of every bias
    banned: tuple[torch.Tensor, torch.Tensor] | None  # (plan row, token): -inf (min_tokens not reached)


class LogitsProcessor:
    """The slot tables and the per-step plans of one engine's penalised requests."""

    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self._slots: dict[str, int] = {}
        self._free: list[int] = []
        self.seen = torch.zeros((0, vocab_size), dtype=torch.bool, device=device)
        self.counts = torch.zeros((0, vocab_size), dtype=torch.int32, device=device)

    def _slot(self, req: Request) -> int:
        s = self._slots.get(req.request_id)
        if s is not None:
            return s
        if not self._free:  # grow the tables (twice the rows): rare, outside the steady state
            old = self.seen.shape[0]
            new = max(8, 2 * old)
            seen = torch.zeros((new, self.vocab_size), dtype=torch.bool, device=self.device)
            counts = torch.zeros((new, self.vocab_size), dtype=torch.int32, device=self.device)
            seen[:old], counts[:old] = self.seen, self.counts
            self.seen, self.counts = seen, counts
            self._free = list(range(new - 1, old - 1, -1))
        s = self._slots[req.request_id] = self._free.pop()
        # the tokens so far (the host knows them all at a request's first sampled step; a request
        # that resumes after preemption keeps its slot)
        known = torch.tensor(req.token_ids[: req.num_known_tokens], dtype=torch.int64).to(self.device, non_blocking=True)
        self.seen[s].zero_()
        self.seen[s, known] = True
        self.counts[s].zero_()
        outputs = known[req.num_prompt_tokens :]
        if outputs.numel():
            self.counts[s].index_put_((outputs,), torch.ones_like(outputs, dtype=torch.int32), accumulate=True)
        return s

    def release(self, request_id: str) -> None:
        s = self._slots.pop(request_id, None)
        if s is not None:
            self._free.append(s)

    def plan(self, reqs: list[Request]) -> LogitsPlan | None:
        """The processing of this step's sampling rows (`reqs`, in row order); None when no row
        needs any. Below min_tokens a request's end-of-sequence ids (none with ignore_eos) and stop
        token ids are banned."""
        picked = [(i, r) for i, r in enumerate(reqs) if r.adjusts_logits]
        if not picked:
            return None
        dev = self.device

        def f32(values: list[float]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.float32).to(dev, non_blocking=True)

        def i64(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64).to(dev, non_blocking=True)

        rows = i64([i for i, _ in picked])
        penalised = [(j, r) for j, (_, r) in enumerate(picked) if r.sampling.counts_tokens]
        counted = None
        rep: list[float] = []
        freq: list[float] = []
        pres: list[float] = []
        if penalised:
            counted = (i64([j for j, _ in penalised]), i64([self._slot(r) for _, r in penalised]))
            rep = [r.sampling.repetition_penalty for _, r in penalised]
            freq = [r.sampling.frequency_penalty for _, r in penalised]
            pres = [r.sampling.presence_penalty for _, r in penalised]
        b_row, b_tok, b_val, n_row, n_tok = [], [], [], [], []
        for j, (_, r) in enumerate(picked):
            sp = r.sampling
            for tok, val in sp.logit_bias.items():
                b_row.append(j)
                b_tok.append(tok)
                b_val.append(val)
            if sp.min_tokens and r.num_output_tokens < sp.min_tokens:
                ends = set(sp.stop_token_ids) | set(r.eos_token_ids)
                for tok in ends:
                    if tok < self.vocab_size:
                        n_row.append(j)
                        n_tok.append(tok)
        return LogitsPlan(
            rows=rows,
            counted=counted,
            repetition=f32(rep) if any(x != 1.0 for x in rep) else None,
            frequency=f32(freq) if any(freq) else None,
            presence=f32(pres) if any(pres) else None,
            bias=(i64(b_row), i64(b_tok), f32(b_val)) if b_row else None,
            banned=(i64(n_row), i64(n_tok)) if n_row else None,
        )

    def apply(self, logits: torch.Tensor, plan: LogitsPlan) -> torch.Tensor:
        """The processed logits (a new tensor; `logits`, which log-probabilities report, is kept)."""
        x = logits.float().clone()
        sub = x.index_select(0, plan.rows)  # [P, V]
        if plan.bias is not None:
            r, t, v = plan.bias
            sub.index_put_((r, t), v, accumulate=True)
        if plan.counted is not None:
            at, slots = plan.counted
            part = sub.index_select(0, at)  # [C, V]: the penalised rows
            if plan.repetition is not None:
                p = plan.repetition[:, None]
                seen = self.seen.index_select(0, slots)
                part = torch.where(seen, torch.where(part > 0, part / p, part * p), part)
            if plan.frequency is not None or plan.presence is not None:
                counts = self.counts.index_select(0, slots).float()
                if plan.frequency is not None:
                    part = part - plan.frequency[:, None] * counts
                if plan.presence is not None:
                    part = part - plan.presence[:, None] * (counts > 0).float()
            sub.index_copy_(0, at, part)
        if plan.banned is not None:
            r, t = plan.banned
            sub[r, t] = float("-inf")
        x.index_copy_(0, plan.rows, sub)
        return x

    def update(self, plan: LogitsPlan, tokens: torch.Tensor) -> None:
        """Add the step's sampled tokens (`tokens`, one per sampling row) to their rows' tables
        (each slot appears once in a step: no write races)."""
        if plan.counted is None:
            return
        at, slots = plan.counted
        toks = tokens.index_select(0, plan.rows.index_select(0, at))
        self.seen.index_put_((slots, toks), torch.ones_like(toks, dtype=torch.bool))
        self.counts.index_put_((slots, toks), torch.ones_like(toks, dtype=torch.int32), accumulate=True)
