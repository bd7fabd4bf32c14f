"""What the engine learns from the run itself: thresholds fitted to its healthy history (`fit`), the early
warning from its own grad-norm distribution (`early_warning`), the rollback target from its own checkpoints
(`rollback_target`) and the per-source loss view for status (`loss_view`)."""
