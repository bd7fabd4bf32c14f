"""Checkpoint library: manifests, validation, quarantine, `latest`, retention, disk guard, durable saves.

Pure Python on the directories DeepSpeed writes (no engine calls), so the daemon can use it too:

    {ckpt_dir}/latest                      DeepSpeed's pointer (tag name, no newline)
    {ckpt_dir}/step-00000100/              one tag dir: mp_rank_00_model_states.pt, zero_pp_rank_*_optim_states.pt
    {ckpt_dir}/step-00000100/manifest.json written LAST and atomically: a tag without a valid manifest does
                                           not exist for resume (a crash mid-save leaves a partial dir)
    {ckpt_dir}/step-00000050.corrupt-1764444444   a quarantined tag (renamed, never deleted)

The manifest records every file's size and sha256, so truncation and bit flips are caught before
DeepSpeed loads (or half-loads) a bad tag. All ranks' files must be complete before rank 0 writes it
(barrier after `save_checkpoint`), and the directory must be visible to rank 0 (shared filesystem).

Modules: `files` (tags, manifests, validation, quarantine, `latest`), `retention` (what to keep, pruning,
disk guard, known-good anchors), `budget` (the directory's one budget: every entry in a category, the order
room is made in, the job's check before a save; docs/CHECKPOINT_DISK.md), `rollback_guard` (a decided
rollback until its relaunch: its target kept, the tags after its onset never used), `saving` (failed-write descriptions, the asynchronous writer), `snapshot`
(its host-memory copies, pinned buffers and registered snapshot pool), `shard_io` (how it writes one shard: hash on the way, O_DIRECT), `digests` (the writer's digest mode, manifest v3's
`chunk_list_sha256`, the streaming check of a file against its entry). The package
namespace is the public import path the daemon, `ulyssesctl` and `ulyssesd.client.manifest` use
(`from ulyssesd.training import checkpoint as ck`), so it re-exports the modules' public names.
"""

from __future__ import annotations

from .files import (
    DEFAULT_VERIFY_THREADS,
    DELETING_PREFIX,
    DIGEST_CHUNK_BYTES,
    HASH_CHUNK,
    LATEST_NAME,
    MANIFEST_NAME,
    MANIFEST_VERSION,
    QUARANTINE_RE,
    TAG_RE,
    ManifestError,
    digest_file,
    latest_valid_tag,
    list_quarantined,
    list_tags,
    list_valid_tags,
    manifest_bytes,
    point_latest_to,
    quarantine,
    read_latest,
    read_manifest,
    sha256_file,
    step_of_tag,
    tag_for_step,
    validate_tag,
    verify_checksums_parallel,
    write_manifest,
)
from .retention import (
    bytes_free,
    disk_guard,
    known_good,
    known_good_tags,
    prune,
    prune_for_space,
    retention_plan,
    tag_bytes,
)
from .saving import (
    COMMIT_POLL_S,
    DONE_PREFIX,
    NO_SPACE_ERRNOS,
    AsyncCheckpointWriter,
    AsyncSaveError,
    commit_when_durable,
    errno_name,
    filesystem_errno,
    is_write_error,
    save_failure,
)
from .shard_io import durable_torch_save, write_shard, write_shard_direct
from .snapshot import (
    CudaHostRegistrar,
    HostRegistrar,
    PinnedPool,
    SnapshotPool,
    engine_snapshot_bytes,
    host_snapshot,
    snapshot_pool_bytes,
    tag_snapshot_bytes,
)

__all__ = [
    "AsyncCheckpointWriter",
    "AsyncSaveError",
    "CudaHostRegistrar",
    "HostRegistrar",
    "COMMIT_POLL_S",
    "DEFAULT_VERIFY_THREADS",
    "DELETING_PREFIX",
    "DIGEST_CHUNK_BYTES",
    "DONE_PREFIX",
    "HASH_CHUNK",
    "LATEST_NAME",
    "MANIFEST_NAME",
    "MANIFEST_VERSION",
    "ManifestError",
    "NO_SPACE_ERRNOS",
    "PinnedPool",
    "SnapshotPool",
    "QUARANTINE_RE",
    "TAG_RE",
    "bytes_free",
    "commit_when_durable",
    "digest_file",
    "disk_guard",
    "durable_torch_save",
    "engine_snapshot_bytes",
    "errno_name",
    "filesystem_errno",
    "host_snapshot",
    "is_write_error",
    "known_good",
    "known_good_tags",
    "latest_valid_tag",
    "list_quarantined",
    "list_tags",
    "list_valid_tags",
    "manifest_bytes",
    "point_latest_to",
    "prune",
    "prune_for_space",
    "quarantine",
    "read_latest",
    "read_manifest",
    "retention_plan",
    "save_failure",
    "sha256_file",
    "snapshot_pool_bytes",
    "step_of_tag",
    "tag_bytes",
    "tag_for_step",
    "tag_snapshot_bytes",
    "validate_tag",
    "verify_checksums_parallel",
    "write_manifest",
    "write_shard",
    "write_shard_direct",
]
