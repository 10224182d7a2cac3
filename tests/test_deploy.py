"""The deployment files (deploy/): each systemd unit and drop-in runs a
command the CLI accepts, on the ports the rest of the project uses, and
`systemd-analyze verify` (where installed) finds nothing to fix."""

from __future__ import annotations

import importlib.util
import re
import shlex
import shutil
import socket
import ssl
import subprocess
import sys
from pathlib import Path

import pytest

from mlfabric.cli import build_parser
from mlfabric.errors import ConfigError

ROOT = Path(__file__).resolve().parent.parent
SYSTEMD = ROOT / "deploy" / "systemd"
UNITS = sorted(p.name for p in SYSTEMD.glob("*.service"))
# The ports every unit, example and guide page gives each process.
PORTS = {"server": (7070, 9471), "replica": (7070, 9471), "controller": (7071, 9472)}


def settings(text: str) -> tuple[dict[str, str], list[str]]:
    """The [Service] Environment= defaults of a unit or drop-in (the last
    one of a name wins, as in systemd), and its ExecStart= lines."""
    env: dict[str, str] = {}
    starts = []
    for line in text.splitlines():
        if line.startswith("Environment="):
            for word in shlex.split(line.removeprefix("Environment=")):
                name, _, value = word.partition("=")
                env[name] = value
        elif line.startswith("ExecStart="):
            starts.append(line.removeprefix("ExecStart="))
    return env, starts


def argv_of(unit: str, start: str, env: dict[str, str]) -> list[str]:
    """ExecStart as systemd runs it: ${NAME} replaced in place, $NAME split
    into words, with the unit's credentials and state directories."""
    dirs = {"CREDENTIALS_DIRECTORY": f"/run/credentials/{unit}",
            "STATE_DIRECTORY": f"/var/lib/{unit.removesuffix('.service')}"}
    start = re.sub(r"\$\{(\w+)\}", lambda m: {**env, **dirs}[m.group(1)], start)
    argv = []
    for word in shlex.split(start):
        if word.startswith("$"):
            argv += shlex.split(env[word[1:]])
        else:
            argv.append(word)
    return argv


def parsed(unit: str, extra: str = ""):
    env, (start,) = settings((SYSTEMD / unit).read_text())
    env.update(settings(extra)[0])
    argv = argv_of(unit, start, env)
    assert argv[0] == "/usr/local/bin/mlfabric", argv
    return build_parser(argv[1]).parse_args(argv[1:])


@pytest.mark.parametrize("unit", UNITS)
def test_each_unit_runs_a_command_the_cli_accepts(unit):
    args = parsed(unit)
    kind = unit.removeprefix("mlfabric-").removesuffix(".service")
    assert args.command == ("server" if kind == "replica" else kind)
    text = (SYSTEMD / unit).read_text()
    assert "DynamicUser=yes" in text and "WantedBy=multi-user.target" in text
    if kind in PORTS:
        listen, metrics = PORTS[kind]
        assert args.listen == f"0.0.0.0:{listen}" and args.metrics_port == metrics
        # every token is root's file, handed over by systemd
        assert args.token_file == f"/run/credentials/{unit}/job.token"
        assert "LoadCredential=job.token:/etc/mlfabric/job.token" in text.splitlines()
    if kind == "server":
        assert (args.resume, args.checkpoint_dir) == ("auto", "/var/lib/mlfabric-server")
    if kind == "replica":
        assert args.role == "replica" and args.join_from == "server:7070"
    if kind == "agent":
        # the job's own traffic to its server is not counted as load, and the
        # agent may read the socket counters that tell it so (netlink)
        assert args.job_port == [7070] and args.metrics_port == 9470
        assert str(args.config) == "/etc/mlfabric/agent.json"
        # the cluster token, root's file, handed to the agent's DynamicUser by systemd
        assert args.cluster_token_file == f"/run/credentials/{unit}/cluster.token"
        assert "LoadCredential=cluster.token:/etc/mlfabric/cluster.token" in text.splitlines()
        assert "KillSignal=SIGTERM" in text
        families = next(x for x in text.splitlines() if x.startswith("RestrictAddressFamilies="))
        assert "AF_NETLINK" in families.split("=", 1)[1].split()


@pytest.mark.parametrize(("unit", "drop_in"), [
    ("mlfabric-agent.service", "aggregator.conf"),
    ("mlfabric-controller.service", "controller-agents.conf"),
])
def test_each_drop_in_adds_flags_the_cli_accepts_and_the_credential_they_read(unit, drop_in):
    text = (SYSTEMD / drop_in).read_text()
    args = parsed(unit, text)
    if drop_in == "aggregator.conf":
        assert args.aggregate == "0.0.0.0:7401" and args.servers
        assert args.token_file == f"/run/credentials/{unit}/job.token"
        assert "LoadCredential=job.token:/etc/mlfabric/job.token" in text.splitlines()
    else:
        assert args.agent and args.agent_key_file == f"/run/credentials/{unit}/agent.key"
        assert "LoadCredential=agent.key:/etc/mlfabric/agent.key" in text.splitlines()


