"""`python -m jqlora.cli ...` (same as the `jqlora` console script)."""
import sys

from jqlora.cli import main

sys.exit(main())
