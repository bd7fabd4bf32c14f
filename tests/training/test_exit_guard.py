"""The job's exit (SIGTERM) save is refused after a step the daemon would judge non-finite (training/recovery/
exit_guard.py), on the job's own knowledge: the daemon's `suspect` may be written after the job's last poll
(issue 38's r3 on the H100: step-00000121 written one step after a NaN). The real-process case (a NaN, then
SIGTERM, no control file) is tests/training/test_train_job.py; the daemon run is tests/daemon/test_rollback_safety_e2e.py."""

from __future__ import annotations

from types import SimpleNamespace

from train_job_helpers import tiny_spec

from ulyssesd.training.recovery.exit_guard import ExitSaveGuard, nonfinite_what
from ulyssesd.training.train import Trainer


def test_a_finite_run_may_save_at_exit():
    g = ExitSaveGuard()
    for step, loss, gn in ((1, 3.2, 1.5), (2, 2.9, 40.0), (3, 1e9, 1e12)):   # big is not non-finite
        g.observe(step, loss, gn)
    assert g.refusal() is None and g.first_bad_step is None


def test_a_nan_loss_refuses_every_later_exit_save_in_the_attempt():
    g = ExitSaveGuard()
    g.observe(119, 1.9, 4.2)
    g.observe(120, float("nan"), float("inf"))
    g.observe(121, 5.2, 51.4)   # finite again (the r3 run's step 121): the weights still went through step 120
    why = g.refusal()
    assert why is not None and "step 120" in why and "nan" in why and g.first_bad_step == 120


def test_a_non_finite_grad_norm_counts_unless_the_step_was_skipped():
    assert nonfinite_what(2.0, float("inf"), skipped=True) is None     # an fp16 overflow step: not applied
    assert nonfinite_what(2.0, float("inf"), skipped=False) == "grad norm inf on an applied step"
    assert nonfinite_what(2.0, None, skipped=False) is None             # no norm reported: nothing to judge
    assert nonfinite_what(float("-inf"), 1.0, skipped=False) == "loss -inf"
    g = ExitSaveGuard()
    g.observe(7, 2.0, float("nan"))
    assert g.first_bad_step == 7 and "grad norm nan" in (g.refusal() or "")


class _Engine:
    def __init__(self, grad_norm, applied=True):
        self.grad_norm, self.applied = grad_norm, applied

    def get_global_grad_norm(self):
        return self.grad_norm

    def was_step_applied(self):
        return self.applied

    def gradient_clipping(self):
        return 1.0


class _Control:
    """control.json as the job's poller sees it: `pending` is what the daemon wrote after the job's last poll."""

    def __init__(self, pending_suspect=False):
        self.state = SimpleNamespace(suspect=False, version=0, lr_scale=1.0)
        self.pending = pending_suspect
        self.polls = 0

    def poll(self):
        self.polls += 1
        if not self.pending:
            return None
        self.state.suspect, self.pending = True, False
        return {"version": 1, "suspect": True}


def _trainer(tmp_path, grad_norm=1.0, pending_suspect=False, dtype="fp32", applied=True):
    t = Trainer(tiny_spec(precision={"dtype": dtype}), tmp_path, 1, 1)
    t.engine, t.control = _Engine(grad_norm, applied), _Control(pending_suspect)
    t.events = []
    t._event = lambda name, **f: t.events.append((name, f))
    return t


def test_the_trainer_refuses_its_exit_save_after_a_nan_and_allows_it_on_a_healthy_run(tmp_path):
    healthy = _trainer(tmp_path)
    healthy._guard_exit_save(5, 2.0)
    assert healthy._exit_save_refused() is None
    bad = _trainer(tmp_path)
    bad._guard_exit_save(5, float("nan"))
    bad._guard_exit_save(6, 2.0)
    assert "step 5" in (bad._exit_save_refused() or "")
    inf_norm = _trainer(tmp_path, grad_norm=float("inf"))
    inf_norm._guard_exit_save(9, 2.0)
    assert "grad norm inf" in (inf_norm._exit_save_refused() or "")
    fp16_overflow = _trainer(tmp_path, grad_norm=float("inf"), dtype="fp16", applied=False)
    fp16_overflow._guard_exit_save(9, 2.0)
    assert fp16_overflow._exit_save_refused() is None


def test_the_daemons_suspect_written_after_the_last_poll_is_read_at_the_stop(tmp_path):
    t = _trainer(tmp_path, pending_suspect=True)   # finite steps only: the job knows nothing bad itself
    t._guard_exit_save(5, 2.0)
    why = t._exit_save_refused()
    assert why is not None and "suspect" in why and t.control.polls == 1
    assert [n for n, _f in t.events] == ["control_applied"]
