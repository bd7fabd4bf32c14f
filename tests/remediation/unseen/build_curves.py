"""Build tests/remediation/unseen/curves/*.json: real loss rows copied by hand from public issue threads on 2026-12-03
(the unseen round; the format of tests/fixtures/replay/real/README.md). Every row is a published row; conversions
(step time from timestamps or wall clock) are said in each file's `source.what`. Rows where a thread printed no step
number use the row number. The split is not stored here: it is drawn with the round's seed (unseen_round.py).
"""
import json
from pathlib import Path

OUT = Path(__file__).resolve().parent / "curves"
C = []


def add(id, kind, incident, onset, url, what, rows, job=None, notes=""):
    C.append(dict(id=id, kind=kind, incident=incident, onset_step=onset, source=dict(url=url, what=what),
                  job=job or {}, notes=notes, records=rows))


def r(step, loss, **kw):
    d = {"kind": "step", "step": step, "loss": loss}
    d.update({k: v for k, v in kw.items() if v is not None})
    return d


# ---------------------------------------------------------------- incidents (NaN)
ym = [(76930, 2.6496577), (76940, 2.59109), (76950, 2.596339), (76960, 2.735384), (76970, 2.6265104),
      (76980, "nan"), (76990, "nan"), (77000, "nan"), (77010, "nan")]
add("yanmtt-7-bart-fp16-nan", "incident", "nan", 76980, "https://github.com/prajdabre/yanmtt/issues/7",
    "BART pre-training with --fp16, rows 'STEP LOSS' every 10 steps, 76930-77010 (a checkpoint save/load between 76990 "
    "and 77000). Loss nan from 76980; the maintainer: the same fp16 issue, use a smaller LR or fp32.",
    [r(s, loss) for s, loss in ym], job={"precision.dtype": "fp16"})

bp = [(1, 45.729, "05:44:02,294"), (2, 46.012, "05:44:02,654"), (3, 45.780, "05:44:03,550"), (4, 60.220, "05:44:04,426"),
      (5, 61.163, "05:44:05,311"), (6, 70.405, "05:44:06,251"), (7, "nan", "05:44:07,141"), (8, "nan", "05:44:07,971"),
      (9, "nan", "05:44:08,882")]


def _secs(ts):
    h, m, s = ts.replace(",", ".").split(":")
    return int(h) * 3600 + int(m) * 60 + float(s)


add("byteps-411-mxnet-fp16-nan", "incident", "nan", 7, "https://github.com/bytedance/byteps/issues/411",
    "MXNet 1.8 fp16 ResNet-50 with BytePS, rows 'Epoch[1] Batch[N] Speed: ... IDLoss=X', batches 1-9 (step = batch; "
    "step time = difference of the row timestamps). IDLoss rises 45.7 -> 70.4, then nan from batch 7; fp32 has no nan.",
    [r(s, loss, step_time_s=(round(_secs(t) - _secs(bp[i - 1][2]), 3) if i else None))
     for i, (s, loss, t) in enumerate(bp)], job={"precision.dtype": "fp16"})

st = [("15:29:33", 1.10886), ("15:31:41", 1.53702), ("15:33:53", 0.866067), ("15:36:03", 1.32708), ("15:38:15", 1.20029),
      ("15:40:22", "nan"), ("15:42:27", "nan"), ("15:44:38", "nan"), ("15:46:45", "nan"), ("15:48:54", "nan")]
add("sequence-tagging-47-lr-nan", "incident", "nan", 6, "https://github.com/guillaumegenthial/sequence_tagging/issues/47",
    "'INFO: train loss:X' rows with lr 0.01/0.1 (step = row number; step time = difference of the row timestamps, s). "
    "The loss swings 0.87-1.54, then nan from row 6; lr 0.001 has no problem.",
    [r(i + 1, loss, step_time_s=(_secs(t) - _secs(st[i - 1][0]) if i else None)) for i, (t, loss) in enumerate(st)])

# ---------------------------------------------------------------- healthy
lf = [(1.7319, 0.547949492931366), (1.7129, 0.7897462844848633), (1.8102, 0.8784598112106323),
      (1.787, 0.6685737371444702), (1.8175, 0.6903296709060669), (1.7414, 0.7967870831489563)]
add("llamafactory-3529-pretrain-hf-rows", "healthy", None, None, "https://github.com/hiyouga/LlamaFactory/issues/3529",
    "HF Trainer rows {'loss', 'grad_norm', 'learning_rate', 'epoch'} at epochs 1.42-1.74 of a pre-training run (step = "
    "row number). The thread is about the model's generations; the loss hovers 1.71-1.82 (+-3 %).",
    [r(i + 1, loss, grad_norm=g) for i, (loss, g) in enumerate(lf)])

