"""One line for a failed call through Ray: what the person running the job needs, not Ray's traceback framing."""

from __future__ import annotations


def innermost_message(e: BaseException) -> str:
    """The last line of the innermost cause's message (a RayTaskError's `cause`, else `__cause__`)."""
    inner = getattr(e, "cause", None) or e.__cause__
    if isinstance(inner, BaseException) and inner is not e:
        return innermost_message(inner)
    text = str(e).strip().splitlines()
    return text[-1] if text else type(e).__name__
