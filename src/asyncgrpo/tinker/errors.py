"""The one error a Tinker request can be refused with, and the body that carries it.

The SDK polls `retrieve_future` for every result. A body `{"error": ..., "category":
"user"}` (HTTP 200) makes it raise `RequestFailedError` at once, whereas a bare HTTP 400 is
retried three times and a 5xx forever, so a user's mistake must travel as this body to fail
fast. `TinkerUserError` names the request field at fault with the dotted path the SDK's own
request types use (`forward_backward_input.data[3].loss_fn_inputs.advantages`), so the user
can find it in the code that built the request.
"""

from __future__ import annotations

from typing import Any, Literal

# The SDK reads `category` with its `RequestErrorCategory` (a StrEnum of these lowercase
# values); anything else becomes "unknown", which it treats like a server error.
ErrorCategory = Literal["user", "server"]


class TinkerUserError(ValueError):
    """A request the client got wrong: refused at once, the server keeps serving.

    `field` is the dotted path of the offending request field (`""` when the request as a
    whole is at fault, e.g. a body too large); the message starts with it. `request_key` is
    the request's `(model_id or sampling_session_id, seq_id)` when the decoder got that far,
    so that the server can fail that operation's future (and let the model's later `seq_id`s
    run) instead of refusing the submission, whose `seq_id` the client has already spent.
    """

    def __init__(self, field: str, problem: str):
        self.field = field
        self.problem = problem
        self.request_key: tuple[str, int] | None = None
        super().__init__(f"{field}: {problem}" if field else problem)


def as_error_body(exc: BaseException, category: ErrorCategory | None = None) -> dict[str, Any]:
    """The JSON body `retrieve_future` answers a failed request with (HTTP 200).

    `category` defaults to "user" for a `TinkerUserError` and "server" for anything else.
    A server error names its exception type so that the user can report it; it carries
    no traceback.
    """
    if category is None:
        category = "user" if isinstance(exc, TinkerUserError) else "server"
    if category not in ("user", "server"):
        raise ValueError(f"category must be 'user' or 'server', not {category!r}")
    message = str(exc) if category == "user" else f"{type(exc).__name__}: {exc}"
    return {"error": message, "category": category}
