"""The monitoring files agree with each other and with the compose file: the dashboard names its datasource
by the provisioned uid, the job names it filters `up` by are the ones Prometheus gives its targets, those
targets are the services' --metrics-port on an address Prometheus can reach, and there is one copy of the
dashboard. How names are read off PromQL and /metrics text is tested here too; that every metric the
dashboard reads is exported by a live cluster is tests/integration/test_dashboard.py."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.dashboard_metrics import (
    DASHBOARD,
    REPO,
    dashboard_metric_names,
    dashboard_queries,
    exported_sample_names,
    query_metric_names,
)

MONITORING_K8S = REPO / "deploy" / "kubernetes" / "base" / "monitoring"
COMPOSE_PROMETHEUS = REPO / "deploy" / "monitoring" / "prometheus.yml"
HOST_PROMETHEUS = REPO / "deploy" / "monitoring" / "prometheus.host.yml"


class _ComposeLoader(yaml.SafeLoader):
    """Reads compose's merge tags (`!reset`, `!override`) as the plain value they tag."""


def _untagged(loader: yaml.SafeLoader, suffix: str, node: yaml.Node) -> Any:
    if isinstance(node, yaml.MappingNode):
        return loader.construct_mapping(node, deep=True)
    if isinstance(node, yaml.SequenceNode):
        return loader.construct_sequence(node, deep=True)
    return loader.construct_scalar(node)  # type: ignore[arg-type]


_ComposeLoader.add_multi_constructor("!", _untagged)


def _yaml(path: Path) -> Any:
    return yaml.load(path.read_text(), Loader=_ComposeLoader)


def _dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def _panels(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    panels = []
    for panel in dashboard["panels"]:
        panels.append(panel)
        panels.extend(panel.get("panels", []))  # a collapsed row holds its panels
    return panels


def _static_targets(config: Path) -> dict[str, list[str]]:
    """job -> its static targets, from a Prometheus config."""
    return {job["job_name"]: [t for group in job["static_configs"] for t in group["targets"]]
            for job in _yaml(config)["scrape_configs"]}


def _flag(command: list[str], name: str) -> str | None:
    values = [arg.split("=", 1)[1] for arg in command if arg.startswith(f"{name}=")]
    return values[-1] if values else None


@pytest.mark.parametrize(("expr", "names"), [
    ("l4m_scheduler_queue_depth", {"l4m_scheduler_queue_depth"}),
    ('sum by (kind) (rate(l4m_scheduler_commands_total{kind!="x"}[$__rate_interval]))',
     {"l4m_scheduler_commands_total"}),
    ('histogram_quantile(0.99, sum by (le, kind) (rate(a_seconds_bucket{kind="forward_text"}[5m])))',
     {"a_seconds_bucket"}),
    ("sum(rate(a_sum[1m])) by (kind) / sum(rate(a_count[1m])) by (kind)", {"a_sum", "a_count"}),
    ("a * on(instance) group_left(kind) b unless c offset 1h > bool 1e3", {"a", "b", "c"}),
    ("max_over_time(rate(x_total[5m])[1h:1m])", {"x_total"}),
    ('up{job=~"l4m-.*"} and ignoring(job) ns:recorded:rule', {"up", "ns:recorded:rule"}),
    ('count(label_values("no_metric_in_a_string"))', set()),
    ("sum without (instance) (g) / ${divisor}", {"g"}),
])
def test_query_metric_names_reads_metrics_only(expr: str, names: set[str]) -> None:
    assert query_metric_names(expr) == names


def test_dashboard_queries_are_found_in_rows_and_templating() -> None:
    dashboard = {"panels": [{"type": "row", "panels": [{"targets": [{"expr": "a"}]}]}, {"targets": [{"expr": "b"}]}],
                 "templating": {"list": [{"query": {"expr": "c"}}]}}
    assert sorted(dashboard_queries(dashboard)) == ["a", "b", "c"]
    assert dashboard_metric_names({"panels": [{"targets": [{"expr": "up + d"}]}]}) == {"d": ["up + d"]}


EXPOSITION = """\
# HELP c_total Counted.
# TYPE c_total counter
c_total{kind="x"} 1.0
# HELP h_seconds Timed.
# TYPE h_seconds histogram
# HELP g A gauge.
# TYPE g gauge
g 3.0
"""


def test_exported_names_expand_each_family_by_its_type() -> None:
    names = exported_sample_names([EXPOSITION])
    # A counter is stored as x_total; a histogram with no observation yet still declares its series.
    assert {"c_total", "h_seconds_bucket", "h_seconds_sum", "h_seconds_count", "g"} <= names
    # ... and nothing else: a histogram is never queried bare, a gauge has no buckets, a counter no bare name.
    assert not {"h_seconds", "g_bucket", "c", "c_total_total"} & names


def test_every_panel_and_query_names_the_provisioned_datasource_by_uid() -> None:
    [datasource] = _yaml(MONITORING_K8S / "grafana" / "datasources.yaml")["datasources"]
    assert datasource["type"] == "prometheus"
    wanted = {"type": "prometheus", "uid": datasource["uid"]}
    panels = [p for p in _panels(_dashboard()) if p["type"] != "row"]
    assert len(panels) >= 15
    for panel in panels:
        assert panel["datasource"] == wanted, panel["title"]
        assert panel["targets"], f"panel {panel['title']!r} has no query"
        for target in panel["targets"]:
            assert target.get("datasource", wanted) == wanted, panel["title"]
            assert target["expr"].strip(), panel["title"]


def test_panel_ids_are_unique_and_every_panel_has_a_title_and_description() -> None:
    panels = _panels(_dashboard())
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), ids
    for panel in panels:
        assert panel["title"].strip()
        assert panel["type"] == "row" or panel["description"].strip(), panel["title"]


