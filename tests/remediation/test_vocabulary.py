"""The symptom/severity vocabulary is remediation's: every name the detectors, playbook and engine emit is in
it, and the store's enums are the very same classes (so the DB values cannot drift apart)."""

from __future__ import annotations

import pytest

from ulyssesd.daemon.store import enums as store_enums
from ulyssesd.remediation.detectors import SYMPTOMS
from ulyssesd.remediation.playbook import CRASH_LADDER, SYMPTOM_LADDER
from ulyssesd.remediation.vocabulary import Severity, Symptom


def test_every_emitted_symptom_is_in_the_vocabulary() -> None:
    emitted = set(SYMPTOMS) | set(SYMPTOM_LADDER) | {sym for _, sym in CRASH_LADDER.values()}
    assert emitted <= {s.value for s in Symptom}, emitted - {s.value for s in Symptom}


def test_store_imports_the_vocabulary_not_a_copy() -> None:
    assert store_enums.Symptom is Symptom
    assert store_enums.Severity is Severity


def test_parse_names_the_allowed_values() -> None:
    assert Symptom.parse("hang") is Symptom.hang
    assert str(Severity.critical) == "critical"
    with pytest.raises(ValueError, match=r"unknown Symptom 'hangs'; allowed: memory_spike, cuda_oom"):
        Symptom.parse("hangs")


def test_finding_severities_are_vocabulary_severities() -> None:
    from typing import get_args

    from ulyssesd.remediation.detectors.base import FindingSeverity

    assert set(get_args(FindingSeverity)) <= {s.value for s in Severity}
