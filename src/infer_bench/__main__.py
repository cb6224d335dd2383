"""`python -m infer_bench ARGS`: `infer bench ARGS` where the package is not installed (a checkout on PYTHONPATH)."""

import sys

from infer.cli import COMMANDS, main
from infer_bench import COMMAND

raise SystemExit(main(["bench", *sys.argv[1:]], {**COMMANDS, "bench": COMMAND}))
