"""clawback judge: the PRM and hint judges (prompts, votes, backends) the daemon's sample pipeline calls."""
