"""Prompt log-probs: score every prompt token under the model, during the prefill.

A prefill normally needs logits only at a prompt's last position (they start the
completion). A request with `prompt_logprobs` (Tinker's `compute_logprobs`, vLLM's
field of that name) also wants, at every position p, the log-probability of prompt
token p + 1 and the k most likely tokens there. Its prefill keeps the final hidden
states of every position of each chunk, and `PromptScores` turns them into those
numbers right away, `SCORE_ROWS` positions per LM-head pass, so no more than
(SCORE_ROWS x vocab) logits exist at once however long the prompt or its chunks.

The distribution is the raw model's: log_softmax of the float32 logits, no temperature,
top-k or top-p, whatever the request samples with; that is what a trainer's forward at
temperature 1 computes. Such requests never read the prefix cache (prefill.py): a hit
would skip the positions whose logits are needed. Requests without prompt log-probs take
none of this path.
"""

from __future__ import annotations

import torch

from asyncgrpo.inference.engine.types import PromptLogprobs

SCORE_ROWS = 256  # prompt positions per LM-head pass: bounds the (rows x vocab) logits alive


class PromptScores:
    """The prompt log-probs of one request, filled chunk by chunk as its prefill runs."""

    def __init__(self, prompt: list[int], top_k: int):
        self.prompt = prompt
        self.top_k = top_k
        self.logprobs: list[float] = []
        self.ranks: list[int] = []
        self.top: list[list[tuple[int, float]]] = []

    def add_chunk(self, logits_of, hidden: torch.Tensor, start: int) -> None:
        """Score the positions of a prefilled chunk that starts at prompt position `start`.

        hidden: (T, hidden) final hidden states of positions start..start+T-1 (the rows
        past the chunk's length are ignored); `logits_of` maps such rows to float32 logits
        (rows, V). Position p is scored against prompt token p + 1, so the prompt's last
        position (whose logits predict the completion) is not.
        """
        if start != len(self.logprobs):
            raise RuntimeError(f"prompt chunk at {start} after {len(self.logprobs)} scored")
        end = min(start + hidden.shape[0], len(self.prompt) - 1)
        targets = torch.tensor(  # (T',) where the hidden states are (a CUDA engine's GPU)
            self.prompt[start + 1 : end + 1], dtype=torch.long, device=hidden.device
        )
        for a in range(0, end - start, SCORE_ROWS):
            b = min(a + SCORE_ROWS, end - start)
            self._score(logits_of(hidden[a:b]), targets[a:b])

    def _score(self, logits: torch.Tensor, targets: torch.Tensor) -> None:
        logp = torch.log_softmax(logits.float(), dim=-1)  # (c, V)
        chosen = logp.gather(1, targets.unsqueeze(1))  # (c, 1)
        self.logprobs += chosen[:, 0].tolist()
        self.ranks += (logp >= chosen).sum(dim=1).tolist()
        if self.top_k == 0:
            self.top += [[] for _ in range(len(targets))]
            return
        values, ids = logp.topk(self.top_k, dim=-1)  # (c, k), most likely first
        self.top += [
            list(zip(row_ids, row_values, strict=True))
            for row_ids, row_values in zip(ids.tolist(), values.tolist(), strict=True)
        ]

    def result(self) -> PromptLogprobs:
        return PromptLogprobs(self.logprobs, self.ranks, self.top)