@pytest.mark.skipif(shutil.which("systemd-analyze") is None,
                    reason="systemd-analyze is not installed")
@pytest.mark.parametrize("unit", UNITS)
def test_systemd_analyze_verify_finds_nothing_to_fix(unit, tmp_path):
    """With the command's path pointed at this install's `mlfabric` (verify
    checks that the executable exists)."""
    mlfabric = str(Path(sys.executable).parent / "mlfabric")
    copy = tmp_path / unit
    copy.write_text((SYSTEMD / unit).read_text().replace("/usr/local/bin/mlfabric", mlfabric))
    out = subprocess.run(["systemd-analyze", "verify", str(copy)], capture_output=True,
                         text=True, timeout=60)
    problems = [line for line in (out.stdout + out.stderr).splitlines()
                if str(copy) in line or unit in line]
    assert out.returncode == 0 and not problems, out.stdout + out.stderr


# --- Kubernetes: the agents' DaemonSet ----------------------------------------------

DAEMONSET = ROOT / "deploy" / "kubernetes" / "daemonset.yaml"


def agent_argv(host_ip: str) -> list[str]:
    """The DaemonSet's agent command as it runs on the node at `host_ip`."""
    lines = DAEMONSET.read_text().splitlines()
    start = next(i for i, x in enumerate(lines) if x.strip() == "command:")
    argv = []
    for x in lines[start + 1:]:
        if x.strip().startswith("#"):
            continue  # a comment between the arguments
        if not x.strip().startswith("- "):
            break
        argv.append(x.strip()[2:].replace("$(HOST_IP)", host_ip))
    return argv


def test_daemonset_runs_a_valid_agent_command_and_config() -> None:
    import json

    text = DAEMONSET.read_text()
    argv = agent_argv("10.0.0.1")
    assert argv[:2] == ["mlfabric", "agent"]
    args = build_parser("agent").parse_args(argv[1:])
    # named by the node's IP, as the controller names hosts; the job's port is not load
    assert (args.listen, args.metrics_port, args.name) == ("10.0.0.1:7400", 9470, "10.0.0.1")
    assert args.job_port == [7070]
    # the cluster token from its Secret, mounted where the flag says
    assert args.cluster_token_file == "/etc/mlfabric-secret/cluster.token"
    assert "secretName: mlfabric-cluster-token" in text
    assert "mountPath: /etc/mlfabric-secret" in text
    # the embedded agent.json holds only keys the agent's config file takes
    lines = text.splitlines()
    cfg_start = next(i for i, x in enumerate(lines) if x.strip() == "agent.json: |")
    body = []
    for x in lines[cfg_start + 1:]:
        if not x.startswith("    "):
            break
        body.append(x)
    cfg = json.loads("\n".join(body))
    assert set(cfg) <= {"name", "listen", "metrics_port", "probe_budget", "stale_after", "peers",
                        "interface"}
    assert "hostNetwork: true" in text and 'prometheus.io/port: "9470"' in text
    # TLS: the agents' certificate from an optional Secret, mounted where the
    # keys the header tells to add to agent.json point
    import yaml

    from mlfabric.agent.cli import CONFIG_KEYS

    ds = next(d for d in yaml.safe_load_all(text) if d["kind"] == "DaemonSet")
    pod = ds["spec"]["template"]["spec"]
    (volume,) = [v for v in pod["volumes"] if v["name"] == "tls"]
    assert volume["secret"] == {"secretName": "mlfabric-agent-tls", "defaultMode": 0o440,
                                "optional": True}
    (mount,) = [m for m in pod["containers"][0]["volumeMounts"] if m["name"] == "tls"]
    told = dict(re.findall(r'"(tls_\w+)": "([^"]+)"', text))
    assert set(told) == {"tls_cert", "tls_key", "tls_ca"} <= set(CONFIG_KEYS)
    assert {Path(p).parent for p in told.values()} == {Path(mount["mountPath"])}
    assert {Path(p).name for p in told.values()} == {"agents.pem", "agents.key", "ca.pem"}


# --- Prometheus: the alerting rules -------------------------------------------------

PROMETHEUS = ROOT / "deploy" / "prometheus"
# Labels every scraped series has (the scrape's target).
TARGET_LABELS = {"instance", "job"}


