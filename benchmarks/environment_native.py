"""The three environment examples rewritten as native `agent.rollout` functions.

`environment_overhead.py` trains each example twice: through its adapter (TRL's
`environment_factory`, an OpenEnv server, a verifiers environment) and through the
function here that does the same episode in process, written as an asyncgrpo user who
owns the environment would write it: the same environment logic and prompts, the same
tool schema (so the engine sees the same tokens), the same chat calls with the same
sampling, the same reward; none of the adapter's machinery (thread hops for the
environment's methods, a WebSocket session per episode, verifiers' state and rubric,
a group scorer). What the adapter costs is the difference. The verifiers episode has two
rewards: the classic example's (`verifiers_rollout`, verifiers 0.3) and its port to
verifiers 0.4's API (`verifiers_v1_rollout`, `word_budget_v1.py`), the same episode.

Where a native rollout cannot do exactly what the adapter does, stated:

- verifiers: the rubric's group-level term (`shortest_exact_bonus`) needs the whole
  group, which a per-episode rollout does not see; the native reward is `word_budget`
  alone (the bonus is a comparison of a few numbers: no measurable work). The 0.4 port
  has no group term at all.
- TRL: the two reward columns (`stated_count`, `Warehouse`) become one reward, their sum.

`configure(cfg, ...)` must be called with the run's config before it trains: the rollout
reads `max_turns`, the sampling and (OpenEnv) the shared opening messages from it.
"""

from __future__ import annotations

from typing import Any

from asyncgrpo.base.episode import StopReason
from asyncgrpo.learning.agents.rollout_api import LLM, Result
from asyncgrpo.learning.agents.tools import ToolBox

SETTINGS: dict[str, Any] = {}  # set by `configure`


def configure(cfg: Any, openenv_prompt: list[dict] | None = None) -> None:
    """The run's turn limit and sampling; `openenv_prompt` is the adapter run's
    `agent.openenv.prompt` (the shared opening messages)."""
    r = cfg.rollout
    SETTINGS.clear()
    SETTINGS.update(
        max_turns=cfg.agent.max_turns,
        sampling={"max_tokens": r.max_tokens, "temperature": r.temperature, "top_p": r.top_p},
        openenv_prompt=openenv_prompt,
    )


def _assistant(message: Any) -> dict[str, Any]:
    """The reply as the next request repeats it."""
    out: dict[str, Any] = {"role": "assistant", "content": message.content}
    if message.tool_calls:
        out["tool_calls"] = [c.model_dump(exclude_none=True) for c in message.tool_calls]
    return out


def _ended(choice: Any) -> StopReason:
    return StopReason.LENGTH if choice.finish_reason == "length" else StopReason.OK


# ---- TRL: examples/trl_environment.py's Warehouse ----


async def trl_rollout(task: dict, llm: LLM) -> Result:
    """One Warehouse, its `check_stock` as the tool, TRL's loop (the last reply's calls
    unrun), reward get_reward() + stated_count."""
    from examples.trl_environment import Warehouse, stated_count

    env = Warehouse()
    env.reset(**task)
    toolbox = ToolBox([env.check_stock], timeout=3600.0)
    messages = [dict(m) for m in task["prompt"]]
    completion: list[dict] = []  # what stated_count reads: the replies
    stop = StopReason.MAX_TURNS
    async with llm.client() as oai:
        for turn in range(1, SETTINGS["max_turns"] + 1):
            response = await oai.chat.completions.create(
                model=llm.model, messages=messages, tools=toolbox.schemas, **SETTINGS["sampling"]
            )
            choice = response.choices[0]
            calls = choice.message.tool_calls or []
            messages.append(_assistant(choice.message))
            completion.append({"role": "assistant", "content": choice.message.content or ""})
            if calls:
                completion[-1]["tool_calls"] = [c.model_dump() for c in calls]
            if not calls:
                stop = _ended(choice)
                break
            if turn == SETTINGS["max_turns"]:
                break
            for call in calls:
                result = await toolbox.run(call)
                messages.append(
                    {"role": "tool", "tool_call_id": call.id, "content": result.content}
                )
    reward = env.get_reward() + stated_count([completion], [env])[0]
    return Result(reward, stop, sum(toolbox.errors.values()), {"tool_calls": toolbox.calls})


# ---- OpenEnv: examples/openenv_guess.py's GuessEnvironment, in process ----


