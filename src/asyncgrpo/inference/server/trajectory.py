"""Token-exact training samples from the recorded calls of one agent episode.

An agent talks to the engine through chat messages; training must see the exact
tokens the engine prefilled and sampled, never chat text tokenized again (BPE is
not one-to-one: sampled "a","b" decode to "ab", which encodes as one other id;
tool parsers rewrite text; templates drop reasoning of earlier turns). So every
call is recorded with its prompt ids and sampled ids, and a trajectory is
assembled from those ids alone:

- A call whose prompt ids start with a branch's tokens extends that branch: the
  new prompt tokens (tool results, the next user turn, template scaffolding) are
  appended with loss mask 0, the sampled tokens with mask 1.
- A call whose prompt does not, but whose *messages* continue the branch (the
  previous messages, the assistant reply, then new messages) still extends it:
  the branch keeps its exact tokens and only the new messages are rendered and
  appended (the "bridge"). The engine then saw a different prompt than the one
  trained on; that is counted as a mismatch. The gateway avoids it entirely by
  prefilling `next_prompt_ids(...)`, the branch tokens plus the bridge, instead
  of the re-rendered conversation — then every turn takes the first path.
- Anything else starts a new branch. One sample per branch; a branch that is a
  prefix of another is merged into it, so shared tokens are trained once.

This departs from re-tokenizing designs (and from TRL's chat-level masks) in
that no sampled token ever goes through decode→encode.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from asyncgrpo.base.episode import BranchSequence, EpisodeMetrics, EpisodeResult, StopReason
from asyncgrpo.inference.server.toolcalls import inject_tools_fallback, template_renders_tools


@dataclass
class Call:
    """One chat completion of an episode, as the gateway recorded it."""

    messages: list[dict[str, Any]]  # the request's messages, as the client sent them
    prompt_ids: list[int]  # what the engine prefilled
    completion_ids: list[int]  # what it sampled (an end-of-turn token included if sampled)
    logprobs: list[float]  # behaviour log-prob per sampled token
    versions: list[int]  # weight version per sampled token
    finish_reason: str
    reply: dict[str, Any] | None = None  # the assistant message returned (content, tool_calls)
    tools: list[dict[str, Any]] | None = None  # the request's tools
    chat_template_kwargs: dict[str, Any] | None = None
    malformed_tool_calls: int = 0

    def __post_init__(self):
        n = len(self.completion_ids)
        if len(self.logprobs) != n or len(self.versions) != n:
            raise ValueError(
                f"call has {n} sampled tokens but {len(self.logprobs)} log-probs "
                f"and {len(self.versions)} versions"
            )


# ---- rendering ----


def message_for_template(message: dict[str, Any]) -> dict[str, Any]:
    """Drop unset keys, join text parts, and give templates tool arguments as mappings."""
    out = {k: v for k, v in message.items() if v is not None}
    if isinstance(out.get("content"), list):
        out["content"] = "\n".join(p.get("text", "") for p in out["content"])
    if out.get("tool_calls"):
        out["tool_calls"] = [_arguments_as_mapping(c) for c in out["tool_calls"]]
    return out


def _arguments_as_mapping(call: dict[str, Any]) -> dict[str, Any]:
    function = call.get("function")
    if isinstance(function, dict) and isinstance(function.get("arguments"), str):
        try:
            return {
                **call,
                "function": {**function, "arguments": json.loads(function["arguments"])},
            }
        except ValueError:
            return call
    return call


_RENDERS_TOOLS: dict[str | None, bool] = {}  # by template text: the answer depends on it alone


class ChatRenderer:
    """The chat template of a tokenizer, with the tool fallback when the template lacks tools."""

    def __init__(
        self,
        tokenizer,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        fallback: bool | None = None,  # None: when tools are given and the template ignores them
    ):
        self.tokenizer = tokenizer
        self.tools = tools or None
        self.kwargs = chat_template_kwargs or {}
        if fallback is None and self.tools:
            template = tokenizer.chat_template
            if template not in _RENDERS_TOOLS:
                _RENDERS_TOOLS[template] = template_renders_tools(tokenizer)
            fallback = not _RENDERS_TOOLS[template]
        self.fallback = bool(fallback)

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool) -> str:
        messages = [message_for_template(m) for m in messages]
        tools = self.tools
        if self.fallback:
            messages, tools = inject_tools_fallback(messages, tools), None
        return self.tokenizer.apply_chat_template(
            messages,
            tools=tools,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            **self.kwargs,
        )

    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def prompt_ids(self, messages: list[dict[str, Any]]) -> list[int]:
        """A first prompt: the whole conversation rendered and tokenized."""
        return self.encode(self.render(messages, add_generation_prompt=True))

    def bridge_ids(
        self, history: list[dict], new: list[dict], sampled: list[int]
    ) -> list[int] | None:
        """Tokens to put after `sampled` (the reply ending `history`) to add the `new` messages.

        The rest of the template's end-of-turn that was not sampled, then the
        rendering of `new` with the generation prompt. None if the template's
        rendering of the new messages cannot be isolated.
        """
        suffix = self._suffix_text(history, new)
        if suffix is None:
            return None
        tail = self._turn_tail()
        tail_ids = self.encode(tail)
        done = max(
            (k for k in range(len(tail_ids), 0, -1) if sampled[-k:] == tail_ids[:k]), default=0
        )
        consumed = self.tokenizer.decode(tail_ids[:done], skip_special_tokens=False)
        rest = tail[len(consumed) :] if tail.startswith(consumed) else ""
        return self.encode(rest + suffix)

    def _suffix_text(self, history: list[dict], new: list[dict]) -> str | None:
        """The full render minus the render of `history`, or of a minimal stand-in for it.

        The stand-in (a one-word user turn and the reply without reasoning) serves
        templates that render earlier turns differently once more turns follow.
        """
        reply = history[-1]
        stand_in = [
            {"role": "user", "content": "."},
            {k: reply[k] for k in ("role", "content", "tool_calls") if reply.get(k) is not None},
        ]
        for head in (history, stand_in):
            try:
                full = self.render(head + new, add_generation_prompt=True)
                prefix = self.render(head, add_generation_prompt=False)
            except Exception:  # templates that refuse a history ending on the assistant
                continue
            if full.startswith(prefix):
                return full[len(prefix) :]
        return None

    def _turn_tail(self) -> str:
        """What the template writes after an assistant message's content (e.g. `<|im_end|>\\n`)."""
        marker = "\x00asyncgrpo-end-of-content\x00"
        try:
            text = self.render(
                [{"role": "user", "content": "."}, {"role": "assistant", "content": marker}],
                add_generation_prompt=False,
            )
        except Exception:
            return ""
        return text.split(marker, 1)[1] if marker in text else ""


