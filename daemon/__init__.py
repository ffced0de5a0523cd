"""clawback daemon: OpenAI-compatible serving, exact call capture, durable store."""
