"""Weight updates through every transport, pause modes and the client's errors, over real HTTP.

After each publish the engine's log-probs must equal a plain forward pass of
the *published* weights: that catches a transport that moves bytes to the
wrong place, not just one that moves nothing. Hostile weight paths (files
outside the transports' directories, symlinks, FIFOs) and integer tensors are
refused with a 400 that changes nothing.
"""

import asyncio
import contextlib
import os
import secrets
import shutil
import tempfile
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from asyncgrpo.inference.client import EngineClient, EngineRefused
from asyncgrpo.inference.transport import make_transport
from asyncgrpo.inference.transport.disk import DIRECTORY_PREFIX
from asyncgrpo.inference.transport.shm import SEGMENT_PREFIX, shm_directory

ENGINE_SETTINGS = dict(max_num_seqs=8)  # the `server` fixture of conftest.py


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


def reference_logprobs(model, prompt, completion):
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([prompt + completion])).logits[0], dim=-1)
    return [logp[len(prompt) - 1 + j, t].item() for j, t in enumerate(completion)]


def run(coro):
    return asyncio.run(coro)


def test_each_backend_changes_outputs_and_bumps_versions(server, tokenizer, model):
    prompt = tokenizer.encode("Hello, world!")
    original = {k: v.clone() for k, v in model.state_dict().items()}

    async def scenario():
        async with EngineClient(server.base_url, admin_token=server.admin_token) as client:
            before = await client.complete(prompt, max_tokens=12, temperature=0, ignore_eos=True)
            previous = before.samples[0]
            for version, (backend, scale) in enumerate(
                [("shm", 1.15), ("disk", 0.85), ("http", 1.3)], start=1
            ):
                new = {k: v * scale for k, v in original.items()}
                options = {"max_chunk_bytes": 64 * 1024} if backend == "http" else {}
                transport = make_transport(backend, client, **options)
                try:
                    await transport.publish(new.items(), version)
                    shm_path = getattr(transport, "segment_path", None)
                finally:
                    await transport.close()
                if shm_path is not None:
                    assert not os.path.exists(shm_path)  # close() freed the segment
                model.load_state_dict(new)
                greedy = await client.complete(
                    prompt, max_tokens=12, temperature=0, ignore_eos=True
                )
                sample = greedy.samples[0]
                assert sample.weight_versions == [version] * 12, backend
                assert sample.logprobs != previous.logprobs, backend
                sampled = await client.complete(
                    prompt, max_tokens=12, seed=version, ignore_eos=True
                )
                s = sampled.samples[0]
                err = max(
                    abs(a - b)
                    for a, b in zip(reference_logprobs(model, prompt, s.token_ids), s.logprobs)
                )
                assert err < 1e-4, (backend, err)
                assert (await client.server_info())["weight_version"] == version
                previous = sample

    try:
        run(scenario())
    finally:
        model.load_state_dict(original)


def test_bad_weight_updates_are_refused_and_change_nothing(server, tokenizer):
    prompt = tokenizer.encode("Hello")

    async def scenario():
        async with EngineClient(server.base_url, admin_token=server.admin_token) as client:
            info = await client.server_info()
            before = await client.complete(prompt, max_tokens=6, temperature=0, ignore_eos=True)
            transport = make_transport("shm", client)
            with pytest.raises(EngineRefused, match="unknown parameter 'nope.weight'"):
                await transport.publish([("nope.weight", torch.zeros(3))], 99)
            await transport.close()
            with pytest.raises(EngineRefused, match="start_weight_update"):
                await client.update_weights({"path": "/nonexistent"})
            await client.init_weight_transfer_engine("shm")
            await client.start_weight_update()
            with pytest.raises(EngineRefused, match="cannot read weights"):
                await client.update_weights({"path": "/nonexistent", "names": []})
            with pytest.raises(EngineRefused, match="unknown weight transfer backend"):
                await client.init_weight_transfer_engine("carrier-pigeon")
            after = await client.complete(prompt, max_tokens=6, temperature=0, ignore_eos=True)
            assert after.samples[0].token_ids == before.samples[0].token_ids
            assert (await client.server_info())["weight_version"] == info["weight_version"]

    run(scenario())


async def _first_tokens(server, body):
    """Start a streamed completion; return the task collecting it once its first token arrived."""
    import httpx

    first = asyncio.Event()
    out = {"ids": [], "versions": [], "finish": None}

    async def collect():
        import json

        async with httpx.AsyncClient(base_url=server.base_url, timeout=60) as http:
            async with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
                async for line in r.aiter_lines():
                    if not line.startswith("data: {"):
                        continue
                    choice = json.loads(line[6:])["choices"][0]
                    out["ids"] += choice.get("token_ids", [])
                    out["versions"] += choice["weight_versions"]
                    out["finish"] = choice["finish_reason"] or out["finish"]
                    first.set()
        return out

    task = asyncio.create_task(collect())
    await asyncio.wait_for(first.wait(), 30)
    return task


