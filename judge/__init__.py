"""clawback judge: next states to rewards and hints (built in the signals issue)."""
