"""Where a run's step records come from: the job's telemetry.jsonl (telemetry_reader), or records derived from
the job's own output (log_source: stdout lines; framework_files: HF trainer_state.json, TensorBoard events), and
the run's declared total (declared_total)."""
