"""Token sampling: greedy, temperature, top-k, top-p, per-request seeds; no host sync inside."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from workers.engine.penalties import LogitsPlan, LogitsProcessor
    from workers.engine.sequence import Request


@dataclass
class SamplingBatch:
    """Per-row sampling parameters of the rows that sample this step, on the device."""

    all_greedy: bool
    temperature: torch.Tensor | None  # [N] fp32; 1.0 on greedy rows
    greedy_mask: torch.Tensor | None  # [N] bool
    top_k: torch.Tensor | None  # [N] int64, vocab size where unset; None when no row sets it
    top_p: torch.Tensor | None  # [N] fp32; None when no row sets it
    generators: list[torch.Generator | None]  # per row: the request's own RNG when seeded
    # logit_bias, penalties, min_tokens of the rows that ask (workers/engine/penalties.py); None: none
    adjust: LogitsPlan | None = None
    # guided decoding: (rows [G] int64, their token bitmasks [G, words] int32) on the device; None: none
    guide: tuple[torch.Tensor, torch.Tensor] | None = None


def sampling_batch(reqs: list[Request], device: torch.device, vocab_size: int,
                   generators: dict[str, torch.Generator]) -> SamplingBatch:
    """The SamplingBatch of the requests that sample this step, in row order; a seeded request's
    RNG is made at its first sampled token and kept in `generators` (by request id) until it ends."""
    if all(r.sampling.temperature == 0.0 for r in reqs):
        return SamplingBatch(True, None, None, None, None, [])
    temps = [r.sampling.temperature or 1.0 for r in reqs]
    greedy = [r.sampling.temperature == 0.0 for r in reqs]
    top_k = [r.sampling.top_k if r.sampling.top_k else vocab_size for r in reqs]
    top_p = [r.sampling.top_p for r in reqs]
    gens: list[torch.Generator | None] = []
    for r in reqs:
        g = None
        if r.sampling.seed is not None and r.sampling.temperature > 0:
            g = generators.get(r.request_id)
            if g is None:
                g = generators[r.request_id] = torch.Generator(device=device).manual_seed(r.sampling.seed)
        gens.append(g)

    def dev(values: list, dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)

    return SamplingBatch(
        all_greedy=False,
        temperature=dev(temps, torch.float32),
        greedy_mask=dev(greedy, torch.bool),
        top_k=dev(top_k, torch.int64) if any(k < vocab_size for k in top_k) else None,
        top_p=dev(top_p, torch.float32) if any(p < 1.0 for p in top_p) else None,
        generators=gens,
    )


class Sampler:
    """Picks one token per row of logits (after the rows' logits processing, when they ask)."""

    def __init__(self, device: torch.device, seed: int = 0, processor: LogitsProcessor | None = None,
                 argmax: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        self.device = device
        self.generator = torch.Generator(device=device).manual_seed(seed)
        self.processor = processor
        # logits [N, V] -> [N] int64, torch.argmax(dim=-1)'s answer (the first maximum, NaN first);
        # kernels.argmax.argmax_triton on a GPU: two short launches for the one long one of torch's
        self.argmax = argmax or (lambda x: x.argmax(dim=-1))

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        # logits: [N, V] fp32 -> token ids [N] int64 (on the device). `logits` itself is left as it
        # is: log-probabilities report the raw distribution
        adjusted = batch.adjust is not None and self.processor is not None
        x = self.processor.apply(logits, batch.adjust) if adjusted else logits  # type: ignore[union-attr,arg-type]
        if batch.guide is not None:
            from workers.engine.guided import apply_bitmask

            if x is logits:
                x = logits.clone()
            apply_bitmask(x, batch.guide[1], batch.guide[0])
        tokens = self._choose(x, batch)
        if adjusted:
            self.processor.update(batch.adjust, tokens)  # type: ignore[union-attr,arg-type]
        return tokens

    def _choose(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        if batch.all_greedy:
            return self.argmax(logits)
        assert batch.temperature is not None and batch.greedy_mask is not None
        greedy = self.argmax(logits)
        x = logits / batch.temperature[:, None]
        if batch.top_k is not None or batch.top_p is not None:
            x = _top_k_top_p(x, batch.top_k, batch.top_p)
        probs = torch.softmax(x, dim=-1)
        noise = self._exponential(probs, batch.generators)
        # argmax(p / E) with E ~ Exp(1) draws from p without a host sync (the Gumbel-max trick's twin)
        sampled = self.argmax(probs / noise)
        return torch.where(batch.greedy_mask, greedy, sampled)

    def _exponential(self, probs: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
        noise = torch.empty_like(probs)
        if not any(g is not None for g in generators):
            return noise.exponential_(generator=self.generator)
        noise.exponential_(generator=self.generator)
        for i, g in enumerate(generators):
            if g is not None:
                noise[i].exponential_(generator=g)
        return noise


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, k: int) -> tuple[torch.Tensor, ...]:
    """The sampled tokens' log-probabilities under the raw logits (before temperature, top-k or
    top-p, as OpenAI reports them) and each row's k most likely tokens: (logprob [N] fp32,
    top logprobs [N, k] fp32, top ids [N, k] int64). No host sync."""
    lp = torch.log_softmax(logits.float(), dim=-1)  # [N, V]
    chosen = lp.gather(1, tokens[:, None]).squeeze(1)
    top_lp, top_ids = lp.topk(k, dim=-1) if k > 0 else (lp[:, :0], tokens[:, None][:, :0])
    return chosen, top_lp, top_ids


def _top_k_top_p(x: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None) -> torch.Tensor:
    """Mask logits outside each row's top-k and top-p nucleus to -inf. x: [N, V]."""
    sorted_x, idx = x.sort(dim=-1, descending=True)
    v = x.shape[-1]
    if top_k is not None:
        ranks = torch.arange(v, device=x.device)[None, :]
        sorted_x = sorted_x.masked_fill(ranks >= top_k[:, None], float("-inf"))
    if top_p is not None:
        p = torch.softmax(sorted_x, dim=-1)
        cum = p.cumsum(dim=-1)
        # drop a token when the mass before it already reaches top_p; the first token always stays
        drop = (cum - p) >= top_p[:, None]
        sorted_x = sorted_x.masked_fill(drop, float("-inf"))
    return torch.full_like(x, float("-inf")).scatter(-1, idx, sorted_x)
