"""A user's program for the tinker-serve soak (`test_tinker_soak.py` runs several at once,
each as its own process, and kills and restarts them).

It does what a Tinker user does, with the real `tinker` SDK, until its deadline: opens a
session, creates LoRA models or resumes its last saved state, trains (forward_backward +
optim_step), saves states (recording a forward's log-probs right after each, which a
later load must reproduce) and sampler weights (sampling from each), and closes the
session; then opens another. On SIGUSR1 it abandons its session at the next step: it
exits without a goodbye, leaving the session to expire. Any error ends the session (a
best-effort close) and the next one starts; a killed server's clients go on this way.

Everything it sees goes, one JSON object a line, to its records file (appended and
flushed per line, so a SIGKILL loses at most the line being written): the harness reads
them for what was saved, what failed and how long each call took. A call that runs past
`HANG_S` is recorded as a hang and the process exits with code 3: a future pending forever
is what the soak exists to catch.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sys
import threading
import time
from pathlib import Path

import numpy as np
import tinker
from tinker import types

HANG_S = 240.0  # a call this long is pending forever (a loaded 2-core machine takes < 30 s)
THINK_S = (0.02, 0.2)  # a user's own work between steps
PROBE = list(range(40, 60))  # the datum whose log-probs a saved state must reproduce
PROMPT = [40, 41, 42]
SAMPLING = types.SamplingParams(max_tokens=6, seed=5, stop=[])


def datum(tokens: list[int]) -> types.Datum:
    """Cross-entropy on every next token of `tokens` (the SDK's shift)."""
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={
            "target_tokens": types.TensorData.from_numpy(np.array(tokens[1:])),
            "weights": types.TensorData.from_numpy(np.ones(len(tokens) - 1, dtype=np.float32)),
        },
    )


def probe_logprobs(trainer) -> list[float]:
    """The model's log-probs of `PROBE`'s tokens (a forward: nothing changes)."""
    out = trainer.forward([datum(PROBE)], "cross_entropy").result()
    return out.loss_fn_outputs[0]["logprobs"].to_numpy().tolist()


class Records:
    """The records file: one JSON line per event, written whole and flushed."""

    def __init__(self, path: Path, client: int):
        self.path, self.client = path, client
        text = path.read_bytes() if path.exists() else b""
        torn = text and not text.endswith(b"\n")
        self._file = path.open("a")
        if torn:  # an earlier process was killed mid-line: ours start on lines of their own
            self._file.write("\n")
        self._lock = threading.Lock()

    def write(self, event: str, **fields) -> None:
        line = {"event": event, "time": time.time(), "client": self.client, "pid": os.getpid()}
        with self._lock:
            self._file.write(json.dumps({**line, **fields}) + "\n")
            self._file.flush()

    def last_saved_state(self) -> str | None:
        """The newest state this client (any of its earlier processes) saved."""
        states = []
        for line in self.path.read_text().splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                continue  # the line a killed process was writing
            if record["event"] == "saved_state":
                states.append(record["path"])
        return states[-1] if states else None


class Calls:
    """Runs the client's calls one at a time; a watcher thread ends the process, recording
    a hang, when one runs past `HANG_S`."""

    def __init__(self, records: Records):
        self.records = records
        self.op: str | None = None  # the call running now
        self.last = ""  # the latest call begun (what an error came from)
        self.since = time.monotonic()
        threading.Thread(target=self._watch, name="hang-watch", daemon=True).start()

    def __call__(self, op: str, work):
        self.op, self.last, self.since = op, op, time.monotonic()
        try:
            result = work()
        finally:
            self.op, took = None, time.monotonic() - self.since
        self.records.write("op", op=op, s=round(took, 3))
        return result

    def _watch(self) -> None:
        while True:
            time.sleep(1)
            op, since = self.op, self.since
            if op is not None and time.monotonic() - since > HANG_S:
                self.records.write("hang", op=op, s=round(time.monotonic() - since, 1))
                os._exit(3)


