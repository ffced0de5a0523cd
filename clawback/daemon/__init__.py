"""clawback daemon: the orchestrator. Serving, capture, the store, the sample pipeline, the
training loop and the adapter swap; the only package that composes the others."""
