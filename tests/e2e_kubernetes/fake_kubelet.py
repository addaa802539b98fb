"""A fake kubelet for the e2e tier: nodes whose pods are local processes.

Run as ``python fake_kubelet.py --server URL --token T --nodes a,b,c --workdir DIR``. It

- registers each node (Ready, with the given cpu/memory allocatable and 110 pods) and keeps
  it fresh: the Ready condition's heartbeat and the node's Lease in `kube-node-lease` are
  renewed every 10 s, as a kubelet does;
- lists and watches every pod, and runs each pod the scheduler binds to one of its nodes:
  the first container's command and args (with Kubernetes' ``$(VAR)`` expansion) as a
  local process in a session of its own, with the container's environment plus
  ``POD_IP``/``POD_NAME``/``POD_NAMESPACE``/``NODE_NAME``, on a loopback address of its
  own, 127.0.<node>.<n> (Linux answers on all of 127.0.0.0/8). A pod has no network
  namespace here, so an argument ``0.0.0.0`` (listen on all interfaces, which in a pod
  means the pod's own address) becomes the pod's IP;
- reports the pod Running with that IP at once (after ``e2e.stoker.dev/pull-seconds``
  in Pending/ContainerCreating when the pod carries that annotation: an image pull),
  and Ready once the container's first port accepts a connection (what a tcpSocket
  readiness probe would report); a process that exits makes the pod Succeeded or Failed
  (restartPolicy Never is all it supports);
- on a deletion with grace (deletionTimestamp set) sends SIGTERM, SIGKILL after the grace
  period, and then finishes the deletion with a DELETE of grace 0 (preconditioned on the
  pod's uid), as a kubelet does; a pod deleted at once loses its process at once.
  A container without a command (a pause container, the headroom placeholders) runs no
  process and is Ready at once.

What it does not model: no real kubelet (no pod lifecycle hooks, probes other than the
one above, restarts, init or sidecar containers, volumes, eviction under pressure,
static pods), no container engine or image pulls (the image is ignored, a pull is only
a wait; the command runs on this machine's Python and filesystem), no cgroups (requests
and limits are only what the scheduler sees), no CNI (no pod network, only loopback
addresses) and hence no NetworkPolicy enforcement, no node-lifecycle controller (a node
never turns NotReady).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import signal
import sys
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, BinaryIO

import httpx

HEARTBEAT_S = 10.0
WATCH_TIMEOUT = httpx.Timeout(10.0, read=330.0)
#: A pod annotated with this many seconds waits that long in ContainerCreating before its
#: process starts: an image pull, as the kubelet reports one.
PULL_SECONDS = "e2e.stoker.dev/pull-seconds"
LEASE_NAMESPACE = "kube-node-lease"
_VAR = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)")


def now() -> str:
    """RFC 3339, seconds: what Kubernetes' Time fields take."""
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def micro_now() -> str:
    """RFC 3339 with microseconds: what MicroTime fields (Lease renewTime) take."""
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def expand(arg: str, env: dict[str, str]) -> str:
    """Kubernetes' ``$(VAR)`` expansion of a command or argument ($$ escapes a $)."""
    if "$" not in arg:
        return arg
    parts = arg.split("$$")
    return "$".join(_VAR.sub(lambda m: env.get(m.group(1), m.group(0)), part) for part in parts)


@dataclass
class Running:
    """One pod this kubelet runs."""

    uid: str
    namespace: str
    name: str
    node: str
    ip: str
    proc: asyncio.subprocess.Process | None
    task: asyncio.Task[None] | None = None
    terminating: bool = False


