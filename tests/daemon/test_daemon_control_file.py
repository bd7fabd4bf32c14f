"""control.json has one typed owner: the daemon writes only the contract's fields, checked with the parser the
job uses (ulyssesd.client.contract); a document the job would reject is refused and nothing is written."""

from __future__ import annotations

import pytest

from ulyssesd.client.contract import CONTROL_NAME, parse_control
from ulyssesd.daemon.job import config as jc


def test_written_documents_parse_as_the_job_parses_them_and_versions_grow(tmp_path):
    first = jc.write_control(tmp_path, suspect=False)
    second = jc.write_control(tmp_path, lr_scale=0.5, gradient_clipping=0.25)
    assert (first["version"], second["version"]) == (1, 2)
    fields, problem = parse_control((tmp_path / CONTROL_NAME).read_text())
    assert problem is None and fields == {"version": 2, "lr_scale": 0.5, "gradient_clipping": 0.25}


def test_a_value_the_job_would_reject_raises_and_keeps_the_previous_document(tmp_path):
    jc.write_control(tmp_path, lr_scale=0.5)
    before = (tmp_path / CONTROL_NAME).read_text()
    with pytest.raises(ValueError, match="lr_scale"):
        jc.write_control(tmp_path, lr_scale=50.0)
    with pytest.raises(TypeError):
        jc.write_control(tmp_path, learning_rate=0.1)  # type: ignore[call-arg]  # not a control.json field
    assert (tmp_path / CONTROL_NAME).read_text() == before
