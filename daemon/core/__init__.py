"""The supervisor core: run states, the tick's helpers (decisions, exits, relaunch, termination, resume, rank watch), the loop scheduler."""
