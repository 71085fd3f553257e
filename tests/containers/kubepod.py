"""A Kubernetes pod from a manifest, run on one host's Docker as closely as that allows.

What is taken from the manifest as written: each container's command and args (Kubernetes'
`command` replaces the image's ENTRYPOINT, `args` its CMD), env, ports, volume mounts,
securityContext's user and group, terminationGracePeriodSeconds (docker stop's timeout: SIGTERM
to the container's PID 1, SIGKILL after it) and the three HTTP probes, run the kubelet's way:
from the node against the pod's IP, startupProbe first and alone, then livenessProbe and
readinessProbe, each every periodSeconds with its timeoutSeconds (default 1 s), success being a
status in 200..399, failureThreshold consecutive failures deciding.

What a local runtime changes: the pod's network (and IPC) namespace is a "pause" container's,
which every container joins (`--network container:`), as the kubelet does with its sandbox;
an emptyDir is a Docker volume (tmpfs for `medium: Memory`, mode 0777 as the kubelet makes it);
a persistentVolumeClaim is a host directory the caller names; the image is a local one the
caller names for the manifest's; `nvidia.com/gpu` becomes `--gpus N` on a GPU host and, on a
host without GPUs, is dropped with VLAUNCH_DEVICE set to cpu. A container the kubelet would
restart (a failed startup or liveness probe) is recorded, not restarted.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from tests.containers.dockerlib import docker, http, ip_of


@dataclass
class Probe:
    """One httpGet probe of a container, with the kubelet's defaults."""

    kind: str
    path: str
    port: int
    period: float = 10.0
    timeout: float = 1.0
    failures: int = 3
    delay: float = 0.0

    @classmethod
    def of(cls, kind: str, spec: dict[str, Any], ports: dict[str, int]) -> Probe:
        get = spec["httpGet"]
        port = get["port"]
        return cls(kind, get.get("path", "/"), ports[port] if isinstance(port, str) else port,
                   float(spec.get("periodSeconds", 10)), float(spec.get("timeoutSeconds", 1)),
                   int(spec.get("failureThreshold", 3)),
                   float(spec.get("initialDelaySeconds", 0)))

    def passes(self, ip: str) -> bool:
        """One probe, as the kubelet sends it."""
        status, _ = http(f"http://{ip}:{self.port}{self.path}", timeout=self.timeout)
        return 200 <= status < 400


@dataclass
class PodContainer:
    """One container of the pod: its docker run arguments and its probes."""

    name: str
    docker_name: str
    run_args: list[str]
    probes: dict[str, Probe]
    grace: float


