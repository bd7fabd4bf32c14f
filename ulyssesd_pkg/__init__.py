"""ulyssesd: a supervisor for multi-day DeepSpeed ZeRO-3 + Ulysses training runs."""

__version__ = "0.1.0"
