"""`mlfabric kube`: the Kubernetes manifests of a whole job, for its size.

    mlfabric kube --job digits --shards 2 --workers 4 --out digits/
    kubectl create namespace mlfabric
    kubectl -n mlfabric create secret generic mlfabric-job-token --from-file=job.token
    kubectl apply -k digits/

(Without --out it prints the objects, for `kubectl apply -f -`.)

The job's size (shards, workers) and name are the only things to give;
everything that depends on them (the servers' count and their `--shard I/S`,
the controller's `--server` and `--replica` lists, the workers' settings)
follows from them here, so no two places can disagree. The output is a
Kubernetes `List` in JSON, which kubectl reads as it reads YAML. With
`--out DIR` it goes to DIR/job.json beside a kustomization that lists it:
`kubectl apply -k DIR` applies the job, and anything else a cluster needs
(images, resources, node selectors) goes in an overlay that names DIR as
its base, so running `mlfabric kube` again for a new size keeps it.

What it makes (`manifests`, pure: a size in, objects out):

- the servers: a StatefulSet of one pod per shard (stable names
  `mlfabric-server-I`, the pod's index as its shard), each with a persistent
  volume for checkpoints and `--resume auto`, behind a headless Service;
- their replicas, the same way (`--role replica --join-from` the shard's
  server), announced to the controller;
- the controller: a Deployment of one pod with a readiness probe on its
  metrics port, behind a Service, its decision log on a volume;
- the workers: an indexed Job running the PyTorch example under torchrun,
  one rank per pod, the rendezvous at pod 0 (behind a headless Service);
- Prometheus scrape annotations on every pod.

The controller finds the nodes' agents through their Service (the
DaemonSet's `mlfabric-agent`, looked up again every 30 s), or reads those
`--nodes` lists.

The agents are `deploy/kubernetes/daemonset.yaml` (one per node, by IP);
the token is a Secret you create (above), never written here.

With `--tls`, every process of the job speaks mutual TLS (`mlfabric tls`):
one certificate, `job.pem`, names every address a pod of the job is dialled
at (`tls_names`; `--print-tls-host` prints them as `mlfabric tls init
--host` takes them), and it comes with the CA from the Secret `mlfabric-tls`.
A controller on TLS reads the agents on TLS too: they need their own
certificate naming the nodes' IPs (the DaemonSet's `mlfabric-agent-tls`,
deploy/README.md).
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import re
from dataclasses import dataclass
from typing import Any

from ..errors import ConfigError

SERVER_PORT, SERVER_METRICS = 7070, 9471
AGENT_PORT = 7400
# The agents' headless Service (deploy/kubernetes/daemonset.yaml): the nodes'
# IPs, as the agents run on the host network. The controller finds them there.
AGENTS_DNS = f"mlfabric-agent.mlfabric.svc:{AGENT_PORT}"
CONTROLLER_PORT, CONTROLLER_METRICS = 7071, 9472
RENDEZVOUS_PORT = 29500
TOKEN_SECRET = "mlfabric-job-token"
TOKEN_DIR = "/etc/mlfabric-secret"
TLS_SECRET = "mlfabric-tls"
TLS_DIR = "/etc/mlfabric-tls"
# The Secret's keys: the CA's certificate and the job's certificate and key,
# as `mlfabric tls init DIR --host job,...` names them.
TLS_FILES = {"ca": "ca.pem", "cert": "job.pem", "key": "job.key"}
EXAMPLE = "/opt/mlfabric/examples/torch_digits.py"
_NAME = re.compile(r"^[a-z0-9]([-a-z0-9]{0,38}[a-z0-9])?$")


@dataclass(frozen=True)
class JobSize:
    job: str = "digits"
    shards: int = 1
    workers: int = 2
    replicas: bool = True
    image: str = "ghcr.io/mlfabric/mlfabric-torch:0.1.0"
    namespace: str = "mlfabric"
    checkpoint_gi: int = 1
    # The nodes' IPs, each running an agent (deploy/kubernetes/daemonset.yaml
    # names agents by their node's IP): the controller polls them. None given:
    # it finds them through the agents' Service (AGENTS_DNS), unless not `agents`.
    nodes: tuple[str, ...] = ()
    agents: bool = True
    # Mutual TLS on every link of the job, from the Secret TLS_SECRET.
    tls: bool = False

    def check(self) -> JobSize:
        if not _NAME.match(self.job):
            raise ConfigError(f"--job {self.job!r}: a Kubernetes name part, lower-case letters, "
                              f"digits and '-', at most 40 characters")
        if not 1 <= self.shards <= 256:
            raise ConfigError(f"--shards {self.shards}: give 1 to 256 server shards")
        if not 1 <= self.workers <= 10_000:
            raise ConfigError(f"--workers {self.workers}: give 1 to 10000 workers")
        if not _NAME.match(self.namespace):
            raise ConfigError(f"--namespace {self.namespace!r}: a Kubernetes name, lower-case "
                              f"letters, digits and '-'")
        if not 1 <= self.checkpoint_gi <= 1024:
            raise ConfigError(f"--checkpoint-gi {self.checkpoint_gi}: 1 to 1024 GiB")
        for node in self.nodes:
            try:
                ipaddress.ip_address(node)
            except ValueError:
                raise ConfigError(f"--nodes: {node!r} is not an IP address: give the nodes' "
                                  f"IPs (kubectl get nodes -o wide), as their agents are "
                                  f"named") from None
        if len(set(self.nodes)) != len(self.nodes):
            raise ConfigError("--nodes: name each node once")
        if self.nodes and not self.agents:
            raise ConfigError("--nodes names the agents to read and --no-agents reads none: "
                              "give one of them")
        return self

    def servers(self) -> str:
        """The shards' addresses in shard order, as workers and the controller name them."""
        return ",".join(f"mlfabric-server-{i}.mlfabric-server:{SERVER_PORT}"
                        for i in range(self.shards))

    def replica_list(self) -> str:
        return ",".join(f"mlfabric-replica-{i}.mlfabric-replica:{SERVER_PORT}"
                        for i in range(self.shards))

    def controller(self) -> str:
        return f"mlfabric-controller:{CONTROLLER_PORT}"


