"""Recovery within the job: the host-memory checkpoint tier, in-process restart, the save gate (docs/TRAINING.md
"Host-memory tier and in-process restart")."""
