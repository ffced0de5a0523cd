"""clawback trainer: background LoRA training (built in the trainer issue)."""
