"""Hostile inputs against the surfaces added in the 2026-12-02 session (an outside check): the snapshot pool's
and the rank watch's knobs, the writer's digest switch, manifest v3 (chunk digests, `chunk_list_sha256`) as a
broken disk or a careless edit leaves it, read by the job's validation, the daemon's launch check and the
standby's streaming check, a garbage `started.startup` field, and `ulyssesctl incidents --json` over thousands
of actions. Each answer must be a clear error naming what is wrong, never a traceback, a hang or a lost tag."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from ulyssesd.daemon.operator.ctl import main
from ulyssesd.training.checkpoint import files as ckfiles
from ulyssesd.training.checkpoint.digests import DIGEST_MODE_ENV, StreamCheck, chunk_list_sha256, digest_mode
from ulyssesd.training.spec import SpecError, job_spec_from_dict, read_toml

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "configs" / "tiny-cpu.toml"
CTL = Path(sys.executable).parent / "ulyssesctl"
CB = 4096  # the smallest chunk size a manifest may name: small files with several chunks


# ------------------------------------------------------------------------------------------ config knobs
def _job(section: str, **kv):
    data = read_toml(TINY)
    data.setdefault(section, {}).update(kv)
    return job_spec_from_dict(data, source="hostile.toml")


@pytest.mark.parametrize("key, value, why", [
    ("snapshot_pool_chunk_mib", 0, "greater than or equal to 16"),
    ("snapshot_pool_chunk_mib", -1, "greater than or equal to 16"),
    ("snapshot_pool_chunk_mib", 10**9, "less than or equal to 16384"),
    ("snapshot_pool_chunk_mib", "256", "valid integer"),
    ("snapshot_pool_chunk_mib", 256.5, "valid integer"),
    ("snapshot_pool_chunk_mib", True, "valid integer"),
    ("snapshot_pool_pause_ms", -1, "greater than or equal to 0"),
    ("snapshot_pool_pause_ms", 1e9, "less than or equal to 10000"),
    ("snapshot_pool_pause_ms", float("nan"), "less than or equal to 10000"),
    ("snapshot_pool_pause_ms", float("inf"), "less than or equal to 10000"),
    ("snapshot_pool_pause_ms", "slow", "valid number"),
    ("snapshot_pool_pause_ms", "50", "valid number"),   # a TOML string is a typo, not 50 ms
    ("snapshot_pool_pause_ms", True, "valid number"),   # `true` is not 1 ms
])
def test_a_snapshot_pool_knob_that_is_not_a_size_or_a_pause_is_refused_naming_the_key(key, value, why):
    with pytest.raises(SpecError) as err:
        _job("checkpoint", **{key: value})
    assert f"checkpoint.{key}" in str(err.value) and why in str(err.value), str(err.value)


@pytest.mark.parametrize("key, value", [("snapshot_pool_chunk_mib", 16), ("snapshot_pool_chunk_mib", 16384),
                                        ("snapshot_pool_pause_ms", 0), ("snapshot_pool_pause_ms", 10_000),
                                        ("snapshot_pool_pause_ms", 12.5)])
def test_the_snapshot_pool_knobs_bounds_are_accepted(key, value):
    assert getattr(_job("checkpoint", **{key: value}).checkpoint, key) == value


@pytest.mark.parametrize("grace, why", [(-1, "greater than 0"), (0, "greater than 0"), (1e9, "less than or equal"),
                                        (float("nan"), "rank_exit_grace_s"), ("2s", "valid number")])
def test_a_rank_exit_grace_that_is_not_a_grace_is_refused_naming_the_key(grace, why):
    from ulyssesd.daemon.spec import run_spec_from_dict

    data = read_toml(TINY)
    data.setdefault("daemon", {})["rank_exit_grace_s"] = grace
    with pytest.raises(Exception) as err:
        run_spec_from_dict(data, source="hostile.toml")
    text = str(err.value)
    assert "daemon.rank_exit_grace_s" in text and why in text and "Traceback" not in text, text
    data["daemon"]["rank_exit_grace_s"] = 2.5
    assert run_spec_from_dict(data, source="ok.toml").daemon.rank_exit_grace_s == 2.5


# ------------------------------------------------------------------------------------- digest switch
@pytest.mark.parametrize("value", ["sha1", "chunk", "whole,chunks", "0"])
def test_a_bogus_digest_mode_names_the_variable_and_the_choices(monkeypatch, value):
    monkeypatch.setenv(DIGEST_MODE_ENV, value)
    with pytest.raises(ValueError) as err:
        digest_mode()
    assert DIGEST_MODE_ENV in str(err.value) and repr(value) in str(err.value) and "chunks, whole" in str(err.value)


@pytest.mark.parametrize("value, mode", [(" WHOLE ", "whole"), ("", "chunks"), ("  ", "chunks")])
def test_a_digest_mode_in_other_case_or_blank_is_read_as_meant(monkeypatch, value, mode):
    monkeypatch.setenv(DIGEST_MODE_ENV, value)
    assert digest_mode() == mode


def test_a_bogus_digest_mode_refuses_the_async_writer_at_start_not_every_save(monkeypatch):
    """Read only inside each background write, a typo made every save of a multi-day run fail (each one a
    checkpoint_save_failed, the run without a new tag); the writer now refuses it when it is built."""
    from ulyssesd.training.checkpoint.saving import AsyncCheckpointWriter

    monkeypatch.setenv(DIGEST_MODE_ENV, "sha512")
    with pytest.raises(ValueError, match=DIGEST_MODE_ENV):
        AsyncCheckpointWriter(0, pin_memory=False)
    AsyncCheckpointWriter(0, pin_memory=False, direct_io=False)  # the buffered writer takes no chunk digests
    monkeypatch.setenv(DIGEST_MODE_ENV, "whole")
    assert AsyncCheckpointWriter(0, pin_memory=False).direct_io


# --------------------------------------------------------------------------------------- manifest v3
def _v3_tag(root: Path, step: int, sizes=(3 * CB + 100, 2 * CB)) -> Path:
    """A tag whose files carry chunk digests only (no whole-file sha256): what the O_DIRECT writer records."""
    tag = root / ckfiles.tag_for_step(step)
    tag.mkdir(parents=True)
    files = {}
    for i, size in enumerate(sizes):
        rel = f"zero_pp_rank_{i}_mp_rank_00_optim_states.pt"
        data = bytes((step * 7 + i + k) % 251 for k in range(size))
        (tag / rel).write_bytes(data)
        chunks = [hashlib.sha256(data[o:o + CB]).hexdigest() for o in range(0, size, CB)]
        files[rel] = {"size": size, "chunk_bytes": CB, "chunk_sha256": chunks,
                      "chunk_list_sha256": chunk_list_sha256(chunks)}
    (tag / "manifest.json").write_text(json.dumps({"v": 3, "tag": tag.name, "step": step, "files": files}))
    return tag


def _edit(tag: Path, change) -> None:
    doc = json.loads((tag / "manifest.json").read_text())
    change(next(iter(sorted(doc["files"].items())))[1])
    (tag / "manifest.json").write_text(json.dumps(doc))


def _flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


TAMPERS = {
    "chunk_list_sha256 wrong": (lambda m: m.update(chunk_list_sha256="0" * 64), "does not match its 'chunk_sha256'"),
    "chunk list too short": (lambda m: m["chunk_sha256"].pop(), "must list 4 digests"),
    "chunk list too long": (lambda m: m["chunk_sha256"].append("a" * 64), "must list 4 digests"),
    "chunk list not a list": (lambda m: m.update(chunk_sha256="ab" * 32), "must list 4 digests"),
    "a digest not hex": (lambda m: m["chunk_sha256"].__setitem__(1, "z" * 64), "not a 64-digit lowercase hex"),
    "a digest in capitals": (lambda m: m["chunk_sha256"].__setitem__(1, m["chunk_sha256"][1].upper()),
                             "not a 64-digit lowercase hex"),
    "a digest a number": (lambda m: m["chunk_sha256"].__setitem__(0, 7), "not a 64-digit lowercase hex"),
    "chunk_bytes 0": (lambda m: m.update(chunk_bytes=0), "'chunk_bytes' must be an integer in"),
    "chunk_bytes negative": (lambda m: m.update(chunk_bytes=-CB), "'chunk_bytes' must be an integer in"),
    "chunk_bytes a string": (lambda m: m.update(chunk_bytes="4096"), "'chunk_bytes' must be an integer in"),
    "chunk_bytes true": (lambda m: m.update(chunk_bytes=True), "'chunk_bytes' must be an integer in"),
    "chunk_bytes huge": (lambda m: m.update(chunk_bytes=1 << 40), "'chunk_bytes' must be an integer in"),
    "chunk_bytes not the writer's": (lambda m: m.update(chunk_bytes=2 * CB), "must list 2 digests"),
    "chunk_bytes missing": (lambda m: m.pop("chunk_bytes"), "'chunk_bytes' must be an integer in"),
    "sha256 and chunk_list both missing": (lambda m: m.pop("chunk_list_sha256"), "and string 'sha256'"),
    "chunk digests missing": (lambda m: m.pop("chunk_sha256"), "must list 4 digests"),
    "size a string": (lambda m: m.update(size="12388"), "needs integer 'size'"),
    "size negative": (lambda m: m.update(size=-1), "needs integer 'size'"),   # a negative pool size next
    "size true": (lambda m: m.update(size=True), "needs integer 'size'"),
}


@pytest.mark.parametrize("name", sorted(TAMPERS))
def test_a_tampered_v3_entry_is_an_invalid_tag_naming_the_file_and_the_field(tmp_path, name):
    change, why = TAMPERS[name]
    tag = _v3_tag(tmp_path, 2)
    assert ckfiles.validate_tag(tag) == (True, "ok")
    _edit(tag, change)
    ok, reason = ckfiles.validate_tag(tag)
    assert not ok and why in reason and "zero_pp_rank_0_" in reason, reason
    assert sorted(p.name for p in tag.iterdir()) == sorted(["manifest.json", "zero_pp_rank_0_mp_rank_00_optim_states.pt",
                                                            "zero_pp_rank_1_mp_rank_00_optim_states.pt"])


def test_a_flipped_byte_in_a_middle_chunk_names_that_chunk(tmp_path):
    tag = _v3_tag(tmp_path, 2)
    _flip(tag / "zero_pp_rank_0_mp_rank_00_optim_states.pt", 2 * CB + 5)
    ok, reason = ckfiles.validate_tag(tag, threads=2)
    assert not ok and "chunk 2" in reason and "corrupted" in reason, reason


def test_a_huge_claimed_size_with_a_short_chunk_list_is_refused_without_building_its_list(tmp_path):
    """1 EiB in 4 KiB chunks would be 2**48 jobs: the count check must come before anything is allocated."""
    tag = _v3_tag(tmp_path, 2)
    _edit(tag, lambda m: m.update(size=1 << 60))
    t0 = time.monotonic()
    ok, reason = ckfiles.validate_tag(tag)
    assert not ok and f"must list {(1 << 60) // CB} digests" in reason and time.monotonic() - t0 < 2.0, reason


def test_a_long_chunk_list_of_a_real_size_verifies_in_bounded_time_and_memory(tmp_path):
    """A 16 MiB file in the smallest chunks: 4096 digests, one verification job each."""
    tag = _v3_tag(tmp_path, 2, sizes=(16 << 20,))
    t0 = time.monotonic()
    assert ckfiles.validate_tag(tag, threads=2) == (True, "ok")
    assert time.monotonic() - t0 < 30


def test_a_manifest_of_hundreds_of_mib_is_refused_unread(tmp_path):
    """A sparse 300 MiB manifest.json (a damaged disk, a runaway writer): refused by its size before a byte is
    read, by the job's validation and the daemon's size probe alike (both read the whole file before)."""
    from ulyssesd.daemon.core.launch import tag_gib

    tag = _v3_tag(tmp_path, 2)
    with open(tag / "manifest.json", "r+b") as fh:
        fh.truncate(300 << 20)
    t0 = time.monotonic()
    with pytest.raises(ckfiles.ManifestError, match="exceeds"):
        ckfiles.read_manifest(tag)
    ok, reason = ckfiles.validate_tag(tag)
    assert not ok and "manifest of 314572800 bytes" in reason and tag_gib(tmp_path, tag.name) == 0.0
    assert time.monotonic() - t0 < 1.0


def test_a_manifest_lying_about_its_sizes_cannot_size_a_snapshot_pool_beyond_the_host(tmp_path, monkeypatch):
    """On resume the pool is sized from the chosen tag's manifest before the tag is validated: a manifest that
    claims 1 EiB of optimizer states gets a logged refusal (saves fall back to pinned buffers), not an attempt
    to fill the host's memory."""
    from ulyssesd.training.checkpoint.saving import AsyncCheckpointWriter
    from ulyssesd.training.checkpoint.snapshot import tag_snapshot_bytes

    tag = _v3_tag(tmp_path, 2)
    _edit(tag, lambda m: m.update(size=1 << 60, chunk_sha256=[], chunk_bytes=1 << 30, chunk_list_sha256=None))
    doc = json.loads((tag / "manifest.json").read_text())
    nbytes = tag_snapshot_bytes(doc["files"], world=2)
    assert nbytes >= 1 << 60
    writer = AsyncCheckpointWriter(0, pin_memory=False)
    note = writer.prepare_pool(nbytes, registrar=None, memory=(64 << 30, 128 << 30))  # type: ignore[arg-type]
    assert note.startswith("refused:") and "exceed" in note and writer.snapshot_pool is None


