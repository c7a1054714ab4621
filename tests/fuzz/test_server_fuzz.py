"""Fuzz a real `asyncgrpo serve` (tiny model) over HTTP: no input may hurt the server.

Three sources of cases, about 2,000 in all:

- schemathesis over the server's own OpenAPI schema, every route, with data
  that fits the schema and data that does not, each route three ways: without
  a valid token (none, a wrong one, a malformed header), with the admin token,
  and with an open episode's key;
- Hypothesis strategies of generation requests, valid ones with up to three
  fields made hostile (`fuzz_inputs`), on both OpenAI routes and an episode's;
- named examples of the hostile requests that once hurt the server, one test each.

While generation cases run, a bystander client sends ordinary requests: one
bad row must not fail or stall anyone else's.

A case fails on a 5xx (or a 5xx error event in a stream), a request slower than `REQUEST_TIMEOUT_S`, invalid
JSON, an error body not in OpenAI's shape, a dropped connection or a dead
server; a 4xx is the right answer to bad input. Each test lists every distinct
failure it met. The last test checks that the server came through: the same
greedy answer as before, resident memory grown by at most `RSS_GROWTH_LIMIT`,
no restart.

Run with `make test-fuzz` (FUZZ_SCALE=0.1 for a quick run).
"""

from __future__ import annotations

import os
import threading
from contextlib import contextmanager
from urllib.parse import quote

import hypothesis.strategies as st
import pytest
import schemathesis
from fuzz_http import REQUEST_TIMEOUT_S, Bystander, Case, Fuzzer, json_body
from fuzz_inputs import ADMIN_EXAMPLES, EPISODE, GENERATION_EXAMPLES, chat_bodies, completion_bodies
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis.core import NOT_SET

from asyncgrpo.inference.server.app import create_app

pytestmark = pytest.mark.fuzz

FUZZ_SCALE = float(os.environ.get("FUZZ_SCALE", "1"))
"""Multiplies every test's example count: 0.1 for a quick run while developing."""
FUZZ_SETTINGS = settings(
    deadline=None,  # the fuzzer's own per-request timeout is the deadline
    derandomize=True,  # the same cases on every run, so CI results can be compared
    database=None,
    phases=[Phase.explicit, Phase.generate],  # findings are collected, never raised: no shrink
    suppress_health_check=list(HealthCheck),
)

MiB = 2**20
RSS_GROWTH_LIMIT = 384 * MiB  # parsing the largest bodies leaves about 200 MiB of high-water
MIN_CASES = 1000
MAX_HANGS_PER_TEST = 3  # past this many timeouts or restarts a test stops sending (already failed)
AUTH_MODES = ["no-token", "admin", "episode-key"]
BAD_AUTHORIZATIONS = [None, "Bearer wrong-token", "Bearer", "Basic YWRtaW46YWRtaW4=", "bearer a b"]
EPISODE_CHAT = "/e/{episode_id}/v1/chat/completions"
EXAMPLES_PER_ROUTE = {"/v1/chat/completions": 60, "/v1/completions": 60, EPISODE_CHAT: 60}
ROUTES = [
    (method.upper(), path)
    for path, operations in create_app(engine=None).openapi()["paths"].items()
    for method in operations
]


@pytest.fixture(scope="module")
def schema(fuzz_server):
    """The schema the running server publishes (not one rebuilt here)."""
    return schemathesis.openapi.from_url(f"{fuzz_server.base_url}/openapi.json")


def examples(count: int) -> int:
    return max(1, round(count * FUZZ_SCALE))


def cases_of(operation) -> st.SearchStrategy:
    """Schema-conforming and schema-violating cases of one operation."""
    modes = [schemathesis.GenerationMode.POSITIVE]
    if operation.body or operation.query or operation.path_parameters:
        modes.append(schemathesis.GenerationMode.NEGATIVE)
    return st.one_of(*(operation.as_strategy(generation_mode=mode) for mode in modes))


def run_fuzz(fuzzer: Fuzzer, strategy: st.SearchStrategy, count: int, send_one) -> None:
    """Send `count` drawn cases; then fail listing every distinct finding of this test."""
    fuzzer.forget_findings()
    hangs_before = fuzzer.hangs

    @settings(FUZZ_SETTINGS, max_examples=count)
    @given(strategy)
    def each(drawn):
        if fuzzer.hangs - hangs_before < MAX_HANGS_PER_TEST:
            send_one(drawn)

    with Bystander(fuzzer):
        each()
    assert_no_findings(fuzzer)


def assert_no_findings(fuzzer: Fuzzer) -> None:
    found = fuzzer.report()
    assert not found, f"{len(found)} distinct failures:\n" + "\n".join(map(str, found))


@contextmanager
def episode_opened(fuzzer: Fuzzer, wanted: bool):
    """An open episode for the case (closed afterwards), or None."""
    if not wanted:
        yield None
        return
    episode = fuzzer.open_episode()
    try:
        yield episode
    finally:
        fuzzer.close_episode(episode["episode_id"])


def authorization(auth: str, fuzzer: Fuzzer, episode, bad: str | None) -> dict:
    if auth == "admin":
        return fuzzer.admin
    if auth == "episode-key":
        return {"authorization": f"Bearer {episode['api_key']}"}
    return {} if bad is None else {"authorization": bad}