# ---- message-level continuation ----


def _normalized(message: dict[str, Any]) -> dict[str, Any]:
    out = message_for_template(message)
    out["content"] = out.get("content") or ""
    return out


def _same_reply(sent: dict[str, Any], returned: dict[str, Any]) -> bool:
    """Did the agent send back the reply the engine returned (up to whitespace and ids)?"""

    def key(message):
        m = _normalized(message)
        calls = [
            (c.get("function", {}).get("name"), c.get("function", {}).get("arguments"))
            for c in m.get("tool_calls", [])
        ]
        return m.get("role"), str(m["content"]).strip(), calls

    return key(sent) == key(returned)


def _same_setup(call: Call, tools, chat_template_kwargs) -> bool:
    return (call.tools or None) == (tools or None) and (call.chat_template_kwargs or {}) == (
        chat_template_kwargs or {}
    )


def continuation(previous: Call, messages: list[dict[str, Any]]) -> int | None:
    """If `messages` = previous messages + its reply + new messages, where the new ones start."""
    n = len(previous.messages)
    if len(messages) <= n or messages[n].get("role") != "assistant":
        return None
    if [_normalized(m) for m in messages[:n]] != [_normalized(m) for m in previous.messages]:
        return None
    if previous.reply is not None and not _same_reply(messages[n], previous.reply):
        return None
    return n + 1


# ---- branches ----


@dataclass
class _Branch:
    ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    turns: list[tuple[Call, int]] = field(default_factory=list)  # (call, end of its completion)

    @property
    def last(self) -> Call:
        return self.turns[-1][0]

    def extend(self, context: list[int], call: Call) -> None:
        self.ids += context + call.completion_ids
        self.mask += [0] * len(context) + [1] * len(call.completion_ids)
        self.logprobs += [0.0] * len(context) + list(call.logprobs)
        self.versions += [-1] * len(context) + list(call.versions)
        self.turns.append((call, len(self.ids)))