# ----------------------------------------------------------------------- the daemon's launch check
@pytest.mark.parametrize("verify", [True, False])   # False: checksums off, or a tag above verify_max_gib
def test_the_launch_check_quarantines_a_tampered_v3_tag_and_keeps_the_newest_valid_one(tmp_path, verify):
    from ulyssesd.daemon.core.launch import choose_checkpoint, tag_gib
    from ulyssesd.daemon.store import open_store

    ckpt = tmp_path / "ckpt"
    good, bad = _v3_tag(ckpt, 1), _v3_tag(ckpt, 2)
    _edit(bad, lambda m: m["chunk_sha256"].__setitem__(0, m["chunk_sha256"][1]))   # a digest copied over
    said: list[str] = []
    with open_store(tmp_path / "u.db") as store:
        store.create_run("r1", run_dir=tmp_path, spec={}, state="RUNNING")
        chosen, _notes = choose_checkpoint(ckpt, None, verify=verify, verify_max_gib=100.0, store=store, run_id="r1",
                                           clock=time.time, say=said.append, threads=2)
    assert chosen == good.name and ckfiles.validate_tag(good) == (True, "ok")
    assert not bad.exists() and ckfiles.list_quarantined(ckpt), list(ckpt.iterdir())   # set aside, not deleted
    (kept,) = ckfiles.list_quarantined(ckpt)
    assert len(list((ckpt / kept).iterdir())) == 3
    assert (ckpt / "latest").read_text().strip() == good.name
    (good / "manifest.json").write_text('{"files": {"a": {"size": "x"}}}')
    assert tag_gib(ckpt, good.name) == 0.0   # a damaged manifest's size is unknown, not a traceback


