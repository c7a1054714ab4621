"""Weight layout and transports without an engine: byte-exact round trips, validation, clean-up,
and the receiver's rule for where disk weights may be read from."""

import asyncio
import os

import pytest
import torch
from safetensors.torch import load, load_file

from asyncgrpo.inference.engine.types import RequestError
from asyncgrpo.inference.server.weights import WeightReceiver
from asyncgrpo.inference.transport import make_transport
from asyncgrpo.inference.transport.disk import WEIGHTS_FILE, write_safetensors_file
from asyncgrpo.inference.transport.http import split_by_size
from asyncgrpo.inference.transport.layout import (
    LayoutError,
    plan_layout,
    read_safetensors_slots,
    slots_from_description,
    view,
    write_image,
)


def mixed_tensors():
    g = torch.Generator().manual_seed(0)
    return [
        ("a.bias", torch.randn(3, generator=g, dtype=torch.float32)),
        ("b.weight", torch.randn(4, 5, generator=g).to(torch.bfloat16)),
        ("c.steps", torch.tensor([7, -2], dtype=torch.int64)),
        ("d.half", torch.randn(2, 3, generator=g).to(torch.float16)),
        ("e.transposed", torch.randn(5, 4, generator=g).t()),  # not contiguous
        ("f.empty", torch.zeros(0, 3)),
    ]


def test_image_is_a_valid_safetensors_file_with_exact_bytes():
    tensors = mixed_tensors()
    layout = plan_layout(tensors)
    buffer = bytearray(layout.total_size)
    write_image(buffer, layout, tensors)
    loaded = load(bytes(buffer))  # the reference safetensors reader accepts it
    for name, t in tensors:
        assert loaded[name].dtype == t.dtype and torch.equal(loaded[name], t)
    # our reader maps the same tensors as views (no copy)
    slots = read_safetensors_slots(buffer)
    views = {s.name: view(buffer, s) for s in slots}
    for name, t in tensors:
        assert torch.equal(views[name], t)
    assert all(s.offset % s.dtype.itemsize == 0 for s in slots)


def test_json_description_round_trips_and_is_checked():
    tensors = mixed_tensors()
    layout = plan_layout(tensors)
    buffer = bytearray(layout.total_size)
    write_image(buffer, layout, tensors)
    slots = slots_from_description(layout.describe(), len(buffer))
    assert {s.name: torch.equal(view(buffer, s), dict(tensors)[s.name]) for s in slots} == {
        name: True for name, _ in tensors
    }
    info = layout.describe()
    with pytest.raises(LayoutError, match="outside the payload"):
        slots_from_description({**info, "offsets": [len(buffer)] * len(info["names"])}, len(buffer))
    with pytest.raises(LayoutError, match="same length"):
        slots_from_description({**info, "shapes": info["shapes"][:-1]}, len(buffer))
    with pytest.raises(LayoutError, match="unsupported dtype"):
        slots_from_description({**info, "dtype_names": ["complex7"] * 6}, len(buffer))
    with pytest.raises(LayoutError):
        read_safetensors_slots(bytearray(b"\xff" * 16))


def test_duplicate_names_are_refused():
    with pytest.raises(LayoutError, match="unique"):
        plan_layout([("x", torch.zeros(1)), ("x", torch.ones(1))])


def test_split_by_size_keeps_order_and_bounds_chunks():
    tensors = [(f"t{i}", torch.zeros(100)) for i in range(10)]  # 400 bytes each
    groups = list(split_by_size(tensors, 1000))
    assert [len(g) for g in groups] == [2, 2, 2, 2, 2]
    assert [n for g in groups for n, _ in g] == [n for n, _ in tensors]
    assert [len(g) for g in split_by_size([("big", torch.zeros(1000))], 10)] == [1]


class RecordingClient:
    """Stands in for EngineClient: records the four steps and reads what it is sent."""

    def __init__(self):
        self.calls = []
        self.received = {}

    async def init_weight_transfer_engine(self, backend):
        self.calls.append(("init", backend))

    async def start_weight_update(self):
        self.calls.append(("start",))

    async def update_weights(self, info):
        self.calls.append(("update",))
        if "offsets" in info:  # shm: map the segment like the server does
            with open(info["path"], "rb") as f:
                data = bytearray(f.read())
            for s in slots_from_description(info, len(data)):
                self.received[s.name] = view(data, s).clone()
        else:  # disk
            self.received.update(load_file(os.path.join(info["path"], "model.safetensors")))

    async def update_weights_bytes(self, body, size):
        self.calls.append(("update",))
        data = bytearray()
        async for piece in body():
            data += piece
        assert len(data) == size
        self.received.update(load(bytes(data)))

    async def finish_weight_update(self, version):
        self.calls.append(("finish", version))


