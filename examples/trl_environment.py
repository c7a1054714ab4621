"""A TRL-style environment class (`environment_factory=Warehouse`), trained unchanged.

Written as a TRL 1.16 user writes one: `Warehouse()` takes no argument; `reset(**row)`
reads the row's hidden stock and returns nothing (the question is already in the
prompt); `check_stock` is a tool (its type hints and docstring are the schema the model
sees); `get_reward()` scores the episode from the instance's state. The reward function
`stated_count` receives the instances as `environments=`, as TRL passes them.

The task: "How many boxes of pears are in stock?" The model cannot know: it must call
`check_stock("pears")` and state the number. Rewards (two columns, weight 1 each):
`Warehouse` (get_reward) 0.5 when the tool was asked about the right item, else 0.2 when
any call ran, else 0; `stated_count` 1.0 when the final reply contains the number.
SmolLM2's chat template has no tools, so the gateway describes them in a system message;
as in examples/calculator_agent.py, a 135M model copies the call format only from a
worked exchange, so every prompt starts with one (`DEMONSTRATION`). Measured (one run of
recipes/trl_environment.yaml, 2 busy CPU cores): held-out reward 0.23 before training,
0.91 after 3 steps; the recipe's comments have the details.

    from examples.trl_environment import Warehouse, stated_count, rows
    AsyncGRPOTrainer(model="smollm2-135m", reward_funcs=[stated_count],
                     environment_factory=Warehouse, train_dataset=rows(200, seed=0),
                     eval_dataset=rows(16, seed=1), args=AsyncGRPOConfig(...)).train()

or `asyncgrpo train recipes/trl_environment.yaml` from the repository root (its rows are
`examples/trl_environment_rows.jsonl`, written by `python -m examples.trl_environment`).
"""

from __future__ import annotations

import json
import random
import re
import sys

ITEMS = ["pears", "apples", "nails", "bolts", "cables", "lamps", "chairs", "gloves", "tiles"]

DEMONSTRATION = [
    {"role": "user", "content": "How many boxes of cups are in stock? Use the tool."},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_0",
                "type": "function",
                "function": {"name": "check_stock", "arguments": '{"item": "cups"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_0", "content": "17"},
    {"role": "assistant", "content": "There are 17 boxes of cups in stock."},
]


class Warehouse:
    """One warehouse per episode; its stock comes from the row (`reset`)."""

    def __init__(self):
        self.stock: dict[str, int] = {}
        self.asked_for = ""
        self.checked: list[str] = []

    def reset(self, **row) -> str | None:
        self.stock = dict(row["stock"])
        self.asked_for = row["item"]
        self.checked = []
        return None  # the question is the prompt's last message already

    def check_stock(self, item: str) -> int:
        """Count the boxes of an item in the warehouse.

        Args:
            item: the item's name, e.g. "pears"
        """
        self.checked.append(item)
        if item not in self.stock:
            raise KeyError(f"no item {item!r}; items: {', '.join(sorted(self.stock))}")
        return self.stock[item]

    def get_reward(self) -> float:
        if self.asked_for in self.checked:
            return 0.5
        return 0.2 if self.checked else 0.0


def stated_count(completions, environments, **kwargs) -> list[float]:
    """1.0 when the episode's last reply states the asked item's count."""
    scores = []
    for messages, env in zip(completions, environments, strict=True):
        replies = [m for m in messages if m["role"] == "assistant" and not m.get("tool_calls")]
        text = replies[-1]["content"] if replies else ""
        count = str(env.stock[env.asked_for])
        scores.append(1.0 if re.search(rf"(?<!\d){count}(?!\d)", text or "") else 0.0)
    return scores


def rows(count: int, seed: int) -> list[dict]:
    """Questions about one item of a random stock of three (counts 10-99)."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        items = rng.sample(ITEMS, 3)
        stock = {item: rng.randint(10, 99) for item in items}
        item = rng.choice(items)
        question = f"How many boxes of {item} are in stock? Use the tool."
        prompt = [*DEMONSTRATION, {"role": "user", "content": question}]
        out.append({"prompt": prompt, "item": item, "stock": stock})
    return out


if __name__ == "__main__":  # write the recipe's rows
    path = sys.argv[1] if len(sys.argv) > 1 else "examples/trl_environment_rows.jsonl"
    with open(path, "w") as f:
        for row in rows(240, seed=0):
            f.write(json.dumps(row) + "\n")