def test_panels_fit_the_24_column_grid_without_overlapping() -> None:
    taken: dict[tuple[int, int], str] = {}
    for panel in _panels(_dashboard()):
        grid = panel["gridPos"]
        assert grid["x"] >= 0 and grid["w"] > 0 and grid["h"] > 0 and grid["x"] + grid["w"] <= 24, panel["title"]
        for cell in ((x, y) for x in range(grid["x"], grid["x"] + grid["w"])
                     for y in range(grid["y"], grid["y"] + grid["h"])):
            assert cell not in taken, f"{panel['title']!r} overlaps {taken[cell]!r}"
            taken[cell] = panel["title"]


def test_the_jobs_the_dashboard_filters_by_are_the_jobs_prometheus_scrapes() -> None:
    matchers = set()
    for expr in dashboard_queries(_dashboard()):
        matchers.update(re.findall(r'job(=~|=)"([^"]*)"', expr))
    assert matchers, "the dashboard filters no query by job"
    for config in (COMPOSE_PROMETHEUS, HOST_PROMETHEUS):
        jobs = set(_static_targets(config))
        for operator, value in matchers:
            matched = {job for job in jobs if (re.fullmatch(value, job) if operator == "=~" else job == value)}
            assert matched, f"{config.name} has no job matching job{operator}{value!r}; its jobs: {sorted(jobs)}"


def _relabel(rules: list[dict[str, Any]], labels: dict[str, str]) -> dict[str, str] | None:
    """Prometheus' `keep` and `replace` relabelling (anchored regexes, sources joined by ';'); None: dropped."""
    labels = dict(labels)
    for rule in rules:
        value = ";".join(labels.get(name, "") for name in rule.get("source_labels", []))
        match = re.fullmatch(rule.get("regex", "(.*)"), value)
        action = rule.get("action", "replace")
        if action == "keep":
            if match is None:
                return None
        elif action == "replace":
            if match is not None:
                # Prometheus writes groups as $1, Python's Match.expand as \g<1>.
                labels[rule["target_label"]] = match.expand(re.sub(r"\$(\d+)", r"\\g<\1>",
                                                                   rule.get("replacement", "$1")))
        else:
            raise AssertionError(f"relabel action {action!r} not emulated here")
    return labels


def test_kubernetes_prometheus_gives_the_l4m_pods_the_compose_job_names_and_ports() -> None:
    """Kubernetes' Prometheus config over the pods of deploy/kubernetes/base: one target per service, named
    as compose's jobs, at the port compose scrapes."""
    [scrape] = _yaml(MONITORING_K8S / "prometheus" / "prometheus.yml")["scrape_configs"]
    found: dict[str, set[int]] = {}
    for manifest in sorted((REPO / "deploy" / "kubernetes" / "base").glob("*.yaml")):
        for workload in yaml.safe_load_all(manifest.read_text()):
            if not workload or workload["kind"] not in ("Deployment", "StatefulSet"):
                continue
            pod = workload["spec"]["template"]
            annotations = pod["metadata"].get("annotations", {})
            meta = {f"__meta_kubernetes_pod_annotation_{re.sub(r'[^a-zA-Z0-9_]', '_', key)}": value
                    for key, value in annotations.items()}
            for container in pod["spec"]["containers"]:
                for port in container.get("ports", []):
                    target = _relabel(scrape["relabel_configs"], {
                        **meta, "__meta_kubernetes_pod_phase": "Running",
                        "__meta_kubernetes_pod_name": f"{workload['metadata']['name']}-0",
                        "__meta_kubernetes_pod_container_name": container["name"],
                        "__meta_kubernetes_pod_container_port_name": port.get("name", ""),
                        "__address__": f"10.0.0.1:{port['containerPort']}", "job": scrape["job_name"]})
                    if target is not None:
                        found.setdefault(target["job"], set()).add(int(target["__address__"].rsplit(":", 1)[1]))
    compose = {job: {int(t.rsplit(":", 1)[1]) for t in targets}
               for job, targets in _static_targets(COMPOSE_PROMETHEUS).items()}
    assert found == compose


