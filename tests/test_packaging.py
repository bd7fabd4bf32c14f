"""Packaging: `pip install ulyssesd` is the daemon and ulyssesctl without torch/deepspeed; `ulyssesd[train]`
adds the training job's stack. Checked on the wheel metadata setuptools really builds, and by running the
installed console scripts with torch, deepspeed, numpy and tokenizers made unimportable (a meta-path
finder in a sitecustomize that also reports every attempt), against a real finished run's store."""

from __future__ import annotations

import email
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
#: What only a training host needs; the operator side must start without any of it.
TRAIN_ONLY = ("torch", "deepspeed", "numpy", "tokenizers")
BLOCKED_MARK = "BLOCKED-IMPORT"


def _wheel_requirements(tmp_path: Path) -> list[str]:
    code = ("import sys; from setuptools import build_meta as b; "
            "print(b.prepare_metadata_for_build_wheel(sys.argv[1]))")
    res = subprocess.run([sys.executable, "-c", code, str(tmp_path)], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    dist_info = tmp_path / res.stdout.strip().splitlines()[-1]
    return email.message_from_string((dist_info / "METADATA").read_text()).get_all("Requires-Dist") or []


def _name(req: str) -> str:
    for sep in "<>=!~;[ ":
        req = req.split(sep)[0]
    return req.strip().lower()


def test_torch_and_deepspeed_are_only_in_the_train_extra(tmp_path):
    reqs = _wheel_requirements(tmp_path)
    base = {_name(r) for r in reqs if "extra ==" not in r}
    train = {_name(r) for r in reqs if 'extra == "train"' in r}
    assert {"sqlalchemy", "typer", "pydantic"} <= base, base  # the metadata was really read
    assert not base & set(TRAIN_ONLY), f"the base install pulls training packages: {base & set(TRAIN_ONLY)}"
    assert set(TRAIN_ONLY) <= train, train
    in_other_extras = {_name(r) for r in reqs if "extra ==" in r and 'extra == "train"' not in r}
    assert not in_other_extras & {"torch", "deepspeed"}, in_other_extras


@pytest.fixture(scope="module")
def no_torch_env(tmp_path_factory) -> dict[str, str]:
    """Environment whose Python cannot import the training stack and says on stderr whenever it tries."""
    site = tmp_path_factory.mktemp("no-torch-site")
    (site / "sitecustomize.py").write_text(textwrap.dedent(f"""
        import sys
        class _NoTrainingStack:
            def find_spec(self, name, path=None, target=None):
                if name.partition(".")[0] in {TRAIN_ONLY!r}:
                    sys.stderr.write("{BLOCKED_MARK} " + name + "\\n")
                    raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)  # as if absent
                return None
        sys.meta_path.insert(0, _NoTrainingStack())
        for mod in [m for m in sys.modules if m.partition(".")[0] in {TRAIN_ONLY!r}]:
            del sys.modules[mod]
        """))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return {**env, "PYTHONPATH": str(site), "COLUMNS": "120"}


def _run(env: dict[str, str], *argv: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run(list(argv), env=env, cwd=cwd, capture_output=True, text=True, timeout=120)


def test_the_blocker_really_blocks(no_torch_env):
    res = _run(no_torch_env, sys.executable, "-c", "import torch")
    assert res.returncode != 0 and f"{BLOCKED_MARK} torch" in res.stderr, res.stderr[-2000:]


def test_every_daemon_module_imports_without_the_training_stack(no_torch_env):
    code = textwrap.dedent("""
        import importlib, pkgutil, sys
        import ulyssesd.daemon, ulyssesd.remediation
        names = [m.name for pkg in (ulyssesd.daemon, ulyssesd.remediation)
                 for m in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + ".")]
        for name in names:
            importlib.import_module(name)
        print(len(names))
        """)
    res = _run(no_torch_env, sys.executable, "-c", code)
    assert res.returncode == 0 and BLOCKED_MARK not in res.stderr, res.stderr[-3000:]
    assert int(res.stdout.split()[-1]) > 40  # the walk found the package


def _daemon_helpers_importable() -> None:
    # The supervisor tests' helpers (fake job spec, run_until) live next to them, as pytest puts them on the path.
    helpers = str(ROOT / "tests" / "daemon")
    if helpers not in sys.path:
        sys.path.insert(0, helpers)


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory) -> tuple[Path, str]:
    """A real supervised run of the fake job (torch-free), finished: the daemon is gone, the store stays."""
    _daemon_helpers_importable()
    from uls_daemon_helpers import fake_spec, run_until

    from ulyssesd.daemon.host.process import RealOS
    from ulyssesd.daemon.spec import load_run_spec
    from ulyssesd.daemon.store import open_store
    from ulyssesd.daemon.store.enums import RunState
    from ulyssesd.daemon.supervisor import Supervisor

    tmp = tmp_path_factory.mktemp("finished")
    spec = load_run_spec(fake_spec(tmp, steps=6, interval=3))
    sup = Supervisor(spec, open_store(spec.daemon.resolved_db_path()), RealOS())
    sup.start()
    run_until(sup, lambda s: s.state in (RunState.COMPLETED, RunState.FAILED), timeout=60)
    assert sup.state == RunState.COMPLETED
    return tmp / "state", sup.run_id


@pytest.mark.parametrize("argv", [
    ("ulyssesctl", "--help"),
    ("ulyssesctl", "--version"),
    ("ulyssesd", "--help"),
    ("ulyssesctl", "plan", "--spec", "configs/gpt-7b-2xh200.toml", "--gpu", "h200-141g"),
], ids=lambda a: " ".join(a[:2]))
def test_operator_commands_run_without_the_training_stack(no_torch_env, argv):
    res = _run(no_torch_env, str(BIN / argv[0]), *argv[1:])
    assert res.returncode in (0, 1), (res.stdout[-2000:], res.stderr[-3000:])  # plan: 1 = does not fit
    assert BLOCKED_MARK not in res.stderr and "Traceback" not in res.stderr, res.stderr[-3000:]
    assert res.stdout.strip(), "printed nothing"


@pytest.mark.parametrize("command", ["status", "incidents"])
def test_ulyssesctl_reads_a_stopped_daemons_store_without_the_training_stack(no_torch_env, finished_run, command):
    state_dir, run_id = finished_run
    res = _run(no_torch_env, str(BIN / "ulyssesctl"), "--state-dir", str(state_dir), command)
    assert res.returncode == 0, (res.stdout[-2000:], res.stderr[-3000:])
    assert BLOCKED_MARK not in res.stderr and "Traceback" not in res.stderr, res.stderr[-3000:]
    if command == "status":
        assert run_id in res.stdout and "COMPLETED" in res.stdout, res.stdout


@pytest.mark.slow
def test_the_daemon_supervises_a_run_without_the_training_stack(no_torch_env, tmp_path):
    # The daemon process (launch, telemetry, detectors, store, checkpoints' manifests) on a host without torch:
    # the tests' contract-faithful fake job, which needs no torch either, supervised to COMPLETED.
    _daemon_helpers_importable()
    from uls_daemon_helpers import fake_spec

    spec = fake_spec(tmp_path, steps=8, interval=4)
    res = subprocess.run([str(BIN / "ulyssesd"), "run", "--spec", str(spec)], env=no_torch_env, cwd=tmp_path,
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, (res.stdout[-3000:], res.stderr[-3000:])
    assert BLOCKED_MARK not in res.stdout + res.stderr, res.stderr[-3000:]
    assert '"to": "COMPLETED"' in res.stdout, res.stdout[-3000:]


def test_the_training_job_without_its_stack_says_what_to_install(no_torch_env, tmp_path):
    res = _run(no_torch_env, str(BIN / "ulysses-train"), "--spec", str(ROOT / "configs" / "tiny-cpu.toml"),
               "--run-dir", str(tmp_path), cwd=tmp_path)
    assert res.returncode == 1, (res.returncode, res.stderr[-3000:])  # a crash, for the daemon as for torchrun
    assert "pip install 'ulyssesd[train]'" in res.stderr, res.stderr[-3000:]
    assert "ModuleNotFoundError: No module named" in res.stderr  # the daemon's diagnosis: launcher_error



def test_the_preprocessor_without_its_stack_says_what_to_install(no_torch_env, tmp_path):
    (tmp_path / "in.jsonl").write_text('{"text": "hello"}\n')
    res = _run(no_torch_env, str(BIN / "ulysses-preprocess"), "in.jsonl", "--output-prefix", "out",
               "--train-tokenizer", "tok.json", cwd=tmp_path)
    assert res.returncode == 1, (res.returncode, res.stderr[-3000:])
    assert f"{BLOCKED_MARK} numpy" in res.stderr  # it really tried, and numpy was really missing
    assert "pip install 'ulyssesd[train]'" in res.stderr and "Traceback" not in res.stderr, res.stderr[-3000:]
    assert not (tmp_path / "tok.json").exists() and not list(tmp_path.glob("out*"))  # nothing half-written
    res = _run(no_torch_env, str(BIN / "ulysses-preprocess"), "--help", cwd=tmp_path)  # help needs no numpy
    assert res.returncode == 0 and res.stdout.startswith("Usage: ulysses-preprocess"), res.stderr[-3000:]
    assert BLOCKED_MARK not in res.stderr, res.stderr[-3000:]