class Pod:
    """The pod template of a Deployment (or a Pod) in `manifest`, run on Docker."""

    def __init__(self, manifest: Path, *, images: dict[str, str], claims: dict[str, Path],
                 prefix: str, gpus: bool = False) -> None:
        docs = [d for d in yaml.safe_load_all(manifest.read_text()) if d]
        kind = next(d for d in docs if d["kind"] in ("Deployment", "Pod"))
        self.spec = kind["spec"]["template"]["spec"] if kind["kind"] == "Deployment" \
            else kind["spec"]
        self.prefix, self.pause = prefix, f"{prefix}-pause"
        self.volumes = {v["name"]: v for v in self.spec.get("volumes", [])}
        self.docker_volumes: list[str] = []
        self.claims, self.images, self.gpus = claims, images, gpus
        self.grace = float(self.spec.get("terminationGracePeriodSeconds", 30))
        self.containers = [self._container(c) for c in self.spec["containers"]]

    def _container(self, c: dict[str, Any]) -> PodContainer:
        security = {**self.spec.get("securityContext", {}), **c.get("securityContext", {})}
        args = ["--network", f"container:{self.pause}", "--ipc", f"container:{self.pause}",
                "--stop-timeout", str(int(self.grace))]
        if "runAsUser" in security:
            if security.get("runAsNonRoot"):
                assert security["runAsUser"] != 0, "runAsNonRoot with runAsUser 0"
            args += ["--user", f"{security['runAsUser']}:{security.get('runAsGroup', 0)}"]
        env = {e["name"]: str(e["value"]) for e in c.get("env", [])}
        gpus = int(c.get("resources", {}).get("limits", {}).get("nvidia.com/gpu", 0))
        if gpus and self.gpus:
            args += ["--gpus", str(gpus)]
        elif gpus:
            env["VLAUNCH_DEVICE"] = "cpu"  # a host without GPUs: the same pod on the CPU
        for key, value in env.items():
            args += ["-e", f"{key}={value}"]
        for mount in c.get("volumeMounts", []):
            args += ["-v", self._mount(mount)]
        command = c.get("command")
        if command:
            args += ["--entrypoint", command[0]]
        image = self.images[c["image"]]  # KeyError: no local image named for it
        ports = {p["name"]: p["containerPort"] for p in c.get("ports", []) if "name" in p}
        probes = {kind: Probe.of(kind, c[f"{kind}Probe"], ports)
                  for kind in ("startup", "liveness", "readiness") if f"{kind}Probe" in c}
        argv = [*(command or [])[1:], *c.get("args", [])]
        return PodContainer(c["name"], f"{self.prefix}-{c['name']}", [*args, image, *argv],
                            probes, self.grace)

    def _mount(self, mount: dict[str, Any]) -> str:
        volume = self.volumes[mount["name"]]
        read_only = mount.get("readOnly", False)
        if "persistentVolumeClaim" in volume:
            claim = volume["persistentVolumeClaim"]
            source = str(self.claims[claim["claimName"]])
            read_only = read_only or claim.get("readOnly", False)
        elif "emptyDir" in volume:
            source = f"{self.prefix}-{mount['name']}"
            if source not in self.docker_volumes:
                self._empty_dir(source, volume["emptyDir"] or {})
        else:
            raise AssertionError(f"volume {mount['name']}: only emptyDir and "
                                 "persistentVolumeClaim run here")
        return f"{source}:{mount['mountPath']}" + (":ro" if read_only else "")

    def _empty_dir(self, name: str, spec: dict[str, Any]) -> None:
        opts: list[str] = []  # on disk: a plain volume (root, 0755; the kubelet makes 0777)
        if spec.get("medium") == "Memory":
            size = str(spec.get("sizeLimit", "")).replace("Mi", "m").replace("Gi", "g")
            options = "mode=0777" + (f",size={size}" if size else "")
            opts = ["--opt", "type=tmpfs", "--opt", "device=tmpfs", "--opt", f"o={options}"]
        docker("volume", "create", "--driver", "local", *opts, name)
        self.docker_volumes.append(name)

    def start(self) -> None:
        """The sandbox, then every container (Kubernetes starts them in order, at once)."""
        image = next(iter(self.images.values()))
        docker("run", "-d", "--name", self.pause, "--ipc", "shareable", image,
               "sleep", "infinity")
        for c in self.containers:
            docker("run", "-d", "--name", c.docker_name, *c.run_args)

    @property
    def ip(self) -> str:
        """The pod's IP (its sandbox's)."""
        return ip_of(self.pause)

    def delete(self) -> dict[str, tuple[int, float]]:
        """What deleting the pod does to each container: SIGTERM, SIGKILL after the grace
        period; (exit status, seconds it took) per container."""
        out = {}
        for c in self.containers:
            started = time.monotonic()
            docker("stop", c.docker_name, timeout=c.grace + 60)
            code = int(docker("inspect", "--format", "{{.State.ExitCode}}", c.docker_name))
            out[c.name] = (code, time.monotonic() - started)
        return out

    def remove(self) -> None:
        """Remove every container and volume of the pod (what exists of them)."""
        docker("rm", "-f", *(c.docker_name for c in self.containers), self.pause, check=False)
        if self.docker_volumes:
            docker("volume", "rm", "-f", *self.docker_volumes, check=False)


@dataclass
class Kubelet:
    """The kubelet's probing of one container, in a thread: results and decisions recorded."""

    pod: Pod
    container: PodContainer
    results: list[tuple[float, str, bool]] = field(default_factory=list)
    restarts: list[str] = field(default_factory=list)
    started: bool = False
    ready: bool = False

    def __post_init__(self) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> Kubelet:
        """Start probing."""
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop probing."""
        self._stop.set()
        self._thread.join(30)

    def failed(self, kind: str) -> list[float]:
        """When each failed probe of `kind` ran."""
        return [t for t, k, ok in self.results if k == kind and not ok]

    def _run(self) -> None:
        ip = self.pod.ip
        probes = self.container.probes
        due = {kind: time.monotonic() + p.delay for kind, p in probes.items()}
        failures = dict.fromkeys(probes, 0)
        self.started = "startup" not in probes
        while not self._stop.wait(0.1):
            now = time.monotonic()
            for kind, probe in probes.items():
                if now < due[kind] or (kind != "startup" and not self.started) or \
                        (kind == "startup" and self.started):
                    continue
                due[kind] = now + probe.period
                ok = probe.passes(ip)
                self.results.append((time.monotonic(), kind, ok))
                failures[kind] = 0 if ok else failures[kind] + 1
                if kind == "startup" and ok:
                    self.started = True
                if kind == "readiness":
                    self.ready = ok or (self.ready and failures[kind] < probe.failures)
                if kind in ("startup", "liveness") and failures[kind] >= probe.failures:
                    self.restarts.append(f"{kind} probe failed {failures[kind]} times")
                    failures[kind] = 0
