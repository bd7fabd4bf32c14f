"""The daemon's control socket server (pause/resume/stop/restart/ack/status over a Unix socket)."""
