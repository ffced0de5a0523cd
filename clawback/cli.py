"""The `clawback` command: the daemon's commands and `simulate`.

It sits above both packages so that neither imports the other: the daemon never imports the
simulator, which drives the daemon."""

from __future__ import annotations

import sys

from clawback.daemon import cli as daemon_cli
from clawback.sim.cli import add_parser as add_simulate


def main(argv: list[str] | None = None) -> int:
    return daemon_cli.main(argv, commands=(add_simulate,))


if __name__ == "__main__":
    sys.exit(main())
