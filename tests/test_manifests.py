"""The cluster manifests in deploy/ (none of it can run here: no container engine, no Qdrant or
Temporal server binaries) are parsed and checked against the code: names, ports, settings, queues."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path
from unittest import mock

import pytest
import yaml

from api.routes import health
from ragline.settings import Settings
from temporal import queues

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"
ROLES = [r for r in queues.ROLES if r != "all"]


def _docs(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


@pytest.fixture(scope="module")
def objects() -> dict[tuple[str, str], dict]:
    found: dict[tuple[str, str], dict] = {}
    for path in sorted((DEPLOY / "k8s").glob("*.yaml")):
        for doc in _docs(path):
            key = (doc["kind"], doc["metadata"]["name"])
            assert key not in found, f"{key} defined twice"
            found[key] = doc
    return found


@pytest.fixture(scope="module")
def config(objects) -> dict[str, str]:
    return objects[("ConfigMap", "ragline-config")]["data"]


def _ragline_deployments(objects) -> dict[str, dict]:
    """The API's and every worker role's Deployment: the pods that run Ragline's image."""
    return {name: doc for (kind, name), doc in objects.items()
            if kind == "Deployment" and (name == "ragline-api" or name.startswith("ragline-worker-"))}


def _container(deployment: dict) -> dict:
    [container] = deployment["spec"]["template"]["spec"]["containers"]
    return container


def _env(objects, deployment: dict) -> dict[str, str]:
    """The container's environment as the pod sees it: envFrom ConfigMaps/Secrets, then env (a Secret's
    key by secretKeyRef; a pod field as `<fieldPath>`)."""
    c = _container(deployment)
    env: dict[str, str] = {}
    for source in c.get("envFrom", []):
        if "configMapRef" in source:
            env.update(objects[("ConfigMap", source["configMapRef"]["name"])]["data"])
        else:
            env.update(objects[("Secret", source["secretRef"]["name"])]["stringData"])
    for e in c.get("env", []):
        source = e.get("valueFrom", {})
        if "secretKeyRef" in source:
            ref = source["secretKeyRef"]
            env[e["name"]] = objects[("Secret", ref["name"])]["stringData"][ref["key"]]
        elif "fieldRef" in source:
            env[e["name"]] = f"<{source['fieldRef']['fieldPath']}>"
        else:
            env[e["name"]] = e.get("value")
    return env


def _settings(env: dict[str, str]) -> Settings:
    """The settings a pod with this environment reads (values parsed as from the environment: JSON lists...)."""
    ragline = {k: v for k, v in env.items() if k.startswith("RAGLINE_") and v not in (None, "")}
    others = {k: v for k, v in os.environ.items() if not k.startswith("RAGLINE_")}
    with mock.patch.dict(os.environ, {**others, **ragline}, clear=True):
        return Settings()


def test_every_manifest_parses_and_has_the_basics(objects):
    assert objects
    for (kind, name), doc in objects.items():
        assert doc["apiVersion"] and doc["metadata"]["name"] == name
    kinds = {k for k, _ in objects}
    assert {"Deployment", "Service", "StatefulSet", "ScaledObject", "Secret", "ConfigMap",
            "TriggerAuthentication", "PersistentVolumeClaim", "NetworkPolicy"} <= kinds


def test_every_ragline_variable_is_a_setting_and_parses(objects):
    fields = {f"RAGLINE_{name.upper()}" for name in Settings.model_fields}
    for name, doc in _ragline_deployments(objects).items():
        env = _env(objects, doc)
        unknown = {k for k in env if k.startswith("RAGLINE_")} - fields
        assert not unknown, f"{name}: not settings: {unknown}"
        settings = _settings(env)
        settings.worker_processes  # the topology check passes with these settings
        assert settings.qdrant_url, f"{name}: on a cluster every role talks to the Qdrant server"