# ------------------------------------------------------------------------------ streaming check
def test_the_streaming_check_refuses_a_chunk_size_below_one_instead_of_spinning(tmp_path):
    """StreamCheck with chunk_bytes 0 looped forever on the first update (a chunk that is always full)."""
    result: list[object] = []

    def feed():
        try:
            StreamCheck({"size": 10, "chunk_bytes": 0, "chunk_sha256": ["a" * 64]}).update(b"0123456789")
            result.append("fed")
        except ValueError as exc:
            result.append(exc)

    t = threading.Thread(target=feed, daemon=True)
    t.start()
    t.join(5)
    assert not t.is_alive() and isinstance(result[0], ValueError) and "chunk_bytes" in str(result[0]), result


def test_the_standby_preload_stops_at_the_first_bad_chunk_of_a_v3_tag(tmp_path):
    from ulyssesd.training.standby import _read_checked

    tag = _v3_tag(tmp_path, 2, sizes=(64 * CB,))
    rel = "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    meta = ckfiles.read_manifest(tag)["files"][rel]
    assert _read_checked(tag / rel, meta["size"], meta, keep=False, stop=lambda: False, delay_s=0) == -1
    _flip(tag / rel, 3 * CB)
    assert _read_checked(tag / rel, meta["size"], meta, keep=False, stop=lambda: False, delay_s=0) is None
    (tag / rel).write_bytes((tag / rel).read_bytes()[:-1])  # one byte short
    assert _read_checked(tag / rel, meta["size"], meta, keep=True, stop=lambda: False, delay_s=0) is None


