"""Worker processes on this machine: starting one, naming it safely, finding the fleet's.

A process is identified by its pid *and* its start time: a pid alone may have been reused
by an unrelated process, which must never be signalled. Each worker carries stoker's labels
in its environment, which is how `scan_fleet` finds stranded ones.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
from collections.abc import Iterator, Mapping
from typing import Any, BinaryIO

import psutil

from stoker.domain.errors import RuntimeFailure

#: Environment labels that mark a process as one of stoker's workers.
LABEL_FLEET = "STOKER_FLEET"
LABEL_WORKER_ID = "STOKER_WORKER_ID"
LABEL_POOL = "STOKER_POOL"
LABEL_INSTANCE = "STOKER_INSTANCE"
LABEL_ENDPOINT = "STOKER_ENDPOINT"

#: Two start times this close are the same process: /proc reports them in clock ticks
#: (10 ms), and a reused pid belongs to a process started at least a tick later.
START_TIME_TOLERANCE_S = 0.005


def worker_environment(
    template_env: Mapping[str, str], labels: Mapping[str, str]
) -> dict[str, str]:
    """The environment of a worker: ours without STOKER_*, then the template's, then labels."""
    # The control plane's own STOKER_* settings (tokens among them) stay out of workers,
    # which may run tenant code; the template may still set any variable it needs.
    env = {k: v for k, v in os.environ.items() if not k.startswith("STOKER_")}
    env.update(template_env)
    env.update(labels)
    return env


def start_process(
    worker_id: str, argv: list[str], env: dict[str, str], cwd: str | None, log_dir: str | None
) -> int:
    """Fork and exec the worker in a session of its own; returns its pid.

    Output goes to `<log_dir>/<worker id>.log`, or nowhere. Raises `RuntimeFailure` when
    the process cannot be started.
    """
    log: BinaryIO | None = None
    try:
        if log_dir is not None:
            os.makedirs(log_dir, exist_ok=True)
            log = open(os.path.join(log_dir, f"{worker_id}.log"), "ab")  # noqa: SIM115
        out: BinaryIO | int = log if log is not None else subprocess.DEVNULL
        process = subprocess.Popen(
            argv,
            env=env,
            cwd=cwd,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT if log is not None else subprocess.DEVNULL,
            start_new_session=True,
        )
    except (OSError, ValueError, TypeError) as exc:
        # TypeError: an argv or environment value that is not a string.
        raise RuntimeFailure(f"cannot start worker {worker_id}: {exc}") from exc
    finally:
        # The child holds its own copy of the descriptor.
        if log is not None:
            log.close()
    # The runtime reaps its workers itself (pidfd + waitpid), also the ones it adopts and
    # the ones it leaves running at close; the Popen object must neither reap them nor
    # complain, when collected, that they still run.
    process.returncode = 0
    return process.pid


def free_port(host: str) -> int:
    """A port that was free a moment ago (the worker binds it right after)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
        return port


def authority(host: str, port: int) -> str:
    """`host:port`, with an IPv6 host in brackets."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def substitute(arg: str, substitutions: Mapping[str, str]) -> str:
    """`arg` with each placeholder replaced (plain replacement: other braces stay)."""
    for placeholder, value in substitutions.items():
        arg = arg.replace(placeholder, value)
    return arg


def identity(ref: Mapping[str, Any]) -> tuple[int, float] | None:
    """(pid, start time) from a runtime ref, or None when the ref does not name a process."""
    pid, start_time = ref.get("pid"), ref.get("start_time")
    if isinstance(pid, bool) or not isinstance(pid, int) or pid <= 0:
        return None
    if isinstance(start_time, bool) or not isinstance(start_time, int | float):
        return None
    return pid, float(start_time)


def same_start(a: float, b: float) -> bool:
    """True when two start times name the same process (see `START_TIME_TOLERANCE_S`)."""
    return abs(a - b) <= START_TIME_TOLERANCE_S


def is_same_process(pid: int, start_time: float) -> bool:
    """True while `pid` is alive and is the process started at `start_time`."""
    try:
        process = psutil.Process(pid)
        if not same_start(process.create_time(), start_time):
            return False
        if process.status() == psutil.STATUS_ZOMBIE:
            # Ended but not reaped (our own child): collect it, it is gone.
            reap(pid)
            return False
    except psutil.Error:
        return False
    return True