class TrajectoryBuilder:
    """The branches of one episode, extended call by call (the gateway keeps one per episode)."""

    def __init__(self, tokenizer=None):
        self.tokenizer = tokenizer  # without one, only exact token prefixes extend a branch
        self.branches: list[_Branch] = []
        self.calls: list[Call] = []
        self.prompt_mismatches = 0
        self.closed = False  # set by `result()`: a closed episode accepts no more calls

    def add(self, call: Call) -> int:
        """Record a call; return the index of the branch it extended or started."""
        if self.closed:
            raise RuntimeError("the episode is closed; refuse calls made after it ended")
        self.calls.append(call)
        for index in reversed(range(len(self.branches))):
            branch = self.branches[index]
            if call.prompt_ids[: len(branch.ids)] == branch.ids:
                branch.extend(call.prompt_ids[len(branch.ids) :], call)
                return index
        found = self._bridge(call.messages, call.tools, call.chat_template_kwargs)
        if found is not None:
            index, end, bridge = found
            if end == len(self.branches[index].ids):  # the engine was not given these tokens
                self.prompt_mismatches += 1
                self.branches[index].extend(bridge, call)
                return index
        self.branches.append(_Branch())
        self.branches[-1].extend(list(call.prompt_ids), call)
        return len(self.branches) - 1

    def _bridge(self, messages, tools, chat_template_kwargs) -> tuple[int, int, list[int]] | None:
        """(branch, end, bridge ids): `messages` continue the turn that ends at `end`.

        The latest branch and latest turn first; a turn other than a branch's last
        one is a fork (the agent went back, e.g. to retry a step).
        """
        if self.tokenizer is None:
            return None
        renderer = ChatRenderer(self.tokenizer, tools, chat_template_kwargs)
        for index in reversed(range(len(self.branches))):
            branch = self.branches[index]
            for call, end in reversed(branch.turns):
                if not _same_setup(call, tools, chat_template_kwargs):
                    continue
                start = continuation(call, messages)
                if start is None:
                    continue
                bridge = renderer.bridge_ids(messages[:start], messages[start:], branch.ids[:end])
                if bridge is not None:
                    return index, end, bridge
        return None

    def samples(self) -> list[BranchSequence]:
        """One sample per branch; a branch whose tokens prefix another's is merged into it."""
        kept = list(self.branches)
        merged: set[int] = set()
        # shortest first, so merges cascade; equal sequences merge into the earlier branch
        order = sorted(range(len(kept)), key=lambda i: (len(kept[i].ids), -i))
        for position, i in enumerate(order):
            short = kept[i]
            for j in order[position + 1 :]:
                if kept[j].ids[: len(short.ids)] == short.ids:
                    kept[j] = _merged(short, kept[j])
                    merged.add(i)
                    break
        return [
            BranchSequence(b.ids, b.mask, b.logprobs, b.versions, i, b.last.finish_reason)
            for i, b in enumerate(kept)
            if i not in merged
        ]

    def result(
        self, reward: float | None, stop_reason: StopReason | str, tool_failures: int = 0
    ) -> EpisodeResult:
        """Close the episode and return its samples and metrics."""
        self.closed = True
        samples = self.samples()
        metrics = EpisodeMetrics(
            turns=len(self.calls),
            tool_calls=sum(len((c.reply or {}).get("tool_calls") or []) for c in self.calls),
            tool_failures=tool_failures,
            branches=len(samples),
            malformed_tool_calls=sum(c.malformed_tool_calls for c in self.calls),
            prompt_mismatches=self.prompt_mismatches,
        )
        return EpisodeResult(reward, StopReason(stop_reason), samples, metrics)


def _merged(short: _Branch, long: _Branch) -> _Branch:
    """`long` with the sampled tokens of `short` (same ids, same context) marked sampled."""
    out = _Branch(list(long.ids), list(long.mask), list(long.logprobs), list(long.versions))
    out.turns = list(long.turns)
    for t, sampled in enumerate(short.mask):
        if sampled and not out.mask[t]:
            out.mask[t], out.logprobs[t], out.versions[t] = 1, short.logprobs[t], short.versions[t]
    return out


def next_prompt_ids(
    state: TrajectoryBuilder,
    messages: list[dict[str, Any]],
    tokenizer=None,
    tools: list[dict[str, Any]] | None = None,
    chat_template_kwargs: dict[str, Any] | None = None,
) -> list[int]:
    """The prompt the engine should prefill for `messages`.

    When `messages` continue a branch: that branch's exact tokens plus the bridge
    (so the recorded call extends the branch by token prefix, with no mismatch).
    Otherwise the conversation rendered and tokenized, as for any chat request.
    """
    tokenizer = tokenizer if tokenizer is not None else state.tokenizer
    if state.tokenizer is None:
        state.tokenizer = tokenizer
    found = state._bridge(messages, tools, chat_template_kwargs)
    if found is not None:
        index, end, bridge = found
        return state.branches[index].ids[:end] + bridge
    return ChatRenderer(tokenizer, tools, chat_template_kwargs).prompt_ids(messages)


def build_samples(calls: list[Call], tokenizer=None) -> list[BranchSequence]:
    """The samples of an episode from its recorded calls, in order."""
    builder = TrajectoryBuilder(tokenizer)
    for call in calls:
        builder.add(call)
    return builder.samples()
