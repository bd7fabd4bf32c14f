# Sourced by bench/gpu_call*.sh on the lent H200 machine (or on the CPU with BENCH_CPU=1 for a dry run).
# Installs the wheels carried in .whl/, sets the NVLS variables, and defines the deadline of this call.
set -u
T0=$(date +%s)
: "${OUT:=/tmp/bench-out}"; mkdir -p "$OUT"
: "${CALL_BUDGET_S:=540}"           # stop starting work after this many seconds of the device call
DEADLINE=$((T0 + CALL_BUDGET_S))
if [ -z "${BENCH_CPU:-}" ]; then
  # Once per machine: a later command (polling a background job) must not replace what that job imports.
  WHL_STAMP=$(ls .whl | md5sum | cut -d' ' -f1)
  if [ "$(cat /tmp/site/.whl-stamp 2>/dev/null)" != "$WHL_STAMP" ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
      > "$OUT/pip.log" 2>&1 || { tail -20 "$OUT/pip.log"; exit 1; }
    echo "$WHL_STAMP" > /tmp/site/.whl-stamp
  fi
  export PYTHONPATH=/tmp/site
  PY=python3
  nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,driver_version --format=csv > "$OUT/gpu.txt" 2>&1
else
  PY=${PY:-/work/main/.venv/bin/python}
  export DS_ACCELERATOR=cpu
fi
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export BENCH_WORKDIR=/tmp/ulysses-bench
# The package maps ulyssesd.* onto top-level folders (pyproject package-dir); without an installed wheel, a
# shim of symlinks makes `python -m ulyssesd.training` run this checkout's code (what the call carried).
# Every package of pyproject's package-dir is linked (a new top-level package needs no edit here).
shim_ulyssesd() {  # shim_ulyssesd DIR: DIR/ulyssesd/... -> this checkout's folders (kept when it already is)
  [ "$(readlink "$1/ulyssesd/training" 2>/dev/null)" = "$(pwd -P)/training" ] && return 0
  rm -rf "$1" && mkdir -p "$1" && $PY - "$1" <<'PYEOF'
import pathlib, sys, tomllib
shim, root = pathlib.Path(sys.argv[1]), pathlib.Path.cwd()
dirs = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
(shim / "ulyssesd").mkdir()
for f in (root / dirs["ulyssesd"]).glob("*.py"):
    (shim / "ulyssesd" / f.name).symlink_to(f)
for pkg, folder in dirs.items():
    if pkg != "ulyssesd":
        (shim / pkg.replace(".", "/")).symlink_to(root / folder)
PYEOF
}
if ! $PY -c "import ulyssesd.training.train" 2>/dev/null; then
  SHIM=/tmp/ulyssesd-shim; shim_ulyssesd "$SHIM" || { echo "shim of ulyssesd failed" >&2; exit 1; }
  export PYTHONPATH="$SHIM${PYTHONPATH:+:$PYTHONPATH}"
  # Fail the call at once (not once per case) when the product cannot be imported.
  $PY -c "import ulyssesd.training.train, ulyssesd.training.model.gpt" || { echo "ulyssesd not importable" >&2; exit 1; }
fi
$PY -c "import torch, deepspeed; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'deepspeed', deepspeed.__version__)" \
  > "$OUT/versions.txt" 2>/dev/null
cat "$OUT/versions.txt"
bench() {  # bench CASE... -> appends JSON lines to $OUT/bench.jsonl
  $PY bench/gpu_bench.py --base "${BASE:-configs/gpt-7b-2xh200.toml}" --nproc "${NPROC:-2}" \
      --out "$OUT/bench.jsonl" --deadline "${BENCH_DEADLINE:-$DEADLINE}" "$@"
}
collect_logs() {  # copy each case's log tail + telemetry (small) into $OUT
  for d in "$BENCH_WORKDIR"/*/; do
    n=$(basename "$d"); mkdir -p "$OUT/cases/$n"
    [ -f "$d/log.txt" ] && tail -c 20000 "$d/log.txt" > "$OUT/cases/$n/log_tail.txt"
    [ -f "$d/telemetry.jsonl" ] && cp "$d/telemetry.jsonl" "$OUT/cases/$n/"
    [ -f "$d/spec.toml" ] && cp "$d/spec.toml" "$OUT/cases/$n/"
    cp "$d"/profile-rank*.txt "$OUT/cases/$n/" 2>/dev/null
  done
  # The device tool brings back only a few files: one tarball of all cases.
  tar czf "$OUT/cases.tgz" -C "$OUT" cases && rm -rf "$OUT/cases"
}
