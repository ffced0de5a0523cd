"""`clawback simulate`: the real daemon loop against a simulated user, scored on held-out tasks."""