def test_a_deployment_per_role_running_that_role(objects, config):
    for role in ROLES:
        deployment = objects[("Deployment", f"ragline-worker-{role}")]
        command = _container(deployment)["command"]
        assert command[-3:] == ["worker.py", "--role", role]
        labels = deployment["spec"]["template"]["metadata"]["labels"]
        assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()
        env = _env(objects, deployment)
        drain = float(env["RAGLINE_WORKER_GRACEFUL_SHUTDOWN"])
        grace = deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
        assert grace > drain, f"{role}: the pod is killed before its worker has drained"
        if role == "llm":
            # A pod scaled in (or rolled) mid-call lets the call end: cut off, it runs again elsewhere
            # and the model is paid twice.
            timeout = float(env.get("RAGLINE_LLM_TIMEOUT", Settings.model_fields["llm_timeout"].default))
            assert drain >= timeout, f"{role}: drains for {drain:g} s, a model call may take {timeout:g} s"
    workers = {n for k, n in objects if k == "Deployment" and n.startswith("ragline-worker-")}
    assert workers == {f"ragline-worker-{r}" for r in ROLES}


def test_keda_scales_each_role_on_its_own_queues(objects, config):
    task_queue = config["RAGLINE_TASK_QUEUE"]
    for role in ROLES:
        scaled = objects[("ScaledObject", f"ragline-worker-{role}")]
        assert scaled["spec"]["scaleTargetRef"]["name"] == f"ragline-worker-{role}"
        triggers = scaled["spec"]["triggers"]
        assert {t["type"] for t in triggers} == {"temporal"}
        assert sorted(t["metadata"]["taskQueue"] for t in triggers) == sorted(queues.role_queues(task_queue, role))
        for t in triggers:
            meta = t["metadata"]
            kind = next(k for k in queues.ROLES[role] if queues.queue_name(task_queue, k) == meta["taskQueue"])
            types = set(meta["queueTypes"].split(","))
            assert types == ({"workflow", "activity"} if kind in queues.WORKFLOW_KINDS else {"activity"}), role
            assert meta["endpoint"] == config["RAGLINE_TEMPORAL_ADDRESS"]
            assert meta["namespace"] == config["RAGLINE_TEMPORAL_NAMESPACE"]
            assert int(meta["targetQueueSize"]) >= 1
            assert meta["workerDeploymentName"] == config["RAGLINE_WORKER_DEPLOYMENT_NAME"]
            assert meta["workerDeploymentBuildId"] == config["RAGLINE_WORKER_BUILD_ID"]
            assert ("TriggerAuthentication", t["authenticationRef"]["name"]) in objects
        assert scaled["spec"]["minReplicaCount"] <= scaled["spec"]["maxReplicaCount"]


def test_keda_holds_each_roles_backlog_under_the_alerts_line(objects):
    """The backlog alert (deploy/prometheus/rules.yml) fires once a queue's backlog is over 80% of its workers'
    activity slots. KEDA holds a role's backlog at up to targetQueueSize per pod: were that over 80% of a pod's
    slots, the alert would fire ("add workers") while KEDA scales as designed (vector: 20 queued per pod of 8
    slots)."""
    from worker import activity_slot_limit

    for role in ROLES:
        settings = _settings(_env(objects, objects[("Deployment", f"ragline-worker-{role}")]))
        for t in objects[("ScaledObject", f"ragline-worker-{role}")]["spec"]["triggers"]:
            kind = next(k for k in queues.ROLES[role]
                        if queues.queue_name(settings.task_queue, k) == t["metadata"]["taskQueue"])
            slots = activity_slot_limit(settings, kind)
            assert int(t["metadata"]["targetQueueSize"]) <= 0.8 * slots, (role, kind, slots)


def test_the_build_id_is_the_image_tag(objects, config):
    for name, doc in _ragline_deployments(objects).items():
        assert _container(doc)["image"].rsplit(":", 1)[1] == config["RAGLINE_WORKER_BUILD_ID"], name


