"""Remediation library (pure: records + clock in, findings + decisions out). See docs/REMEDIATION.md.

records (telemetry parsing) · detectors/ (one per symptom) · playbook (ladders as data) · engine
(grace, verification, budgets) · replay (offline) · synthetic (seeded test traces) · config (spec sections).
"""