def _guess_tool() -> dict[str, Any]:
    """The `guess` tool's schema as the adapter shows it, and the adapter's checker of its
    calls: built once per run (`configure` clears them)."""
    if "guess_tool" not in SETTINGS:
        from asyncgrpo.learning.environments.openenv import ActionChecker, action_tool
        from examples.openenv_guess import GuessAction

        tool = action_tool(GuessAction.model_json_schema())
        SETTINGS.update(guess_tool=tool, guess_checker=ActionChecker(tool))
    return SETTINGS["guess_tool"]


def _opening(task: dict, observation: str) -> list[dict]:
    """The shared opening messages, the row's prompt, the first observation appended."""
    prompt = task.get("prompt")
    rows = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt or []
    messages = [dict(m) for m in (SETTINGS["openenv_prompt"] or [])] + [dict(m) for m in rows]
    last = messages[-1] if messages else {}
    if last.get("role") == "user" and isinstance(last.get("content"), str):
        messages[-1] = {**last, "content": f"{last['content']}\n\n{observation}"}
    else:
        messages.append({"role": "user", "content": observation})
    return messages


def _guess(env: Any, call: Any) -> tuple[Any, str | None]:
    """The step's observation, or the error text the model reads (decoded by the
    adapter's own checker, so both ways answer a bad call with the same message)."""
    from examples.openenv_guess import GuessAction

    _guess_tool()
    arguments, problem = SETTINGS["guess_checker"].action(call)
    if problem is not None:
        return None, problem
    return env.step(GuessAction(**arguments)), None


async def openenv_rollout(task: dict, llm: LLM) -> Result:
    """reset(seed), then one step per `guess` call, rewards summed until done."""
    from examples.openenv_guess import GuessEnvironment

    tool = _guess_tool()
    env = GuessEnvironment()
    first = env.reset(**{k: v for k, v in task.items() if k != "prompt"})
    messages = _opening(task, first.message)
    reward, steps, failures, done = 0.0, 0, 0, False
    stop = StopReason.MAX_TURNS
    async with llm.client() as oai:
        for _ in range(SETTINGS["max_turns"]):
            response = await oai.chat.completions.create(
                model=llm.model, messages=messages, tools=[tool], **SETTINGS["sampling"]
            )
            choice = response.choices[0]
            messages.append(_assistant(choice.message))
            if not choice.message.tool_calls:
                stop = _ended(choice)
                break
            for call in choice.message.tool_calls:
                observation, problem = _guess(env, call)
                if observation is None:
                    failures += 1
                else:
                    steps, reward, done = steps + 1, reward + observation.reward, observation.done
                text = problem or observation.message
                messages.append({"role": "tool", "tool_call_id": call.id, "content": text})
                if done:
                    break
            if done:
                stop = StopReason.OK
                break
    return Result(reward, stop, failures, {"env_steps": steps, "env_done": done})


# ---- verifiers: examples/verifiers_word_budget.py's two turns (and its 0.4 port) ----


async def verifiers_rollout(task: dict, llm: LLM) -> Result:
    """The classic example's episode; reward its `word_budget`."""
    from examples.verifiers_word_budget import word_budget

    completion, stop = await _two_turns(task, llm)
    return Result(word_budget(completion, task["info"]), stop)


async def verifiers_v1_rollout(task: dict, llm: LLM) -> Result:
    """The same episode, rewarded by `word_budget_v1` (its port to verifiers 0.4, where the
    classic module cannot be imported): the same arithmetic on the replies' texts."""
    from word_budget_v1 import budget_score

    completion, stop = await _two_turns(task, llm)
    replies = [m["content"] for m in completion if m["role"] == "assistant"]
    return Result(budget_score(replies, task["info"]["targets"]), stop)


async def _two_turns(task: dict, llm: LLM) -> tuple[list[dict], StopReason]:
    """The first reply, the second question, the second reply: (the messages after the
    prompt, how the last call ended)."""
    info = task["info"]
    messages = [dict(m) for m in task["prompt"]]
    stop = StopReason.OK
    async with llm.client() as oai:
        for turn in range(2):  # the environment's max_turns
            if turn:
                topic, target = info["topics"][1], info["targets"][1]
                messages.append(
                    {"role": "user", "content": f"Now describe {topic} in exactly {target} words."}
                )
            response = await oai.chat.completions.create(
                model=llm.model, messages=messages, **SETTINGS["sampling"]
            )
            choice = response.choices[0]
            messages.append({"role": "assistant", "content": choice.message.content or ""})
            stop = _ended(choice)
            if not choice.message.content:  # verifiers stops at an empty reply (an error)
                break
    return messages[len(task["prompt"]) :], stop
