"""Where a cold start-up of the training job goes (issue 21, MTTR), on one GPU.

Three runs of the bare job (torchrun, one rank) in one run directory:
- `prepare`: a fresh start, 2 steps, one (asynchronous) save of the tag the next runs resume from;
- `resume`: a fresh process that resumes from that tag, every start-up phase timed, 3 more steps;
- `resume_prof`: the same with a cProfile of each phase (the top functions by cumulative time).

Each run's rank is this script in `--child` mode under torchrun: it times its own imports, then runs the job's
`main()` with the Trainer's start-up methods wrapped by timers (none of the product's code changes):
  launch -> child       torchrun's start-up and the rank's interpreter (launch time passed in the environment)
  import_torch, import_deepspeed, import_training
  cuda_context          pick_device + the first allocation on the device (creates the CUDA context)
  init_distributed      deepspeed.init_distributed, the process group
  agree_on_tag          rank 0 picks the tag and verifies its sha256 (checkpoint.verify_checksums), broadcast
  build                 ds_config, the model under zero.Init (`model_construct`), deepspeed.initialize
  resume                engine.load_checkpoint of the tag
  first_step, step_2..  the training steps (the first one pays the lazy work)
The phases go to `{out}/{run}_phases.json`, profiles to `{out}/{run}_prof_{phase}.txt`.

    python bench/gpu_startup21.py --out $OUT/startup [--preset gpt-1b --seq 16384 --device cuda --dtype bf16]
    python bench/gpu_startup21.py --out DIR --analyze     # the table again from the raw files
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

LAUNCH_ENV = "BENCH_STARTUP_LAUNCH_T"
CHILD_T0 = time.time()   # the first line this interpreter runs (stdlib imports only above)

# Trainer methods timed, in start-up order (those missing in this checkout are reported, not fatal).
TRAINER_PHASES = (("_init_distributed", "init_distributed"), ("_agree_on_tag", "agree_on_tag"),
                  ("_build", "build"), ("_resume", "resume"))
PROFILED = ("import_torch", "import_deepspeed", "import_training", "cuda_context", "init_distributed",
            "agree_on_tag", "build", "resume", "first_step")
TIMED_STEPS = 3


# ------------------------------------------------------------------------------------------- the rank
class PhaseClock:
    """Wall time of each phase (epoch seconds), optionally profiled (one cProfile at a time: no nesting)."""

    def __init__(self, profile_dir: Path | None, top: int):
        self.phases: list[dict] = []
        self.profile_dir, self.top, self._active = profile_dir, top, False

    def run(self, name: str, fn, *args, **kwargs):
        prof = None
        if self.profile_dir is not None and name in PROFILED and not self._active:
            import cProfile

            prof, self._active = cProfile.Profile(), True
            prof.enable()
        t0 = time.time()
        try:
            return fn(*args, **kwargs)
        finally:
            t1 = time.time()
            if prof is not None:
                prof.disable()
                self._active = False
                self._dump(name, prof)
            self.phases.append({"phase": name, "start": t0, "end": t1, "seconds": round(t1 - t0, 4)})

    def _dump(self, name: str, prof) -> None:
        import io
        import pstats

        buf = io.StringIO()
        st = pstats.Stats(prof, stream=buf)
        st.sort_stats("cumulative").print_stats(self.top)
        buf.write("\n\n===== by own time (tottime) =====\n")
        st.sort_stats("tottime").print_stats(self.top)
        assert self.profile_dir is not None
        (self.profile_dir / f"prof_{name}.txt").write_text(buf.getvalue())


def child(a, train_argv: list[str]) -> int:
    clock = PhaseClock(Path(a.profile_dir) if a.profile_dir else None, a.top)
    clock.run("import_torch", __import__, "torch")
    clock.run("import_deepspeed", __import__, "deepspeed")

    def import_training():
        import ulyssesd.training.__main__  # noqa: F401 - the job's entry point
        import ulyssesd.training.train  # noqa: F401

    clock.run("import_training", import_training)
    import deepspeed
    import torch

    import ulyssesd.training.__main__ as entry
    import ulyssesd.training.train as tr

    missing = []
    orig_pick = tr.pick_device

    def pick_device(spec):
        def ctx():
            dev = orig_pick(spec)
            if dev.type == "cuda":
                torch.zeros(1, device=dev)
                torch.cuda.synchronize(dev)
            return dev
        return clock.run("cuda_context", ctx)

    tr.pick_device = pick_device
    for meth, name in TRAINER_PHASES:
        orig = getattr(tr.Trainer, meth, None)
        if orig is None:
            missing.append(meth)
            continue

        def timed(self, *args, _orig=orig, _name=name, **kwargs):
            return clock.run(_name, _orig, self, *args, **kwargs)

        setattr(tr.Trainer, meth, timed)
    # Inside build (timers only: build itself may be profiled).
    inner: list[dict] = []

    def timer(name, fn):
        def wrapped(*args, **kwargs):
            t0 = time.time()
            try:
                return fn(*args, **kwargs)
            finally:
                inner.append({"phase": name, "start": t0, "end": time.time(), "seconds": round(time.time() - t0, 4)})
        return wrapped

    tr.GPT = timer("model_construct", tr.GPT)
    deepspeed.initialize = timer("deepspeed_initialize", deepspeed.initialize)
    step_meth = "_train_step" if hasattr(tr.Trainer, "_train_step") else None
    if step_meth:
        orig_step = tr.Trainer._train_step
        count = [0]

        def train_step(self, *args, **kwargs):
            count[0] += 1
            if count[0] > TIMED_STEPS:
                return orig_step(self, *args, **kwargs)
            name = "first_step" if count[0] == 1 else f"step_{count[0]}"
            return clock.run(name, orig_step, self, *args, **kwargs)

        tr.Trainer._train_step = train_step
    else:
        missing.append("_train_step")
    code = 1
    try:
        code = entry.main(train_argv)
    finally:
        out = {"launch": float(os.environ.get(LAUNCH_ENV, "nan")), "child_start": CHILD_T0, "exit_code": code,
               "phases": clock.phases, "inner": inner, "missing_methods": missing, "end": time.time(),
               "torch": torch.__version__, "deepspeed": deepspeed.__version__}
        Path(a.phases_out).write_text(json.dumps(out, indent=1))
    entry._leave(code)   # the job's own exit (no process-group teardown at interpreter exit)
    return code


# ------------------------------------------------------------------------------------------ the driver
def sh(cmd: str, timeout: float = 60) -> str:
    try:
        p = subprocess.run(cmd, shell=True, capture_output=True, text=True, timeout=timeout)
        return (p.stdout + p.stderr).strip()
    except subprocess.TimeoutExpired:
        return f"timeout: {cmd}"


def page_cache_state(ckpt: Path, drop: bool) -> dict:
    """How much of the checkpoint is in the page cache before a resume (fincore), after an optional drop."""
    res: dict = {}
    if drop:
        res["drop_caches"] = sh("sync; echo 3 > /proc/sys/vm/drop_caches && echo ok")
    files = sorted(str(p) for p in ckpt.rglob("*") if p.is_file() and p.stat().st_size > 1 << 20)
    res["fincore"] = sh("fincore -b " + " ".join(files)) if files and shutil.which("fincore") else "no fincore"
    res["free"] = sh("free -m | head -2")
    return res


def job_spec(a, steps: int, interval: int) -> str:
    from gpu_ckpt21 import JOB

    return JOB.format(preset=a.preset, dtype=a.dtype, seq=a.seq, device=a.device, steps=steps, interval=interval,
                      keep=2, async_save="true")


def one_run(a, name: str, attempt: int, work: Path, out: Path, profile: bool, steps: int, interval: int) -> dict:
    spec = work / f"{name}.toml"
    spec.write_text(job_spec(a, steps, interval))
    prof_dir = out / f"{name}_prof"
    if profile:
        prof_dir.mkdir(parents=True, exist_ok=True)
    phases = out / f"{name}_phases.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1",
           str(Path(__file__).resolve()), "--child", "--phases-out", str(phases), "--top", str(a.top)] \
        + (["--profile-dir", str(prof_dir)] if profile else []) \
        + ["--", "--spec", str(spec), "--run-dir", str(work / "run"), "--attempt", str(attempt)]
    log_path = work / f"{name}.log"
    info: dict = {"run": name, "cmd": " ".join(cmd)}
    if name != "prepare":
        info["page_cache"] = page_cache_state(work / "run" / "checkpoints", a.drop_caches)
    env = dict(os.environ, **{LAUNCH_ENV: repr(time.time())})
    t0 = time.time()
    with open(log_path, "w") as log:
        p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        left = a.run_timeout if a.deadline is None else min(a.run_timeout, a.deadline - time.time())
        try:
            info["returncode"] = p.wait(timeout=max(5.0, left))
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, 9)
            p.wait()
            info["returncode"], info["timed_out"] = p.returncode, True
    info["wall_s"] = round(time.time() - t0, 2)
    text = log_path.read_text(errors="replace")
    (out / f"{name}_log.txt").write_text(text[:30000] + "\n...\n" + text[-10000:])
    (out / f"{name}_info.json").write_text(json.dumps(info, indent=1))
    print(json.dumps({k: v for k, v in info.items() if k != "cmd"}), flush=True)
    return info


def import_baseline(out: Path) -> dict:
    """A bare interpreter, and `-X importtime` of the job's imports (warm file cache: after the runs)."""
    res: dict = {}
    for name, code in (("python_pass", "pass"), ("import_torch", "import torch"),
                       ("import_all", "import torch, deepspeed, ulyssesd.training.train")):
        t0 = time.time()
        subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=120)
        res[f"{name}_s"] = round(time.time() - t0, 3)
    p = subprocess.run([sys.executable, "-X", "importtime", "-c", "import torch, deepspeed, ulyssesd.training.train"],
                       capture_output=True, text=True, timeout=120)
    rows = []
    for line in p.stderr.splitlines():   # "import time: self [us] | cumulative | imported package"
        parts = line.split("|")
        if len(parts) == 3 and parts[0].startswith("import time:") and parts[1].strip().isdigit():
            rows.append((int(parts[1]), int(parts[0].split(":")[1]), parts[2].rstrip()))
    rows.sort(reverse=True)
    res["importtime_top_cumulative"] = [{"module": m, "cumulative_s": round(c / 1e6, 3), "self_s": round(s_ / 1e6, 3)}
                                        for c, s_, m in rows[:40]]
    (out / "imports.json").write_text(json.dumps(res, indent=1))
    return res


