"""A calculator agent written as a plain OpenAI-client loop, trained unchanged by asyncgrpo.

Nothing here knows about training: it is the loop one would write against any
OpenAI-compatible server. `asyncgrpo train recipes/calculator.yaml` runs it as
the recipe's `agent.rollout`, handing it a per-episode `llm.base_url` and
`llm.api_key`; the engine's episode gateway records the exact tokens of every
call, and the returned `Result` is the episode's reward.

The loop: ask with the `calculator` tool; run the tool calls of the reply and
send back their results; stop at the first reply without a tool call (the final
answer) or after `MAX_TURNS` calls. SmolLM2's chat template does not render
tools, so the gateway describes them in the system message and parses
`<tool_call>{...}</tool_call>` blocks out of the reply.

Reward, a ladder (see `recipes/calculator.yaml` for the base rates behind it):
1.0 when the final answer contains the right number; else 0.5 when a tool call
returned the right number (the right expression); else 0.3 when a tool call ran
(well-formed, a valid expression); else 0.1 when a reply at least attempted a
`<tool_call>` block; else 0. Untrained, the model attempts a call in 16-30% of
episodes but completes one in 5-9% and is right in ~6%, so the lower rungs are
what gives most groups some variance. `Result.info` carries the separate flags, averaged by the evaluation.
"""

from __future__ import annotations

import openai

from asyncgrpo.learning.agents import LLM, Result, StopReason, ToolBox
from asyncgrpo.learning.tasks.calculator import calculator, contains_answer

MAX_TURNS = 3
MAX_TOKENS = 48  # per reply: a tool call is ~25 tokens, an answer a sentence


# One worked exchange before the question: a 135M model never writes a `<tool_call>` from the
# tool description alone (0 of 64 episodes), but copies the format from an example.
DEMONSTRATION = [
    {
        "role": "user",
        "content": "What is 512 * 34? Use the calculator tool, then state the final answer.",
    },
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_0",
                "type": "function",
                "function": {"name": "calculator", "arguments": '{"expression": "512 * 34"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_0", "content": "17408"},
    {"role": "assistant", "content": "512 * 34 = 17408. The answer is 17408."},
]
USE_DEMONSTRATION = True


async def rollout(task: dict, llm: LLM) -> Result:
    toolbox = ToolBox([calculator])
    messages = (DEMONSTRATION if USE_DEMONSTRATION else []) + list(task["prompt"])
    answered = ""
    attempted = tool_ran = right_result = False
    stop = StopReason.MAX_TURNS  # unless a reply comes without a tool call
    async with openai.AsyncOpenAI(base_url=llm.base_url, api_key=llm.api_key) as client:
        for _ in range(MAX_TURNS):
            response = await client.chat.completions.create(
                model=llm.model, messages=messages, tools=toolbox.schemas, max_tokens=MAX_TOKENS
            )
            message = response.choices[0].message
            attempted |= bool(message.tool_calls) or "<tool_call>" in (message.content or "")
            if not message.tool_calls:
                answered, stop = message.content or "", StopReason.OK
                break
            messages.append(
                {
                    "role": "assistant",
                    "content": message.content,
                    "tool_calls": [c.model_dump(exclude_none=True) for c in message.tool_calls],
                }
            )
            for call in message.tool_calls:
                result = await toolbox.run(call)
                tool_ran |= result.error is None
                right_result |= result.error is None and result.content == task["answer"]
                messages.append(
                    {"role": "tool", "tool_call_id": call.id, "content": result.content}
                )
    correct = contains_answer(answered, task["answer"])
    reward = (
        1.0 if correct else 0.5 if right_result else 0.3 if tool_ran else 0.1 if attempted else 0.0
    )
    info = {
        "correct": correct,
        "attempted_tool_call": attempted,
        "tool_ran": tool_ran,
        "right_tool_result": right_result,
        "answered": bool(answered),
        "reply": answered[:300],  # text: shown by the base-rate script, not averaged
    }
    return Result(reward, stop, tool_failures=sum(toolbox.errors.values()), info=info)
