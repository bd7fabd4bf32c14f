"""The daemon's side of the job: launch argv and its wrapper, the bring-your-own command job, the configs and control.json it writes, the telemetry it reads."""
