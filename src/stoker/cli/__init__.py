"""The `stoker` command: serve, claim, release, claims, workers, pools, status, config,
scaletest, worker-check, version.

`serve` runs the control plane and its HTTP API; `config check` validates a config file
as `serve` would; `scaletest` runs it against a simulated cluster in virtual time
(`stoker.sim`); `worker-check` checks a worker command against the worker protocol
(`stoker.worker_check`); the other commands are clients of a running server (through the
SDK), found at `--url` / `$STOKER_URL` (default http://127.0.0.1:8080) with `--token` /
`$STOKER_TOKEN` (before the command or after it), and print a table, or with `--json` the
server's JSON. One grammar: every list is `NOUN list`; seconds are named as the API names
them (`--lease-s`, `--ttl-s`, `--timeout-s`); `-c`/`--config` is always the config file.
Every failure is one line on stderr and a non-zero exit status (2 for bad usage, 1 for
everything else), never a traceback.
"""

from stoker.cli.app import app, main

__all__ = ["app", "main"]
