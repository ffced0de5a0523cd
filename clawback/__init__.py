"""clawback: serve a self-hosted policy to OpenClaw, capture every call, learn from what follows.

The modules directly in this package are the shared core every other package may import (chat
rendering, the engine interface, the adapter format); they import none of them. `clawback.cli`
is the exception: the `clawback` command, above the daemon and the simulator."""

__version__ = "0.1.0"