def records(path: Path) -> list[dict]:
    from bench_common import read_records

    return read_records(path)


def analyze_run(out: Path, name: str, tele: list[dict]) -> dict | None:
    p = out / f"{name}_phases.json"
    if not p.exists():
        return None
    ph = json.loads(p.read_text())
    launch = ph["launch"]
    rows = [{"phase": "launch_to_child (torchrun + interpreter)", "seconds": round(ph["child_start"] - launch, 3),
             "at_s": 0.0}]
    prev_end = ph["child_start"]
    for x in ph["phases"]:
        gap = x["start"] - prev_end
        if gap > 0.05:
            rows.append({"phase": "(between)", "seconds": round(gap, 3), "at_s": round(prev_end - launch, 3)})
        rows.append({"phase": x["phase"], "seconds": x["seconds"], "at_s": round(x["start"] - launch, 3)})
        prev_end = x["end"]
    for x in ph["inner"]:
        rows.append({"phase": f"  in build: {x['phase']}", "seconds": x["seconds"], "at_s": round(x["start"] - launch, 3)})
    first = next((x for x in ph["phases"] if x["phase"] == "first_step"), None)
    res = {"rows": rows, "exit_code": ph["exit_code"], "missing_methods": ph["missing_methods"],
           "launch_to_first_step_end_s": None if first is None else round(first["end"] - launch, 3),
           "launch_to_exit_s": round(ph["end"] - launch, 3)}
    att = {"prepare": 1, "resume": 2, "resume_prof": 3}.get(name)
    started = next((r for r in tele if r.get("event") == "started" and r.get("attempt") == att), None)
    if started is not None:
        res["started_event"] = {k: v for k, v in started.items() if k not in ("kind", "event")}
    res["saves"] = [{k: r.get(k) for k in ("tag", "seconds", "blocked_seconds", "write_seconds", "bytes")}
                    for r in tele if r.get("event") == "checkpoint_saved" and r.get("attempt") == att]
    return res