@pytest.mark.parametrize("tamper", ["chunk_list_sha256", "data", "chunk_bytes"])
def test_the_standby_drops_its_preload_of_a_tampered_v3_tag_and_leaves_the_tag_alone(tmp_path, tamper):
    """What the warm standby reads while it waits: a tag `latest` names whose manifest or bytes were damaged
    gives no preload (the attempt then validates the tag from disk, as a cold start does)."""
    from ulyssesd.training.standby import Preload

    ckpt = tmp_path / "ckpt"
    tag = _v3_tag(ckpt, 4, sizes=(8 * CB + 3, 2 * CB))
    ckfiles.point_latest_to(ckpt, tag.name)
    good = Preload.read(ckpt, rank=0)
    assert good is not None and len(good.verified) == 1
    good.release()
    rel = "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    if tamper == "data":
        _flip(tag / rel, 5 * CB)
    else:
        _edit(tag, (lambda m: m.update(chunk_list_sha256="f" * 64)) if tamper == "chunk_list_sha256"
              else (lambda m: m.update(chunk_bytes=0)))
    before = {p.name: p.stat().st_size for p in tag.iterdir()}
    assert Preload.read(ckpt, rank=0) is None
    assert {p.name: p.stat().st_size for p in tag.iterdir()} == before and ckfiles.read_latest(ckpt) == tag.name


