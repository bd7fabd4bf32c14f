"""The goodput model (remediation/goodput.py): closed forms, monotonicity, the optimum, and a Monte Carlo check."""

from __future__ import annotations

import math
import statistics

import pytest

from ulyssesd.remediation.goodput import (
    HOUR,
    GoodputInputs,
    daly_interval,
    effective_block_s,
    ettr,
    ettr_first_order,
    failure_rate_per_gpu_hour,
    optimal_interval,
    run_mtbf_s,
    scaled_inputs,
    simulate,
    young_interval,
)

BLOCKING = GoodputInputs(block_s=60.0, write_s=0.0, restart_s=120.0, mtbf_s=6 * HOUR)
ASYNC = GoodputInputs(block_s=2.0, write_s=300.0, restart_s=120.0, mtbf_s=6 * HOUR)


def test_llama3_rate_per_gpu_hour_and_run_mtbf():
    rate = failure_rate_per_gpu_hour()
    assert rate == pytest.approx(419 / (54 * 24 * 16384))
    assert rate == pytest.approx(1.973e-5, rel=1e-3)
    # 16,384 GPUs: one interruption every ~3.1 h, as the paper's 419 in 54 days says.
    assert run_mtbf_s(16384) / HOUR == pytest.approx(54 * 24 / 419)
    assert run_mtbf_s(32) == pytest.approx(run_mtbf_s(16384) * 512)


def test_no_failures_limit_is_the_checkpoint_duty_cycle():
    x = GoodputInputs(block_s=10.0, write_s=0.0, restart_s=100.0, mtbf_s=1e15)
    assert ettr(990.0, x) == pytest.approx(0.99, rel=1e-9)


def test_no_checkpoint_cost_closed_form():
    # δ = R = 0: T = M(e^(τ/M) − 1), so ETTR = (τ/M)/(e^(τ/M) − 1).
    m = 1000.0
    x = GoodputInputs(block_s=0.0, write_s=0.0, restart_s=0.0, mtbf_s=m)
    for tau in (1.0, 100.0, 1000.0, 5000.0):
        assert ettr(tau, x) == pytest.approx((tau / m) / math.expm1(tau / m), rel=1e-12)


def test_exact_agrees_with_first_order_when_failures_are_rare():
    x = GoodputInputs(block_s=60.0, write_s=0.0, restart_s=120.0, mtbf_s=1000 * HOUR)
    tau = young_interval(x)
    assert ettr(tau, x) == pytest.approx(ettr_first_order(tau, x), abs=1e-4)
    # ...and the first order is pessimistic when they are not (it double counts failures on redone work).
    assert ettr_first_order(3 * HOUR, BLOCKING) < ettr(3 * HOUR, BLOCKING)


def test_ettr_unimodal_in_interval_and_monotone_in_each_cost():
    taus = [60.0 * 1.2 ** k for k in range(40)]
    vals = [ettr(t, BLOCKING) for t in taus]
    peak = vals.index(max(vals))
    assert 0 < peak < len(vals) - 1
    assert all(a < b for a, b in zip(vals[:peak], vals[1:peak + 1], strict=True))
    assert all(a > b for a, b in zip(vals[peak:-1], vals[peak + 1:], strict=True))
    tau = 1800.0
    worse = [GoodputInputs(120.0, 0.0, 120.0, 6 * HOUR), GoodputInputs(60.0, 60.0, 120.0, 6 * HOUR),
             GoodputInputs(60.0, 0.0, 600.0, 6 * HOUR), GoodputInputs(60.0, 0.0, 120.0, 3 * HOUR)]
    for x in worse:
        assert ettr(tau, x) < ettr(tau, BLOCKING), x


def test_numeric_optimum_beats_neighbours_and_matches_daly_and_young():
    best, best_ettr = optimal_interval(BLOCKING)
    for f in (0.9, 0.99, 1.01, 1.1):
        assert ettr(best * f, BLOCKING) < best_ettr
    # Daly's higher-order form is within 0.1 % of the exact optimum; Young's first-order one within 5 %.
    assert daly_interval(BLOCKING) == pytest.approx(best, rel=1e-3)
    assert young_interval(BLOCKING) == pytest.approx(best, rel=0.05)
    assert young_interval(BLOCKING) == pytest.approx(math.sqrt(2 * 60 * 6 * HOUR))


def test_async_save_back_pressure_and_optimum():
    # A save due before the previous background write ends waits for it.
    assert effective_block_s(100.0, ASYNC) == pytest.approx(200.0)
    assert effective_block_s(1000.0, ASYNC) == pytest.approx(2.0)
    best, best_ettr = optimal_interval(ASYNC)
    assert best >= ASYNC.write_s - ASYNC.block_s - 1   # never checkpoint faster than the disk can keep up
    assert best_ettr > optimal_interval(BLOCKING)[1]