@dataclass
class Kubelet:
    """The nodes, and the pods running on them."""

    client: httpx.AsyncClient
    nodes: list[str]
    cpu: str
    memory: str
    workdir: Path
    pods: dict[str, Running] = field(default_factory=dict)
    _next_ip: dict[str, int] = field(default_factory=dict)
    _done: set[str] = field(default_factory=set)
    _tasks: set[asyncio.Task[None]] = field(default_factory=set)

    def _background(self, coroutine: Any) -> None:
        task = asyncio.create_task(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # -- nodes ------------------------------------------------------------------------------

    def _node_ip(self, node: str) -> str:
        return f"127.0.{10 + self.nodes.index(node)}.1"

    def _conditions(self) -> list[dict[str, str]]:
        stamp = now()
        conditions = [
            {
                "type": kind,
                "status": "False",
                "reason": reason,
                "lastHeartbeatTime": stamp,
                "lastTransitionTime": stamp,
            }
            for kind, reason in (
                ("MemoryPressure", "KubeletHasSufficientMemory"),
                ("DiskPressure", "KubeletHasNoDiskPressure"),
                ("PIDPressure", "KubeletHasSufficientPID"),
            )
        ]
        conditions.append(
            {
                "type": "Ready",
                "status": "True",
                "reason": "KubeletReady",
                "lastHeartbeatTime": stamp,
                "lastTransitionTime": stamp,
            }
        )
        return conditions

    def _node_status(self, node: str) -> dict[str, Any]:
        resources = {"cpu": self.cpu, "memory": self.memory, "pods": "110"}
        return {
            "capacity": resources,
            "allocatable": resources,
            "conditions": self._conditions(),
            "addresses": [
                {"type": "InternalIP", "address": self._node_ip(node)},
                {"type": "Hostname", "address": node},
            ],
            "nodeInfo": {
                "kubeletVersion": "v1.20.2-fake",
                "operatingSystem": "linux",
                "architecture": "amd64",
                "containerRuntimeVersion": "fake://0",
                "kernelVersion": "",
                "osImage": "",
                "machineID": "",
                "systemUUID": "",
                "bootID": "",
                "kubeProxyVersion": "",
            },
        }

    async def register(self) -> None:
        """Create the nodes (or take over existing ones) and report them Ready."""
        for node in self.nodes:
            body = {
                "apiVersion": "v1",
                "kind": "Node",
                "metadata": {
                    "name": node,
                    "labels": {
                        "kubernetes.io/hostname": node,
                        "kubernetes.io/os": "linux",
                        "kubernetes.io/arch": "amd64",
                    },
                },
                "status": self._node_status(node),
            }
            response = await self.client.post("/api/v1/nodes", json=body)
            if response.status_code not in (201, 409):
                response.raise_for_status()
        await self.heartbeat()

    async def heartbeat(self) -> None:
        """Renew each node's Ready condition and its Lease."""
        for node in self.nodes:
            response = await self.client.patch(
                f"/api/v1/nodes/{node}/status",
                json={"status": self._node_status(node)},
                headers={"Content-Type": "application/merge-patch+json"},
            )
            response.raise_for_status()
            lease_path = f"/apis/coordination.k8s.io/v1/namespaces/{LEASE_NAMESPACE}/leases"
            spec = {
                "holderIdentity": node,
                "leaseDurationSeconds": 40,
                "renewTime": micro_now(),
            }
            response = await self.client.patch(
                f"{lease_path}/{node}",
                json={"spec": spec},
                headers={"Content-Type": "application/merge-patch+json"},
            )
            if response.status_code == 404:
                response = await self.client.post(
                    lease_path,
                    json={
                        "apiVersion": "coordination.k8s.io/v1",
                        "kind": "Lease",
                        "metadata": {"name": node, "namespace": LEASE_NAMESPACE},
                        "spec": spec,
                    },
                )
            if response.status_code >= 400 and response.status_code != 409:
                response.raise_for_status()

    async def keep_fresh(self) -> None:
        """Heartbeat forever; an unreachable API server is retried at the next beat."""
        while True:
            await asyncio.sleep(HEARTBEAT_S)
            with contextlib.suppress(httpx.HTTPError):
                await self.heartbeat()

    # -- pods -------------------------------------------------------------------------------

    async def watch_pods(self) -> None:
        """List and watch every pod; act on those bound to our nodes. Relists after any
        end of the watch (410 Gone, API server restart, timeout)."""
        while True:
            try:
                response = await self.client.get("/api/v1/pods")
                response.raise_for_status()
                listing = response.json()
                seen = set()
                for pod in listing["items"]:
                    seen.add(pod["metadata"]["uid"])
                    self.observe(pod)
                for uid in list(self.pods):
                    if uid not in seen:
                        self.gone(uid)
                version = listing["metadata"]["resourceVersion"]
                params = {"watch": "1", "resourceVersion": version, "timeoutSeconds": "300"}
                # Only the watch may be silent for long; a list or a patch that hangs (on
                # an API server that is shutting down) is given up after 10 s.
                async with self.client.stream(
                    "GET", "/api/v1/pods", params=params, timeout=WATCH_TIMEOUT
                ) as stream:
                    async for line in stream.aiter_lines():
                        if not line:
                            continue
                        event = json.loads(line)
                        if event["type"] == "ERROR":
                            break
                        pod = event["object"]
                        if event["type"] == "DELETED":
                            self.gone(pod["metadata"]["uid"])
                        else:
                            self.observe(pod)
            except (httpx.HTTPError, ValueError, KeyError) as exc:
                print(f"{now()} fake_kubelet: watch ended: {exc!r}", flush=True)
                await asyncio.sleep(0.5)

    def observe(self, pod: dict[str, Any]) -> None:
        """React to one pod's current state."""
        meta, spec = pod["metadata"], pod.get("spec", {})
        node = spec.get("nodeName")
        uid = meta["uid"]
        if node not in self.nodes:
            return
        running = self.pods.get(uid)
        if meta.get("deletionTimestamp"):
            grace = int(meta.get("deletionGracePeriodSeconds") or 0)
            if running is None:
                if uid not in self._done:
                    self._done.add(uid)
                    self._background(self.finish_deletion(meta, None, grace))
            elif not running.terminating:
                running.terminating = True
                self._background(self.finish_deletion(meta, running, grace))
            return
        phase = pod.get("status", {}).get("phase")
        if running is None and uid not in self._done and phase not in ("Succeeded", "Failed"):
            self.start(pod, node)

    def gone(self, uid: str) -> None:
        """The pod is deleted: its process goes at once."""
        running = self.pods.pop(uid, None)
        self._done.add(uid)
        if running is not None and running.proc is not None:
            kill(running.proc, signal.SIGKILL)

    def _allocate_ip(self, node: str) -> str:
        index = self.nodes.index(node)
        taken = {p.ip for p in self.pods.values()}
        for _ in range(253):
            n = self._next_ip.get(node, 1) % 253 + 1
            self._next_ip[node] = n
            ip = f"127.0.{10 + index}.{n + 1}"
            if ip not in taken:
                return ip
        raise RuntimeError(f"node {node} has no loopback address left")

    def start(self, pod: dict[str, Any], node: str) -> None:
        """Run the pod's first container as a local process."""
        meta, spec = pod["metadata"], pod["spec"]
        ip = self._allocate_ip(node)
        running = Running(
            uid=meta["uid"],
            namespace=meta["namespace"],
            name=meta["name"],
            node=node,
            ip=ip,
            proc=None,
        )
        self.pods[running.uid] = running
        pull_s = float((meta.get("annotations") or {}).get(PULL_SECONDS, 0))
        running.task = asyncio.create_task(self.run(running, spec["containers"][0], pull_s))

    def _log_file(self, running: Running) -> BinaryIO:
        log_dir = self.workdir / "pods"
        log_dir.mkdir(parents=True, exist_ok=True)
        return open(log_dir / f"{running.namespace}_{running.name}.log", "ab")

    async def run(self, running: Running, container: dict[str, Any], pull_s: float) -> None:
        """Pull (wait `pull_s`), start the process, report Running and Ready, then its end."""
        if pull_s > 0:
            await self.report(running, "Pending", ready=False, waiting="ContainerCreating")
            await asyncio.sleep(pull_s)
            if running.terminating or running.uid not in self.pods:
                return
        env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "HOME": os.environ.get("HOME", "/"),
            "POD_IP": running.ip,
            "POD_NAME": running.name,
            "POD_NAMESPACE": running.namespace,
            "NODE_NAME": running.node,
            "HOSTNAME": running.name,
        }
        for var in container.get("env") or []:
            env[var["name"]] = expand(var.get("value", ""), env)
        argv = [
            running.ip if arg == "0.0.0.0" else expand(arg, env)
            for arg in [*(container.get("command") or []), *(container.get("args") or [])]
        ]
        ports = [p["containerPort"] for p in container.get("ports") or []]
        started = now()
        if argv:
            with self._log_file(running) as log:
                try:
                    running.proc = await asyncio.create_subprocess_exec(
                        *argv,
                        env=env,
                        stdin=asyncio.subprocess.DEVNULL,
                        stdout=log,
                        stderr=log,
                        start_new_session=True,
                    )
                except OSError as exc:
                    await self.report(
                        running, "Failed", ready=False, exit_code=127, reason=str(exc)
                    )
                    return
        await self.report(running, "Running", ready=not argv or not ports, started=started)
        if running.proc is None:
            return
        if ports:
            # Probed every 50 ms at first, then less often: a pod that never listens
            # (a test's sleeping container) costs little.
            waiter = asyncio.create_task(running.proc.wait())
            period = 0.05
            while not waiter.done():
                if await accepts(running.ip, ports[0]):
                    await self.report(running, "Running", ready=True, started=started)
                    break
                await asyncio.wait({waiter}, timeout=period)
                period = min(period * 1.5, 0.5)
        code = await running.proc.wait()
        if running.terminating or running.uid not in self.pods:
            return
        await self.report(
            running, "Succeeded" if code == 0 else "Failed", ready=False, exit_code=code
        )

    async def report(
        self,
        running: Running,
        phase: str,
        *,
        ready: bool,
        started: str | None = None,
        exit_code: int | None = None,
        reason: str | None = None,
        waiting: str | None = None,
    ) -> None:
        """Patch the pod's status (retried while the API server is away)."""
        stamp = now()
        flag = "True" if ready else "False"
        if waiting is not None:
            state: dict[str, Any] = {"waiting": {"reason": waiting}}
        elif exit_code is None:
            state = {"running": {"startedAt": started or stamp}}
        else:
            state = {
                "terminated": {
                    "exitCode": exit_code,
                    "reason": "Completed" if exit_code == 0 else "Error",
                    "message": reason or "",
                    "finishedAt": stamp,
                }
            }
        status = {
            "phase": phase,
            "hostIP": self._node_ip(running.node),
            "podIP": running.ip,
            "podIPs": [{"ip": running.ip}],
            "startTime": started or stamp,
            "conditions": [
                {"type": "Initialized", "status": "True", "lastTransitionTime": stamp},
                {"type": "Ready", "status": flag, "lastTransitionTime": stamp},
                {"type": "ContainersReady", "status": flag, "lastTransitionTime": stamp},
                {"type": "PodScheduled", "status": "True", "lastTransitionTime": stamp},
            ],
            "containerStatuses": [
                {
                    "name": "worker",
                    "ready": ready,
                    "restartCount": 0,
                    "image": "fake",
                    "imageID": "",
                    "state": state,
                }
            ],
        }
        path = f"/api/v1/namespaces/{running.namespace}/pods/{running.name}/status"
        for attempt in range(600):
            if running.uid not in self.pods:
                return
            try:
                response = await self.client.patch(
                    path,
                    json={"metadata": {"uid": running.uid}, "status": status},
                    headers={"Content-Type": "application/merge-patch+json"},
                )
            except httpx.HTTPError:
                await asyncio.sleep(min(0.1 * 2**attempt, 2.0))
                continue
            if response.status_code in (404, 409, 422):
                return  # gone, or another pod of that name now
            if response.status_code < 400:
                return
            await asyncio.sleep(min(0.1 * 2**attempt, 2.0))

    async def finish_deletion(
        self, meta: dict[str, Any], running: Running | None, grace: int
    ) -> None:
        """Stop the process within `grace` seconds, then remove the pod for good."""
        if running is not None and running.proc is not None and running.proc.returncode is None:
            kill(running.proc, signal.SIGTERM)
            try:
                await asyncio.wait_for(running.proc.wait(), timeout=max(grace, 0))
            except TimeoutError:
                kill(running.proc, signal.SIGKILL)
                await running.proc.wait()
        path = f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}"
        body = {
            "apiVersion": "v1",
            "kind": "DeleteOptions",
            "gracePeriodSeconds": 0,
            "preconditions": {"uid": meta["uid"]},
        }
        for attempt in range(600):
            try:
                response = await self.client.request("DELETE", path, json=body)
            except httpx.HTTPError:
                await asyncio.sleep(min(0.1 * 2**attempt, 2.0))
                continue
            if response.status_code < 500:
                break
            await asyncio.sleep(min(0.1 * 2**attempt, 2.0))
        self.pods.pop(meta["uid"], None)
        self._done.add(meta["uid"])

    def shutdown(self) -> None:
        """Kill every process (the pods stay as they are in the API)."""
        for running in self.pods.values():
            if running.proc is not None:
                kill(running.proc, signal.SIGKILL)


