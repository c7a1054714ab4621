"""A verifiers 0.4 environment for tests, without tools: `vf_talk`, a custom multi-turn
`Env` (the environment answers the model's first reply with a user turn of its own). Its
taskset alone, as `vf_single` exports it, is a single-turn environment (`SingleAgentEnv`
plays one segment; with `task.single_turn`, a `@vf.stop` refuses any second turn).
"""

import asyncio

import verifiers.v1 as vf


class TalkTaskConfig(vf.TaskConfig):
    single_turn: bool = False


class TalkTask(vf.Task[vf.TaskData, vf.State, TalkTaskConfig]):
    @vf.stop
    async def one_reply(self, trace: vf.Trace) -> bool:
        return self.config.single_turn and trace.num_turns >= 1

    @vf.reward(weight=1.0)
    async def reply_length(self, trace: vf.Trace) -> float:
        return float(len("".join(m.content or "" for m in trace.assistant_messages)) % 5)

    @vf.reward(weight=0.0)
    async def replies(self, trace: vf.Trace) -> float:
        return float(trace.num_turns)


class TalkConfig(vf.TasksetConfig):
    num_tasks: int = 12
    task: TalkTaskConfig = TalkTaskConfig()


class TalkTaskset(vf.Taskset[TalkTask, TalkConfig]):
    def load(self) -> list[TalkTask]:
        words = ("a", "b", "c", "d", "e")
        return [
            TalkTask(vf.TaskData(prompt=f"say {words[i % 5]}"), self.config.task)
            for i in range(self.config.num_tasks)
        ]


class TalkEnv(vf.SingleAgentEnv):
    """The model replies; the environment says something; the model replies again."""

    async def run(self, task, agents):
        async with agents.agent.interaction(task) as interaction:
            first = await interaction.turn()
            if first.terminated:
                return
            await asyncio.sleep(0.1)  # so a group's episodes overlap if they run at once
            await interaction.turn("observation: 42")


__all__ = ["TalkEnv", "TalkTaskset"]