@pytest.mark.parametrize("kind", ["shm", "disk", "http"])
def test_transports_deliver_every_tensor_and_clean_up(kind, tmp_path):
    tensors = mixed_tensors()

    async def scenario():
        client = RecordingClient()
        options = {"max_chunk_bytes": 64} if kind == "http" else {}
        if kind == "shm":
            options = {"directory": tmp_path}
        transport = make_transport(kind, client, **options)
        await transport.publish(tensors, 3)
        await transport.publish(tensors, 4)  # the shm segment is reused
        leftover = list(tmp_path.iterdir()) if kind == "shm" else []
        directory = getattr(transport, "directory", None)
        await transport.close()
        return client, leftover, directory

    client, leftover, directory = asyncio.run(scenario())
    for name, t in tensors:
        assert torch.equal(client.received[name], t), name
    steps = [c[0] for c in client.calls]
    assert steps[:2] == ["init", "start"] and client.calls[-1] == ("finish", 4)
    if kind == "http":
        assert steps.count("update") > 2  # small chunks: several bodies per publish
    if kind == "shm":
        assert len(leftover) == 1 and not leftover[0].exists()  # one segment, unlinked by close
    if kind == "disk":
        assert not directory.exists()  # the temporary directory it created is removed


def test_unknown_transport_is_refused():
    with pytest.raises(ValueError, match="unknown weight transport"):
        make_transport("nccl-over-carrier-pigeon", object())


@pytest.mark.parametrize("kind", ["shm", "disk", "http"])
def test_prepare_talks_to_no_engine_and_the_publish_after_it_is_exact(kind, tmp_path):
    """`prepare` runs while the engine is still starting: it must not call it."""
    tensors = mixed_tensors()

    async def scenario():
        client = RecordingClient()
        options = {"directory": tmp_path} if kind == "shm" else {}
        transport = make_transport(kind, client, **options)
        await transport.prepare(tensors)
        calls_after_prepare = list(client.calls)
        prepared = list(tmp_path.iterdir())
        await transport.publish(tensors, 1)
        segments = list(tmp_path.iterdir())
        await transport.close()
        return client, calls_after_prepare, prepared, segments

    client, calls_after_prepare, prepared, segments = asyncio.run(scenario())
    assert calls_after_prepare == []
    for name, t in tensors:
        assert torch.equal(client.received[name], t), name
    if kind == "shm":  # the publish writes into the segment `prepare` allocated
        assert len(prepared) == 1 and segments == prepared


class RecordingEngine:
    """Stands in for Engine behind a WeightReceiver: keeps what a finished update delivers."""

    weight_version = 0

    def __init__(self):
        self.received = {}

    async def update_weights(self, staged, version):
        self.received = {name: t.clone() for name, t in staged}


def test_receiver_reads_disk_weights_only_under_weights_dir(tmp_path):
    root, outside = tmp_path / "weights", tmp_path / "outside"
    tensors = mixed_tensors()
    layout = plan_layout(tensors)
    for directory in (root / "run-1", outside):
        directory.mkdir(parents=True)
        write_safetensors_file(directory / WEIGHTS_FILE, layout, tensors)
    (root / "link.safetensors").symlink_to(outside / WEIGHTS_FILE)
    os.mkfifo(root / "fifo.safetensors")
    engine = RecordingEngine()
    receiver = WeightReceiver(engine, weights_dir=str(root))
    receiver.init({"backend": "disk"})

    async def scenario():
        receiver.start()
        assert await receiver.add_description({"path": str(root / "run-1")}) == len(tensors)
        await receiver.finish(1)
        receiver.start()
        messages = set()
        for path in [
            outside,
            outside / WEIGHTS_FILE,
            tmp_path / "missing",
            root / "link.safetensors",
            root / "fifo.safetensors",
            root / "missing",
            root / ".." / "outside",
        ]:
            with pytest.raises(RequestError) as refused:
                await receiver.add_description({"path": str(path)})
            messages.add(refused.value.message.replace(repr(str(path)), "<path>"))
        return messages

    messages = asyncio.run(scenario())
    for name, t in tensors:
        assert torch.equal(engine.received[name], t), name
    assert messages == {
        f"cannot read weights at <path>: update_info.path must be an existing regular file "
        f"under {os.path.realpath(root)} (engine.weights_dir)"
    }


def test_a_new_segment_removes_those_of_dead_creators_only(tmp_path):
    """A SIGKILLed trainer leaves its segment in tmpfs; the next one to allocate removes
    it, and leaves the files of live processes (this one's) alone."""
    import subprocess
    import sys

    from asyncgrpo.inference.transport.shm import SEGMENT_PREFIX, SharedSegment

    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
    )
    orphan = tmp_path / f"{SEGMENT_PREFIX}{dead.stdout.strip()}-0123456789ab.safetensors"
    live = tmp_path / f"{SEGMENT_PREFIX}{os.getpid()}-ba9876543210.safetensors"
    other = tmp_path / "unrelated-file"
    for path in (orphan, live, other):
        path.write_bytes(b"x" * 16)
    segment = SharedSegment(64, tmp_path)
    try:
        assert not orphan.exists()
        assert live.exists() and other.exists() and segment.path.exists()
    finally:
        segment.close()
    assert not segment.path.exists()