tc = [(1, 5.2557, 1.36), (2, 5.40362, 2.22), (3, 5.45125, 3.17), (4, 5.49206, 4.03), (5, 5.57774, 4.97),
      (6, 5.62333, 5.84), (10, 5.40187, 9.41)]
add("turicreate-2771-first-iterations", "healthy", None, None, "https://github.com/apple/turicreate/issues/2771",
    "Object detector table 'Iteration | Loss | Elapsed Time', iterations 1-6 and 10 (step time = difference of the "
    "elapsed times, per iteration). The maintainer: 'This is correct behavior'; the loss drifts 5.26 -> 5.62 -> 5.40 in "
    "the first iterations.",
    [r(s, loss, step_time_s=(round((e - tc[i - 1][2]) / (s - tc[i - 1][0]), 3) if i else None))
     for i, (s, loss, e) in enumerate(tc)])

hv = [0.449658, 0.504039, 0.627796, 0.405917, 0.597174, 0.488670, 0.264431, 0.654959, 0.554720, 0.443470, 0.458032,
      0.319679]
add("horovod-2255-mnist-per-batch-noise", "healthy", None, None, "https://github.com/horovod/horovod/issues/2255",
    "Horovod PyTorch MNIST rows 'Train Epoch: 1 [N/60000 (P%)] Loss: X', samples 52480-59520 (step = N / 640, the "
    "log interval). Per-batch loss noise 0.26-0.65; the run later ends in a DataLoader shm bus error, not a loss problem.",
    [r(82 + i, loss) for i, loss in enumerate(hv)])

fs = [(445, 11.521, 882), (495, 11.346, 973), (545, 11.186, 1065), (595, 11.039, 1156), (645, 10.902, 1263),
      (695, 10.776, None)]
add("fairseq-940-transformer-early-updates", "healthy", None, None, "https://github.com/facebookresearch/fairseq/issues/940",
    "fairseq rows '| epoch 001: N / 1891 loss=X, ..., num_updates=U, ..., loss_scale=2.000, wall=W', updates 445-695 "
    "(step = num_updates; step time = difference of wall / 50 updates; the 695 row is cut before its wall). The loss "
    "falls steadily 11.52 -> 10.78 (a validation pass between 595 and 645).",
    [r(u, loss, loss_scale=2.0, step_time_s=(round((fs[i + 1][2] - w) / 50, 3) if w and i + 1 < len(fs) and fs[i + 1][2]
                                            else None))
     for i, (u, loss, w) in enumerate(fs)], job={"precision.dtype": "fp16"})

f3 = [(10, 2000, 1.27), (10, 3000, 1.28), (10, 4000, 0.91), (10, 5000, 0.95), (10, 6000, 1.56), (10, 7000, 0.86),
      (10, 8000, 1.33), (11, 1000, 1.89), (11, 2000, 1.37), (11, 3000, 0.75)]
add("fairseq-301-per-1000-updates-noise", "healthy", None, None, "https://github.com/facebookresearch/fairseq/issues/301",
    "fairseq rows '| epoch E  N / 8223 loss=X (running avg), ...', epochs 10-11 (step = (E - 1) * 8223 + N). The "
    "per-row loss swings 0.75-1.89 (+-40 %) while the running average falls 1.50 -> 1.35; the thread is about speed.",
    [r((e - 1) * 8223 + n, loss) for e, n, loss in f3])

add("nanotron-390-steady-iterations", "healthy", None, None, "https://github.com/huggingface/nanotron/issues/390",
    "nanotron rows 'iteration: N / 378950 | elapsed_time_per_iteration_ms: 11.5K | ... | lm_loss: X | grad_norm: G', "
    "iterations 327281-327284 (step time 11.5 s). The thread asks about the log format.",
    [r(327281 + i, loss, step_time_s=11.5, grad_norm=g)
     for i, (loss, g) in enumerate([(2.38, 1.25), (2.35, 1.22), (2.51, 1.21), (2.36, 1.18)])])

add("streammapnet-37-loss-falls-grad-norm-high", "healthy", None, None,
    "https://github.com/yuantianyuan01/StreamMapNet/issues/37",
    "mmdet rows 'Iter [N/15000] ... time: T, ... total: X, grad_norm: G', iterations 100-300 (step time = time). The "
    "thread worries about the large grad norm; the total loss falls 51.8 -> 31.7 -> 32.3.",
    [r(100, 51.7671, step_time_s=0.569, grad_norm=117.7429), r(200, 31.6701, step_time_s=0.561, grad_norm=79.9597),
     r(300, 32.2995, step_time_s=0.564, grad_norm=94.7493)])

if __name__ == "__main__":
    OUT.mkdir(exist_ok=True)
    for c in C:
        (OUT / f"{c['id']}.json").write_text(json.dumps(c, indent=1) + "\n")
    print(f"wrote {len(C)} curves to {OUT}")
