"""The planner's one error type, apart so that every input module can raise it."""


class PlanInputError(ValueError):
    """A cost model or run directory the planner cannot use (the message says why)."""
