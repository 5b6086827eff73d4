"""Errors raised by the interop layer."""
from __future__ import annotations

from jqlora.errors import Error


class CheckpointError(Error, ValueError):
    """A checkpoint file or directory is malformed, inconsistent or unsupported.

    The message always names the file and, where one is involved, the tensor or key.
    It is a ValueError so callers that already catch ValueError keep working.
    """