def reap(pid: int) -> int | None:
    """Collect the exit status of our own child: its exit code, or minus the signal that
    ended it. None for a non-child (its parent reaps it) or a child still running."""
    try:
        done, status = os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        return None
    return os.waitstatus_to_exitcode(status) if done else None


def how_it_ended(returncode: int | None) -> str:
    """An ended process's exit in words (`exited with code 3`, `killed by SIGSEGV`)."""
    if returncode is None:
        return "exited"
    if returncode >= 0:
        return f"exited with code {returncode}"
    try:
        return f"killed by {signal.Signals(-returncode).name}"
    except ValueError:
        return f"killed by signal {-returncode}"


def kill_quietly(pid: int) -> None:
    """SIGKILL and reap a child that was started a moment ago (never a reused pid)."""
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        return
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, 0)


def _live_workers(own_pid: int) -> Iterator[tuple[psutil.Process, dict[str, str]]]:
    """Each live process labelled as a worker (of any fleet) but this one, with its
    environment."""
    for pid in psutil.pids():
        if pid == own_pid:
            continue
        try:
            process = psutil.Process(pid)
            env = process.environ()
            if LABEL_WORKER_ID not in env or process.status() == psutil.STATUS_ZOMBIE:
                continue
        except psutil.Error:
            # Gone meanwhile, or another user's process: not one of ours either way.
            continue
        yield process, env


def scan_fleet(fleet: str, own_pid: int) -> list[tuple[int, float, dict[str, str]]]:
    """(pid, create time, environment) of every live process labelled with `fleet`."""
    found = []
    for process, env in _live_workers(own_pid):
        if env.get(LABEL_FLEET) != fleet:
            continue
        with contextlib.suppress(psutil.Error):  # gone meanwhile
            found.append((process.pid, process.create_time(), env))
    return found


def scan_workers(own_pid: int) -> set[str]:
    """The worker ids of every live process labelled as a worker, of any fleet."""
    return {env[LABEL_WORKER_ID] for _, env in _live_workers(own_pid)}


def lower_priority(pid: int, steps: int) -> None:
    """Make a process `steps` nicer than this one (no error when it cannot be done).

    A worker leads a session of its own, and with the kernel's autogroups (on by default
    on desktop and many server kernels) each session is scheduled as one group, against
    which a nice value inside the group counts for nothing: the group's nice is set too.
    """
    if steps <= 0:
        return
    with contextlib.suppress(OSError):
        os.setpriority(os.PRIO_PROCESS, pid, os.getpriority(os.PRIO_PROCESS, 0) + steps)
    own = _autogroup_nice("self")
    if own is not None:
        _set_autogroup_nice(pid, min(19, own + steps))


def restore_priority(pid: int) -> bool:
    """Give a process this one's priority (and autogroup nice) back; False when the system
    forbids it (raising a priority needs RLIMIT_NICE or CAP_SYS_NICE)."""
    try:
        os.setpriority(os.PRIO_PROCESS, pid, os.getpriority(os.PRIO_PROCESS, 0))
    except PermissionError:
        return False
    except OSError:
        return True  # gone: nothing to restore
    own = _autogroup_nice("self")
    return own is None or _set_autogroup_nice(pid, own)


def _autogroup_nice(pid: str) -> int | None:
    """The nice value of a process's autogroup; None without autogroups."""
    try:
        with open(f"/proc/{pid}/autogroup") as file:
            return int(file.read().split()[-1])
    except (OSError, ValueError, IndexError):
        return None


def _set_autogroup_nice(pid: int, nice: int) -> bool:
    try:
        with open(f"/proc/{pid}/autogroup", "w") as file:
            file.write(str(nice))
    except PermissionError:
        return False
    except OSError:
        return True
    return True


def is_sleeping(pid: int) -> bool | None:
    """True while a process sleeps (waits for a timer, a socket, a child), False while it
    runs or waits for the CPU or the disk; None once it is gone."""
    try:
        status = psutil.Process(pid).status()
    except psutil.Error:
        return None
    return status in (psutil.STATUS_SLEEPING, psutil.STATUS_IDLE)