def test_every_worker_is_restarted_once_its_alive_file_goes_stale(objects, tmp_path):
    """Each worker role touches the file its env names (RAGLINE_WORKER_ALIVE_FILE), and its probes read that
    file: run here as the kubelet runs them, they pass on a fresh file and fail on one older than a minute, or
    on none (a worker not yet polling, at start)."""
    workers = {name: doc for name, doc in _ragline_deployments(objects).items() if name.startswith("ragline-worker-")}
    assert len(workers) == len(queues.ROLES) - 1  # every role but "all" (one process for make run)
    for name, deployment in workers.items():
        c = _container(deployment)
        alive = _env(objects, deployment)["RAGLINE_WORKER_ALIVE_FILE"]
        assert Settings(worker_alive_file=alive).worker_alive_file.parent.as_posix() == \
            next(m["mountPath"] for m in c["volumeMounts"] if m["name"] == "tmp"), name  # writable
        for probe in ("startupProbe", "livenessProbe"):
            command = c[probe]["exec"]["command"]
            assert alive in command[-1], (name, probe)
            here = tmp_path / f"{name}-{probe}"
            run = [*command[:-1], command[-1].replace(alive, str(here))]
            assert subprocess.run(run).returncode != 0, (name, probe, "no file yet")
            here.touch()
            assert subprocess.run(run).returncode == 0, (name, probe, "fresh")
            if probe == "livenessProbe":
                stale = time.time() - 120
                os.utime(here, (stale, stale))
                assert subprocess.run(run).returncode != 0, (name, probe, "two minutes old")
        # A stale file fails the pod after some minutes, not at the first late touch (every 10 s by default).
        live = c["livenessProbe"]
        assert live["periodSeconds"] * live["failureThreshold"] >= 6 * Settings().worker_alive_every, name


def test_api_ports_and_probe(objects):
    api = objects[("Deployment", "ragline-api")]
    c = _container(api)
    env = _env(objects, api)
    port = Settings(api_port=env["RAGLINE_API_PORT"]).api_port
    assert c["ports"][0]["containerPort"] == port and c["command"][-1] == str(port)
    assert env["RAGLINE_API_HOST"] == "0.0.0.0"
    # Probes ask the process, not Temporal (a Temporal outage would take every replica out of service at once).
    assert c["readinessProbe"]["httpGet"]["path"] == c["livenessProbe"]["httpGet"]["path"] == "/livez"
    assert "/livez" in {route.path for route in health.router.routes}
    service = objects[("Service", "ragline-api")]
    assert service["spec"]["ports"][0]["targetPort"] == c["ports"][0]["name"]
    assert service["spec"]["selector"].items() <= api["spec"]["template"]["metadata"]["labels"].items()


def test_qdrant_server_matches_the_url_and_the_key(objects, config):
    from urllib.parse import urlsplit

    url = urlsplit(config["RAGLINE_QDRANT_URL"])
    service = objects[("Service", url.hostname.split(".")[0])]
    assert url.port in {p["port"] for p in service["spec"]["ports"]}
    statefulset = objects[("StatefulSet", "qdrant")]
    c = _container(statefulset)
    assert url.port in {p["containerPort"] for p in c["ports"]}
    [key] = [e for e in c["env"] if e["name"] == "QDRANT__SERVICE__API_KEY"]
    ref = key["valueFrom"]["secretKeyRef"]
    assert ref["key"] in objects[("Secret", ref["name"])]["stringData"]
    assert ref["key"] == "RAGLINE_QDRANT_API_KEY"  # the workers get the same key under its setting name


def test_api_replicas_share_their_rate_limits_in_the_redis_service(objects):
    from urllib.parse import urlsplit

    api = objects[("Deployment", "ragline-api")]
    assert api["spec"]["replicas"] > 1
    url = urlsplit(_env(objects, api)["RAGLINE_RATE_LIMIT_STORAGE"])
    assert url.scheme in {"redis", "rediss"}  # memory:// would give each replica counters of its own
    service = objects[("Service", url.hostname.split(".")[0])]
    redis = objects[("Deployment", "ragline-redis")]
    assert service["spec"]["selector"].items() <= redis["spec"]["template"]["metadata"]["labels"].items()
    [port] = [p for p in service["spec"]["ports"] if p["port"] == url.port]
    c = _container(redis)
    assert port["targetPort"] in {p["name"] for p in c["ports"]}
    # The password in the API's URL is the one the server requires.
    assert c["args"][c["args"].index("--requirepass") + 1] == "$(REDIS_PASSWORD)"
    [password] = [e for e in c["env"] if e["name"] == "REDIS_PASSWORD"]
    ref = password["valueFrom"]["secretKeyRef"]
    assert objects[("Secret", ref["name"])]["stringData"][ref["key"]] == url.password


