"""A request's stop strings, prepared once so the check after every token stays cheap.

A sample stops when one of its request's stop strings appears in the decoded text of
its last few tokens (the longest stop string plus two, assuming a token decodes to at
least one character). The check runs on the engine thread after every token of every
sample, and a request may carry thousands of stop strings: one million of them once
slowed an unrelated request 27-fold. The server bounds their count and length; this
module keeps even the bounded worst case cheap:

- the window and the distinct lengths are computed once per request, not per token;
- a search costs the smaller of one substring scan per stop string and one set lookup
  per (text position, distinct stop length), so past that bound it no longer grows
  with the number of stop strings.

When several stop strings occur, the one listed first wins, as in vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StopStrings:
    """Non-empty, distinct stop strings in request order, with what the search needs."""

    rank: dict[str, int]  # stop string -> its position in the request (insertion order)
    lengths: tuple[int, ...]  # the distinct lengths of the stop strings
    window: int  # tokens decoded per check

    @classmethod
    def of(cls, stops: list[str]) -> StopStrings | None:
        """None when there is nothing to look for (no stop strings, or only empty ones)."""
        ordered = list(dict.fromkeys(s for s in stops if s))
        if not ordered:
            return None
        lengths = tuple(sorted({len(s) for s in ordered}))
        return cls({s: i for i, s in enumerate(ordered)}, lengths, lengths[-1] + 2)

    def match(self, tokenizer, tokens: list[int]) -> str | None:
        """The stop string that the text of the last `window` tokens contains, if any."""
        text = tokenizer.decode(tokens[-self.window :], skip_special_tokens=False)
        return self.find(text)

    def find(self, text: str) -> str | None:
        """The first listed stop string occurring in `text`, or None."""
        if len(self.rank) <= len(text) * len(self.lengths):
            return next((s for s in self.rank if s in text), None)
        found = [
            piece
            for n in self.lengths
            for i in range(len(text) - n + 1)
            if (piece := text[i : i + n]) in self.rank
        ]
        return min(found, key=self.rank.__getitem__) if found else None
