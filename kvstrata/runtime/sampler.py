"""Sampler: turns one logits row per sequence into the next token, honoring each request's params.

Order per row: penalties -> logit bias -> grammar mask -> (greedy argmax | temperature, top_k, top_p, min_p,
draw).
Logprobs returned to clients are those of the model's raw distribution (log_softmax of the logits).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Optional

import torch

from kvstrata.runtime.req import Req


@dataclass
class SampleOutput:
    """Next tokens plus optional logprob data, one entry per row."""

    token_ids: list[int]
    logprobs: Optional[list[float]]
    top_logprobs: Optional[list[list[tuple[float, int]]]]


class Sampler:
    """Stateless apart from the default generator used by unseeded requests.

    `argmax`: a compiled `torch.argmax(x, dim=-1)` for CPU float32 / bf16 rows (paged_kernels.argmax_op), or
    None for torch's, which on CPU is scalar code (~15x amax's time on a [16, 32000] decode step).
    """

    def __init__(self, vocab_size: int, seed: int, device: torch.device, argmax: Optional[Callable] = None):
        self.vocab_size = vocab_size
        self.device = device
        self.default_generator = torch.Generator(device="cpu").manual_seed(seed)
        self.argmax_op = argmax

    def next_seed(self) -> int:
        """A seed for one request's own generator, drawn from the server's seed."""
        return int(torch.randint(0, 2**62, (1,), generator=self.default_generator))

    def sample(self, logits: torch.Tensor, reqs: list[Req], masks: Optional[torch.Tensor] = None,
               mask_rows: Optional[torch.Tensor] = None, apply_mask: Optional[Callable] = None) -> SampleOutput:
        """Pick one token per row of `logits` ([B, V] float32) for `reqs`.

        `apply_mask(logits, masks, mask_rows)`: the grammar backend's (fast) kernel; a torch one by default.
        """
        want_logprobs = any(r.return_logprob for r in reqs)
        raw_logits = logits
        raw_logprobs = torch.log_softmax(logits, dim=-1) if want_logprobs else None
        logits = self._apply_penalties(logits, reqs)
        logits = self._apply_logit_bias(logits, reqs)
        if masks is not None:
            if want_logprobs and logits is raw_logits:
                logits = logits.clone()   # the mask is applied in place; logprobs rank the raw logits
            if apply_mask is None:
                from kvstrata.constrained.base import GrammarBackend

                apply_mask = GrammarBackend.apply_bitmask
            apply_mask(logits, masks, mask_rows)
        tokens = self._choose(logits, reqs)
        lp, top = None, None
        if raw_logprobs is not None:
            top_nums = [r.top_logprobs_num if r.return_logprob else 0 for r in reqs]
            lp, top = logprob_info(raw_logits, raw_logprobs, tokens, top_nums)
        return SampleOutput(tokens.tolist(), lp, top)

    def _apply_penalties(self, logits: torch.Tensor, reqs: list[Req]) -> torch.Tensor:
        rows = [i for i, r in enumerate(reqs) if _has_penalty(r) and r.output_ids]
        if not rows:
            return logits
        logits = logits.clone()
        for i in rows:
            r, s = reqs[i], reqs[i].sampling
            counts = output_counts(r, self.vocab_size)
            row = logits[i, : counts.numel()]
            if s.repetition_penalty != 1.0:
                seen = counts > 0
                seen_prompt = torch.zeros_like(seen)
                seen_prompt[torch.tensor(r.prompt_ids, dtype=torch.long).clamp(max=seen.numel() - 1)] = True
                seen |= seen_prompt
                row[seen] = torch.where(row[seen] > 0, row[seen] / s.repetition_penalty,
                                        row[seen] * s.repetition_penalty)
            if s.frequency_penalty:
                row -= s.frequency_penalty * counts.to(row.dtype)
            if s.presence_penalty:
                row -= s.presence_penalty * (counts > 0).to(row.dtype)
        return logits

    @staticmethod
    def _apply_logit_bias(logits: torch.Tensor, reqs: list[Req]) -> torch.Tensor:
        """Add each request's `logit_bias` to its row (a copy; the raw logits give the logprobs)."""
        rows = [i for i, r in enumerate(reqs) if r.sampling.logit_bias]
        if not rows:
            return logits
        logits = logits.clone()
        for i in rows:
            bias = reqs[i].sampling.logit_bias
            ids = torch.tensor(list(bias), dtype=torch.long, device=logits.device)
            logits[i].index_add_(0, ids, torch.tensor(list(bias.values()), dtype=logits.dtype,
                                                      device=logits.device))
        return logits

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        """`torch.argmax(logits, dim=-1)`, through the compiled op for the tensors it takes."""
        op = self.argmax_op
        if (op is None or logits.device.type != "cpu" or logits.dim() != 2 or logits.shape[-1] == 0
                or logits.dtype not in (torch.float32, torch.bfloat16)):
            return torch.argmax(logits, dim=-1)
        return op(logits.contiguous())

    def _choose(self, logits: torch.Tensor, reqs: list[Req]) -> torch.Tensor:
        tokens = self.argmax(logits).cpu()
        sampled = [i for i, r in enumerate(reqs) if not r.sampling.is_greedy]
        if not sampled:
            return tokens
        idx = torch.tensor(sampled, dtype=torch.long, device=logits.device)
        probs = self._filtered_probs(logits.index_select(0, idx).float(), [reqs[i] for i in sampled])
        probs = probs.cpu()
        for k, i in enumerate(sampled):
            gen = reqs[i].generator or self.default_generator
            tokens[i] = torch.multinomial(probs[k], 1, generator=gen).item()
        return tokens

    @staticmethod
    def _filtered_probs(logits: torch.Tensor, reqs: list[Req]) -> torch.Tensor:
        """Temperature, then top_k / top_p / min_p on the sorted distribution, renormalized."""
        dev = logits.device
        temp = torch.tensor([r.sampling.temperature for r in reqs], device=dev).unsqueeze(1)
        # A tiny repetition_penalty or temperature can overflow a logit to +inf, and softmax(inf) is NaN:
        # keep them finite (their order, all that sampling needs, is unchanged).
        finite = torch.finfo(logits.dtype).max
        probs = torch.softmax((logits / temp).clamp_(-finite, finite), dim=-1)
        sorted_p, order = probs.sort(dim=-1, descending=True)
        vocab = probs.shape[-1]
        top_k = torch.tensor([r.sampling.top_k if r.sampling.top_k > 0 else vocab for r in reqs], device=dev)
        top_p = torch.tensor([r.sampling.top_p for r in reqs], device=dev).unsqueeze(1)
        min_p = torch.tensor([r.sampling.min_p for r in reqs], device=dev).unsqueeze(1)
        ranks = torch.arange(vocab, device=dev).unsqueeze(0)
        drop = ranks >= top_k.unsqueeze(1)
        drop |= (sorted_p.cumsum(dim=-1) - sorted_p) > top_p          # keep the smallest set reaching top_p
        drop |= sorted_p < min_p * sorted_p[:, :1]
        drop[:, 0] = False                                            # the most likely token always survives
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        out = torch.zeros_like(probs).scatter_(1, order, sorted_p)
        return out / out.sum(dim=-1, keepdim=True)