def test_mounted_secrets_and_volumes_exist(objects, config):
    tls_dir = str(Path(config["RAGLINE_TEMPORAL_TLS_CA"]).parent)
    for name, doc in _ragline_deployments(objects).items():
        spec = doc["spec"]["template"]["spec"]
        volumes = {v["name"]: v for v in spec["volumes"]}
        mounts = {m["mountPath"]: m["name"] for m in _container(doc)["volumeMounts"]}
        secret = volumes[mounts[tls_dir]]["secret"]["secretName"]
        stored = objects[("Secret", secret)]["stringData"]
        for setting in ("RAGLINE_TEMPORAL_TLS_CA", "RAGLINE_TEMPORAL_TLS_CERT", "RAGLINE_TEMPORAL_TLS_KEY"):
            assert Path(config[setting]).name in stored, setting
        # One API keys file and one set of payload keys for the API and every worker (a pod that made
        # its own codec key could not read what the others wrote).
        for setting in ("RAGLINE_API_KEYS_FILE", "RAGLINE_CODEC_KEYS_FILE"):
            path = Path(config[setting])
            files = objects[("Secret", volumes[mounts[str(path.parent)]]["secret"]["secretName"])]["stringData"]
            assert path.name in files, (name, setting)
        # The blob store is shared by the API and every worker.
        blobs = volumes[mounts[str(Settings(data_dir=config["RAGLINE_DATA_DIR"]).blob_dir)]]
        claim = blobs["persistentVolumeClaim"]["claimName"]
        assert "ReadWriteMany" in objects[("PersistentVolumeClaim", claim)]["spec"]["accessModes"]


def test_job_links_and_the_codec_origin_name_the_clusters_web_ui(objects):
    """`make run`'s defaults name 127.0.0.1: on a cluster a job's Web UI link would lead nowhere, and the Web UI
    could not decode payloads through the API's codec endpoint (CORS)."""
    [values] = _docs(DEPLOY / "helm" / "temporal-values.yaml")
    callback = next(e["value"] for e in values["web"]["additionalEnv"] if e["name"] == "TEMPORAL_AUTH_CALLBACK_URL")
    settings = _settings(_env(objects, objects[("Deployment", "ragline-api")]))
    ui = settings.effective_temporal_ui_url
    assert callback.startswith(f"{ui}/") and settings.effective_codec_cors_origins == [ui]


def test_temporal_helm_values_on_postgresql():
    [values] = _docs(DEPLOY / "helm" / "temporal-values.yaml")
    config = values["server"]["config"]
    shards = config["numHistoryShards"]
    assert shards >= 1 and shards & (shards - 1) == 0, "a power of two"
    for store in ("default", "visibility"):
        sql = config["persistence"][store]["sql"]
        assert config["persistence"][store]["driver"] == "sql" and sql["driver"] == "postgres12"


def test_the_audit_trail_outlives_the_api_pods_and_keeps_every_replicas_entries(objects):
    """The API appends its audit entries to RAGLINE_AUDIT_LOG: on a volume that outlives the pod (not the
    container's filesystem, erased at a restart), shared by the replicas (one trail, not one per node), in
    a file of each pod's own (appends from two NFS clients to one file are not atomic)."""
    api = objects[("Deployment", "ragline-api")]
    env = _env(objects, api)
    path = _settings(env).audit_log_file
    assert path is not None and path.is_absolute(), path
    mounts = {Path(m["mountPath"]): m for m in _container(api)["volumeMounts"]}
    folder = max((m for m in mounts if m in path.parents), key=lambda m: len(m.parts), default=None)
    assert folder is not None, f"{path} is on the container's own filesystem"
    volumes = {v["name"]: v for v in api["spec"]["template"]["spec"]["volumes"]}
    volume = volumes[mounts[folder]["name"]]
    assert "persistentVolumeClaim" in volume, f"{path}: {volume} does not outlive the pod"
    claim = objects[("PersistentVolumeClaim", volume["persistentVolumeClaim"]["claimName"])]
    assert "ReadWriteMany" in claim["spec"]["accessModes"]
    assert not mounts[folder].get("readOnly")
    # A file per pod: its name holds the pod's name, set (before it, for Kubernetes to expand) from the pod.
    names = [e["name"] for e in _container(api)["env"]]
    [var] = [n for n in names if f"$({n})" in path.name]
    assert env[var] == "<metadata.name>" and names.index(var) < names.index("RAGLINE_AUDIT_LOG")


