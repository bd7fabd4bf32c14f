"""Multi-rank (4 and 8 oversubscribed gloo ranks) tests reuse the training tests' launch helpers."""

import sys
from pathlib import Path

# `train_job_helpers` lives in tests/training (not a package): make it importable from here.
_TRAINING_TESTS = str(Path(__file__).resolve().parents[1] / "training")
if _TRAINING_TESTS not in sys.path:
    sys.path.insert(0, _TRAINING_TESTS)
