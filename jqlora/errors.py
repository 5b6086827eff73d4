"""The one base class of the errors jqlora raises for input a user can fix.

A file, tensor, setting, checkpoint or data row that cannot be used raises a subclass of `Error`
whose message names it. The CLI prints such a message on one line and exits with status 2; any
other exception is a bug and keeps its traceback. Most subclasses are also ValueErrors, so code
that caught ValueError before keeps working.

This module imports nothing: every layer, `interop` included, may raise these.
"""
from __future__ import annotations


class Error(Exception):
    """Bad input a user can fix; the message names the file, tensor, key, row or setting."""


class SettingError(Error, ValueError):
    """A setting (an argument, flag or config value: a dtype, a mesh, a remat policy, LoRA targets,
    sampling parameters) outside the values it may take; the message names the setting."""


__all__ = ["Error", "SettingError"]
