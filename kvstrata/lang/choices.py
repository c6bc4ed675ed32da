"""How `select` picks among its choices, given each choice's token logprobs after the prompt.

Each method turns per-choice token logprobs into one score per choice and a best index:
  - token_length_normalized (default): the mean logprob over the choice's tokens;
  - greedy_token_selection: the highest first-token logprob, ties broken by the following tokens (a
    shorter choice is padded with its own mean so that it can be compared with a longer one);
  - unconditional_likelihood_normalized: the mean of (logprob given the prompt − logprob of the choice on
    its own), which discounts choices that are likely whatever the question.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

Logprobs = list[Optional[float]]


@dataclass(frozen=True)
class ChoicesDecision:
    """The chosen index and the score of every choice."""

    index: int
    scores: list[float]


class ChoicesMethod:
    """A way of choosing; callable on per-choice token logprobs."""

    name = "base"
    needs_unconditional = False

    def decide(self, conditional: list[Logprobs], unconditional: Optional[list[Logprobs]] = None
               ) -> ChoicesDecision:
        """Score every choice and pick the best (ties go to the earliest choice)."""
        scores = self.scores(conditional, unconditional)
        return ChoicesDecision(_argmax(scores), scores)

    def scores(self, conditional: list[Logprobs], unconditional: Optional[list[Logprobs]]) -> list[float]:
        """One score per choice (higher is better)."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"kvstrata.lang.{self.name}"


class TokenLengthNormalized(ChoicesMethod):
    """The choice with the highest mean token logprob."""

    name = "token_length_normalized"

    def scores(self, conditional: list[Logprobs], unconditional: Optional[list[Logprobs]]) -> list[float]:
        """Mean logprob per choice."""
        return [mean_logprob(lps) for lps in conditional]


class GreedyTokenSelection(ChoicesMethod):
    """The choice with the highest first-token logprob; later tokens break ties."""

    name = "greedy_token_selection"

    def decide(self, conditional: list[Logprobs], unconditional: Optional[list[Logprobs]] = None
               ) -> ChoicesDecision:
        """Compare the padded logprob sequences lexicographically."""
        known = [[lp for lp in lps if lp is not None] for lps in conditional]
        width = max(len(k) for k in known)
        padded = [k + [mean_logprob(k)] * (width - len(k)) for k in known]
        best = max(range(len(padded)), key=lambda i: (padded[i], -i))
        return ChoicesDecision(best, self.scores(conditional, unconditional))

    def scores(self, conditional: list[Logprobs], unconditional: Optional[list[Logprobs]]) -> list[float]:
        """First-token logprob per choice."""
        firsts = []
        for lps in conditional:
            known = [lp for lp in lps if lp is not None]
            firsts.append(known[0] if known else -math.inf)
        return firsts


class UnconditionalLikelihoodNormalized(ChoicesMethod):
    """The choice whose tokens gain most from the prompt (conditional minus unconditional logprob)."""

    name = "unconditional_likelihood_normalized"
    needs_unconditional = True

    def scores(self, conditional: list[Logprobs], unconditional: Optional[list[Logprobs]]) -> list[float]:
        """Mean per-token gain; tokens without an unconditional logprob (the very first) are left out."""
        if unconditional is None:
            raise ValueError("unconditional_likelihood_normalized needs the unconditional logprobs")
        out = []
        for cond, uncond in zip(conditional, unconditional):
            gains = [c - u for c, u in zip(cond, uncond) if c is not None and u is not None]
            out.append(sum(gains) / len(gains) if gains else mean_logprob(cond))
        return out


def mean_logprob(logprobs: Logprobs) -> float:
    """Mean of the known logprobs (-inf when there is none)."""
    known = [lp for lp in logprobs if lp is not None]
    return sum(known) / len(known) if known else -math.inf


def _argmax(scores: list[float]) -> int:
    return max(range(len(scores)), key=lambda i: (scores[i], -i))


token_length_normalized = TokenLengthNormalized()
greedy_token_selection = GreedyTokenSelection()
unconditional_likelihood_normalized = UnconditionalLikelihoodNormalized()