def analyze(out: Path) -> dict:
    tele = records(out / "telemetry.jsonl")
    res: dict = {n: analyze_run(out, n, tele) for n in ("prepare", "resume", "resume_prof")}
    for n in ("resume", "resume_prof"):
        info = out / f"{n}_info.json"
        if info.exists() and res.get(n):
            res[n]["page_cache"] = json.loads(info.read_text()).get("page_cache")
    if (out / "imports.json").exists():
        res["imports"] = json.loads((out / "imports.json").read_text())
    return res


def print_table(res: dict) -> None:
    for name, r in res.items():
        if not r or name == "imports":
            continue
        print(f"\n== {name}: exit {r['exit_code']}, launch -> end of first step "
              f"{r['launch_to_first_step_end_s']} s, missing {r['missing_methods']}")
        for row in r["rows"]:
            print(f"  {row['phase']:<44} {row['seconds']:>9.3f} s   (at {row['at_s']:.2f} s)")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out")
    ap.add_argument("--work", default="/tmp/ulysses-startup21")
    ap.add_argument("--preset", default="gpt-1b")
    ap.add_argument("--seq", type=int, default=16384)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--runs", default="prepare,resume,resume_prof")
    ap.add_argument("--top", type=int, default=30, help="functions per profile listing")
    ap.add_argument("--drop-caches", action="store_true", help="drop the page cache before each resume (root)")
    ap.add_argument("--run-timeout", type=float, default=150.0)
    ap.add_argument("--deadline", type=float, default=None, help="epoch seconds: no run starts later than "
                                                                   "60 s before it, a run is cut at it")
    ap.add_argument("--analyze", action="store_true")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--phases-out", help=argparse.SUPPRESS)
    ap.add_argument("--profile-dir", help=argparse.SUPPRESS)
    argv = sys.argv[1:]
    train_argv = argv[argv.index("--") + 1:] if "--" in argv else []
    a = ap.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    if a.child:
        return child(a, train_argv)
    if not a.out:
        ap.error("--out is required")
    out, work = Path(a.out), Path(a.work)
    out.mkdir(parents=True, exist_ok=True)
    if not a.analyze:
        shutil.rmtree(work, ignore_errors=True)
        (work / "run").mkdir(parents=True)
        plan = {"prepare": (1, False, 2, 2), "resume": (2, False, 5, 100), "resume_prof": (3, True, 5, 100)}
        for name in a.runs.split(","):
            if a.deadline is not None and time.time() > a.deadline - 60:
                print(f"{name}: skipped, under 60 s left before the deadline", flush=True)
                continue
            attempt, profile, steps, interval = plan[name]
            one_run(a, name, attempt, work, out, profile, steps, interval)
        if a.deadline is None or time.time() < a.deadline - 30:
            print(json.dumps({k: v for k, v in import_baseline(out).items() if k.endswith("_s")}), flush=True)
        tele = work / "run" / "telemetry.jsonl"
        if tele.exists():
            shutil.copy(tele, out / "telemetry.jsonl")
        shutil.rmtree(work / "run" / "checkpoints", ignore_errors=True)   # 17 GB: the probe needs the room
    res = analyze(out)
    (out / "results.json").write_text(json.dumps(res, indent=1))
    print_table(res)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    sys.exit(main())
