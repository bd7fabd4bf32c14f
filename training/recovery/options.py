"""`[checkpoint]` keys of the host-memory tier, in-process restart and the save gate (docs/TRAINING.md
"Host-memory tier and in-process restart"). A base class of `training.spec.CheckpointSpec`, kept here so the
spec module stays about the job's other sections."""

from __future__ import annotations

from pydantic import BaseModel, Field, StrictBool, model_validator


class RecoveryOptions(BaseModel):
    memory_tier: StrictBool = Field(False, description="Keep the newest snapshot in host memory as a restorable, "
                                    "verified tag (one per rank, replaced by the next); rollbacks and in-process "
                                    "restarts load it when it is newer than the newest durable tag.")
    memory_interval_steps: int = Field(0, ge=0, le=1_000_000, strict=True,
                                       description="Also snapshot to host memory every N steps between disk saves "
                                       "(0: only at disk saves). Needs memory_tier.")
    in_process_restart: StrictBool = Field(False, description="A step that raises (on any rank, at any point), or "
                                           "ends with a non-finite loss, is dropped and the ranks restore the host "
                                           "tier in the same process (no disk read); one that raises after its collectives "
                                           "began on some ranks rebuilds the process group first. Needs memory_tier.")
    in_process_max_restarts: int = Field(3, ge=1, le=100, strict=True,
                                         description="In-process restarts per attempt; the next fault takes the "
                                         "usual path (crash / the daemon's rollback).")
    in_process_rebuild_timeout_s: float = Field(30.0, gt=0, le=3600, description="A step that failed after its "
                                                "collectives began: seconds every rank waits for the others to "
                                                "make the new process group before the fault takes the usual path "
                                                "(exit; the daemon relaunches from the host tier or disk).")
    memory_shm: StrictBool = Field(True, description="Also keep the host snapshot in shared memory (/dev/shm, "
                                   "with its manifest), so a relaunch after a process died resumes from it when it "
                                   "is newer than the newest durable tag (only with memory_tier).")
    memory_shm_max_gib: float = Field(64.0, gt=0, le=4096, description="Largest snapshot (GiB per rank) kept in "
                                      "shared memory; a larger one, or one /dev/shm has no room for, is skipped "
                                      "with a `memory_snapshot_shm` event saying why.")
    save_defer_max_steps: int = Field(0, ge=0, le=10_000, strict=True,
                                      description="Async saves: a save due while its snapshot memory is not ready "
                                      "(or the previous write still runs) moves up to N steps later instead of "
                                      "blocking; then it is taken as it is (0: never deferred, the saves keep "
                                      "their steps).")

    @model_validator(mode="after")
    def _needs_tier(self) -> RecoveryOptions:
        if self.memory_interval_steps and not self.memory_tier:
            raise ValueError(f"checkpoint.memory_interval_steps={self.memory_interval_steps} needs "
                             "checkpoint.memory_tier = true")
        if self.in_process_restart and not self.memory_tier:
            raise ValueError("checkpoint.in_process_restart = true needs checkpoint.memory_tier = true (it restores "
                             "from the host-memory tier)")
        return self
