"""The HTTP side of the fuzz suite: send one case to a live server, judge the answer, recover.

A case fails when the server answers with a 5xx (or a 5xx error event inside a
stream), gives no complete answer within `REQUEST_TIMEOUT_S`, sends a body that
is not strict JSON (`NaN`, `Infinity`), an error not in OpenAI's shape, drops
the connection, or dies. A 4xx is the expected answer to bad input.

A failure is recorded as a `Finding` (deduplicated within a test by route, kind
and message, with the first body that caused it) instead of raised, so a test
lists every distinct failure it met, and fuzzing goes on: after a hang the fuzzer waits for the
server to answer `/health` again, and a dead or wedged server is restarted.
"""

from __future__ import annotations

import json
import os
import re
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx

REQUEST_TIMEOUT_S = float(os.environ.get("FUZZ_REQUEST_TIMEOUT_S", "10"))
"""The longest any one request may take, send to last byte ("a few seconds")."""
RECOVERY_TIMEOUT_S = 30.0  # after a hang: how long /health may take before a restart
GREEDY_PROMPT = [5, 17, 42, 99, 7, 250, 3]
SHOWN_BODY_CHARS = 1000


@dataclass
class Case:
    """One HTTP request as sent: `body` is raw bytes (JSON already serialised) or None."""

    method: str
    path: str
    body: bytes | None = None
    query: dict | None = None
    headers: dict = field(default_factory=dict)
    route: str = ""  # the route template, for grouping findings (defaults to `path`)

    def describe(self) -> str:
        query = f"?{self.query}" if self.query else ""
        return f"{self.method} {self.path}{query} {shown_body(self.body)}"


def shown_body(body: bytes | None) -> str:
    """The body for a report: long strings and lists shortened, so every field stays visible."""
    if body is None:
        return ""
    try:
        value = json.loads(body)
    except ValueError:
        return repr(body[:SHOWN_BODY_CHARS])
    return json.dumps(abbreviated(value), allow_nan=True)[:SHOWN_BODY_CHARS]


def abbreviated(value):
    if isinstance(value, str) and len(value) > 40:
        return f"{value[:20]}...({len(value)} chars)"
    if isinstance(value, list):
        head = [abbreviated(v) for v in value[:4]]
        return head + [f"...({len(value)} items)"] if len(value) > 4 else head
    if isinstance(value, dict):
        return {k: abbreviated(v) for k, v in list(value.items())[:30]}
    return value


def json_body(value) -> bytes:
    """JSON text as a hostile client writes it: NaN/Infinity literals and lone surrogates kept."""
    return json.dumps(value, allow_nan=True, ensure_ascii=True).encode()


@dataclass
class Finding:
    kind: str  # "HTTP 500", "timeout", "invalid JSON", "server died", ...
    route: str
    message: str
    example: str
    count: int = 1

    def __str__(self) -> str:
        return f"[{self.kind}] {self.route} x{self.count}: {self.message}\n    e.g. {self.example}"


def _refuse_constant(name: str):
    raise ValueError(f"non-standard JSON constant {name}")


def strict_json(text: str):
    """`json.loads` that refuses NaN and Infinity, which no JSON parser but Python's accepts."""
    return json.loads(text, parse_constant=_refuse_constant)


def judge(response: httpx.Response) -> tuple[str, str] | None:
    """(kind, message) of what is wrong with a complete answer, or None when it is fine."""
    text = response.text
    if response.headers.get("content-type", "").startswith("text/event-stream"):
        return _judge_stream(text)
    try:
        body = strict_json(text) if text else None
    except ValueError as exc:
        return "invalid JSON", f"HTTP {response.status_code}: {exc}: {text[:120]}"
    if response.status_code >= 500:
        return f"HTTP {response.status_code}", _error_message(body, text)
    if response.status_code >= 400 and not _is_openai_error(body):
        return "error not in OpenAI shape", f"HTTP {response.status_code}: {text[:200]}"
    return None


def _judge_stream(text: str) -> tuple[str, str] | None:
    for line in text.splitlines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        try:
            event = strict_json(line.removeprefix("data: "))
        except ValueError as exc:
            return "invalid JSON in stream", f"{exc}: {line[:120]}"
        error = event.get("error") if isinstance(event, dict) else None
        if isinstance(error, dict) and int(error.get("code") or 0) >= 500:
            return f"stream error {error.get('code')}", str(error.get("message"))[:200]
    return None