def to_case(generated, route: str, headers: dict, episode, extra_body) -> Case:
    """A schemathesis case as sent: the episode's real id where wanted, a chat body for its
    chat route (whose body the schema does not describe)."""
    path_parameters = {
        k: quote(str(v), safe="") for k, v in (generated.path_parameters or {}).items()
    }
    if episode is not None and "episode_id" in path_parameters:
        path_parameters["episode_id"] = episode["episode_id"]
    path = route.format(**path_parameters)
    body = extra_body if generated.body is NOT_SET else generated.body
    raw = body if isinstance(body, bytes) or body is None else json_body(body)
    sent_headers = {**(generated.headers or {}), **headers}
    if raw is not None:
        sent_headers.setdefault("content-type", generated.media_type or "application/json")
    query = {k: v for k, v in (generated.query or {}).items() if v is not None} or None
    return Case(generated.method.upper(), path, raw, query, sent_headers, route=route)


@pytest.mark.parametrize("auth", AUTH_MODES)
@pytest.mark.parametrize("method, route", ROUTES, ids=[f"{m} {p}" for m, p in ROUTES])
def test_schema_cases(fuzzer, schema, auth, method, route):
    operation = schema[route][method]
    chat_operation = schema["/v1/chat/completions"]["POST"]
    bodies = cases_of(chat_operation) if route == EPISODE_CHAT else st.none()
    strategy = st.tuples(
        cases_of(operation), bodies, st.booleans(), st.sampled_from(BAD_AUTHORIZATIONS)
    )
    has_episode_id = "{episode_id}" in route

    def send_one(drawn):
        generated, chat_case, real_episode, bad = drawn
        extra_body = None if chat_case is None else chat_case.body
        wanted = auth == "episode-key" or (has_episode_id and real_episode)
        with episode_opened(fuzzer, wanted) as episode:
            headers = authorization(auth, fuzzer, episode, bad)
            case = to_case(generated, route, headers, episode, extra_body)
            outcome = fuzzer.send(case)
            if auth == "admin":
                fuzzer.undo_side_effects(case, outcome)

    run_fuzz(fuzzer, strategy, examples(EXAMPLES_PER_ROUTE.get(route, 12)), send_one)


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions", EPISODE])
def test_hostile_generation_requests(fuzzer, route):
    bodies = completion_bodies if route == "/v1/completions" else chat_bodies

    def send_one(body):
        send_generation(fuzzer, route, body)

    run_fuzz(fuzzer, bodies, examples(250), send_one)


def send_generation(fuzzer: Fuzzer, route: str, body: dict) -> None:
    with episode_opened(fuzzer, route == EPISODE) as episode:
        headers = {"content-type": "application/json"}
        path = route
        if episode is not None:
            headers["authorization"] = f"Bearer {episode['api_key']}"
            path = f"/e/{episode['episode_id']}/v1/chat/completions"
        fuzzer.send(Case("POST", path, json_body(body), None, headers, route=route))


@pytest.mark.parametrize(
    "route, body", [e[1:] for e in GENERATION_EXAMPLES], ids=[e[0] for e in GENERATION_EXAMPLES]
)
def test_named_generation_example(fuzzer, route, body):
    fuzzer.forget_findings()
    with Bystander(fuzzer):
        send_generation(fuzzer, route, body() if callable(body) else body)
    assert_no_findings(fuzzer)


@pytest.mark.parametrize(
    "setup, method, path, body", [e[1:] for e in ADMIN_EXAMPLES], ids=[e[0] for e in ADMIN_EXAMPLES]
)
def test_named_admin_example(fuzzer, tmp_path, setup, method, path, body):
    fifo = tmp_path / "weights.fifo"
    os.mkfifo(fifo)
    # a server blocked opening the pipe (on its event loop) is let go once the case timed out
    release = threading.Timer(REQUEST_TIMEOUT_S + 1.0, release_fifo_reader, [fifo])
    release.start()
    fuzzer.forget_findings()
    try:
        for step_method, step_path, step_body in [*setup, (method, path, body)]:
            raw = None if step_body is None else json_body(step_body)
            raw = raw and raw.replace(b"{fifo}", str(fifo).encode())
            headers = {**fuzzer.admin, "content-type": "application/json"}
            case = Case(step_method, step_path, raw, None, headers)
            fuzzer.undo_side_effects(case, fuzzer.send(case))
    finally:
        release.cancel()
        release_fifo_reader(fifo)
    assert_no_findings(fuzzer)


def release_fifo_reader(fifo) -> None:
    """If the server is blocked opening the pipe for reading, open and close its other end."""
    try:
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
    except OSError:
        pass  # no reader: nothing is blocked on it


def test_server_came_through_unharmed(fuzzer):
    """Last in this module: the same server, same greedy answer, bounded memory growth."""
    print(f"{fuzzer.cases} cases; answers by status: {dict(sorted(fuzzer.statuses.items()))}")
    print(f"RSS {fuzzer.baseline_rss / MiB:.0f} -> {fuzzer.rss_bytes() / MiB:.0f} MiB")
    assert fuzzer.restarts == 0, f"the server was restarted {fuzzer.restarts} times while fuzzing"
    assert fuzzer.greedy_answer() == fuzzer.baseline_greedy
    growth = fuzzer.rss_bytes() - fuzzer.baseline_rss
    assert growth <= RSS_GROWTH_LIMIT, f"RSS grew by {growth / MiB:.0f} MiB while fuzzing"
    assert fuzzer.cases >= examples(MIN_CASES), f"only {fuzzer.cases} cases were sent"
