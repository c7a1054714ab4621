"""`weight_transport: nccl`: weights broadcast from the trainer's GPU into vLLM's workers.

The GPU data path. The trainer joins vLLM's workers in an NCCL group through
vLLM's own trainer-side engine (`WeightTransferTrainerFactory` with
`NCCLTrainerInitInfo`: the trainer is rank 0, the workers follow), so the
tensors never leave the GPUs; the server runs vLLM's `nccl` backend
(`--weight-transfer-config '{"backend": "nccl"}'`, which the launcher passes for
this transport). vllm is imported only here, when this transport is used: it is
an optional dependency of the trainer (the trainer's environment then needs a
CUDA build of vllm).

Per publish: the first one after a (re)start of the server opens the group
(`init_weight_transfer_engine` on the server, rendezvous on a fresh port);
then vLLM's `send_weights` runs start, the update (the server receives while
the trainer broadcasts) and finish. vLLM's engine finishes without a version, so
the version is set with `/update_weight_version` afterwards, and the prefix
cache is reset, before the backend resumes generation.

NCCL calls cannot be interrupted: a publish that misses `engine.sync_timeout_s`
leaves its thread blocked until the peer dies (the backend restarts the server,
and the next publish opens a new group).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Iterator
from typing import Any

import httpx
import torch

from asyncgrpo.base.ports import free_port
from asyncgrpo.inference.client.retry import server_message
from asyncgrpo.inference.vllm.client import VLLMClient


class NCCLTransportError(RuntimeError):
    """The NCCL transport cannot run here, or the server refused a step of it."""


def _import_vllm_trainer_side() -> tuple[Any, Any, Any]:
    try:
        from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource
        from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
        from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo
    except ImportError as exc:
        raise NCCLTransportError(
            "weight_transport nccl needs vllm (a CUDA build) in the trainer's environment too; "
            f"importing it failed: {exc}"
        ) from exc
    return WeightTransferTrainerFactory, NCCLTrainerInitInfo, (ParamMeta, WeightSource)


def tensor_source(tensors: list[tuple[str, torch.Tensor]], device: torch.device):
    """A vLLM `WeightSource` over (name, tensor) pairs, each sent from `device`."""
    _, _, (ParamMeta, WeightSource) = _import_vllm_trainer_side()

    class TensorSource(WeightSource):
        def metadata(self) -> list:
            return [ParamMeta(name, t.dtype, tuple(t.shape)) for name, t in tensors]

        def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
            for name, t in tensors:
                yield name, t.to(device, non_blocking=True)

    return TensorSource()


def _sending_device(tensors: list[tuple[str, torch.Tensor]]) -> torch.device:
    """The trainer's GPU: where the tensors are, else the current CUDA device."""
    if not torch.cuda.is_available():
        raise NCCLTransportError("weight_transport nccl needs a CUDA device in the trainer")
    for _, t in tensors:
        if t.is_cuda:
            return t.device
    return torch.device("cuda", torch.cuda.current_device())


def _on_device(device: torch.device, fn, *args):
    """Run `fn` with `device` current: vLLM's engine reads the current device, which is
    per thread, and these calls run on worker threads."""
    with torch.cuda.device(device):
        return fn(*args)


class BlockingWeightSyncClient:
    """vLLM's `VLLMWeightSyncClient` protocol (four blocking calls) over httpx; vLLM's
    engine calls it from its own threads."""

    def __init__(self, base_url: str, timeout: float = 600.0):
        self.base_url = base_url.rstrip("/")
        self.timeout = timeout

    def _post(self, path: str, body: dict | None = None) -> None:
        # a fresh connection per call: vLLM drops connections after a 500
        with httpx.Client(timeout=self.timeout) as http:
            response = http.post(self.base_url + path, json=body)
        if response.status_code >= 400:
            raise NCCLTransportError(
                f"POST {path}: HTTP {response.status_code}: {server_message(response)}"
            )

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        self._post("/init_weight_transfer_engine", {"init_info": init_info})

    def start_weight_update(self) -> None:
        self._post("/start_weight_update")

    def update_weights(self, update_info: dict | list[dict]) -> None:
        self._post("/update_weights", {"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        body = None if weight_version is None else {"weight_version": weight_version}
        self._post("/finish_weight_update", body)


class NCCLTransport:
    """A `WeightTransport` that broadcasts over NCCL with vLLM's trainer-side engine.

    `master_address` must be reachable from vLLM's workers (loopback when they share
    the node with the trainer); the rendezvous port is a free one, new per group.
    """

    def __init__(self, client: VLLMClient, master_address: str = "127.0.0.1"):
        self.client = client
        self.master_address = master_address
        self._engine = None
        self._tensors: list[tuple[str, torch.Tensor]] = []

    async def prepare(self, tensors: list[tuple[str, torch.Tensor]]) -> None:
        return None  # the group needs the server up; it opens at the first publish

    async def publish(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int
    ) -> None:
        # the source reads this list, so the group keeps sending the latest tensors
        self._tensors[:] = [(name, t.detach()) for name, t in named_tensors]
        device = _sending_device(self._tensors)
        if self._engine is None or not self.client.transfer_ready:
            await self._connect(device)
        await asyncio.to_thread(_on_device, device, self._engine.send_weights)
        await self.client.set_weight_version(version)
        await self.client.after_weight_update(version)

    async def _connect(self, device: torch.device) -> None:
        # a group from before a restart lost its peers: dropped, not destroyed (that
        # could wait on them forever)
        self._engine = None
        workers = await self.client.get_world_size()
        await asyncio.to_thread(_on_device, device, self._open_group, 1 + workers, device)
        self.client.transfer_ready = True

    def _open_group(self, world_size: int, device: torch.device) -> None:
        """Rendezvous with the server's workers (blocks until they joined)."""
        factory, init_info_cls, _ = _import_vllm_trainer_side()
        info = init_info_cls(self.master_address, free_port(), world_size, rank=0)
        self._engine = factory.trainer_init(
            info,
            client=BlockingWeightSyncClient(self.client.base_url),
            source=tensor_source(self._tensors, device),
        )

    def _shutdown(self) -> None:
        engine, self._engine = self._engine, None
        if engine is not None:
            engine.shutdown()

    async def close(self) -> None:
        await asyncio.to_thread(self._shutdown)