def tls_names(size: JobSize) -> list[str]:
    """Every host name a process of the job dials another at: what the job's
    certificate must name, as a client checks the name it dialled (the
    servers, the replicas and the controller; workers are only dialled by
    torchrun, which is not mlfabric's link)."""
    addresses = [*size.servers().split(","), size.controller()]
    if size.replicas:
        addresses += size.replica_list().split(",")
    return [a.rsplit(":", 1)[0] for a in addresses]


def tls_host(size: JobSize) -> str:
    """`mlfabric tls init DIR --host` for the job's certificate: its file
    name (job.pem, job.key) then every name it carries."""
    name = TLS_FILES["cert"].removesuffix(".pem")
    return ",".join([name, *tls_names(size)])


def _labels(component: str) -> dict[str, str]:
    return {"app.kubernetes.io/name": "mlfabric", "app.kubernetes.io/component": component}


def _scraped(port: int) -> dict[str, str]:
    return {"prometheus.io/scrape": "true", "prometheus.io/port": str(port),
            "prometheus.io/path": "/metrics"}


def _service(name: str, component: str, ports: dict[str, int], headless: bool
             ) -> dict[str, Any]:
    spec: dict[str, Any] = {"selector": _labels(component),
                            "ports": [{"name": n, "port": p, "targetPort": p}
                                      for n, p in ports.items()]}
    if headless:
        spec["clusterIP"] = "None"
        spec["publishNotReadyAddresses"] = True  # peers find each other while starting
    return {"apiVersion": "v1", "kind": "Service",
            "metadata": {"name": name, "labels": _labels(component)}, "spec": spec}


