"""kiln's exception types. Every error kiln raises on purpose is one of these."""


class KilnError(RuntimeError):
    """A mistake in how kiln was used: the message says what was wrong and what to do."""


class InternalError(KilnError):
    """A broken invariant inside kiln (a bug: please report it with the message)."""


class Unsupported(KilnError):
    """A construct the tracer cannot capture; normally handled by falling back to eager."""


class GraphBreakError(Unsupported):
    """Raised under fullgraph=True at the first graph break: names the construct, file:line and a hint."""


class BackendError(KilnError):
    """A backend failed to compile a captured graph."""
