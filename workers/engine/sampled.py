"""One launched step's sampled tokens (and log-probabilities), on the device with their copy to
the host in flight: what the engine reads back, a step later under async scheduling."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from workers.engine.sequence import Request


class SampledTokens:
    """One launched step's sampled token ids (and, when a request asked, their log-probabilities):
    on the device, with their copy to the host in flight."""

    def __init__(self, tokens: torch.Tensor | None, logprobs: tuple[torch.Tensor, ...] | None = None,
                 rows: list[int] | None = None, prompt: PromptLogprobs | None = None) -> None:
        # tokens: [N] int64 on the device, one per entry that samples; logprobs: sampler.token_logprobs'
        # of the rows `rows` (None: all of them); prompt: the step's prompt log-probabilities
        self.device_tokens = tokens
        self._lp_rows = rows
        self._plan = None if prompt is None else prompt[1]
        self._event: torch.cuda.Event | None = None
        self._host, self._host_lp, self._host_prompt = tokens, logprobs, None if prompt is None else prompt[0]
        first = tokens if tokens is not None else None if prompt is None else prompt[0][0]
        if first is not None and first.is_cuda:  # copies to the host in flight, then one event for them all
            self._host = None if tokens is None else _to_host(tokens)
            self._host_lp = None if logprobs is None else tuple(map(_to_host, logprobs))
            self._host_prompt = None if prompt is None else tuple(map(_to_host, prompt[0]))
            self._event = torch.cuda.Event()
            self._event.record()

    # CUDA events recorded before and after the step's work (ModelRunner.execute); None on a CPU
    timing: tuple[torch.cuda.Event, torch.cuda.Event] | None = None

    @classmethod
    def empty(cls) -> SampledTokens:
        return cls(None)

    def device_seconds(self) -> float | None:
        """The step's time on the device, from the stream reaching its first kernel to its last
        (waits for it): exact under async scheduling, where the host's clock sees the step only
        when it reads it back. None without timing events (a CPU)."""
        if self.timing is None:
            return None
        start, end = self.timing
        end.synchronize()
        return start.elapsed_time(end) / 1e3

    def __len__(self) -> int:
        return 0 if self.device_tokens is None else self.device_tokens.shape[0]

    def tolist(self) -> list[int]:
        """Wait for the step (only it, not the steps launched after it) and return its tokens."""
        if self._event is not None:
            self._event.synchronize()
        return [] if self._host is None else self._host.tolist()

    def prompt_logprobs(self) -> Iterator[tuple[Request, int, list[RowLogprobs]]]:
        """(request, first position, a RowLogprobs per prompt token after it) of each prompt chunk
        this step computed for a request that asked; after `tolist`."""
        if self._host_prompt is None or self._plan is None:
            return
        chosen, top_lp, top_ids = (t.tolist() for t in self._host_prompt)
        at = 0
        for req, start, n in self._plan:
            yield req, start, list(zip(chosen[at : at + n], top_ids[at : at + n], top_lp[at : at + n]))
            at += n

    def logprobs(self) -> list[RowLogprobs | None] | None:
        """Per sampled row, its RowLogprobs (None for a row whose request did not ask); None when
        no request of the step asked. After `tolist`."""
        if self._host_lp is None or self._host is None:
            return None
        out: list[RowLogprobs | None] = [None] * self._host.shape[0]
        rows = range(len(out)) if self._lp_rows is None else self._lp_rows
        for r, lp, lps, ids in zip(rows, *(t.tolist() for t in self._host_lp)):
            out[r] = (lp, ids, lps)
        return out


# a token's log-probability, then the k likeliest ids and their log-probabilities (k: the step's largest ask)
RowLogprobs = tuple[float, list[int], list[float]]
PromptLogprobs = tuple[tuple[torch.Tensor, ...], list[tuple["Request", int, int]]]  # (tensors, [(req, start, rows)])


def _to_host(t: torch.Tensor) -> torch.Tensor:
    """A pinned host copy of a device tensor, in flight on the current stream."""
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    return host
