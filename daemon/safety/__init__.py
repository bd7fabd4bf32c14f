"""The daemon's safety nets, each a small module the supervisor's tick calls: its own store unwritable
(store_health), a job's death confirmed by more than one sign before it is called gone (liveness), a stop of a
hung job on the hang timescale (hung_stop), attempt logs bounded and read to their end (attempt_log), only regular files read among those a job or a user
controls, never a FIFO that would block (regular_file)."""