def _pod_labels(doc: dict) -> dict[str, str]:
    return doc["spec"]["template"]["metadata"]["labels"]


def _selects(selector: dict, labels: dict[str, str]) -> bool:
    """A Kubernetes label selector (matchLabels, matchExpressions) against a pod's labels."""
    if not selector.get("matchLabels", {}).items() <= labels.items():
        return False
    for e in selector.get("matchExpressions", []):
        key, op, values = e["key"], e["operator"], e.get("values", [])
        if not {"In": key in labels and labels[key] in values, "NotIn": labels.get(key) not in values,
                "Exists": key in labels, "DoesNotExist": key not in labels}[op]:
            return False
    return True


def _workloads(objects) -> dict[str, dict]:
    return {name: doc for (kind, name), doc in objects.items() if kind in ("Deployment", "StatefulSet")}


def test_each_pod_gets_only_the_keys_of_ragline_keys_it_uses(objects, config, restore_policies):
    """No pod loads the whole Secret (envFrom): each names the keys its code reads. The model's key goes
    to the role that calls the model, Qdrant's to the role that opens the store, the Redis URL (with its
    password) to the API; each pod may need Temporal's (Temporal Cloud style)."""
    import worker
    from temporal import policies

    policies.load(config.get("RAGLINE_POLICIES"), worker.activity_names())  # which role runs what
    for name, doc in _workloads(objects).items():
        c = _container(doc)
        assert not [s for s in c.get("envFrom", []) if "secretRef" in s], f"{name} loads a whole Secret"
    keys = objects[("Secret", "ragline-keys")]["stringData"]
    for name, doc in _ragline_deployments(objects).items():
        refs = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in _container(doc).get("env", [])
                if "secretKeyRef" in e.get("valueFrom", {})}
        assert all(r["name"] == "ragline-keys" and r["key"] == var and r["key"] in keys for var, r in refs.items())
        wanted = {"RAGLINE_TEMPORAL_API_KEY"}
        if name == "ragline-api":
            wanted.add("RAGLINE_RATE_LIMIT_STORAGE")
        else:
            role = name.removeprefix("ragline-worker-")
            if worker.role_needs(role) & {"model"}:  # by what it runs, not by its queues' names
                wanted.add("RAGLINE_LLM_API_KEY")
            if worker.role_needs(role) & {"index"}:
                wanted.add("RAGLINE_QDRANT_API_KEY")
        assert set(refs) == wanted, name
        assert refs["RAGLINE_TEMPORAL_API_KEY"].get("optional"), "empty unless on Temporal Cloud"


def test_pods_run_unprivileged_on_a_read_only_image(objects, config):
    """Every pod: no service account token, not root, no privilege escalation, no capabilities, the image's
    filesystem read-only; what a pod writes goes to its volumes."""
    for name, doc in _workloads(objects).items():
        spec = doc["spec"]["template"]["spec"]
        assert spec["automountServiceAccountToken"] is False, name
        pod = spec["securityContext"]
        assert pod["runAsNonRoot"] is True and pod["runAsUser"] > 0, name
        c = _container(doc)
        sc = c["securityContext"]
        assert sc["allowPrivilegeEscalation"] is False and sc["capabilities"]["drop"] == ["ALL"], name
        assert sc["readOnlyRootFilesystem"] is True, name
    for name, doc in _ragline_deployments(objects).items():
        env = _env(objects, doc)
        settings = _settings(env)
        mounts = {m["mountPath"]: m for m in _container(doc)["volumeMounts"]}
        volumes = {v["name"]: v for v in doc["spec"]["template"]["spec"]["volumes"]}
        # Python's temporary files (an upload over 1 MiB is spooled there) and the blob store.
        assert "emptyDir" in volumes[mounts["/tmp"]["name"]], name
        assert not mounts[str(settings.blob_dir)].get("readOnly"), name