def test_pause_keep_abort_and_wait(server, tokenizer, model):
    prompt = tokenizer.encode("The quick brown fox")
    body = {"prompt": prompt, "max_tokens": 450, "ignore_eos": True, "return_token_ids": True}
    state = model.state_dict()

    async def scenario():
        async with EngineClient(server.base_url, admin_token=server.admin_token) as client:
            start = (await client.server_info())["weight_version"]
            transport = make_transport("shm", client)
            # keep: the request survives the swap; its tokens carry both versions
            task = await _first_tokens(server, body)
            await client.pause("keep")
            assert await client.is_paused()
            await transport.publish(((k, v * 1.01) for k, v in state.items()), start + 1)
            await client.resume()
            kept = await task
            assert kept["finish"] == "length" and len(kept["ids"]) == 450
            assert kept["versions"][0] == start and kept["versions"][-1] == start + 1
            assert kept["versions"] == sorted(kept["versions"])
            # abort: partial output with finish_reason "abort"
            task = await _first_tokens(server, body)
            await client.pause("abort")
            aborted = await task
            assert aborted["finish"] == "abort" and 0 < len(aborted["ids"]) < 450
            await client.resume()
            # wait: pause returns only after the running request finished
            task = await _first_tokens(server, {**body, "max_tokens": 200})
            await client.pause("wait")
            assert (await client.server_info())["stats"]["running"] == 0
            waited = await asyncio.wait_for(task, 10)  # finished while paused: nothing frozen
            assert waited["finish"] == "length" and len(waited["ids"]) == 200
            await client.resume()
            assert not await client.is_paused()
            await transport.close()

    run(scenario())


def test_client_raises_4xx_with_the_server_message(server):
    async def scenario():
        async with EngineClient(server.base_url) as client:
            with pytest.raises(EngineRefused) as info:
                await client.complete([5] * 600, max_tokens=2)
            assert info.value.status == 400 and "max_model_len is 512" in str(info.value)
            with pytest.raises(EngineRefused) as info:
                await client.pause("keep")  # no token given to this client
            assert info.value.status == 401

    run(scenario())


def test_chat_abort_requests_and_information_routes(server, tokenizer):
    async def scenario():
        async with EngineClient(server.base_url, admin_token=server.admin_token) as client:
            chat = await client.chat([{"role": "user", "content": "Hi"}], n=2, max_tokens=5, seed=1)
            assert len(chat.samples) == 2 and chat.prompt_token_ids
            for s in chat.samples:
                assert len(s.token_ids) == len(s.logprobs) == len(s.weight_versions) <= 5
            task = await _first_tokens(
                server,
                {
                    "prompt": tokenizer.encode("Hi"),
                    "max_tokens": 450,
                    "ignore_eos": True,
                    "return_token_ids": True,
                },
            )
            assert await client.abort_requests() == 1
            aborted = await task
            assert aborted["finish"] == "abort" and 0 < len(aborted["ids"]) < 450
            assert (await client.models())[0]["max_model_len"] == 512
            assert await client.get_world_size() == 1
            assert await client.weight_version() == (await client.server_info())["weight_version"]
            await client.reset_prefix_cache()

    run(scenario())


# ---- hostile weight paths (the admin token is required too: this is defence in depth) ----


def admin_http(server) -> httpx.Client:
    headers = {"Authorization": f"Bearer {server.admin_token}"}
    return httpx.Client(base_url=server.base_url, headers=headers, timeout=10)


def open_session(http: httpx.Client, backend: str) -> None:
    init = http.post("/init_weight_transfer_engine", json={"init_info": {"backend": backend}})
    assert init.status_code == 200, init.text
    assert http.post("/start_weight_update", json={}).status_code == 200


def refusal(response: httpx.Response, path: str) -> str:
    """The error message with the path blanked out (so two refusals can be compared)."""
    assert response.status_code == 400, (path, response.status_code, response.text)
    return response.json()["error"]["message"].replace(repr(path), "<path>")


SEGMENT_INFO = {"names": ["x"], "dtype_names": ["uint8"], "shapes": [[8]], "offsets": [0]}
needs_dev_shm = pytest.mark.skipif(
    str(shm_directory()) != "/dev/shm", reason="needs a writable /dev/shm"
)


