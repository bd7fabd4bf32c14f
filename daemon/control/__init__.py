"""The daemon's control socket (pause/resume/stop/restart/ack/status over a Unix socket), one concern a module:

- `protocol`: the wire format (one JSON line per request), its bounds, `parse_request`, the error answers and
  the `ControlError` family;
- `peers`: SO_PEERCRED credentials and the authorizer (root, the daemon's uid, allowed uids, the group);
- `paths`: where the daemon listens and where a client connects;
- `server`: `ControlServer`, polled by the main loop (the command handlers are the supervisor's);
- `client`: `send_request`, what ulyssesctl calls.
"""