# Secret files are root's, group fsGroup's: group-readable is how the
# unprivileged user (10001, in fsGroup 10001) reads them.
_TOKEN_VOLUME: dict[str, Any] = {"name": "token", "secret": {"secretName": TOKEN_SECRET,
                                                             "defaultMode": 0o440}}
_TOKEN_MOUNT: dict[str, Any] = {"name": "token", "mountPath": TOKEN_DIR, "readOnly": True}
_TLS_VOLUME: dict[str, Any] = {"name": "tls", "secret": {"secretName": TLS_SECRET,
                                                         "defaultMode": 0o440}}
_TLS_MOUNT: dict[str, Any] = {"name": "tls", "mountPath": TLS_DIR, "readOnly": True}
_TLS_FLAGS = ["--tls-cert", f"{TLS_DIR}/{TLS_FILES['cert']}", "--tls-key",
              f"{TLS_DIR}/{TLS_FILES['key']}", "--tls-ca", f"{TLS_DIR}/{TLS_FILES['ca']}"]
# A worker takes them as settings (docs/guide/configuration.md).
_TLS_ENV: list[dict[str, Any]] = [
    {"name": f"MLFABRIC_TLS_{k.upper()}", "value": f"{TLS_DIR}/{v}"}
    for k, v in TLS_FILES.items()]