def test_only_the_ragline_pods_that_use_them_reach_qdrant_redis_and_temporal(objects, config):
    from urllib.parse import urlsplit

    policies = {name: doc for (kind, name), doc in objects.items() if kind == "NetworkPolicy"}
    ragline = _ragline_deployments(objects)
    pods = {name: _pod_labels(doc) for name, doc in _workloads(objects).items()}

    def guarding(labels: dict[str, str], namespace: str | None = None) -> dict:
        [policy] = [p for p in policies.values()
                    if p["metadata"].get("namespace") == namespace and _selects(p["spec"]["podSelector"], labels)]
        assert policy["spec"]["policyTypes"] == ["Ingress"]
        return policy

    def allowed(rule: dict, namespace: str = "ragline") -> set[str]:
        """The pods of these manifests (namespace ragline) a rule of a policy in `namespace` lets in."""
        names = set()
        for peer in rule["from"]:
            ns = peer.get("namespaceSelector")
            if ns is None and namespace != "ragline":  # the policy's own namespace
                continue
            if ns is not None and not _selects(ns, {"kubernetes.io/metadata.name": "ragline"}):
                continue
            names |= {n for n, labels in pods.items() if _selects(peer.get("podSelector", {}), labels)}
        return names

    # Qdrant: the roles that open the store, on the ports of RAGLINE_QDRANT_URL's Service.
    qdrant = guarding(pods["qdrant"])
    [rule] = qdrant["spec"]["ingress"]
    assert allowed(rule) == {"ragline-worker-vector"}
    assert urlsplit(config["RAGLINE_QDRANT_URL"]).port in {p["port"] for p in rule["ports"]}
    # Redis: the API.
    redis = guarding(pods["ragline-redis"])
    [rule] = redis["spec"]["ingress"]
    assert allowed(rule) == {"ragline-api"}
    assert [p["port"] for p in rule["ports"]] == [6379]
    # The Temporal frontend, in its own namespace: the API and every worker role, on the frontend's port.
    host, port = config["RAGLINE_TEMPORAL_ADDRESS"].rsplit(":", 1)
    service, namespace = host.split(".")[:2]
    frontend_labels = {"app.kubernetes.io/name": "temporal", "app.kubernetes.io/instance": service.split("-")[0],
                       "app.kubernetes.io/component": "frontend"}
    temporal = guarding(frontend_labels, namespace)
    from_ragline = [r for r in temporal["spec"]["ingress"] if allowed(r, namespace)]
    assert [allowed(r, namespace) for r in from_ragline] == [set(ragline)]  # not Redis, not Qdrant
    assert [p["port"] for p in from_ragline[0]["ports"]] == [int(port)]
    for rule in temporal["spec"]["ingress"]:
        for peer in rule["from"]:  # every other peer is Temporal's own namespace, KEDA's operator or Prometheus
            ns = peer.get("namespaceSelector", {}).get("matchLabels", {}).get("kubernetes.io/metadata.name")
            assert ns in (None, "ragline", "keda", "monitoring"), peer
            assert ns is not None or rule is temporal["spec"]["ingress"][0]
            if ns == "monitoring":  # Prometheus reaches the metrics port, never the gRPC one
                assert [p["port"] for p in rule["ports"]] == [9090], rule