def _is_openai_error(body) -> bool:
    error = body.get("error") if isinstance(body, dict) else None
    return isinstance(error, dict) and isinstance(error.get("message"), str)


def _error_message(body, text: str) -> str:
    if _is_openai_error(body):
        return body["error"]["message"][:200]
    return text[:200]


@dataclass
class Outcome:
    finding: Finding | None
    status: int | None = None  # None: no answer at all
    response: httpx.Response | None = None


class Fuzzer:
    """Sends cases to one server, records findings, keeps the server usable for the next case.

    `restart` brings a dead or wedged server back (recorded: the greedy-answer
    and memory checks then no longer compare one process with itself).
    """

    def __init__(self, server, restart: Callable[[], None]):
        self.server = server
        self.restart = restart
        self.client = httpx.Client(base_url=server.base_url, timeout=REQUEST_TIMEOUT_S)
        # the fuzzer's own calls use a fresh connection each: a fuzz case must not break them
        self.control = httpx.Client(
            base_url=server.base_url,
            timeout=REQUEST_TIMEOUT_S,
            limits=httpx.Limits(max_keepalive_connections=0),
        )
        self.findings: dict[tuple[str, str, str], Finding] = {}
        self.cases = 0
        self.current: Case | None = None  # the case in flight, for what a bystander saw
        self.lock = threading.Lock()
        self.statuses: Counter[int | None] = Counter()  # None: no answer
        self.previous_status: int | None = None
        self.hangs = 0  # timeouts and deaths: a test stops sending after a few
        self.restarts = 0
        self.baseline_greedy: list[int] = []
        self.baseline_rss = 0

    def take_baseline(self) -> None:
        """What must not change while fuzzing: the greedy answer; and the memory to compare."""
        self.baseline_greedy = self.greedy_answer()
        self.baseline_rss = self.rss_bytes()

    @property
    def admin(self) -> dict:
        return {"authorization": f"Bearer {self.server.admin_token}"}

    def send(self, case: Case) -> Outcome:
        """Send one case; record what went wrong, if anything."""
        self.cases += 1
        self.current = case
        started = time.monotonic()
        try:
            response = self.client.request(
                case.method, case.path, content=case.body, params=case.query, headers=case.headers
            )
        except httpx.LocalProtocolError:
            raise  # a request httpx will not send is a bug in the case, not in the server
        except httpx.TimeoutException:
            self.hangs += 1
            self._recover()
            return Outcome(self._record("timeout", case, f"no answer within {REQUEST_TIMEOUT_S}s"))
        except httpx.TransportError as exc:
            alive = self._still_alive()
            if not alive:
                self.hangs += 1
                self._restart()
            kind = "connection dropped" if alive else "server died"
            message = f"{type(exc).__name__}: {exc}; the answer before was {self.previous_status}"
            return Outcome(self._record(kind, case, message))
        elapsed = time.monotonic() - started
        self.statuses[response.status_code] += 1
        self.previous_status = response.status_code  # a 500 that closes the connection shows next
        problem = judge(response)
        if problem is None and elapsed > REQUEST_TIMEOUT_S:
            problem = ("too slow", f"answered after {elapsed:.1f}s")
        finding = None if problem is None else self._record(problem[0], case, problem[1])
        return Outcome(finding, response.status_code, response)

    def _record(self, kind: str, case: Case, message: str, route: str = "") -> Finding:
        route = route or case.route or case.path
        key = (kind, route, re.sub(r"\d+", "N", message[:100]))
        with self.lock:
            finding = self.findings.get(key)
            if finding is None:
                finding = self.findings[key] = Finding(kind, route, message, case.describe())
            else:
                finding.count += 1
        return finding

    def _still_alive(self, grace_s: float = 1.0) -> bool:
        """Whether the server survived a dropped connection (a dying one needs a moment)."""
        deadline = time.monotonic() + grace_s
        while self.server.alive() and time.monotonic() < deadline:
            time.sleep(0.1)
        return self.server.alive()

    def _recover(self) -> None:
        """After a hang: wait for /health to answer again; restart the server if it does not."""
        deadline = time.monotonic() + RECOVERY_TIMEOUT_S
        while time.monotonic() < deadline:
            if not self.server.alive():
                break
            try:
                if self.control.get("/health", timeout=5.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1.0)
        self._restart()

    def _restart(self) -> None:
        self.restarts += 1
        self.restart()

    def close(self) -> None:
        self.client.close()
        self.control.close()

    def forget_findings(self) -> None:
        """Start a new test: it reports only what went wrong while it ran."""
        with self.lock:
            self.findings.clear()

    def report(self) -> list[Finding]:
        with self.lock:
            return list(self.findings.values())

    # ---- helpers that must succeed (they are not fuzz cases) ----

    def open_episode(self) -> dict:
        response = self.control.post("/episodes", json={}, headers=self.admin)
        response.raise_for_status()
        return response.json()

    def close_episode(self, episode_id: str) -> None:
        """Close an episode the fuzzer opened: closed by the case itself (409) or lost in a
        restart (404) are fine too."""
        response = self.control.post(f"/episodes/{episode_id}/close", json={}, headers=self.admin)
        if response.status_code not in (200, 404, 409):
            response.raise_for_status()

    def undo_side_effects(self, case: Case, outcome: Outcome) -> None:
        """An admin case may pause the engine or open an episode: undo it for the next case."""
        if case.path.startswith("/pause"):
            self.control.post("/resume", headers=self.admin).raise_for_status()
        opened = outcome.status is not None and outcome.status < 400
        if opened and case.method == "POST" and case.path == "/episodes":
            self.close_episode(outcome.response.json()["episode_id"])

    def greedy_answer(self, max_tokens: int = 16) -> list[int]:
        """The token ids of a greedy completion: the same before and after fuzzing."""
        body = {"prompt": GREEDY_PROMPT, "max_tokens": max_tokens, "temperature": 0.0}
        body |= {"ignore_eos": True, "return_token_ids": True}
        response = self.control.post("/v1/completions", json=body)
        response.raise_for_status()
        return response.json()["choices"][0]["token_ids"]

    def rss_bytes(self) -> int:
        """The server process's resident memory (VmRSS of /proc/PID/status)."""
        with open(f"/proc/{self.server.pid}/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
        raise RuntimeError("no VmRSS in /proc status")


class Bystander:
    """An ordinary client sending greedy completions in a loop while cases run.

    One bad row once failed its whole engine batch, so that an unrelated request
    got a 500, and stop strings once slowed everyone down. What the bystander
    meets is recorded against the case in flight at the time.
    """

    BODY = {"prompt": GREEDY_PROMPT, "max_tokens": 32, "ignore_eos": True, "temperature": 0.0}
    ROUTE = "bystander POST /v1/completions"

    def __init__(self, fuzzer: Fuzzer):
        self.fuzzer = fuzzer
        self.requests = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="fuzz-bystander", daemon=True)

    def __enter__(self) -> Bystander:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _loop(self) -> None:
        with httpx.Client(
            base_url=self.fuzzer.server.base_url, timeout=REQUEST_TIMEOUT_S
        ) as client:
            while not self._stop.is_set():
                problem = self._one(client)
                if problem is not None:
                    cause = self.fuzzer.current or Case("-", "-")
                    self.fuzzer._record(problem[0], cause, problem[1], route=self.ROUTE)
                    self._stop.wait(1.0)  # the server may be restarting

    def _one(self, client: httpx.Client) -> tuple[str, str] | None:
        self.requests += 1
        started = time.monotonic()
        try:
            response = client.post("/v1/completions", json=self.BODY)
        except httpx.TimeoutException:
            return "timeout", f"no answer within {REQUEST_TIMEOUT_S}s"
        except httpx.TransportError as exc:
            return "connection failed", f"{type(exc).__name__}: {exc}"
        elapsed = time.monotonic() - started
        if response.status_code != 200:
            return f"HTTP {response.status_code}", response.text[:200]
        if elapsed > REQUEST_TIMEOUT_S:
            return "too slow", f"answered after {elapsed:.1f}s"
        return None
