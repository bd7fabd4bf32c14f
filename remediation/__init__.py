"""Remediation library (pure: records + clock in, findings + decisions out). See docs/REMEDIATION.md.

records (telemetry parsing) · vocabulary (symptoms, severities) · detectors/ (one per symptom) · playbook
(ladders as data) · job (the engine's job values) · engine (grace, verification, budgets) · diagnosis/ (crash
logs) · replay (offline) · synthetic (seeded test traces) · config (spec sections). Imports neither the daemon
nor the training job.
"""