@pytest.mark.parametrize("x,tau", [(BLOCKING, 1570.0), (BLOCKING, 7200.0), (ASYNC, 600.0), (ASYNC, 3600.0)])
def test_monte_carlo_matches_the_formula(x, tau):
    runs = [simulate(tau, x, horizon_s=2e7, seed=s) for s in range(8)]
    mean, sem = statistics.mean(runs), statistics.stdev(runs) / math.sqrt(len(runs))
    assert abs(mean - ettr(tau, x)) < max(4 * sem, 2e-3), (mean, sem, ettr(tau, x))


def test_scaling_by_checkpoint_bytes_per_node():
    one = scaled_inputs(1_414_105_088, 1, 1)
    assert one.block_s == pytest.approx(42.0)
    assert one.restart_s == pytest.approx(2.72 + 10.21 + 13.60 + 1.27)  # call 13: 27.80 s cold
    big = scaled_inputs(10 * 1_414_105_088, 2, 16)
    assert big.block_s == pytest.approx(42.0 * 5)
    assert big.mtbf_s == pytest.approx(one.mtbf_s / 16)
    a = scaled_inputs(1_414_105_088, 1, 1, async_save=True)
    assert a.block_s == pytest.approx(0.352) and a.write_s == pytest.approx(16.97 / (0.99 * 1.3))


@pytest.mark.parametrize("kw", [dict(block_s=-1.0), dict(mtbf_s=0.0), dict(restart_s=float("nan"))])
def test_bad_inputs_are_named(kw):
    args = dict(block_s=1.0, write_s=0.0, restart_s=1.0, mtbf_s=1.0) | kw
    with pytest.raises(ValueError, match=next(iter(kw))):
        GoodputInputs(**args)
    with pytest.raises(ValueError, match="interval"):
        ettr(0.0, BLOCKING)


def _plan_app():
    """`ulyssesctl plan` alone, as a Typer app for CliRunner."""
    import typer

    from ulyssesd.daemon.operator.ctl_plan import register_plan

    app = typer.Typer()

    @app.callback()
    def main() -> None:
        pass

    register_plan(app)
    return app


def test_ulyssesctl_plan_suggests_the_optimal_interval():
    from pathlib import Path

    from typer.testing import CliRunner

    app = _plan_app()
    spec = Path(__file__).resolve().parents[2] / "configs" / "gpt-176b-8xa100.toml"
    res = CliRunner().invoke(app, ["plan", "--spec", str(spec)])
    assert res.exit_code == 1, res.output
    line = next(ln for ln in res.output.splitlines() if ln.startswith("Suggested checkpoint interval"))
    x = scaled_inputs(174.6e9, 1, 8)
    hours = float(__import__("re").search(r"every ([0-9.]+) h", line).group(1))
    assert hours == pytest.approx(optimal_interval(x)[0] / HOUR, rel=0.01) and "ETTR 97.8" in line
    res = CliRunner().invoke(app, ["plan", "--spec", str(spec), "--nodes", "4", "--json"])
    sug = __import__("json").loads(res.output)["checkpoint_interval"]
    # 4x the GPUs: 4x the failure rate and 1/4 of the bytes per node -> 1/4 of the interval (δM both / 4).
    assert sug["interval_h"] == pytest.approx(optimal_interval(x)[0] / HOUR / 4, rel=0.02)


def test_ulyssesctl_plan_suggests_from_async_saves_when_the_spec_has_them(tmp_path):
    from pathlib import Path

    from typer.testing import CliRunner

    app = _plan_app()
    configs = Path(__file__).resolve().parents[2] / "configs"
    text = (configs / "gpt-176b-8xa100.toml").read_text()
    (tmp_path / "ds_config_ulysses.json").write_text((configs / "ds_config_ulysses.json").read_text())
    assert text.count("\n[checkpoint]\n") == 1
    spec = tmp_path / "async.toml"
    spec.write_text(text.replace("\n[checkpoint]\n", "\n[checkpoint]\nasync_save = true\n"))
    res = CliRunner().invoke(app, ["plan", "--spec", str(spec), "--nodes", "4", "--json"])
    sug = __import__("json").loads(res.output)["checkpoint_interval"]
    x = scaled_inputs(174.6e9, 4, 32, async_save=True)
    # A 0.35 s stall per 17 GB instead of 42 s: a much shorter optimum and a higher ETTR than blocking saves.
    assert sug["async_save"] is True and sug["save_block_s"] == pytest.approx(x.block_s, rel=0.01)
    assert sug["interval_h"] == pytest.approx(optimal_interval(x)[0] / HOUR, rel=0.02)
    blocking = scaled_inputs(174.6e9, 4, 32)
    assert sug["interval_h"] < optimal_interval(blocking)[0] / HOUR / 4 and sug["ettr"] > 0.99
    res = CliRunner().invoke(app, ["plan", "--spec", str(spec), "--nodes", "4"])
    assert "an async save blocks" in res.output
