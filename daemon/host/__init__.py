"""Host integration: the OS seam (processes, signals, psutil), locks, systemd sd_notify, Prometheus metrics, alerts, logging, host OOM and disk checks."""
