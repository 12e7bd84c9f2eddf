"""The one error type of live control: the message is meant for the person who asked."""

from __future__ import annotations


class ControlError(RuntimeError):
    """A control request that was refused or could not reach the job; nothing was changed."""