# --------------------------------------------------------------------------- started.startup garbage
GARBAGE_STARTUP = [
    {"process_started_at": "yesterday", "imports": "fast"}, {"imports": -5.0, "model_built": 1e308},
    {"imports": None, "deepspeed_initialized": [1, 2]}, "not a dict", 12, {"tag_verified": {"deep": {"er": 1}}},
]


@pytest.fixture
def startup_state(tmp_path) -> Path:
    from ulyssesd.daemon.store import open_store

    sd = tmp_path / "state"
    run_dir = sd / "runs" / "r1"
    (run_dir / "logs").mkdir(parents=True)
    with open_store(sd / "ulyssesd.db") as store:
        store.create_run("r1", run_dir=run_dir, spec={"train": {"steps": 10}}, state="RUNNING")
        store.add_attempt("r1", command=["train"])
    lines = [{"kind": "event", "event": "started", "step": 0, "time": 1.0, "startup": s} for s in GARBAGE_STARTUP]
    lines.append({"kind": "step", "step": 3, "loss": 2.5, "step_time_s": 0.1, "time": 2.0})
    nested = '{"kind": "event", "event": "started", "step": 0, "startup": ' + "[" * 100_000 + "]" * 100_000 + "}"
    (run_dir / "telemetry.jsonl").write_text(nested + "\n" + "".join(json.dumps(x) + "\n" for x in lines))
    (run_dir / "logs" / "attempt-1.log").write_text("[rank0]:step 3\n")
    return sd


def test_a_garbage_startup_field_is_read_past_by_the_daemons_telemetry_reader(startup_state):
    from ulyssesd.daemon.telemetry.telemetry_reader import TelemetryReader

    records = [r for r, _ in TelemetryReader(startup_state / "runs" / "r1" / "telemetry.jsonl").read()]
    assert records and getattr(records[-1], "step", None) == 3   # the step after the garbage is still read


