"""Data pipeline figures: preprocessing throughput (MB/s of input text) and loader overhead per step.

    DS_ACCELERATOR=cpu .venv/bin/python bench/data_bench.py [--out bench/results/data_bench.json]

Preprocessing input: every `.py` file of the Python standard library (real, non-repeated text, one
document per file), tokenized with byte-level BPEs trained on the stdlib's docstrings (1024 and 32768
ids), with 1 and 2 worker processes. Loader: the time a step spends getting its batches, inline
(`data.prefetch = 0`) and with the prefetch thread (depth 2) while the "step" holds the main thread
for a fixed time (a sleep: on a GPU the loop mostly waits for kernels the same way).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import numpy as np

from ulyssesd.training.data.batches import DataCursor, SampleSource
from ulyssesd.training.data.loader import PrefetchLoader
from ulyssesd.training.data.preprocess import Options, preprocess, read_meta
from ulyssesd.training.data.tokenizer import train_bpe
from ulyssesd.training.spec import DataSpec

REPO = Path(__file__).resolve().parents[1]


def stdlib_sources(limit_bytes: int) -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    out, total = [], 0
    for p in sorted(root.rglob("*.py")):
        if "site-packages" in p.parts or "dist-packages" in p.parts:
            continue
        try:
            p.read_text(encoding="utf-8")
        except UnicodeDecodeError:  # a few test fixtures are Latin-1 on purpose
            continue
        out.append(p)
        total += p.stat().st_size
        if total >= limit_bytes:
            break
    return out


def _cpu_seconds() -> float:
    """CPU time of this process (all its threads) plus its finished worker processes."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def bench_preprocess(work: Path, inputs: list[Path], docstrings: Path) -> list[dict]:
    texts = [json.loads(line)["text"] for line in docstrings.read_text().splitlines()]
    rows = []
    for vocab in (1024, 32768):
        tok = work / f"tok{vocab}.json"
        t0 = time.perf_counter()
        train_bpe(texts, vocab, min_frequency=2).save(tok)
        train_s = time.perf_counter() - t0
        for workers in (1, 2):
            prefix = work / f"ds-{vocab}-{workers}"
            load_before = os.getloadavg()[0]
            cpu0 = _cpu_seconds()
            stats = preprocess(inputs, tok, prefix, Options(skip_empty=True), workers=workers, chunk_bytes=4 << 20)
            cpu = _cpu_seconds() - cpu0
            rows.append({"vocab_asked": vocab, "vocab": stats.vocab_size, "workers": workers,
                         "cpu_s": round(cpu, 2), "mb_per_cpu_s": round(stats.input_bytes / 1e6 / cpu, 2),
                         "loadavg_1min_before": round(load_before, 2), "input_mb": round(stats.input_bytes / 1e6, 2),
                         "documents": stats.documents, "tokens": stats.tokens, "seconds": round(stats.seconds, 3),
                         "mb_per_s": round(stats.mb_per_s, 2), "tokenizer_train_s": round(train_s, 2)})
            print(json.dumps(rows[-1]), flush=True)
    return rows


def bench_loader(prefix: Path, vocab: int) -> list[dict]:
    rows = []
    for micro, seq, step_ms in ((8, 128, 60.0), (4, 4096, 200.0), (1, 32768, 500.0)):
        src = SampleSource(DataSpec(kind="indexed", path=str(prefix)), seq, vocab, seed=1)
        for depth in (0, 2):
            cursor = DataCursor()
            loader = PrefetchLoader(src, cursor, 0, 1, micro, 1, depth=depth)
            waits = []
            try:
                for _ in range(40):
                    got = loader.next(cursor)
                    waits.append(got.wait_s)
                    time.sleep(step_ms / 1000)  # the step's compute
            finally:
                loader.close()
            w = waits[5:]  # after the first batches (thread start, cold pages)
            rows.append({"micro_batch": micro, "seq_len": seq, "step_ms": step_ms, "prefetch": depth,
                         "wait_ms_median": round(statistics.median(w) * 1e3, 4),
                         "wait_ms_max": round(max(w) * 1e3, 4),
                         "overhead_pct": round(100 * statistics.median(w) * 1e3 / step_ms, 4)})
            print(json.dumps(rows[-1]), flush=True)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "data_bench.json")
    ap.add_argument("--input-mb", type=float, default=24.0, help="stdlib source to tokenize (default 24 MB)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        docstrings = work / "stdlib.jsonl"
        subprocess.run([sys.executable, str(REPO / "examples/stdlib_text/make_corpus.py"), str(docstrings)],
                       check=True, capture_output=True)
        inputs = stdlib_sources(int(args.input_mb * 1e6))
        pre = bench_preprocess(work, inputs, docstrings)
        load = bench_loader(work / "ds-32768-2", read_meta(work / "ds-32768-2")["stats"]["vocab_size"])
    result = {"machine": f"{platform.node()} {platform.processor() or platform.machine()}, "
                         f"{os.cpu_count()} CPUs, Python {platform.python_version()}, numpy {np.__version__}",
              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "preprocess": pre, "loader": load}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