def declared_metrics() -> dict[str, tuple[str, set[str]]]:
    """Every metric as scraped, name -> (type, label names), from the metrics
    reference (docs/guide/metrics.md, generated from the code and checked
    against it by tests/test_docgen.py)."""
    out = {}
    for line in (ROOT / "docs" / "guide" / "metrics.md").read_text().splitlines():
        m = re.match(r"\| `(mlfabric_\w+)` \| (\w+) \| ([^|]*) \|", line)
        if m:
            labels = set(re.findall(r"`(\w+)`", m.group(3)))
            out[m.group(1)] = (m.group(2), labels)
    assert len(out) > 100
    return out


def series(name: str, metrics: dict[str, tuple[str, set[str]]]) -> tuple[str, set[str]] | None:
    """The declared metric a series name belongs to (a histogram's _bucket,
    _sum and _count are its own)."""
    if name in metrics:
        return metrics[name]
    for suffix in ("_bucket", "_sum", "_count"):
        base = name.removesuffix(suffix)
        if base != name and metrics.get(base, ("", set()))[0] == "histogram":
            return metrics[base]
    return None


def check_query(where: str, expr: str, shown: str, metrics) -> None:
    """Every metric `expr` names is declared, and every label it groups or
    matches by, or `shown` (a legend, an annotation) prints, is on one of
    them (or is a scrape target's)."""
    used = set(re.findall(r"\bmlfabric_\w+", expr))
    assert used, f"{where}: no mlfabric metric in {expr!r}"
    labels: set[str] = set(TARGET_LABELS)
    for name in used:
        found = series(name, metrics)
        assert found is not None, f"{where}: {name} is no metric mlfabric declares"
        labels |= found[1]
        if name.endswith("_bucket"):
            labels.add("le")
    grouped = re.findall(r"\b(?:by|without|on|ignoring)\s*\(([^)]*)\)", expr)
    named = {x.strip() for group in grouped for x in group.split(",") if x.strip()}
    named |= set(re.findall(r"\{(\w+)\s*[=!~]", expr))
    named |= set(re.findall(r"\$labels\.(\w+)", shown))
    named |= set(re.findall(r"\{\{\s*(\w+)\s*\}\}", shown))
    assert named <= labels, f"{where}: labels {sorted(named - labels)} are on no series"


def test_the_alerts_cover_what_an_operator_must_know_with_metrics_that_exist():
    import yaml

    rules = yaml.safe_load((PROMETHEUS / "alerts.yml").read_text())["groups"][0]["rules"]
    names = {r["alert"] for r in rules}
    assert {"MlfabricServerAppliesNothing", "MlfabricDropRateHigh",
            "MlfabricReplicaPastDivergenceBound", "MlfabricAgentEstimatesStale",
            "MlfabricCheckpointOld"} <= names
    metrics = declared_metrics()
    for rule in rules:
        where = rule["alert"]
        assert rule["labels"]["severity"] in ("warning", "critical"), where
        assert rule["annotations"]["summary"] and rule["annotations"]["description"], where
        check_query(where, rule["expr"], " ".join(rule["annotations"].values()), metrics)


def test_prometheus_scrapes_every_process_and_loads_the_alerts():
    import yaml

    text = (PROMETHEUS / "prometheus.yml").read_text()
    config = yaml.safe_load(text)
    jobs = {j["job_name"] for j in config["scrape_configs"]}
    assert {"mlfabric-agent", "mlfabric-server", "mlfabric-controller"} <= jobs
    assert ":9470" in text and "kubernetes_sd_configs" in text
    assert config["rule_files"] == ["alerts.yml"]
    assert (PROMETHEUS / "alerts.yml").is_file()


@pytest.mark.skipif(shutil.which("promtool") is None,
                    reason="promtool is not installed (apt-get install prometheus)")
