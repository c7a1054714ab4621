"""Which prompt chunks a step of the embedded engine prefills: admission and chunking.

The scheduler (scheduler.py) runs one batched prefill forward per step; this module
decides what goes into it. It holds the requests that have not started decoding:
those waiting to be admitted, and those admitted whose prompt is longer than
`engine.prefill_chunk_size` and is prefilled one chunk per step in a staging slot
(one of `STAGING_SLOTS` cache slots past the decode slots). A step's rows are every
staged prompt's next chunk, then waiting requests in arrival order for as long as:

- their `n` samples fit in the decode slots left (staged prompts keep theirs);
- the batch stays within `engine.prefill_token_budget` (rows x the widest row);
- no row of this step already computes the same missing prefix block: the later
  request waits one step and copies it from the prefix cache instead;
- a long prompt finds a free staging slot.

Admission loads a prompt's cached leading blocks into its slot, so a row starts
after them, and counts the prompt tokens admitted and read from the cache. A request
that asks for prompt log-probs bypasses the cache (it needs every position's logits);
its blocks are still stored for later prompts.
Like the scheduler it runs only on the engine thread.
"""

from __future__ import annotations

from collections import deque

from asyncgrpo.base.config import EmbeddedEngineConfig
from asyncgrpo.inference.engine.prefix_cache import BLOCK as PREFIX_BLOCK
from asyncgrpo.inference.engine.prefix_cache import PrefixCache
from asyncgrpo.inference.engine.request import Request

STAGING_SLOTS = 2  # extra cache slots for prompts whose prefill spans several steps

Row = tuple[Request, int, int, int]  # one prefill row: (request, slot, start, end)


class PrefillQueue:
    """Requests before their first token: waiting, or staged (prefilling in chunks)."""

    def __init__(self, config: EmbeddedEngineConfig, prefix_cache: PrefixCache):
        self.config = config
        self.prefix_cache = prefix_cache
        self.waiting: deque[Request] = deque()
        self.staging: list[Request] = []  # admitted, prefill spanning several steps
        self.prompt_tokens = 0  # prompt tokens admitted
        self.cached_prompt_tokens = 0  # of which read from the prefix cache

    def plan(self, *, admit: bool, running: int, weights_epoch: int) -> list[Row]:
        """This step's prefill rows: each staged prompt's next chunk, then waiting requests
        if `admit`. `running`: decode slots taken (a direct row's samples go next);
        `weights_epoch`: stamped on admitted requests (their keys' and values' weights)."""
        chunk_size = self.config.prefill_chunk_size
        rows: list[Row] = []
        for request in self.staging:
            end = min(len(request.prompt), request.prefilled + chunk_size)
            rows.append((request, request.staging_slot, request.prefilled, end))
        if admit:
            self._admit(rows, running, weights_epoch)
        return rows

    def _admit(self, rows: list[Row], running: int, weights_epoch: int) -> None:
        """Move waiting requests into this step's prefill while slots and budget allow."""
        chunk_size = self.config.prefill_chunk_size
        budget = self.config.prefill_token_budget
        next_slot = running
        reserved = sum(r.params.n for r in self.staging)  # decode slots staged prompts will take
        free = self.config.max_num_seqs - running - reserved
        pending: set = set()  # prefix blocks this step's rows will compute
        while self.waiting:
            request = self.waiting[0]
            n, length = request.params.n, len(request.prompt)
            if n > free:
                break
            # the last prompt token is always computed: its logits start the completion
            hits, missing = self._lookup(request)
            if missing is not None and missing in pending:
                break  # a row of this step computes the same blocks: reuse them next step
            cached = len(hits) * PREFIX_BLOCK
            remaining = length - cached
            widest = max([remaining] + [e - s for _, _, s, e in rows])
            if rows and widest * (len(rows) + 1) > budget:
                break
            if remaining <= chunk_size:
                slot = next_slot
                rows.append((request, slot, cached, length))
                next_slot += n
            else:
                slot = self._stage(request, cached)
                if slot is None:
                    break
                rows.append((request, slot, cached, cached + chunk_size))
            self.prefix_cache.load(hits, slot)
            request.weights_epoch = weights_epoch
            self.prompt_tokens += length
            self.cached_prompt_tokens += cached
            if missing is not None:
                pending.add(missing)
            free -= n
            self.waiting.popleft()

    def _lookup(self, request: Request) -> tuple[list[int], tuple | None]:
        """The request's cached leading blocks; none for a request that wants prompt
        log-probs: it needs the logits of every position, so it computes them all."""
        if request.prompt_scores is not None:
            return [], None
        return self.prefix_cache.lookup(request.prompt, len(request.prompt) - 1)

    def _stage(self, request: Request, cached: int) -> int | None:
        """Give a long prompt a free staging slot (None when all are taken)."""
        used = {r.staging_slot for r in self.staging}
        base = self.config.max_num_seqs
        spare = [s for s in range(base, base + STAGING_SLOTS) if s not in used]
        if not spare:
            return None
        request.staging_slot = spare[0]
        request.prefilled = cached
        self.staging.append(request)
        return request.staging_slot

    def advance(self, request: Request, end: int) -> bool:
        """A staged prompt is prefilled up to `end`; True, and out of staging, once whole."""
        request.prefilled = end
        if end < len(request.prompt):
            return False
        self.staging.remove(request)
        request.staging_slot = -1
        return True

    def requests(self) -> list[Request]:
        return list(self.waiting) + list(self.staging)

    def remove(self, request: Request) -> None:
        if request in self.waiting:
            self.waiting.remove(request)
        if request in self.staging:
            self.staging.remove(request)

    def clear(self) -> None:
        self.waiting.clear()
        self.staging.clear()