def kill(proc: asyncio.subprocess.Process, sig: int) -> None:
    """Signal the process's whole session (a worker may have children)."""
    if proc.returncode is not None:
        return
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, sig)


async def accepts(host: str, port: int) -> bool:
    """True when `host:port` accepts a TCP connection now."""
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout=1.0)
    except (OSError, TimeoutError):
        return False
    writer.close()
    with contextlib.suppress(OSError):
        await writer.wait_closed()
    return True


async def main(argv: list[str]) -> None:
    """Parse the arguments and run the kubelet until SIGTERM or SIGINT."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--server", required=True)
    parser.add_argument("--token", required=True)
    parser.add_argument("--nodes", required=True, help="comma-separated node names")
    parser.add_argument("--cpu", default="4")
    parser.add_argument("--memory", default="8Gi")
    parser.add_argument("--workdir", type=Path, required=True)
    args = parser.parse_args(argv)
    args.workdir.mkdir(parents=True, exist_ok=True)
    client = httpx.AsyncClient(
        base_url=args.server,
        verify=False,
        headers={"Authorization": f"Bearer {args.token}"},
        timeout=10.0,
    )
    kubelet = Kubelet(
        client=client,
        nodes=args.nodes.split(","),
        cpu=args.cpu,
        memory=args.memory,
        workdir=args.workdir,
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await kubelet.register()
    print(f"{now()} fake_kubelet: nodes registered", flush=True)
    tasks = [asyncio.create_task(kubelet.keep_fresh()), asyncio.create_task(kubelet.watch_pods())]
    await stop.wait()
    for task in tasks:
        task.cancel()
    kubelet.shutdown()
    await client.aclose()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1:]))
