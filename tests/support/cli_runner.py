"""Running the `jqlora` command line in-process from a test. Not a test module: tests import it
(tests/conftest.py puts tests/support/ on the path, as for ``checkpoint_factory``)."""
from __future__ import annotations

from jqlora.cli import main


def run_cli(capsys, *argv) -> tuple[int, str, str]:
    """`jqlora *argv` -> (exit status, stdout, stderr), with output captured by pytest's capsys."""
    capsys.readouterr()
    rc = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err