@pytest.mark.parametrize("argv", [["status", "--json"], ["status"], ["report"]])
def test_ulyssesctl_answers_over_a_garbage_startup_field(startup_state, capsys, argv):
    capsys.readouterr()
    html = startup_state / "report.html"
    code = main(["--state-dir", str(startup_state), *argv, *(["-o", str(html)] if argv == ["report"] else [])])
    captured = capsys.readouterr()
    assert code == 0 and "Traceback" not in captured.out + captured.err, captured.err[-2000:]
    if "--json" in argv:
        assert json.loads(captured.out)["step"] == 3
    if argv == ["report"]:
        assert html.stat().st_size > 1000


# ------------------------------------------------------------------------ incidents over many actions
@pytest.mark.parametrize("as_json", [True, False])
def test_incidents_over_thousands_of_actions_is_bounded_and_complete(tmp_path, as_json):
    from ulyssesd.daemon.store import open_store

    sd = tmp_path / "state"
    run_dir = sd / "runs" / "r1"
    (run_dir / "logs").mkdir(parents=True)
    n_incidents, per = 1000, 3
    with open_store(sd / "ulyssesd.db") as store:
        store.create_run("r1", run_dir=run_dir, spec={"train": {"steps": 10}}, state="RUNNING")
        store.add_attempt("r1", command=["train"])
        for i in range(n_incidents):
            inc = store.record_incident("r1", attempt=1, symptom="loss_spike", step=i, summary=f"spike {i}")
            for _ in range(per):
                store.record_action("r1", "set_config", incident_id=inc, config_diff={"train.lr": [1e-3, 9e-4]})
    t0 = time.monotonic()
    out = subprocess.run([str(CTL), "--state-dir", str(sd), "incidents", *(["--json"] if as_json else [])],
                         capture_output=True, text=True, timeout=120, env={**os.environ, "COLUMNS": "200"})
    took = time.monotonic() - t0
    assert out.returncode == 0, out.stderr[-2000:]
    if as_json:
        doc = json.loads(out.stdout)
        assert len(doc) == n_incidents and all(len(i["actions"]) == per for i in doc)
    else:
        assert out.stdout.count("set_config, set_config, set_config") == n_incidents
    assert took < 60, f"incidents over {n_incidents * per} actions took {took:.1f} s"
    print(f"incidents json={as_json}: {n_incidents} incidents, {n_incidents * per} actions, {took:.2f} s")


def test_a_bogus_digest_mode_is_a_config_refusal_of_the_job_before_its_build(tmp_path):
    """The real job (one process): exit 2 with the variable named and a config_rejected event, before the model
    is built; not a traceback at its first async save, which a daemon would relaunch into the same crash."""
    sys.path.insert(0, str(REPO / "tests" / "training"))
    from train_job_helpers import launch, tiny_spec

    spec = tiny_spec(parallel={"sequence_parallel_size": 1}, checkpoint={"async_save": True})
    run = launch(spec, tmp_path / "run", nproc=1, env={DIGEST_MODE_ENV: "sha512"}, timeout=180)
    assert run.returncode == 2, run.output[-3000:]
    assert f"{DIGEST_MODE_ENV}='sha512'" in run.output and "Traceback" not in run.output, run.output[-3000:]
    (exiting,) = run.events("exiting")
    assert exiting["reason"] == "config_rejected" and not run.steps()
    assert not (tmp_path / "run" / "checkpoints").exists() or not ckfiles.list_tags(tmp_path / "run" / "checkpoints")



def test_compile_blocks_meeting_a_partitioned_weight_is_a_config_refusal_not_a_crash():
    """A RuntimeError there was exit 1, a crash a daemon relaunches into the same first step (restart budget
    spent on model builds); as a SpecError the job says config_rejected and exits 2 on every rank. No refusal
    at load: measured, the 2-rank CPU tiny job with stage3_param_persistence_threshold 0 and no leaf blocks
    ran 2 steps (ZeRO-3 had gathered the weights), so the combination is not always wrong."""
    import torch

    from ulyssesd.training.model import fused_block

    with pytest.raises(SpecError) as err:
        fused_block.check_gathered(torch.ones(3), torch.empty(0))
    assert isinstance(err.value, RuntimeError) and err.value.problems and "train.zero3_leaf_blocks = true" in str(err.value)
    fused_block.check_gathered(torch.ones(3))
