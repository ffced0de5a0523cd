"""clawback: serve a self-hosted policy to OpenClaw, capture every call, learn from what follows."""

__version__ = "0.1.0"
