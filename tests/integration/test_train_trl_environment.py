"""A TRL `environment_factory` class trained through the real pipeline on a tiny model.

The tiny random model is first taught (a few seconds of supervised steps) to answer
every turn with one `look` tool call, under a chat template that renders tools in a
line, so that episodes really call the environment's method and carry tool messages.
Then `AsyncGRPOTrainer(environment_factory=Lookup, reward_funcs=...)` runs 2 steps.

Checked: every trained sequence is a sample the gateway recorded, token for token, with
its loss mask; tool results sit inside completions at mask 0; each episode has its own
instance (reset once), a group's episodes overlap in time; reward functions get the
instances as `environments=`; a reset that raises is an infra_error, counted and run
again, and the run goes on.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch
from test_train import Recorder, base_config, flat, read_jsonl

from asyncgrpo import AsyncGRPOConfig, AsyncGRPOTrainer
from asyncgrpo.inference.server.trajectory import ChatRenderer
from asyncgrpo.learning.agents.tools import tool_schema
from asyncgrpo.learning.rollout import episodes as episodes_mod
from asyncgrpo.testing import save_tiny_model_dir, tiny_prompt_rows

# a ChatML template that shows tools in one line (the fallback's long description would
# not fit the tiny model's 512 positions) and renders earlier calls as <tool_call> text
TOOLS_TEMPLATE = (
    "{% if tools %}<|im_start|>system\ntools:{% for t in tools %} {{ t.function.name }}"
    "{% endfor %}<|im_end|>\n{% endif %}"
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message.tool_calls %}{% for c in message.tool_calls %}<tool_call>"
    "{{ {'name': c.function.name, 'arguments': c.function.arguments} | tojson }}</tool_call>"
    "{% endfor %}{% else %}{{ message['content'] }}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CALL = '<tool_call>{"name": "look", "arguments": {"key": "a"}}</tool_call><|im_end|>'


class Lookup:
    """A TRL-style environment: `look` is its tool; bookkeeping for the test's checks."""

    lock = threading.Lock()
    instances: list = []  # noqa: RUF012 - every instance built, in order
    failed_rows: dict = {}  # noqa: RUF012 - answer -> when its first reset raised

    def __init__(self):
        self.resets = 0
        self.reset_at = None
        self.looked: list[str] = []
        with self.lock:
            self.instances.append(self)

    def reset(self, **row):
        self.resets += 1
        self.reset_at = time.monotonic()
        self.row = row
        if row.get("fail") and row["answer"] not in self.failed_rows:
            with self.lock:
                self.failed_rows[row["answer"]] = time.monotonic()
            raise ConnectionResetError("the environment's backend went away")
        return " Use the look tool."

    def look(self, key: str) -> str:
        """Look a key up.

        Args:
            key: what to look up
        """
        self.looked.append(key)
        return f"value of {key}"

    def get_reward(self) -> float:
        return float(len(self.looked))


def look(key: str) -> str:
    """Look a key up."""
    return key


