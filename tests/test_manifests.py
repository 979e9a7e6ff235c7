"""The cluster manifests in deploy/ (none of it can run here: no container engine, no Qdrant or
Temporal server binaries) are parsed and checked against the code: names, ports, settings, queues."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

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
    return Settings(**{k[len("RAGLINE_"):].lower(): v for k, v in env.items()
                       if k.startswith("RAGLINE_") and v not in (None, "")})


def test_every_manifest_parses_and_has_the_basics(objects):
    assert objects
    for (kind, name), doc in objects.items():
        assert doc["apiVersion"] and doc["metadata"]["name"] == name
    kinds = {k for k, _ in objects}
    assert {"Deployment", "Service", "StatefulSet", "ScaledObject", "Secret", "ConfigMap",
            "TriggerAuthentication", "PersistentVolumeClaim"} <= kinds


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


def test_the_build_id_is_the_image_tag(objects, config):
    for name, doc in _ragline_deployments(objects).items():
        assert _container(doc)["image"].rsplit(":", 1)[1] == config["RAGLINE_WORKER_BUILD_ID"], name


def test_api_ports_and_probe(objects):
    api = objects[("Deployment", "ragline-api")]
    c = _container(api)
    env = _env(objects, api)
    port = Settings(api_port=env["RAGLINE_API_PORT"]).api_port
    assert c["ports"][0]["containerPort"] == port and c["command"][-1] == str(port)
    assert env["RAGLINE_API_HOST"] == "0.0.0.0"
    assert c["readinessProbe"]["httpGet"]["path"] == "/healthz"
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
