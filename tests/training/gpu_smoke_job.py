"""GPU smoke of the training job (not collected by pytest): run on a 2-GPU machine as

    python3 tests/training/gpu_smoke_job.py OUT_DIR [nproc]

Each case launches the real job under torchrun and prints a summary of its telemetry.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from train_job_helpers import tiny_spec  # noqa: E402

CASES = {
    "tiny-bf16-sp2": dict(precision={"dtype": "bf16", "fp32_layers": 1}, train={"device": "cuda", "steps": 6}),
    "tiny-fp16-sp2": dict(precision={"dtype": "fp16"}, train={"device": "cuda", "steps": 4}),
    "1b-8k-cudnn-ckpt": dict(model={"preset": "gpt-1b"}, precision={"dtype": "bf16"}, attention={"backend": "cudnn"},
                             train={"device": "cuda", "steps": 6, "seq_len": 8192, "activation_checkpoint_every": 1,
                                    "warmup_steps": 1}, checkpoint={"interval_steps": 3}),
    "1b-8k-auto": dict(model={"preset": "gpt-1b"}, precision={"dtype": "bf16"},
                       train={"device": "cuda", "steps": 4, "seq_len": 8192, "warmup_steps": 1},
                       checkpoint={"interval_steps": 100}),
    # Throughput probes: the `raise` fault at step 6 ends the run without the (large) final save.
    "1b-32k-auto-ckpt": dict(model={"preset": "gpt-1b"}, precision={"dtype": "bf16"},
                             train={"device": "cuda", "steps": 100, "seq_len": 32768, "warmup_steps": 1,
                                    "activation_checkpoint_every": 1},
                             checkpoint={"interval_steps": 1000}, faults=[{"kind": "raise", "at_step": 6}]),
    "1b-32k-auto": dict(model={"preset": "gpt-1b"}, precision={"dtype": "bf16"},
                        train={"device": "cuda", "steps": 100, "seq_len": 32768, "warmup_steps": 1},
                        checkpoint={"interval_steps": 1000}, faults=[{"kind": "raise", "at_step": 6}]),
}


def main() -> int:
    out = Path(sys.argv[1])
    nproc = sys.argv[2] if len(sys.argv) > 2 else "2"
    only = sys.argv[3].split(",") if len(sys.argv) > 3 else list(CASES)
    for name in only:
        run_dir = out / name
        run_dir.mkdir(parents=True, exist_ok=True)
        cfg = run_dir / "v1.json"
        case = dict(CASES[name])
        if nproc == "1":  # one GPU: no sequence parallelism (NCCL refuses two ranks on one device)
            case["parallel"] = {"sequence_parallel_size": 1}
        cfg.write_text(tiny_spec(**case).to_json())
        t0 = time.time()
        with open(out / f"{name}.log", "w") as log:
            rc = subprocess.call([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
                                  nproc, "-m", "ulyssesd.training", "--config", str(cfg), "--run-dir", str(run_dir)],
                                 stdout=log, stderr=subprocess.STDOUT, env=os.environ)
        recs = [json.loads(x) for x in (run_dir / "telemetry.jsonl").read_text().splitlines()] \
            if (run_dir / "telemetry.jsonl").exists() else []
        print(f"== {name}: rc={rc} wall={time.time() - t0:.1f}s")
        for r in recs:
            if r["kind"] == "step":
                print("  step", {k: r.get(k) for k in ("step", "loss", "grad_norm", "lr", "loss_scale", "skipped",
                                                       "step_time_max_s", "tokens_per_s", "mem_max_allocated_gib")})
            else:
                print("  event", r["event"], {k: v for k, v in r.items()
                                              if k not in ("v", "kind", "time", "attempt", "event")})
        if rc:
            print((out / f"{name}.log").read_text()[-3000:])
    return 0


if __name__ == "__main__":
    sys.exit(main())
