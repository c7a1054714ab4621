"""How many boxes of an item are in stock? The model cannot know: it must ask the tool.

Each task holds a random stock of three items (10-99 boxes each) and asks about one of
them. `setup` puts the stock in the episode's state, where the shared `check_stock` server
reads it. Rewards: `asked_right_item` (weight 0.5) is 1 when a reply called the tool for
the asked item, 0.4 when it called it at all; `stated_count` (weight 1) is 1 when the
last reply states the count. A worked exchange opens every prompt: a 135M model copies the
call format only from an example.
"""

import json
import random
import re

import verifiers.v1 as vf

from verifiers_warehouse.servers.stock import StockToolset, WarehouseState

ITEMS = ["pears", "apples", "nails", "bolts", "cables", "lamps", "chairs", "gloves", "tiles"]

DEMONSTRATION = [
    vf.UserMessage(content="How many boxes of cups are in stock? Use the tool."),
    vf.AssistantMessage(
        tool_calls=[vf.ToolCall(id="call_0", name="check_stock", arguments='{"item": "cups"}')]
    ),
    vf.ToolMessage(tool_call_id="call_0", content="17"),
    vf.AssistantMessage(content="There are 17 boxes of cups in stock."),
]


class WarehouseData(vf.TaskData):
    item: str
    """The item asked about."""
    stock: dict[str, int]
    """Boxes per item, hidden from the model."""


class WarehouseTask(vf.Task[WarehouseData, WarehouseState]):
    async def setup(self, trace: vf.Trace) -> None:
        trace.state.stock = dict(self.data.stock)

    @vf.reward(weight=0.5)
    async def asked_right_item(self, trace: vf.Trace) -> float:
        asked = [_item(c.arguments) for m in trace.assistant_messages for c in m.tool_calls or []]
        if self.data.item in asked:
            return 1.0
        return 0.4 if asked else 0.0

    @vf.reward(weight=1.0)
    async def stated_count(self, trace: vf.Trace) -> float:
        count = str(self.data.stock[self.data.item])
        return 1.0 if re.search(rf"(?<!\d){count}(?!\d)", trace.last_reply) else 0.0


def _item(arguments: str) -> str | None:
    try:
        parsed = json.loads(arguments)
    except json.JSONDecodeError:
        return None
    return parsed.get("item") if isinstance(parsed, dict) else None


class WarehouseConfig(vf.TasksetConfig):
    num_tasks: int = 240
    """How many questions to build."""
    seed: int = 0
    """The random stock's seed (another seed: other questions, e.g. held out)."""
    tools: vf.SharedToolsetConfig = vf.SharedToolsetConfig()


class WarehouseTaskset(vf.Taskset[WarehouseTask, WarehouseConfig]):
    @classmethod
    def toolsets(cls, config: WarehouseConfig) -> list[vf.Toolset]:
        return [StockToolset(config.tools)]

    def load(self) -> list[WarehouseTask]:
        rng = random.Random(self.config.seed)
        tasks = []
        for i in range(self.config.num_tasks):
            items = rng.sample(ITEMS, 3)
            stock = {item: rng.randint(10, 99) for item in items}
            item = rng.choice(items)
            question = vf.UserMessage(
                content=f"How many boxes of {item} are in stock? Use the tool."
            )
            data = WarehouseData(idx=i, prompt=[*DEMONSTRATION, question], item=item, stock=stock)
            tasks.append(WarehouseTask(data, self.config.task))
        return tasks