def test_promtool_checks_the_alerting_rules():
    out = subprocess.run(["promtool", "check", "rules", str(PROMETHEUS / "alerts.yml")],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "SUCCESS" in out.stdout + out.stderr, out.stdout + out.stderr


# --- Grafana: the dashboard ---------------------------------------------------------

GRAFANA = ROOT / "deploy" / "grafana"


def test_every_dashboard_query_names_declared_metrics_and_labels():
    import json

    board = json.loads((GRAFANA / "mlfabric.json").read_text())
    metrics = declared_metrics()
    panels = [p for p in board["panels"] if p["type"] != "row"]
    titles = {p["title"] for p in panels}
    # what the operator asked to see (issue 36)
    for want in ("Updates applied and dropped per second", "Update delay (staleness) "
                 "distribution", "Push to applied", "Available bandwidth per host pair",
                 "Controller: re-plan time and events per re-plan", "Server apply time per "
                 "shard", "Server bytes in and out per shard",
                 "Replica: lag and divergence against its bound"):
        assert want in titles
    for panel in panels:
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            check_query(panel["title"], target["expr"], target.get("legendFormat", ""),
                        metrics)
    assert [v["name"] for v in board["templating"]["list"]] == ["datasource"]


@pytest.mark.skipif(importlib.util.find_spec("grafana_foundation_sdk") is None,
                    reason="grafana-foundation-sdk is not installed (the test extra has it)")
def test_the_dashboard_is_what_its_builder_gives():
    out = subprocess.run([sys.executable, str(GRAFANA / "dashboard.py")], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout == (GRAFANA / "mlfabric.json").read_text(), (
        "deploy/grafana/mlfabric.json is not what deploy/grafana/dashboard.py builds: run "
        "python deploy/grafana/dashboard.py > deploy/grafana/mlfabric.json")


# --- the container image ------------------------------------------------------------


def dockerfile() -> list[tuple[str, str]]:
    """(instruction, arguments) of the Dockerfile, continuation lines joined."""
    text = re.sub(r"\\\n\s*", " ", (ROOT / "Dockerfile").read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def test_the_image_builds_what_the_readme_installs():
    """The build stage copies what `pip install .` (the README's install)
    reads and builds the wheel from it; the image installs that wheel with
    extras pyproject.toml has, on a Python it supports, and runs the
    `mlfabric` command pyproject.toml declares."""
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    steps = dockerfile()
    froms = [args for word, args in steps if word == "FROM"]
    assert len(froms) == 2 and froms[0].endswith(" AS build")  # two stages
    python = next(args for word, args in steps if word == "ARG" and args.startswith("PYTHON="))
    version = python.split("=", 1)[1]
    minimum = project["requires-python"].removeprefix(">=")
    assert tuple(map(int, version.split("."))) >= tuple(map(int, minimum.split(".")))
    # the README's install: from the repository root, pip reads these
    readme = (ROOT / "README.md").read_text()
    assert "pip install '.[" in readme
    copied = " ".join(args for word, args in steps[:steps.index(("FROM", froms[1]))]
                      if word == "COPY")
    needed = ["pyproject.toml", "setup.py", project["readme"], "src"]
    for path in needed:
        assert path in copied.split(), f"the build stage does not copy {path}"
    builds = [args for word, args in steps if word == "RUN" and "pip wheel" in args]
    assert len(builds) == 1 and builds[0].split()[-1] == "."
    # setup.py's extensions are sources under src/: the build stage has them
    for source in re.findall(r'"(src/[^"]+\.pyx)"', (ROOT / "setup.py").read_text()):
        assert (ROOT / source).is_file()
    extras = next(args for word, args in steps if word == "ARG" and args.startswith("EXTRAS="))
    for extra in extras.split("=", 1)[1].split(","):
        assert extra in project["optional-dependencies"], extra
    (entry,) = [args for word, args in steps if word == "ENTRYPOINT"]
    assert entry == '["mlfabric"]' and "mlfabric" in project["scripts"]
    assert ("USER", "mlfabric") in steps  # not root
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert not set(needed) & set(ignored) and ".venv" in ignored


# --- Kubernetes: the whole job (mlfabric kube) ---------------------------------------

KUBERNETES = "1.30.0"  # the schemas the manifests are checked against (pod-index: 1.28+)
SIZES = [(1, 1, True), (2, 4, True), (3, 2, False)]


def kube_job(shards: int, workers: int, replicas: bool) -> dict[str, dict]:
    from mlfabric.tools.kube import JobSize, manifests

    size = JobSize(shards=shards, workers=workers, replicas=replicas)
    return {f"{m['kind']}/{m['metadata']['name']}": m for m in manifests(size)}


def pod_of(obj: dict) -> dict:
    return obj["spec"]["template"]["spec"]


def command_of(container: dict, **env: str) -> list[str]:
    """The container's command as Kubernetes runs it: $(VAR) from `env`."""
    return [re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], word)
            for word in container["command"]]


def ports_of(container: dict) -> dict[str, int]:
    return {p["name"]: p["containerPort"] for p in container["ports"]}


@pytest.mark.parametrize(("shards", "workers", "replicas"), SIZES)
def test_every_manifest_is_valid_kubernetes(shards, workers, replicas):
    import kubernetes_validate

    for name, obj in kube_job(shards, workers, replicas).items():
        try:
            kubernetes_validate.validate(obj, KUBERNETES, strict=True)
        except kubernetes_validate.ValidationError as exc:
            raise AssertionError(f"{name}: {exc.message}") from None


@pytest.mark.parametrize(("shards", "workers", "replicas"), SIZES)
def test_the_manifests_agree_with_the_cli_and_with_each_other(shards, workers, replicas):
    """Every command parses with mlfabric's CLI; every process listens on the
    port its container, its Service, its probe and its scrape annotation
    name; the controller's and the workers' server lists are the
    StatefulSet's pods, in shard order."""
    job = kube_job(shards, workers, replicas)
    sets = [("StatefulSet/mlfabric-server", "server")] + (
        [("StatefulSet/mlfabric-replica", "replica")] if replicas else [])
    servers = ",".join(f"mlfabric-server-{i}.mlfabric-server:7070" for i in range(shards))
    for key, role in sets:
        sts = job[key]
        assert sts["spec"]["replicas"] == shards
        (container,) = pod_of(sts)["containers"]
        ports = ports_of(container)
        for index in range(shards):
            argv = command_of(container, POD_INDEX=str(index))
            assert argv[0] == "mlfabric"
            args = build_parser(argv[1]).parse_args(argv[1:])
            assert args.listen == f"0.0.0.0:{ports['ps']}"
            assert args.metrics_port == ports["metrics"]
            assert args.token_file.startswith(container["volumeMounts"][0]["mountPath"])
            if role == "server":
                assert (args.shard, args.resume) == (f"{index}/{shards}", "auto")
            else:
                assert args.role == "replica"
                assert args.join_from == servers.split(",")[index]
        template = sts["spec"]["template"]
        assert template["metadata"]["annotations"]["prometheus.io/port"] == str(ports["metrics"])
        assert container["readinessProbe"]["httpGet"]["port"] == ports["metrics"]
        service = job[f"Service/{sts['spec']['serviceName']}"]
        assert service["spec"]["clusterIP"] == "None"  # stable pod names
        assert service["spec"]["selector"] == template["metadata"]["labels"]
        assert {p["targetPort"] for p in service["spec"]["ports"]} == set(ports.values())
    # the controller
    (ctl,) = pod_of(job["Deployment/mlfabric-controller"])["containers"]
    argv = command_of(ctl)
    args = build_parser(argv[1]).parse_args(argv[1:])
    ports = ports_of(ctl)
    assert args.listen == f"0.0.0.0:{ports['control']}" and args.metrics_port == ports["metrics"]
    assert ctl["readinessProbe"]["httpGet"]["port"] == ports["metrics"]
    assert job["Deployment/mlfabric-controller"]["spec"]["replicas"] == 1
    if replicas:
        assert args.server == servers
        assert args.replica == servers.replace("server", "replica")
    # the workers: one torchrun rank per pod, rendezvous at pod 0's stable name
    workers_job = job["Job/mlfabric-workers"]
    spec = workers_job["spec"]
    assert spec["completionMode"] == "Indexed"
    assert spec["completions"] == spec["parallelism"] == workers
    (w,) = pod_of(workers_job)["containers"]
    env = {e["name"]: e.get("value") for e in w["env"]}
    assert env["MLFABRIC_SERVER"] == servers
    assert env["MLFABRIC_CONTROLLER"] == f"mlfabric-controller:{ports['control']}"
    argv = command_of(w, JOB_COMPLETION_INDEX="0")
    assert argv[0] == "torchrun"
    assert argv[argv.index("--nnodes") + 1] == str(workers)
    subdomain = pod_of(workers_job)["subdomain"]
    assert argv[argv.index("--master-addr") + 1] == f"mlfabric-workers-0.{subdomain}"
    assert f"Service/{subdomain}" in job
    # the example the workers and the servers' init run is where the image puts it
    example = argv[-1]
    assert example.startswith("/opt/mlfabric/examples/")
    assert (ROOT / "examples" / Path(example).name).is_file()
    assert ("COPY", "examples /opt/mlfabric/examples") in dockerfile()


def test_mlfabric_kube_prints_one_list_and_refuses_bad_sizes():
    import json

    out = subprocess.run([sys.executable, "-m", "mlfabric", "kube", "--shards", "2",
                          "--workers", "3", "--namespace", "team-a"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    listed = json.loads(out.stdout)
    assert listed["kind"] == "List"
    assert {i["metadata"]["namespace"] for i in listed["items"]} == {"team-a"}
    for args, message in ((["--shards", "0"], "--shards 0: give 1 to 256 server shards"),
                          (["--job", "Digits"], "--job 'Digits': a Kubernetes name part"),
                          (["--workers", "0"], "--workers 0: give 1 to 10000 workers")):
        bad = subprocess.run([sys.executable, "-m", "mlfabric", "kube", *args],
                             capture_output=True, text=True, timeout=60)
        assert bad.returncode == 2 and message in bad.stderr, bad.stderr
        assert "Traceback" not in bad.stderr


def test_the_controller_names_hosts_as_the_agents_name_themselves():
    """With the nodes' IPs (--nodes), the controller polls each node's agent
    under the name that agent reports (the DaemonSet's --name=$(HOST_IP), on
    its --listen port), and the workers and servers are named by the same
    node IPs (the workers' MLFABRIC_HOST is their node's; the servers are on
    the node's network): one name per host across the network picture."""
    from mlfabric.tools.kube import JobSize, manifests

    nodes = ("10.0.0.1", "10.0.0.2", "10.0.0.3")
    job = {f"{m['kind']}/{m['metadata']['name']}": m
           for m in manifests(JobSize(shards=2, workers=3, nodes=nodes))}
    # what each node's agent calls itself, and where it listens
    agents = {}
    for node in nodes:
        args = build_parser("agent").parse_args(agent_argv(node)[1:])
        agents[args.name] = args.listen
    (ctl,) = pod_of(job["Deployment/mlfabric-controller"])["containers"]
    argv = command_of(ctl)
    args = build_parser("controller").parse_args(argv[1:])
    polled = dict(a.split("=", 1) for a in args.agent)
    assert polled == agents  # every agent, by the name it reports, at its address
    assert args.agent_key_file.startswith(ctl["volumeMounts"][0]["mountPath"])
    (w,) = pod_of(job["Job/mlfabric-workers"])["containers"]
    host = next(e for e in w["env"] if e["name"] == "MLFABRIC_HOST")
    assert host["valueFrom"]["fieldRef"]["fieldPath"] == "status.hostIP"
    for key in ("StatefulSet/mlfabric-server", "StatefulSet/mlfabric-replica"):
        assert pod_of(job[key])["hostNetwork"] is True
    with pytest.raises(ConfigError, match="--nodes: 'node-a' is not an IP address"):
        manifests(JobSize(nodes=("node-a",)))
    assert "--agents-dns" not in argv  # the nodes given are the agents read


def test_without_nodes_the_controller_finds_the_agents_through_their_service():
    """By default the controller looks the agents up (--agents-dns): the
    name is the DaemonSet's headless Service, in its namespace, over the
    agents' pods, on the port each agent listens on; every address it gives
    is a node's IP, the name that node's agent reports. --no-agents reads
    none. The DaemonSet's objects are valid Kubernetes."""
    import kubernetes_validate
    import yaml

    from mlfabric.tools.kube import JobSize, manifests

    docs = {f"{d['kind']}/{d['metadata']['name']}": d
            for d in yaml.safe_load_all(DAEMONSET.read_text())}
    for name, obj in docs.items():
        try:
            kubernetes_validate.validate(obj, KUBERNETES, strict=True)
        except kubernetes_validate.ValidationError as exc:
            raise AssertionError(f"{name}: {exc.message}") from None
    job = {f"{m['kind']}/{m['metadata']['name']}": m
           for m in manifests(JobSize(shards=2, workers=3))}
    (ctl,) = pod_of(job["Deployment/mlfabric-controller"])["containers"]
    args = build_parser("controller").parse_args(command_of(ctl)[1:])
    assert args.agent == [] and args.agent_key_file.endswith("/agent.key")
    name, port = args.agents_dns.rsplit(":", 1)
    service_name, namespace, svc = name.split(".")
    service = docs[f"Service/{service_name}"]
    daemonset = docs["DaemonSet/mlfabric-agent"]
    assert (svc, namespace) == ("svc", service["metadata"]["namespace"])
    assert namespace == daemonset["metadata"]["namespace"]
    assert service["spec"]["clusterIP"] == "None"  # each agent's own address
    labels = daemonset["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()
    assert daemonset["spec"]["template"]["spec"]["hostNetwork"] is True  # a node's IP
    listen = build_parser("agent").parse_args(agent_argv("10.0.0.1")[1:]).listen
    assert listen == f"10.0.0.1:{port}"
    assert [p["port"] for p in service["spec"]["ports"]] == [int(port)]
    job = {f"{m['kind']}/{m['metadata']['name']}": m
           for m in manifests(JobSize(agents=False))}
    (ctl,) = pod_of(job["Deployment/mlfabric-controller"])["containers"]
    assert not {"--agents-dns", "--agent", "--agent-key-file"} & set(ctl["command"])
    with pytest.raises(ConfigError, match="--nodes names the agents to read and --no-agents"):
        manifests(JobSize(nodes=("10.0.0.1",), agents=False))


def tls_handshake(server: ssl.SSLContext, client: ssl.SSLContext, dialled: str) -> None:
    """A real TLS handshake over loopback: the listener presents its
    certificate, the client checks it names `dialled` (as mlfabric's links
    do, `server_hostname` the host of the address). Raises what ssl raises."""
    import threading

    with socket.create_server(("127.0.0.1", 0)) as listener:
        listener.settimeout(10)
        port = listener.getsockname()[1]
        failed: list[BaseException] = []

        def accept() -> None:
            try:
                conn, _ = listener.accept()
                conn.settimeout(10)
                with server.wrap_socket(conn, server_side=True):
                    pass
            except (OSError, ssl.SSLError) as exc:  # the client gave up: its error tells
                failed.append(exc)

        t = threading.Thread(target=accept)
        t.start()
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=10) as raw, \
                    client.wrap_socket(raw, server_hostname=dialled):
                pass
        finally:
            t.join(10)
        assert not t.is_alive()


def test_the_job_on_tls_every_address_dialled_is_named_by_its_certificate(tmp_path):
    """`mlfabric kube --tls`: every mlfabric process of the job gets the
    certificate, its key and the CA from the Secret, and every address one
    process dials another at is named by the certificate that
    `mlfabric tls init --host "$(mlfabric kube --print-tls-host)"` makes (a
    real handshake per name); the controller's agents, by the agents'
    certificate naming the nodes' IPs (deploy/README.md)."""
    import kubernetes_validate

    from mlfabric.config import resolve
    from mlfabric.tools import tls_cli
    from mlfabric.tools.kube import TLS_SECRET, JobSize, manifests, tls_host
    from mlfabric.transport import tls

    nodes = ("10.0.0.1", "10.0.0.2", "10.0.0.3")
    size = JobSize(shards=2, workers=3, nodes=nodes, tls=True)
    job = {f"{m['kind']}/{m['metadata']['name']}": m for m in manifests(size)}
    for name, obj in job.items():
        try:
            kubernetes_validate.validate(obj, KUBERNETES, strict=True)
        except kubernetes_validate.ValidationError as exc:
            raise AssertionError(f"{name}: {exc.message}") from None

    def tls_files(pod: dict, container: dict, cert: str | None, key: str | None,
                  ca: str | None) -> None:
        """The three files are in the container's mount of the TLS Secret."""
        (volume,) = [v for v in pod["volumes"] if v.get("secret", {}).get("secretName")
                     == TLS_SECRET]
        (mount,) = [m for m in container["volumeMounts"] if m["name"] == volume["name"]]
        assert (cert, key, ca) == tuple(f"{mount['mountPath']}/{f}"
                                        for f in ("job.pem", "job.key", "ca.pem"))

    def hosts(*addresses: str | None) -> set[str]:
        return {a.rsplit(":", 1)[0] for value in addresses if value
                for a in value.split(",")}

    dialled: set[str] = set()  # job addresses, by the job's certificate
    for key in ("StatefulSet/mlfabric-server", "StatefulSet/mlfabric-replica"):
        pod = pod_of(job[key])
        (container,) = pod["containers"]
        for index in range(size.shards):
            argv = command_of(container, POD_INDEX=str(index))
            args = build_parser(argv[1]).parse_args(argv[1:])
            tls_files(pod, container, args.tls_cert, args.tls_key, args.tls_ca)
            dialled |= hosts(getattr(args, "join_from", None), getattr(args, "advertise", None),
                             getattr(args, "controller", None))
    pod = pod_of(job["Deployment/mlfabric-controller"])
    (ctl,) = pod["containers"]
    args = build_parser("controller").parse_args(command_of(ctl)[1:])
    tls_files(pod, ctl, args.tls_cert, args.tls_key, args.tls_ca)
    dialled |= hosts(args.server, args.replica)
    agents = hosts(*(a.split("=", 1)[1] for a in args.agent))
    assert agents == set(nodes)
    pod = pod_of(job["Job/mlfabric-workers"])
    (w,) = pod["containers"]
    settings = resolve(environ={e["name"]: e["value"] for e in w["env"] if "value" in e})
    tls_files(pod, w, settings.tls_cert, settings.tls_key, settings.tls_ca)
    dialled |= hosts(settings.server, settings.replica, settings.controller)
    assert len(dialled) == 2 * size.shards + 1  # servers, replicas, the controller

    # the certificates as the guide makes them, and a handshake per name dialled
    tls_cli.init(tmp_path, [tls_host(size), "agents," + ",".join(nodes)])
    job_files = tls.TLSFiles(str(tmp_path / "job.pem"), str(tmp_path / "job.key"),
                             str(tmp_path / "ca.pem"))
    agent_files = tls.TLSFiles(str(tmp_path / "agents.pem"), str(tmp_path / "agents.key"),
                               str(tmp_path / "ca.pem"))
    client = tls.client_context(job_files)
    for host in sorted(dialled):
        tls_handshake(tls.server_context(job_files), client, host)
    for host in sorted(agents):
        tls_handshake(tls.server_context(agent_files), client, host)
    # and the check is real: a name the certificate lacks is refused
    with pytest.raises(ssl.SSLCertVerificationError, match="mlfabric-server-2"):
        tls_handshake(tls.server_context(job_files), client,
                      "mlfabric-server-2.mlfabric-server")
    out = subprocess.run([sys.executable, "-m", "mlfabric", "kube", "--shards", "2",
                          "--print-tls-host"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == tls_host(size), out.stderr


def test_kube_out_is_a_kustomization_kubectl_builds_and_an_overlay_patches(tmp_path):
    """`mlfabric kube --out DIR`: job.json beside a kustomization.
    `kubectl kustomize DIR` (kubectl's own kustomize, offline) builds exactly
    the job's objects, and an overlay naming DIR as its base changes every
    pod's image, as deploy/README.md tells operators to do."""
    import json

    import yaml

    from mlfabric.tools.kube import JobSize, as_list

    out = tmp_path / "digits"
    run = subprocess.run([sys.executable, "-m", "mlfabric", "kube", "--shards", "2",
                          "--workers", "3", "--out", str(out)],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == [str(out / "job.json"), str(out / "kustomization.yaml")]
    expected = as_list(JobSize(shards=2, workers=3))["items"]
    assert json.loads((out / "job.json").read_text())["items"] == expected
    kustomization = yaml.safe_load((out / "kustomization.yaml").read_text())
    assert kustomization["resources"] == ["job.json"]
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed: the kustomization was written, not built")

    def build(directory: Path) -> list[dict]:
        done = subprocess.run([kubectl, "kustomize", str(directory)], capture_output=True,
                              text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        return sorted(yaml.safe_load_all(done.stdout),
                      key=lambda o: (o["kind"], o["metadata"]["name"]))

    assert build(out) == sorted(expected, key=lambda o: (o["kind"], o["metadata"]["name"]))
    overlay = tmp_path / "overlay"
    overlay.mkdir()
    (overlay / "kustomization.yaml").write_text(
        "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\n"
        "resources:\n  - ../digits\n"
        "images:\n  - name: ghcr.io/mlfabric/mlfabric-torch\n    newTag: \"9.9.9\"\n")
    images = {c["image"] for o in build(overlay) if "template" in o.get("spec", {})
              for c in [*pod_of(o)["containers"], *pod_of(o).get("initContainers", [])]}
    assert images == {"ghcr.io/mlfabric/mlfabric-torch:9.9.9"}


def test_the_documented_secrets_hold_every_file_the_pods_read(tmp_path):
    """Each `kubectl create secret generic` that deploy/README.md and the
    DaemonSet's header tell the operator to run (run here with
    --dry-run=client: kubectl builds the Secret offline) holds every file a
    pod reads from its mount of that Secret: the tokens, the agent key, the
    job's and the agents' certificates."""
    import json

    import yaml

    from mlfabric.tools.kube import JobSize, manifests

    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed: it builds the documented Secrets")
    texts = [(ROOT / "deploy" / "README.md").read_text(),
             "\n".join(x.lstrip("#").strip() for x in DAEMONSET.read_text().splitlines()
                       if x.startswith("#"))]
    commands = {}
    for text in texts:
        for line in re.sub(r"\\\n\s*", " ", text).splitlines():
            if line.startswith("kubectl") and " create secret generic " in line:
                argv = shlex.split(line)
                commands[argv[argv.index("generic") + 1]] = argv
    made: dict[str, set[str]] = {}
    for name, argv in commands.items():
        for arg in argv:
            if arg.startswith("--from-file="):
                path = tmp_path / arg.split("=")[-1]
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text("x\n")
        done = subprocess.run([kubectl, *argv[1:], "--dry-run=client", "-o", "json"],
                              capture_output=True, text=True, timeout=60, cwd=tmp_path)
        assert done.returncode == 0, done.stderr
        made[name] = set(json.loads(done.stdout)["data"])
    # what the pods read: each path under a Secret's mount, by Secret
    pods = [pod_of(m) for m in manifests(JobSize(shards=2, workers=2, tls=True))
            if "template" in m["spec"]]
    daemonset = next(d for d in yaml.safe_load_all(DAEMONSET.read_text())
                     if d["kind"] == "DaemonSet")
    pods.append(pod_of(daemonset))
    told = re.findall(r'"tls_\w+": "([^"]+)"', DAEMONSET.read_text())  # agent.json's keys
    needed: dict[str, set[str]] = {}
    for pod in pods:
        secrets = {v["name"]: v["secret"]["secretName"] for v in pod["volumes"] if "secret" in v}
        for c in [*pod["containers"], *pod.get("initContainers", [])]:
            words = [*c["command"], *(e.get("value", "") for e in c.get("env", []))]
            if pod is pods[-1]:
                words += told
            for mount in c.get("volumeMounts", []):
                if mount["name"] in secrets:
                    prefix = mount["mountPath"] + "/"
                    needed.setdefault(secrets[mount["name"]], set()).update(
                        w[len(prefix):] for w in words if w.startswith(prefix))
    assert set(needed) == {"mlfabric-job-token", "mlfabric-tls", "mlfabric-cluster-token",
                           "mlfabric-agent-tls"}
    assert needed["mlfabric-job-token"] == {"job.token", "agent.key"}
    for name, files in needed.items():
        assert name in made, f"no documented command makes Secret {name}"
        assert files <= made[name], f"Secret {name} lacks {sorted(files - made[name])}"