def teach_tool_calls(model_dir, steps: int = 50) -> None:
    """Train the tiny model to answer every turn (first, or after a tool result) with CALL."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    tok.chat_template = TOOLS_TEMPLATE
    tok.save_pretrained(model_dir)
    renderer = ChatRenderer(tok, [tool_schema(look)])
    target = tok(CALL, add_special_tokens=False)["input_ids"]
    seqs = []
    for i in range(8):
        first = [{"role": "user", "content": f"What is {i} + {i % 7}? Use the look tool."}]
        call = {
            "id": "c",
            "type": "function",
            "function": {"name": "look", "arguments": {"key": "a"}},
        }
        later = [
            *first,
            {"role": "assistant", "tool_calls": [call]},
            {"role": "tool", "content": "value of a"},
        ]
        for messages in (first, later):
            seqs.append(tok(renderer.render(messages, True), add_special_tokens=False)["input_ids"])
    width = max(len(s) for s in seqs) + len(target)
    ids = torch.full((len(seqs), width), tok.pad_token_id)
    labels = torch.full((len(seqs), width), -100)
    attention = torch.zeros((len(seqs), width), dtype=torch.long)
    for row, prompt in enumerate(seqs):
        n = len(prompt) + len(target)
        ids[row, :n] = torch.tensor(prompt + target)
        labels[row, len(prompt) : n] = torch.tensor(target)
        attention[row, :n] = 1
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).train()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(steps):
        optimizer.zero_grad()
        model(input_ids=ids, attention_mask=attention, labels=labels).loss.backward()
        optimizer.step()
    model.save_pretrained(model_dir)


@pytest.fixture(scope="module")
def tool_model_dir(tmp_path_factory):
    model_dir = save_tiny_model_dir(tmp_path_factory.mktemp("tiny-tool-caller"))
    teach_tool_calls(model_dir)
    return model_dir


@pytest.mark.heavy  # a whole training run (engine process, gateway, trainer): 10-20 s
def test_environment_episodes_train_on_the_gateway_tokens(tmp_path, tool_model_dir, monkeypatch):
    recorder = Recorder(monkeypatch)
    ended = []  # (time, outcome) of every episode
    seen_environments = []

    async def recording_run_episode(*args, **kwargs):
        outcome = await run_episode(*args, **kwargs)
        ended.append((time.monotonic(), outcome))
        return outcome

    run_episode = episodes_mod.run_episode
    monkeypatch.setattr(episodes_mod, "run_episode", recording_run_episode)

    def used_the_tool(completions, environments, **kwargs):
        seen_environments.append(list(environments))
        return [float(any(m["role"] == "tool" for m in c)) for c in completions]

    cfg = base_config(
        tmp_path,
        tool_model_dir,
        "trl-env",
        max_steps=2,
        **{
            "engine.max_model_len": 256,
            "rollout.num_generations": 3,
            "rollout.max_tokens": 40,
            "agent.max_turns": 2,
            "agent.episode_timeout_s": 60,
        },
    )
    rows = tiny_prompt_rows(12, fail_every=2)  # odd rows: the first reset raises
    trainer = AsyncGRPOTrainer(
        model=str(tool_model_dir),
        reward_funcs=[used_the_tool],
        train_dataset=rows,
        args=AsyncGRPOConfig(**flat(cfg)),
        environment_factory=Lookup,
    )
    run_dir = trainer.train()

    assert len(recorder.batches) == 2
    recorded = {tuple(s.input_ids): s for _, o in ended for s in o.samples}
    tool_turns = 0
    for groups in recorder.batches:
        for group in groups:
            for r in group.rollouts:
                sample = recorded[tuple(r.prompt_ids + r.completion_ids)]  # the gateway's own
                assert [0] * len(r.prompt_ids) + r.completion_mask == sample.loss_mask
                masked = [i for i, m in enumerate(r.completion_mask) if not m]
                assert all(r.logprobs[i] == 0.0 and r.versions[i] == -1 for i in masked)
                if masked:  # a tool result between two replies, at mask 0
                    tool_turns += 1
                    assert 0 < masked[0] and masked[-1] < len(r.completion_mask) - 1
                assert r.rewards[0] == float(bool(masked))  # used_the_tool's column
    assert tool_turns > 0, "the taught model never called the tool"

    scored = [o for _, o in ended if o.context is not None]
    instances = [o.context.environment for o in scored]
    assert len({id(e) for e in instances}) == len(instances)  # one instance per episode
    assert all(e.resets == 1 for e in instances)  # never reused
    assert all(e.resets <= 1 for e in Lookup.instances)  # (some were cancelled at the end)
    assert any(e.looked == ["a"] for e in instances)  # the tool ran on the instance
    for environments in seen_environments:  # the instances themselves, one per completion
        assert all(any(e is s for s in instances) for e in environments)
    finished = {id(o.context.environment): t for t, o in ended if o.context is not None}
    by_row: dict[str, list] = {}
    for e in instances:
        by_row.setdefault(e.row["answer"], []).append(e)
    overlapping = 0
    for answer, group in by_row.items():
        first_tries = sorted(group, key=lambda e: e.reset_at)
        if answer in Lookup.failed_rows:
            first_tries.pop()  # the episode run again after the failed reset starts last
        if max(e.reset_at for e in first_tries) < min(finished[id(e)] for e in first_tries):
            overlapping += 1
    assert overlapping == len(by_row), by_row  # every group ran its episodes together

    lines = read_jsonl(run_dir / "metrics.jsonl")
    train_lines = [x for x in lines if x["kind"] == "train"]
    assert [x["version"] for x in train_lines] == [1, 2]
    assert Lookup.failed_rows, "no reset failed: the test rows lost their fail flags"
    infra = sum(x["stop_reasons"].get("infra_error", 0) for x in train_lines)
    retries = sum(x["episode_infra_retries"] for x in train_lines)
    assert infra >= 1 and retries >= 1, train_lines
    assert "reward/Lookup" in train_lines[-1] and "reward/used_the_tool" in train_lines[-1]


# A TRL script as its docs show it; the test renames the two classes and nothing else.
TRL_SCRIPT = '''
from trl import GRPOConfig, GRPOTrainer


class Library:
    def __init__(self):
        self.looked = []

    def reset(self, **kwargs):
        self.looked = []

    def look(self, key: str) -> str:
        """Look a key up in the library.

        Args:
            key: the key to look up
        """
        self.looked.append(key)
        return "found " + key

    def get_reward(self) -> float:
        return float(len(self.looked))


dataset = [{"prompt": [{"role": "user", "content": f"Find key {i}."}]} for i in range(16)]
args = GRPOConfig(
    output_dir=OUTPUT_DIR,
    max_steps=2,
    per_device_train_batch_size=6,
    num_generations=3,
    max_completion_length=40,
    max_tool_calling_iterations=1,
    learning_rate=1e-3,
    logging_steps=1,
    bf16=False,
)
trainer = GRPOTrainer(
    model=MODEL, args=args, train_dataset=dataset, environment_factory=Library
)
trainer.train()
'''


@pytest.mark.heavy  # two engine starts with default settings: ~1-2 min on 2 busy cores
def test_a_trl_environment_factory_script_runs_with_the_classes_renamed(tmp_path, tool_model_dir):
    script = TRL_SCRIPT.replace(
        "from trl import GRPOConfig, GRPOTrainer",
        "from asyncgrpo import AsyncGRPOConfig as GRPOConfig, AsyncGRPOTrainer as GRPOTrainer",
    )
    namespace = {"OUTPUT_DIR": str(tmp_path), "MODEL": str(tool_model_dir)}
    exec(compile(script, "trl_script.py", "exec"), namespace)
    trainer = namespace["trainer"]
    assert trainer.args.agent.max_turns == 2  # max_tool_calling_iterations + 1
    lines = read_jsonl(trainer.run_dir / "metrics.jsonl")
    train_lines = [x for x in lines if x["kind"] == "train"]
    assert [x["version"] for x in train_lines] == [1, 2]
    # get_reward is the only reward: a column named after the class, and the taught model's
    # calls ran on the instances (one look per episode: the second reply's call is not run)
    assert all(x["reward/Library"] is not None for x in train_lines), train_lines
    assert any(x["reward/Library"] > 0 for x in train_lines), train_lines