def logprob_info(logits: torch.Tensor, logprobs: torch.Tensor, tokens: torch.Tensor, top_nums: list[int]
                 ) -> tuple[list[float], list[list[tuple[float, int]]]]:
    """Chosen-token logprobs and top-k (logprob, token) lists.

    The top tokens are ranked by the raw `logits` (log_softmax can round two near-equal logits to one
    value), ties broken by the lower token id, as argmax does: a greedy token is always the first entry.
    """
    chosen = logprobs.gather(1, tokens.to(logprobs.device).unsqueeze(1)).squeeze(1).tolist()
    k = max(top_nums) if top_nums else 0
    tops: list[list[tuple[float, int]]] = [[] for _ in top_nums]
    if k > 0:
        ids = top_token_ids(logits, k)
        vals, ids = logprobs.gather(1, ids).tolist(), ids.tolist()
        for i, n in enumerate(top_nums):
            tops[i] = list(zip(vals[i][:n], ids[i][:n]))
    return chosen, tops


def top_token_ids(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Ids `[B, k]` of each row's k highest scores, highest first, equal scores by ascending id."""
    vals, ids = scores.topk(min(k, scores.shape[-1]), dim=-1)
    by_id = ids.argsort(dim=-1)
    vals, ids = vals.gather(1, by_id), ids.gather(1, by_id)
    return ids.gather(1, vals.argsort(dim=-1, descending=True, stable=True))


def output_counts(req: Req, vocab_size: int) -> torch.Tensor:
    """Histogram of req's output tokens, updated incrementally."""
    counts = req.token_counts
    if counts is None:
        counts = torch.zeros(vocab_size, dtype=torch.int32)
        counted = 0
    else:
        counted = int(counts.sum())
    new = req.output_ids[counted:]
    if new:
        counts.index_add_(0, torch.tensor(new, dtype=torch.long), torch.ones(len(new), dtype=torch.int32))
    req.token_counts = counts
    return counts


def _has_penalty(req: Req) -> bool:
    s = req.sampling
    return s.repetition_penalty != 1.0 or s.frequency_penalty != 0.0 or s.presence_penalty != 0.0
