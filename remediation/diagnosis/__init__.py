"""Log diagnosis: the tail of a crashed (or running) job's output + exit status -> one label with evidence.

`ulyssesd.remediation.diagnosis` is the public, documented import path (docs/DIAGNOSIS.md, the daemon, the
ulyssesctl diagnose command), so this package re-exports its API here. Inside: `model` (labels, config,
result), `rules` (the pattern table and precedence), `scanner` (normalised tail + rule hits), `decide`
(root cause beats consequence: the label, its evidence and confidence).
"""

from ulyssesd.remediation.diagnosis.decide import diagnose, refine_with_host
from ulyssesd.remediation.diagnosis.model import LABELS, TAIL_BYTES, Diagnosis, DiagnosisConfig
from ulyssesd.remediation.diagnosis.rules import PRECEDENCE, RULES, Rule

__all__ = ["LABELS", "PRECEDENCE", "RULES", "TAIL_BYTES", "Diagnosis", "DiagnosisConfig", "Rule", "diagnose",
           "refine_with_host"]
