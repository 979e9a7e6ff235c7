"""A real Prometheus (Debian's package, installed by `make test`) scrapes a live test stack with the
project's own alert rules: the rules pass promtool, a burst of chats with injected model faults
shows up as the expected job counts in PromQL, an alert goes to firing when its condition is
forced, and every series the dashboard and the rules use exists in a scrape."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml

from devtools.supervisor import Supervisor, prometheus_config, prometheus_folder, temporal_metrics_target, worker_specs
from ragline.settings import Settings
from tests.conftest import TEMPORAL_METRICS_PORT, free_port, running_stack, worker_metrics_url
from tests.helpers import eventually
from tests.pdfgen import pdf_bytes

PROJECT = Path(__file__).resolve().parent.parent
RULES = PROJECT / "deploy" / "prometheus" / "rules.yml"
RULES_TEST = PROJECT / "deploy" / "prometheus" / "rules_test.yml"
CONFIG = PROJECT / "deploy" / "prometheus" / "prometheus.yml"
DASHBOARD = PROJECT / "deploy" / "grafana" / "ragline-dashboard.json"
SCREENSHOT = PROJECT / "docs" / "prometheus" / "alerts.png"
CHROMIUM = "/usr/bin/chromium"
QUEUE = "ragline-prom"


def _require(tool: str) -> str:
    """Fails (never skips) when a tool `make test` installs is missing."""
    path = shutil.which(tool)
    if path is None:
        pytest.fail(f"{tool} is not installed: `make test` installs it (apt-get install prometheus)", pytrace=False)
    return path


def test_promtool_accepts_the_rules_and_the_config_and_the_alerts_fire_on_their_conditions():
    """`promtool test rules` evaluates the rules over synthetic series (deploy/prometheus/rules_test.yml):
    the model error rate, the unenforced rate limits and the waiting dead letters each fire, with their
    labels and text, on their condition and not just below it."""
    promtool = _require("promtool")
    for argv in (["check", "rules", str(RULES)], ["check", "config", str(CONFIG)], ["test", "rules", str(RULES_TEST)]):
        done = subprocess.run([promtool, *argv], capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS: 11 rules found" in subprocess.run([promtool, "check", "rules", str(RULES)],
                                                      capture_output=True, text=True).stdout


def _panel_exprs(title: str) -> list[str]:
    [panel] = [p for p in json.loads(DASHBOARD.read_text())["panels"] if p["title"] == title]
    return [t["expr"] for t in panel["targets"]]


def test_dashboard_panels_count_each_job_once_and_only_ragline_workers(tmp_path):
    """Every worker process polls the server for the jobs waiting for people and reports the same count
    (two processes here: one dead-lettered job must read 1, not 2), and the Temporal server's own workers
    export `temporal_worker_task_slots_*` too (its system queues are no Ragline worker's slots)."""
    worker = 'job="ragline-worker", instance="127.0.0.1:{port}"'
    series = []
    for port in (9464, 9465):
        series += [{"series": f'ragline_dead_lettered_jobs{{task_queue="ragline", {worker.format(port=port)}}}',
                    "values": "1x5"},
                   {"series": f'ragline_reviews_waiting{{task_queue="ragline", {worker.format(port=port)}}}',
                    "values": "2x5"}]
    slots = ('temporal_worker_task_slots_{kind}{{namespace="default", task_queue="{queue}", '
             'worker_type="ActivityWorker", {where}}}')
    for kind, value in (("used", 1), ("available", 3)):
        series.append({"series": slots.format(kind=kind, queue="temporal_sys_per_ns_tq",
                                              where='job="temporal", instance="127.0.0.1:7244"'),
                       "values": "0x5" if kind == "used" else "1000x5"})
    # A cpu worker whose slots follow CPU and memory: the SDK exports the used ones, Ragline the most it runs.
    series += [{"series": slots.format(kind="used", queue="ragline-cpu", where=worker.format(port=9464)),
                "values": "1x5"},
               {"series": f'ragline_worker_activity_slots{{task_queue="ragline-cpu", {worker.format(port=9464)}}}',
                "values": "4x5"}]
    reviews, dead = _panel_exprs("Waiting for people")
    [utilisation] = _panel_exprs("Worker slot utilisation")
    tests = {"rule_files": [], "evaluation_interval": "1m", "tests": [{"interval": "1m", "input_series": series,
             "promql_expr_test": [
                 {"expr": reviews, "eval_time": "2m", "exp_samples": [{"labels": "{}", "value": 2}]},
                 {"expr": dead, "eval_time": "2m", "exp_samples": [{"labels": "{}", "value": 1}]},
                 {"expr": utilisation, "eval_time": "2m",
                  "exp_samples": [{"labels": '{task_queue="ragline-cpu"}', "value": 0.25}]}]}]}
    path = tmp_path / "dashboard_test.yml"
    path.write_text(yaml.safe_dump(tests))
    done = subprocess.run([_require("promtool"), "test", "rules", str(path)], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr


def test_make_runs_prometheus_scrapes_every_worker_process_of_a_scale_out(tmp_path):
    """`RAGLINE_PROMETHEUS=1 make run` with RAGLINE_WORKERS: the config it writes passes promtool and scrapes
    each worker process on the metrics port that process is given (the first alone was scraped: the model's
    errors and the llm queue's slots, in the llm workers, were in no alert)."""
    settings = Settings(workers="workflows:1,cpu:1,llm:2,vector:1", worker_metrics_port=45400)
    written = tmp_path / "prometheus.yml"
    written.write_text(prometheus_config(settings))
    shutil.copy(RULES, tmp_path / "rules.yml")
    done = subprocess.run([_require("promtool"), "check", "config", str(written)], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    jobs = {j["job_name"]: j for j in yaml.safe_load(written.read_text())["scrape_configs"]}
    scraped = [t for c in jobs["ragline-worker"]["static_configs"] for t in c["targets"]]
    given = [f"127.0.0.1:{spec.env['RAGLINE_WORKER_METRICS_PORT']}" for spec in worker_specs(settings)]
    assert sorted(scraped) == sorted(given) and len(set(given)) == 5, (scraped, given)


async def test_make_run_on_a_temporal_it_did_not_start_scrapes_its_metrics_only_where_they_answer(tmp_path):
    """`RAGLINE_PROMETHEUS=1 make run` on a Temporal server already running: its metrics were scraped at port + 11
    (where the dev server make run starts serves them), and where nothing answered RaglineTargetDown fired for
    ever. That target is now kept only if metrics answer there."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
    import threading

    class Metrics(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - the library's name
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b"# a Temporal server's metrics\n")

        def log_message(self, *args) -> None:  # noqa: ANN002
            pass

    async def scraped_jobs(temporal_port: int) -> set[str]:
        supervisor = Supervisor(Settings(data_dir=tmp_path, prometheus=True,
                                         temporal_address=f"127.0.0.1:{temporal_port}"), specs=[])
        written = prometheus_folder(supervisor.settings) / "prometheus.yml"
        written.parent.mkdir(parents=True, exist_ok=True)
        written.write_text(prometheus_config(supervisor.settings))  # as the preflight writes it
        await supervisor._scrape_temporal_if_it_answers()
        shutil.copy(RULES, written.parent / "rules.yml")
        done = subprocess.run([_require("promtool"), "check", "config", str(written)], capture_output=True,
                              text=True)
        assert done.returncode == 0, done.stdout + done.stderr
        config = yaml.safe_load(written.read_text())
        targets = {t for j in config["scrape_configs"] for c in j["static_configs"] for t in c["targets"]}
        assert (temporal_metrics_target(supervisor.settings) in targets) == ("temporal" in {
            j["job_name"] for j in config["scrape_configs"]})
        return {j["job_name"] for j in config["scrape_configs"]}

    server = ThreadingHTTPServer(("127.0.0.1", 0), Metrics)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        assert await scraped_jobs(server.server_address[1] - 11) == {"ragline-api", "ragline-worker", "temporal"}
    finally:
        server.shutdown()
        server.server_close()
    # Nothing at port + 11 (the port just closed).
    assert await scraped_jobs(server.server_address[1] - 11) == {"ragline-api", "ragline-worker"}


def _metric_names(expr: str) -> set[str]:
    return set(re.findall(r"\b((?:ragline|temporal)_[a-z_]+)\b", expr))


def _used_series() -> set[str]:
    rules = yaml.safe_load(RULES.read_text())
    names = {n for g in rules["groups"] for r in g["rules"] for n in _metric_names(r["expr"])}
    dashboard = json.loads(DASHBOARD.read_text())
    names |= {n for p in dashboard["panels"] for t in p["targets"] for n in _metric_names(t["expr"])}
    return names


class Prometheus:
    def __init__(self, workdir: Path, targets: dict[str, str]) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        # A test copy of the rules: same expressions, every `for:` cut to 1s so a forced condition fires now.
        rules = yaml.safe_load(RULES.read_text())
        for group in rules["groups"]:
            group["interval"] = "1s"
            for rule in group["rules"]:
                rule["for"] = "1s"
        (workdir / "rules.yml").write_text(yaml.safe_dump(rules))
        config = {"global": {"scrape_interval": "1s", "evaluation_interval": "1s"}, "rule_files": ["rules.yml"],
                  "scrape_configs": [{"job_name": job, "static_configs": [{"targets": [target]}]}
                                     for job, target in targets.items()]}
        (workdir / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.argv = [_require("prometheus"), f"--config.file={workdir / 'prometheus.yml'}",
                     f"--storage.tsdb.path={workdir / 'tsdb'}", f"--web.listen-address=127.0.0.1:{self.port}"]
        self.log = open(workdir / "prometheus.log", "wb")
        self.proc: subprocess.Popen | None = None
        self.http = httpx.AsyncClient(base_url=self.url, timeout=10)

    async def start(self) -> None:
        self.proc = subprocess.Popen(self.argv, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)

        async def ready() -> bool:
            assert self.proc.poll() is None, "prometheus exited at start; see prometheus.log"
            try:
                return (await self.http.get("/-/ready")).status_code == 200
            except httpx.TransportError:
                return False
        await eventually(ready, timeout=30, every=0.2, what="prometheus ready")

    async def stop(self) -> None:
        await self.http.aclose()
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.log.close()

    async def query(self, promql: str) -> list[dict]:
        r = await self.http.get("/api/v1/query", params={"query": promql})
        assert r.status_code == 200, r.text
        return r.json()["data"]["result"]

    async def vector(self, promql: str, label: str) -> dict[str, float]:
        return {s["metric"].get(label, ""): float(s["value"][1]) for s in await self.query(promql)}

    async def alerts(self) -> list[dict]:
        return (await self.http.get("/api/v1/alerts")).json()["data"]["alerts"]


def _screenshot(url: str, path: Path) -> None:
    """The Prometheus alerts page, rendered by Debian's headless Chromium."""
    path.parent.mkdir(parents=True, exist_ok=True)
    profile = path.parent / ".chromium-profile"
    argv = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
            "--disable-background-networking", "--disable-component-update", "--disable-sync",
            f"--user-data-dir={profile}", "--hide-scrollbars", "--window-size=1280,900",
            "--virtual-time-budget=8000", f"--screenshot={path}", url]
    try:
        subprocess.run(argv, capture_output=True, timeout=90, check=True)
    finally:
        shutil.rmtree(profile, ignore_errors=True)


@pytest.mark.timeout(300)
async def test_prometheus_scrapes_a_live_stack_counts_jobs_and_fires_an_alert(temporal_env, scripted_llm, tmp_path):
    started = time.monotonic()
    address = temporal_env.client.service_client.config.target_host
    async with running_stack(address, scripted_llm, tmp_path / "data", task_queue=QUEUE) as stack:
        prom = Prometheus(tmp_path, {
            "ragline-api": stack.base_url.removeprefix("http://"),
            "ragline-worker": worker_metrics_url().removeprefix("http://").removesuffix("/metrics"),
            "temporal": f"127.0.0.1:{TEMPORAL_METRICS_PORT}"})
        await prom.start()
        try:
            up = await stack.upload(("harbour.pdf", pdf_bytes(["The harbour master keeps the tide tables."])),
                                    collection="prom")
            assert (await stack.wait_done(up["job_id"]))["status"] == "completed"

            # The burst: each chat in a scope of its own, so each gets exactly its faults.
            plans = {"ok": [], "retried": ["503"], "rejected": ["400"], "exhausted": ["503"] * 4}
            kinds = ["ok", "ok", "retried", "retried", "rejected", "exhausted"]
            scopes = [scripted_llm.scope() for _ in kinds]
            try:
                for scope, kind in zip(scopes, kinds):
                    if plans[kind]:
                        scope.script("answer", plans[kind])
                accepted = await asyncio.gather(*(stack.chat(f"Who keeps the tide tables? {s.token}", collection="prom")
                                                  for s in scopes))
                jobs = await asyncio.gather(*(stack.wait_job(a["job_id"]) for a in accepted))
            finally:
                for scope in scopes:
                    scope.close()
            assert [j["status"] for j in jobs] == ["completed"] * 4 + ["failed", "dead_lettered"], jobs

            # PromQL sees exactly these jobs (this stack's queue only).
            expected = {"completed": 4.0, "failed": 1.0, "dead_lettered": 1.0}
            query = f'sum by (status) (ragline_jobs_total{{kind="chat", task_queue="{QUEUE}"}})'

            async def counted():
                found = await prom.vector(query, "status")
                return found if found == expected else None
            await eventually(counted, timeout=30, every=0.5, what=f"{query} == {expected}")
            errors_query = (f'sum by (error_type) (ragline_model_errors_total{{step="generate", '
                            f'task_queue=~"{QUEUE}.*"}})')

            async def errors():
                found = await prom.vector(errors_query, "error_type")
                return found if found == {"InternalServerError": 6.0, "BadRequestError": 1.0} else None
            await eventually(errors, timeout=30, every=0.5, what=f"{errors_query}: 6 x 503, 1 x 400")
            attempts = await prom.vector(
                f'sum by (outcome) (ragline_step_attempts_total{{activity_type="generate_answer", task_queue=~"{QUEUE}.*"}})',
                "outcome")
            assert attempts == {"completed": 4.0, "retryable_error": 6.0, "non_retryable_error": 1.0}, attempts

            # The forced condition: one dead-lettered job waits on this queue -> the alert fires for it.
            async def firing():
                return [a for a in await prom.alerts() if a["labels"]["alertname"] == "RaglineDeadLetteredJobsWaiting"
                        and a["labels"].get("task_queue") == QUEUE and a["state"] == "firing"]
            [alert] = await eventually(firing, timeout=30, every=0.5, what="RaglineDeadLetteredJobsWaiting firing")
            assert float(alert["value"]) == 1.0

            # Every series the dashboard and the rules use exists in a scrape.
            missing = [name for name in sorted(_used_series()) if not await prom.query(f"count({name}) > 0")]
            assert not missing, f"used by the dashboard or the rules, absent from every scrape: {missing}"
            async def every_target_up():  # one scrape may time out on a busy machine: the next one counts
                return {s["metric"]["job"] for s in await prom.query("up == 1")} >= {"ragline-api", "ragline-worker",
                                                                                       "temporal"}
            await eventually(every_target_up, timeout=30, every=0.5, what="the API, the worker and Temporal up")

            if os.environ.get("RAGLINE_SCREENSHOTS"):
                _screenshot(f"{prom.url}/classic/alerts", SCREENSHOT)  # Debian ships the classic UI

            # The operator's decision clears it.
            dead = jobs[-1]["job_id"]
            r = await stack.http.post(f"/v1/jobs/{dead}/discard", json={"operator": "test", "reason": "forced"})
            assert r.status_code == 200, r.text
            assert (await stack.wait_done(dead))["status"] == "failed"

            async def resolved():
                return not await firing()
            await eventually(resolved, timeout=30, every=0.5, what="RaglineDeadLetteredJobsWaiting resolved")
        finally:
            await prom.stop()
    print(f"\nPrometheus test took {time.monotonic() - started:.1f} s", file=sys.stderr)


async def test_twice_each_steps_sla_is_a_bound_of_its_latency_histogram():
    """The latency alert compares a step's p95 with twice its SLA. Between two bounds histogram_quantile guesses
    near the upper one: a 2.6 s p95 in a 2.5-5 s bucket read 4.9 s, over twice a 2 s SLA. Twice each SLA, the
    defaults' and RAGLINE_STEP_SLA's, is a bound of the histogram the worker exports; an SLA past what the
    histogram can show is refused at start."""
    from ragline import metrics
    from ragline.settings import Settings
    from temporal.telemetry import worker_runtime

    settings = Settings(step_sla={"generate_answer": 45})
    port = free_port()
    runtime = worker_runtime(f"127.0.0.1:{port}", settings.step_sla)
    metrics.step_attempt(runtime.metric_meter.with_additional_attributes({"activity_type": "generate_answer"}),
                         2.6, "completed", retry=False)
    async with httpx.AsyncClient(timeout=5) as http:
        text = (await http.get(f"http://127.0.0.1:{port}/metrics")).text
    bounds = {float(m) for m in re.findall(r'^ragline_step_duration_seconds_bucket\{[^}]*le="([0-9.]+)"', text, re.M)}
    slas = {**metrics.DEFAULT_STEP_SLA_SECONDS, **settings.step_sla}
    assert {2 * seconds for seconds in slas.values()} <= bounds, sorted(bounds)
    for past in (300, 400):  # twice 300 is the top bound: a p95 above every bound reads as 600, never over it
        with pytest.raises(ValueError, match="under 300 seconds"):
            Settings(step_sla={"generate_answer": past})