class Client:
    """One user: sessions one after another until `until` (a `time.time()`)."""

    def __init__(self, args: argparse.Namespace):
        self.url, self.key, self.base, self.until = args.url, args.key, args.base, args.until
        self.records = Records(Path(args.records), args.client)
        self.calls = Calls(self.records)
        self.rng = random.Random(args.seed * 1000 + os.getpid())
        self.abandon = False
        self.saves = 0
        self.last_state = self.records.last_saved_state()  # an earlier process's, at first
        signal.signal(signal.SIGUSR1, lambda *_: setattr(self, "abandon", True))

    def run(self) -> None:
        self.records.write("start")
        while time.time() < self.until:
            service = None
            try:
                service = self.calls("service", self.new_service)
                self.session(service)
            except Exception as exc:  # recorded; the harness judges it
                self.record_error(exc)
                self.close(service, "errored")
                time.sleep(1)
        self.records.write("done")

    def new_service(self) -> tinker.ServiceClient:
        return tinker.ServiceClient(base_url=self.url, api_key=self.key)

    def session(self, service: tinker.ServiceClient) -> None:
        """1 to 3 models, each trained for a while, then a goodbye."""
        for _ in range(self.rng.randint(1, 3)):
            trainer = self.open_model(service)
            self.records.write("model", model_id=trainer.model_id)
            for step in range(self.rng.randint(8, 24)):
                self.maybe_abandon(trainer.model_id)
                self.train_step(trainer)
                if step % 8 == 7:
                    self.save(service, trainer, sample=step % 16 == 15)
                if time.time() >= self.until:
                    break
                time.sleep(self.rng.uniform(*THINK_S))
            if time.time() >= self.until:
                break
        self.close(service, "success")

    def open_model(self, service: tinker.ServiceClient):
        saved = self.last_state
        if saved is not None and self.rng.random() < 0.5:
            self.records.write("resume", path=saved)
            load = service.create_training_client_from_state_with_optimizer
            return self.calls("load_state", lambda: load(saved).result())
        seed = self.rng.randrange(1 << 30)
        create = service.create_lora_training_client
        return self.calls(
            "create_model", lambda: create(base_model=self.base, rank=4, seed=seed).result()
        )

    def train_step(self, trainer) -> None:
        size = self.rng.randint(8, 40)
        tokens = [self.rng.randrange(3, 400) for _ in range(size)]
        batch = [datum(tokens), datum(PROBE)]
        self.calls(
            "forward_backward", lambda: trainer.forward_backward(batch, "cross_entropy").result()
        )
        adam = types.AdamParams(learning_rate=1e-2)
        self.calls("optim_step", lambda: trainer.optim_step(adam).result())

    def save(self, service: tinker.ServiceClient, trainer, sample: bool) -> None:
        """A state, then the probe's log-probs (after the save in the model's order: the
        saved weights'); with `sample`, sampler weights too, sampled once."""
        self.saves += 1
        name = f"c{self.records.client}-{os.getpid()}-{self.saves}"
        path = self.calls("save_state", lambda: trainer.save_state(name).result().path)
        out = self.calls("forward", lambda: probe_logprobs(trainer))
        self.records.write("saved_state", path=path, model_id=trainer.model_id, logprobs=out)
        self.last_state = path
        if not sample:
            return
        save = trainer.save_weights_for_sampler
        weights = self.calls("save_weights", lambda: save(name).result().path)
        create = service.create_sampling_client
        sampler = self.calls("create_sampler", lambda: create(model_path=weights).result())
        prompt = types.ModelInput.from_ints(PROMPT)
        seq = self.calls("sample", lambda: sampler.sample(prompt, 1, SAMPLING).result())
        seq = seq.sequences[0]
        self.records.write("saved_weights", path=weights, tokens=list(seq.tokens))

    def maybe_abandon(self, model_id: str) -> None:
        """SIGUSR1 came: leave without a goodbye (no close; the SDK's threads die with us)."""
        if self.abandon:
            self.records.write("abandon", model_id=model_id)
            self.calls.op, self.calls.since = "exit", time.monotonic()  # a hung exit is a hang
            sys.exit(0)

    def close(self, service: tinker.ServiceClient | None, status: str) -> None:
        if service is None:
            return
        try:
            self.calls("close", lambda: service.close(status).result(timeout=60))
        except Exception as exc:  # the session may be gone with the server
            self.record_error(exc, op="close")

    def record_error(self, exc: Exception, op: str | None = None) -> None:
        fields = {"type": type(exc).__name__, "message": str(exc)[:2000]}
        for name in ("status_code", "request_id"):
            if getattr(exc, name, None) is not None:
                fields[name] = getattr(exc, name)
        if getattr(exc, "category", None) is not None:
            fields["category"] = exc.category.value
        self.records.write("error", op=op or self.calls.last, **fields)


def main() -> None:
    parser = argparse.ArgumentParser()
    for name in ("url", "key", "base", "records"):
        parser.add_argument(f"--{name}", required=True)
    parser.add_argument("--client", type=int, required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--until", type=float, required=True)
    Client(parser.parse_args()).run()


if __name__ == "__main__":
    os.environ.setdefault("TINKER_TELEMETRY", "0")
    main()