def test_compose_prometheus_scrapes_every_service_at_its_metrics_port_on_all_interfaces() -> None:
    services = _yaml(REPO / "docker-compose.yml")["services"]
    targets = _static_targets(COMPOSE_PROMETHEUS)
    assert set(targets) == {"l4m-scheduler", "l4m-executor", "l4m-spawner", "l4m-gateway"}
    for job, job_targets in targets.items():
        for target in job_targets:
            service, port = target.split(":")
            assert f"l4m-{service}" == job, target
            command = services[service]["command"]
            assert _flag(command, "--metrics-port") == port, (service, command)
            assert _flag(command, "--metrics-host") == "0.0.0.0", (service, command)  # reachable from Prometheus
            if service != "spawner":  # whose metrics port compose published before (L4M_SPAWNER_METRICS_PORT)
                published = [mapping.rsplit(":", 1)[-1] for mapping in services[service].get("ports", [])]
                assert port not in published, f"{service}'s metrics port is published on the host"
    # The CPU override replaces the executor's command: its metrics must stay on.
    cpu_command = _yaml(REPO / "docker-compose.cpu.yml")["services"]["executor"]["command"]
    assert _flag(cpu_command, "--metrics-port") == "9420" and _flag(cpu_command, "--metrics-host") == "0.0.0.0"


def test_host_network_prometheus_scrapes_the_default_loopback_metrics_ports() -> None:
    services = _yaml(REPO / "docker-compose.host.yml")["services"]
    for job, job_targets in _static_targets(HOST_PROMETHEUS).items():
        command = services[job.removeprefix("l4m-")]["command"]
        port = re.fullmatch(r"\$\{L4M_\w+_METRICS_PORT:-(\d+)\}", _flag(command, "--metrics-port") or "")
        assert port is not None, command
        assert job_targets == [f"127.0.0.1:{port.group(1)}"]
        assert _flag(command, "--metrics-host") in (None, "127.0.0.1")  # loopback on the host's network
    for service in ("prometheus", "grafana"):
        assert services[service]["profiles"] == ["monitoring"]  # never started by the compose test


def test_grafana_and_prometheus_are_published_on_loopback_only_whatever_the_bind_address() -> None:
    services = _yaml(REPO / "docker-compose.yml")["services"]
    assert services["grafana"]["ports"] == ["127.0.0.1:${L4M_GRAFANA_PORT:-3000}:3000"]
    assert services["prometheus"]["ports"] == ["127.0.0.1:${L4M_PROMETHEUS_PORT:-9090}:9090"]
    host = _yaml(REPO / "docker-compose.host.yml")["services"]
    assert host["grafana"]["environment"]["GF_SERVER_HTTP_ADDR"] == "127.0.0.1"
    assert "--web.listen-address=127.0.0.1:${L4M_PROMETHEUS_PORT:-9090}" in host["prometheus"]["command"]


def test_one_copy_of_the_dashboard_mounted_by_compose_and_generated_by_kustomize() -> None:
    copies = [p for p in REPO.glob("deploy/**/*.json") if p.name == DASHBOARD.name]
    assert copies == [DASHBOARD]
    mounts = _yaml(REPO / "docker-compose.yml")["services"]["grafana"]["volumes"]
    assert f"./{DASHBOARD.parent.relative_to(REPO)}:/etc/l4m/grafana/dashboards:ro" in mounts
    providers = _yaml(MONITORING_K8S / "grafana" / "dashboards.yaml")["providers"]
    assert [p["options"]["path"] for p in providers] == ["/etc/l4m/grafana/dashboards"]
    kustomization = _yaml(MONITORING_K8S / "kustomization.yaml")
    generated = {name for generator in kustomization["configMapGenerator"] for name in generator["files"]}
    assert f"dashboards/{DASHBOARD.name}" in generated
    for name in generated:  # kustomize refuses files outside its root
        path = (MONITORING_K8S / name).resolve()
        assert path.is_file() and MONITORING_K8S in path.parents, name
    for resource in kustomization["resources"]:
        assert (MONITORING_K8S / resource).is_file(), resource


def test_kubernetes_runs_the_monitoring_images_compose_runs() -> None:
    services = _yaml(REPO / "docker-compose.yml")["services"]
    images = {}
    for manifest in ("jaeger.yaml", "prometheus.yaml", "grafana.yaml"):
        for workload in yaml.safe_load_all((MONITORING_K8S / manifest).read_text()):
            if workload["kind"] == "Deployment":
                [container] = workload["spec"]["template"]["spec"]["containers"]
                images[workload["metadata"]["name"]] = container["image"]
    assert set(images) == {"jaeger", "prometheus", "grafana"}
    for name, image in images.items():
        default = re.fullmatch(r"\$\{L4M_\w+_IMAGE:-([^}]+)\}", services[name]["image"])
        assert default is not None and default.group(1) == image, (name, services[name]["image"], image)