def _secrets(size: JobSize) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The Secret volumes a pod of the job mounts, and their mounts."""
    if size.tls:
        return [_TOKEN_VOLUME, _TLS_VOLUME], [_TOKEN_MOUNT, _TLS_MOUNT]
    return [_TOKEN_VOLUME], [_TOKEN_MOUNT]


_POD_INDEX: dict[str, Any] = {"name": "POD_INDEX", "valueFrom": {"fieldRef": {
    "fieldPath": "metadata.labels['apps.kubernetes.io/pod-index']"}}}
_SECURITY = {"runAsNonRoot": True, "runAsUser": 10001, "fsGroup": 10001}
_CONTAINER_SECURITY = {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                       "capabilities": {"drop": ["ALL"]}}


def _container(name: str, size: JobSize, command: list[str], ports: dict[str, int],
               env: list[dict[str, Any]], mounts: list[dict[str, Any]],
               ready_port: int | None) -> dict[str, Any]:
    c: dict[str, Any] = {
        "name": name, "image": size.image, "imagePullPolicy": "IfNotPresent",
        "command": command, "env": env, "volumeMounts": mounts,
        "ports": [{"name": n, "containerPort": p} for n, p in ports.items()],
        # A worker's PyTorch writes where it likes; the others only to volumes.
        "securityContext": {**_CONTAINER_SECURITY, "readOnlyRootFilesystem": name != "worker"},
    }
    if ready_port is not None:
        c["readinessProbe"] = {"httpGet": {"path": "/metrics", "port": ready_port},
                               "periodSeconds": 5}
    return c


def _server_set(size: JobSize, replica: bool) -> dict[str, Any]:
    name = "mlfabric-replica" if replica else "mlfabric-server"
    component = "replica" if replica else "server"
    common = ["--listen", f"0.0.0.0:{SERVER_PORT}", "--job", size.job, "--token-file",
              f"{TOKEN_DIR}/job.token", "--checkpoint-dir", "/var/lib/mlfabric/checkpoints",
              "--metrics-port", str(SERVER_METRICS), "--metrics-host", "0.0.0.0"]
    if size.tls:
        common += _TLS_FLAGS
    init: list[dict[str, Any]] = []
    volumes, mounts = _secrets(size)
    mounts = [*mounts, {"name": "checkpoints", "mountPath": "/var/lib/mlfabric"}]
    if replica:
        command = ["mlfabric", "server", "--role", "replica", *common,
                   "--join-from", f"mlfabric-server-$(POD_INDEX).mlfabric-server:{SERVER_PORT}",
                   "--advertise", f"mlfabric-replica-$(POD_INDEX).mlfabric-replica:{SERVER_PORT}",
                   "--controller", size.controller()]
    else:
        # Every shard starts from the example's initial model, written by an
        # init container (the same seed as the workers' model).
        init = [{"name": "init-model", "image": size.image, "imagePullPolicy": "IfNotPresent",
                 "command": ["python", EXAMPLE, "--write-init", "/init/init.npz"],
                 "volumeMounts": [{"name": "init", "mountPath": "/init"}],
                 "securityContext": _CONTAINER_SECURITY}]
        volumes = [*volumes, {"name": "init", "emptyDir": {}}]
        mounts = [*mounts, {"name": "init", "mountPath": "/init", "readOnly": True}]
        command = ["mlfabric", "server", *common, "--init", "/init/init.npz",
                   "--resume", "auto", "--shard", f"$(POD_INDEX)/{size.shards}"]
    container = _container(component, size, command,
                           {"ps": SERVER_PORT, "metrics": SERVER_METRICS}, [_POD_INDEX], mounts,
                           SERVER_METRICS)
    pod: dict[str, Any] = {
        "securityContext": _SECURITY, "containers": [container], "volumes": volumes,
        "terminationGracePeriodSeconds": 30,
        # On the node's network, as the agents are: the address workers reach a
        # server at is its node's IP, the name the agents measure paths by.
        "hostNetwork": True, "dnsPolicy": "ClusterFirstWithHostNet",
        # One server (or replica) per node: they listen on the same port, and
        # a shard and its replica on one node would fail together.
        "affinity": {"podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [
            {"labelSelector": {"matchExpressions": [{
                "key": "app.kubernetes.io/component", "operator": "In",
                "values": ["server", "replica"]}]},
             "topologyKey": "kubernetes.io/hostname"}]}}}
    if init:
        pod["initContainers"] = init
    return {
        "apiVersion": "apps/v1", "kind": "StatefulSet",
        "metadata": {"name": name, "labels": _labels(component)},
        "spec": {
            "serviceName": name, "replicas": size.shards, "podManagementPolicy": "Parallel",
            "selector": {"matchLabels": _labels(component)},
            "template": {"metadata": {"labels": _labels(component),
                                      "annotations": _scraped(SERVER_METRICS)},
                         "spec": pod},
            "volumeClaimTemplates": [{
                "metadata": {"name": "checkpoints"},
                "spec": {"accessModes": ["ReadWriteOnce"],
                         "resources": {"requests": {"storage": f"{size.checkpoint_gi}Gi"}}}}],
        },
    }


def _controller(size: JobSize) -> dict[str, Any]:
    command = ["mlfabric", "controller", "--listen", f"0.0.0.0:{CONTROLLER_PORT}", "--job",
               size.job, "--token-file", f"{TOKEN_DIR}/job.token", "--decision-log",
               "/var/log/mlfabric/decisions.jsonl", "--metrics-port", str(CONTROLLER_METRICS),
               "--metrics-host", "0.0.0.0"]
    if size.replicas:
        command += ["--server", size.servers(), "--replica", size.replica_list()]
    if size.nodes or size.agents:
        # Each node by its IP, as its agent names itself and as workers and
        # servers are named in the network picture (both on node IPs).
        command += ["--agent-key-file", f"{TOKEN_DIR}/agent.key"]
    for node in size.nodes:
        command += ["--agent", f"{node}={node}:{AGENT_PORT}"]
    if size.agents and not size.nodes:
        command += ["--agents-dns", AGENTS_DNS]
    if size.tls:
        command += _TLS_FLAGS
    volumes, mounts = _secrets(size)
    container = _container("controller", size, command,
                           {"control": CONTROLLER_PORT, "metrics": CONTROLLER_METRICS}, [],
                           [*mounts, {"name": "log", "mountPath": "/var/log/mlfabric"}],
                           CONTROLLER_METRICS)
    return {
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": "mlfabric-controller", "labels": _labels("controller")},
        "spec": {
            # One controller per job (several need --etcd): never two at once.
            "replicas": 1, "strategy": {"type": "Recreate"},
            "selector": {"matchLabels": _labels("controller")},
            "template": {"metadata": {"labels": _labels("controller"),
                                      "annotations": _scraped(CONTROLLER_METRICS)},
                         "spec": {"securityContext": _SECURITY, "containers": [container],
                                  "volumes": [*volumes, {"name": "log", "emptyDir": {}}]}},
        },
    }


def _workers(size: JobSize) -> dict[str, Any]:
    env: list[dict[str, Any]] = [
        {"name": "MLFABRIC_SERVER", "value": size.servers()},
        # The worker's host in the network picture: its node, as the agents
        # name hosts (the pod's own IP is no host an agent measures).
        {"name": "MLFABRIC_HOST", "valueFrom": {"fieldRef": {"fieldPath": "status.hostIP"}}},
        {"name": "MLFABRIC_JOB", "value": size.job},
        {"name": "MLFABRIC_TOKEN_FILE", "value": f"{TOKEN_DIR}/job.token"},
        {"name": "MLFABRIC_CONTROLLER", "value": size.controller()}]
    if size.replicas:
        env.append({"name": "MLFABRIC_REPLICA", "value": size.replica_list()})
    if size.tls:
        env += _TLS_ENV
    volumes, mounts = _secrets(size)
    command = ["torchrun", "--nnodes", str(size.workers), "--nproc-per-node", "1",
               "--node-rank", "$(JOB_COMPLETION_INDEX)", "--master-addr",
               "mlfabric-workers-0.mlfabric-workers", "--master-port", str(RENDEZVOUS_PORT),
               EXAMPLE]
    container = _container("worker", size, command, {"rendezvous": RENDEZVOUS_PORT},
                           [{"name": "JOB_COMPLETION_INDEX", "valueFrom": {"fieldRef": {
                               "fieldPath": "metadata.annotations['batch.kubernetes.io/"
                                            "job-completion-index']"}}}, *env],
                           [*mounts, {"name": "tmp", "mountPath": "/tmp"}], None)
    return {
        "apiVersion": "batch/v1", "kind": "Job",
        "metadata": {"name": "mlfabric-workers", "labels": _labels("worker")},
        "spec": {
            "completionMode": "Indexed", "completions": size.workers,
            "parallelism": size.workers, "backoffLimit": 0,
            "template": {
                "metadata": {"labels": _labels("worker")},
                "spec": {"subdomain": "mlfabric-workers", "restartPolicy": "Never",
                         "securityContext": _SECURITY, "containers": [container],
                         "volumes": [*volumes, {"name": "tmp", "emptyDir": {}}]}},
        },
    }


def manifests(size: JobSize) -> list[dict[str, Any]]:
    """Every object of the job (namespace-less: `metadata.namespace` is set
    by `as_list`)."""
    size.check()
    objects = [
        _service("mlfabric-server", "server",
                 {"ps": SERVER_PORT, "metrics": SERVER_METRICS}, headless=True),
        _server_set(size, replica=False),
    ]
    if size.replicas:
        objects += [_service("mlfabric-replica", "replica",
                             {"ps": SERVER_PORT, "metrics": SERVER_METRICS}, headless=True),
                    _server_set(size, replica=True)]
    objects += [
        _service("mlfabric-controller", "controller",
                 {"control": CONTROLLER_PORT, "metrics": CONTROLLER_METRICS}, headless=False),
        _controller(size),
        _service("mlfabric-workers", "worker", {"rendezvous": RENDEZVOUS_PORT}, headless=True),
        _workers(size),
    ]
    return objects


def as_list(size: JobSize) -> dict[str, Any]:
    """The objects as one Kubernetes List, each in `size.namespace`."""
    items = manifests(size)
    for item in items:
        item["metadata"]["namespace"] = size.namespace
    return {"apiVersion": "v1", "kind": "List", "items": items}


KUSTOMIZATION = """\
# Written by `mlfabric kube` for job {job!r}: {shards} shard(s), {workers} worker(s), with
# job.json beside it. To change the size, run `mlfabric kube` again; do not
# edit either file. Apply with `kubectl apply -k {out}`. Anything else (images,
# resources, node selectors) goes in an overlay whose kustomization lists
# this directory under `resources:`.
apiVersion: kustomize.config.k8s.io/v1beta1
kind: Kustomization
resources:
  - job.json