@needs_dev_shm
def test_shm_maps_only_its_own_segments(server):
    tag = secrets.token_hex(4)
    link = Path(f"/dev/shm/{SEGMENT_PREFIX}link-{tag}.safetensors")
    unprefixed = Path(f"/dev/shm/not-asyncgrpo-{tag}.safetensors")
    link.symlink_to("/etc/passwd")
    unprefixed.write_bytes(b"\0" * 64)
    paths = ["/etc/passwd", str(link), str(unprefixed), f"/dev/shm/{SEGMENT_PREFIX}missing-{tag}"]
    try:
        with admin_http(server) as http:
            version = http.get("/weight_info").json()["weight_version"]
            open_session(http, "shm")
            messages = set()
            for path in paths:
                response = http.post(
                    "/update_weights", json={"update_info": {**SEGMENT_INFO, "path": path}}
                )
                messages.add(refusal(response, path))
            assert len(messages) == 1 and "/dev/shm/asyncgrpo-weights-*" in messages.pop()
            maps = Path(f"/proc/{server.pid}/maps").read_text()
            assert "/etc/passwd" not in maps and unprefixed.name not in maps  # nothing mapped
            finish = http.post("/finish_weight_update", json={})
            assert finish.status_code == 400 and "no tensors were sent" in finish.text
            assert http.get("/weight_info").json()["weight_version"] == version
    finally:
        link.unlink()
        unprefixed.unlink()


def test_disk_refusals_do_not_reveal_whether_a_path_exists(server, model, tmp_path):
    name, tensor = next(iter(model.state_dict().items()))
    outside = tmp_path / "outside"
    outside.mkdir()
    save_file({name: tensor.clone()}, outside / "model.safetensors")  # valid, but not allowed
    allowed = Path(tempfile.mkdtemp(prefix=DIRECTORY_PREFIX))
    (allowed / "model.safetensors").symlink_to(outside / "model.safetensors")
    paths = [
        str(outside),
        str(outside / "model.safetensors"),
        str(tmp_path / "missing"),
        "/etc/passwd",
        "/etc",
        "/etc/no-such-file",
        str(allowed),  # a directory where the transport writes, whose file links outside
        "/tmp/x\0y",
    ]
    try:
        with admin_http(server) as http:
            open_session(http, "disk")
            messages = set()
            for path in paths:
                response = http.post("/update_weights", json={"update_info": {"path": path}})
                if path == str(allowed):
                    path = str(allowed / "model.safetensors")  # named by the file it refused
                messages.add(refusal(response, path))
        assert len(messages) == 1, messages
    finally:
        shutil.rmtree(allowed)


@needs_dev_shm
def test_fifo_weight_paths_are_refused_without_blocking_the_server(server):
    segment_fifo = f"/dev/shm/{SEGMENT_PREFIX}fifo-{secrets.token_hex(4)}.safetensors"
    disk_dir = tempfile.mkdtemp(prefix=DIRECTORY_PREFIX)
    disk_fifo = os.path.join(disk_dir, "model.safetensors")
    fifos = [segment_fifo, disk_fifo]
    for fifo in fifos:
        os.mkfifo(fifo)

    async def update_while_checking_health(backend: str, info: dict):
        headers = {"Authorization": f"Bearer {server.admin_token}"}
        async with httpx.AsyncClient(base_url=server.base_url, headers=headers, timeout=10) as http:
            await http.post(
                "/init_weight_transfer_engine", json={"init_info": {"backend": backend}}
            )
            await http.post("/start_weight_update", json={})
            update = asyncio.create_task(http.post("/update_weights", json={"update_info": info}))
            health = [(await http.get("/health")).status_code for _ in range(3)]
            return await update, health

    try:
        for backend, info in [
            ("shm", {**SEGMENT_INFO, "path": segment_fifo}),
            ("disk", {"path": disk_dir}),
        ]:
            update, health = asyncio.run(update_while_checking_health(backend, info))
            assert health == [200, 200, 200]
            assert update.status_code == 400 and "regular file" in update.text, update.text
    finally:
        for fifo in fifos:  # on a server that waits on a FIFO, a writer would release it
            with contextlib.suppress(OSError):
                os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
            os.unlink(fifo)
        shutil.rmtree(disk_dir)


def test_integer_weights_are_refused_on_every_backend(server, tokenizer, model):
    prompt = tokenizer.encode("Hello")
    name, tensor = next((n, t) for n, t in model.state_dict().items() if t.dim() == 2)
    state = {**model.state_dict(), name: torch.ones(tensor.shape, dtype=torch.int64)}

    async def scenario():
        async with EngineClient(server.base_url, admin_token=server.admin_token) as client:
            version = await client.weight_version()
            before = await client.complete(prompt, max_tokens=6, temperature=0, ignore_eos=True)
            for backend in ("shm", "disk", "http"):
                transport = make_transport(backend, client)
                try:
                    with pytest.raises(EngineRefused) as info:
                        await transport.publish(state.items(), version + 1)
                finally:
                    await transport.close()
                assert info.value.status == 400, backend
                assert f"dtype mismatch for '{name}': got int64" in info.value.message
            after = await client.complete(prompt, max_tokens=6, temperature=0, ignore_eos=True)
            assert after.samples[0].token_ids == before.samples[0].token_ids
            assert await client.weight_version() == version

    run(scenario())
