"""Reading training progress from what a job prints: the line reader (`tokens`), step continuity checks
(`continuity`) and the run-spec options of derived telemetry (`options`). `ulyssesd.remediation.log_telemetry`
puts them together into telemetry records."""