"""


def write_out(size: JobSize, out: str) -> list[str]:
    """The job's objects as DIR/job.json and the kustomization beside it;
    returns the paths written."""
    import os

    try:
        os.makedirs(out, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"--out {out!r}: cannot create the directory: {exc.strerror}"
                          ) from None
    written = []
    for name, text in (("job.json", json.dumps(as_list(size), indent=2) + "\n"),
                       ("kustomization.yaml", KUSTOMIZATION.format(
                           job=size.job, shards=size.shards, workers=size.workers, out=out))):
        path = os.path.join(out, name)
        try:
            with open(path, "w") as f:
                f.write(text)
        except OSError as exc:
            raise ConfigError(f"--out {out!r}: cannot write {path!r}: {exc.strerror}"
                              ) from None
        written.append(path)
    return written


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--job", default=JobSize.job, help="the job's name (default: digits)")
    p.add_argument("--shards", type=int, default=JobSize.shards,
                   help="server shards, each a pod with its replica (default: 1)")
    p.add_argument("--workers", type=int, default=JobSize.workers,
                   help="worker pods, one torchrun rank each (default: 2)")
    p.add_argument("--no-replicas", action="store_true",
                   help="no replicas (and so no failover)")
    p.add_argument("--image", default=JobSize.image,
                   help="the image every pod runs: the repository's Dockerfile built with "
                        f"--build-arg EXTRAS=demo,torch (default: {JobSize.image})")
    p.add_argument("--namespace", default=JobSize.namespace,
                   help="the namespace (default: mlfabric)")
    p.add_argument("--checkpoint-gi", type=int, default=JobSize.checkpoint_gi,
                   help="each server's checkpoint volume, in GiB (default: 1)")
    p.add_argument("--nodes", default="", metavar="IP,IP,...",
                   help="the nodes' IPs, each running an agent (the DaemonSet): the "
                        "controller polls these (default: it finds the agents through their "
                        f"Service, --agents-dns {AGENTS_DNS}, again every 30 s); either way "
                        "with the job's agent key from the Secret")
    p.add_argument("--no-agents", action="store_true",
                   help="the controller reads no agents and plans from its default link "
                        "rate alone (no agent.key in the Secret needed)")
    p.add_argument("--tls", action="store_true",
                   help=f"mutual TLS on every link of the job: each pod mounts the Secret "
                        f"{TLS_SECRET} ({', '.join(TLS_FILES.values())}; see "
                        f"--print-tls-host) and passes it as --tls-* (default: plain TCP)")
    p.add_argument("--out", metavar="DIR", default=None,
                   help="write the objects to DIR/job.json beside a kustomization "
                        "(`kubectl apply -k DIR`; overlays name DIR as their base) instead of "
                        "printing them")
    p.add_argument("--print-tls-host", action="store_true",
                   help="print the job certificate's `mlfabric tls init --host` value (job, "
                        "then every name a pod of the job is dialled at) instead of the "
                        "manifests")


def run(args: argparse.Namespace) -> int:
    size = JobSize(job=args.job, shards=args.shards, workers=args.workers,
                   replicas=not args.no_replicas, image=args.image, namespace=args.namespace,
                   checkpoint_gi=args.checkpoint_gi,
                   nodes=tuple(n.strip() for n in args.nodes.split(",") if n.strip()),
                   agents=not args.no_agents, tls=args.tls)
    if args.print_tls_host:
        print(tls_host(size.check()))
        return 0
    if args.out is not None:
        for path in write_out(size, args.out):
            print(path)
        return 0
    print(json.dumps(as_list(size), indent=2))
    return 0