def test_temporal_requires_the_client_certificate_ragline_presents(config):
    """The Helm values turn on mTLS at the frontend; Ragline (and KEDA, with the same Secret) present a
    client certificate and check the frontend's certificate for the name the values give it."""
    [values] = _docs(DEPLOY / "helm" / "temporal-values.yaml")
    tls = values["server"]["tls"]
    frontend = tls["frontend"]
    assert frontend["enabled"] and frontend["requireClientAuth"] and frontend["secretName"]
    assert tls["internode"]["enabled"]  # the server's own services present it to a frontend that requires one
    host = config["RAGLINE_TEMPORAL_ADDRESS"].rsplit(":", 1)[0]
    settings = _settings(config)
    assert frontend["serverName"] == (settings.temporal_tls_server_name or host)
    assert settings.temporal_uses_tls and settings.temporal_tls_ca and settings.temporal_tls_cert
    assert settings.temporal_tls_key
    # The chart's Secrets are kubernetes.io/tls ones: the files Ragline names are theirs (ca.crt, tls.*).
    assert {p.name for p in (settings.temporal_tls_ca, settings.temporal_tls_cert, settings.temporal_tls_key)} == {
        "ca.crt", "tls.crt", "tls.key"}
    web = values["web"]
    if web.get("enabled", True):  # the Web UI: behind a login, reaching the frontend with a certificate
        env = {e["name"]: e.get("value") for e in web.get("additionalEnv", [])}
        assert env.get("TEMPORAL_AUTH_ENABLED") == "true" and env.get("TEMPORAL_AUTH_PROVIDER_URL")
        assert web["tls"]["enabled"] and web["tls"]["serverName"] == frontend["serverName"]
        assert not web.get("ingress", {}).get("enabled")


def _rule_jobs() -> set[str]:
    """The scrape `job` labels deploy/prometheus/rules.yml selects Ragline's series by."""
    import re

    rules = yaml.safe_load((DEPLOY / "prometheus" / "rules.yml").read_text())
    jobs = set()
    for group in rules["groups"]:
        for rule in group["rules"]:
            jobs |= set(re.findall(r'job="([^"]+)"', rule["expr"]))
            for alternatives in re.findall(r'job=~"([^"]+)"', rule["expr"]):  # `ragline-.*|temporal`
                jobs |= {j for j in alternatives.split("|") if not any(c in j for c in ".*+?[")}
    return jobs


def test_prometheus_can_scrape_the_api_and_every_worker_as_the_rules_expect(objects):
    """On a cluster Prometheus scrapes the pods: each worker serves its metrics on the pod's network (not
    the 127.0.0.1 of `make run`) on a named container port, and a PodMonitor per kind selects the pods and
    names their job as the alert rules and the dashboard expect (`ragline-api`, `ragline-worker`)."""
    monitors = {name: doc for (kind, name), doc in objects.items() if kind == "PodMonitor"}
    jobs: dict[str, tuple[dict, dict]] = {}
    for name, monitor in monitors.items():
        [endpoint] = monitor["spec"]["podMetricsEndpoints"]
        [job] = [r["replacement"] for r in endpoint.get("relabelings", []) if r.get("targetLabel") == "job"]
        jobs[job] = (monitor["spec"]["selector"]["matchLabels"], endpoint)
    assert {"ragline-api", "ragline-worker"} <= set(jobs), jobs
    assert _rule_jobs() <= set(jobs), (_rule_jobs(), set(jobs))
    for name, doc in _ragline_deployments(objects).items():
        job = "ragline-api" if name == "ragline-api" else "ragline-worker"
        selector, endpoint = jobs[job]
        assert _selects({"matchLabels": selector}, _pod_labels(doc)), f"{name}: no PodMonitor selects its pods"
        container = _container(doc)
        ports = {p["name"]: p["containerPort"] for p in container.get("ports", [])}
        assert endpoint["port"] in ports, f"{name}: no container port {endpoint['port']!r} to scrape"
        assert endpoint.get("path", "/metrics") == "/metrics"
        if job == "ragline-worker":
            settings = _settings(_env(objects, doc))
            assert settings.worker_metrics_port == ports[endpoint["port"]], name
            assert settings.worker_metrics_host not in ("127.0.0.1", "localhost", "::1"), \
                f"{name}: metrics on {settings.worker_metrics_host}: unreachable from outside the pod"
