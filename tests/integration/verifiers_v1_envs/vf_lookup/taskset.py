"""Look keys up with a tool; rewarded for the tool results the episode got and the
length of its replies (any variance will do for tests).

`setup` writes the episode's values into its state (where the shared tool server reads
them) and raises for its first `fail_first` calls in this process, to play an environment
that breaks.
"""

import itertools

import verifiers.v1 as vf

from vf_lookup.servers.look import LookupState, LookupToolset

SETUPS = itertools.count()  # task setups in this process


class LookupData(vf.TaskData):
    values: dict[str, str]


class LookupTaskConfig(vf.TaskConfig):
    fail_first: int = 0


class LookupTask(vf.Task[LookupData, LookupState, LookupTaskConfig]):
    async def setup(self, trace: vf.Trace) -> None:
        if next(SETUPS) < self.config.fail_first:
            raise ConnectionResetError("the lookup backend went away")
        trace.state.values = dict(self.data.values)

    @vf.reward(weight=1.0)
    async def looked(self, trace: vf.Trace) -> float:
        return float(len(trace.tool_messages))

    @vf.reward(weight=0.5)
    async def reply_length(self, trace: vf.Trace) -> float:
        texts = [m.content or "" for m in trace.assistant_messages]
        calls = [c.arguments for m in trace.assistant_messages for c in m.tool_calls or []]
        return float(len("".join(texts + calls)) % 5)

    @vf.metric
    async def replies(self, trace: vf.Trace) -> float:
        return float(trace.num_turns)


class LookupConfig(vf.TasksetConfig):
    num_tasks: int = 12
    task: LookupTaskConfig = LookupTaskConfig()
    tools: vf.SharedToolsetConfig = vf.SharedToolsetConfig()


class LookupTaskset(vf.Taskset[LookupTask, LookupConfig]):
    @classmethod
    def toolsets(cls, config: LookupConfig) -> list[vf.Toolset]:
        return [LookupToolset(config.tools)]

    def load(self) -> list[LookupTask]:
        return [
            LookupTask(
                LookupData(
                    prompt=f"What is {i} + {i % 7}? Use the look tool.",
                    values={"a": f"value {i}"},
                ),
                self.config.task,
            )
            for i in range(self.config.num_tasks)
        ]
