"""The operator side: `ulyssesctl` (ctl), its socket client calls and offline readers (replay, diagnose, plan, report)."""
