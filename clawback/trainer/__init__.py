"""clawback trainer: the LoRA training library (losses, one step, the worker the daemon drives)."""
