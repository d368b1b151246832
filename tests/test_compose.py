"""compose.yaml and the Dockerfile, checked without Docker (none runs here): the file against the
Compose Specification's JSON schema (as vendored by check-jsonschema), then what the schema
cannot see: every FIRSTTOKEN_* variable is a setting (the settings ignore unknown ones, so a typo
would silently do nothing), every dependency is a service with what its condition needs, each
GPU worker has a device of its own and each gpus-N profile starts N of them, the commands name
modules and CLI commands that exist, and the Dockerfile copies paths that exist."""

from __future__ import annotations

import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
COMPOSE = ROOT / "compose.yaml"


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())  # YAML merge keys (<<) resolved as Compose does


@pytest.fixture(scope="module")
def services(compose: dict) -> dict:
    return compose["services"]


def gpu_workers(services: dict) -> dict:
    return {name: svc for name, svc in services.items() if name.startswith("gpu-worker")}


def test_compose_file_matches_the_compose_specification():
    exe = Path(sys.executable).with_name("check-jsonschema")
    proc = subprocess.run(
        [str(exe), "--builtin-schema", "vendor.compose-spec", str(COMPOSE)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_the_schema_check_catches_a_wrong_field(tmp_path: Path):
    # the check above can fail: a misspelt service key is refused
    bad = tmp_path / "compose.yaml"
    bad.write_text("services:\n  api:\n    image: x\n    depends_on_: [db]\n")
    exe = Path(sys.executable).with_name("check-jsonschema")
    proc = subprocess.run(
        [str(exe), "--builtin-schema", "vendor.compose-spec", str(bad)], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode != 0 and "depends_on_" in proc.stdout + proc.stderr


def test_every_firsttoken_variable_is_a_setting(services: dict):
    from pipeline.settings import Settings
    from workers.settings import WorkerSettings

    known = {f"FIRSTTOKEN_{name.upper()}" for name in {*Settings.model_fields, *WorkerSettings.model_fields}}
    used = {
        (service, key)
        for service, svc in services.items()
        for key in (svc.get("environment") or {})
        if key.startswith("FIRSTTOKEN_")
    }
    assert used, "no FIRSTTOKEN_ variables found: the check would pass on anything"
    assert sorted(k for _, k in used if k not in known) == []
    firsttoken_services = [n for n, s in services.items() if s.get("image") == "firsttoken:latest"]
    for name in firsttoken_services:  # each reaches Kafka, Postgres and Redis
        env = services[name].get("environment") or {}
        assert {"FIRSTTOKEN_DATABASE_URL", "FIRSTTOKEN_KAFKA_BOOTSTRAP", "FIRSTTOKEN_REDIS_URL"} <= set(env), name


def test_dependencies_exist_and_their_conditions_can_be_met(services: dict):
    for name, svc in services.items():
        for dep, spec in (svc.get("depends_on") or {}).items():
            assert dep in services, f"{name} depends on a missing service {dep}"
            condition = spec.get("condition")
            if condition == "service_healthy":
                assert "healthcheck" in services[dep], f"{name} waits for {dep} to be healthy; it has no healthcheck"
            elif condition == "service_completed_successfully":
                assert services[dep].get("restart") == "no", f"{dep} must run once for {name} to wait for it"
    # nothing that talks to Postgres starts before the migration
    for name, svc in services.items():
        if "FIRSTTOKEN_DATABASE_URL" in (svc.get("environment") or {}) and name != "migrate":
            assert svc["depends_on"]["migrate"]["condition"] == "service_completed_successfully", name


def test_each_gpu_worker_has_a_device_of_its_own(services: dict):
    workers = gpu_workers(services)
    devices = {}
    for name, svc in workers.items():
        assert "replicas" not in svc.get("deploy", {}), f"{name}: replicas would share one device"
        (dev,) = svc["deploy"]["resources"]["reservations"]["devices"]
        assert "count" not in dev and "gpu" in dev["capabilities"], name
        (devices[name],) = dev["device_ids"]
        assert svc["command"][svc["command"].index("--pool") + 1] == "solo", name
    assert sorted(devices.values()) == [str(i) for i in range(len(workers))]  # 0..N-1, each once
    assert all(devices[f"gpu-worker-{i}"] == str(i) for i in range(len(workers)))


def test_cpu_workers_scale_by_replicas(services: dict):
    # they share nothing a replica would need alone: a Celery prefork worker per container
    assert services["cpu-worker"]["deploy"]["replicas"] == "${FIRSTTOKEN_CPU_WORKERS:-1}"
    assert "gpu" not in str(services["cpu-worker"].get("deploy", {}))


@pytest.mark.parametrize("gpus", [1, 2, 4, 8])
def test_a_gpus_profile_starts_one_worker_per_gpu(services: dict, gpus: int):
    profile = f"gpus-{gpus}"
    started = sorted(
        (name for name, svc in gpu_workers(services).items() if not svc.get("profiles") or profile in svc["profiles"]),
        key=lambda n: int(n.rsplit("-", 1)[1]),
    )
    assert started == [f"gpu-worker-{i}" for i in range(gpus)]
    # no service outside the GPU workers hides behind a profile
    assert all(not svc.get("profiles") for name, svc in services.items() if not name.startswith("gpu-worker"))


def test_the_commands_exist(services: dict):
    import importlib

    from firsttoken.cli import build_parser

    def firsttoken_has(command: str) -> bool:
        try:
            build_parser().parse_args([command, "--help"])
        except SystemExit as exc:  # --help exits 0; an unknown command exits 2
            return exc.code == 0
        return False

    checked = 0
    for name, svc in services.items():
        command = svc.get("command")
        if svc.get("image") != "firsttoken:latest" or not command:
            continue
        argv = shlex.split(command) if isinstance(command, str) else command
        if argv[0] == "celery":
            importlib.import_module(argv[argv.index("-A") + 1])
        elif argv[0] == "firsttoken":
            assert firsttoken_has(argv[1]), f"{name}: firsttoken has no {argv[1]!r} command"
        elif argv[0] == "alembic":
            assert (ROOT / "alembic.ini").is_file() and (ROOT / "migrations").is_dir()
        else:
            pytest.fail(f"{name}: unexpected command {argv}")
        checked += 1
    assert checked >= 4  # migrate, api, the GPU workers, cpu-worker


def test_the_dockerfile_copies_what_exists():
    copied = []
    for line in (ROOT / "Dockerfile").read_text().splitlines():
        parts = line.split()
        if parts and parts[0] == "COPY" and not any(p.startswith("--from") for p in parts):
            copied += parts[1:-1]
    assert copied, "no COPY lines found"
    assert [p for p in copied if not (ROOT / p).exists()] == []
    # the packages pip installs from the image are all copied
    import tomllib

    include = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["include"]
    assert {pattern.rstrip("*") for pattern in include} <= set(copied)


def test_observability_scrapes_what_serves_metrics_and_charts_what_exists(services: dict):
    import json
    import re
    from types import SimpleNamespace

    from prometheus_client import CollectorRegistry

    from firsttoken.api.metrics import ApiMetrics
    from pipeline.metrics import JobMetrics
    from workers.engine.outputs import EngineStats
    from workers.metrics import WorkerCollector

    prom = yaml.safe_load((ROOT / "observability" / "prometheus.yml").read_text())
    targets = {job["job_name"]: [t for sc in job["static_configs"] for t in sc["targets"]] for job in prom["scrape_configs"]}
    api_port = services["api"]["command"][services["api"]["command"].index("--port") + 1]
    assert targets["firsttoken-api"] == [f"api:{api_port}"]
    workers = gpu_workers(services)
    assert sorted(targets["firsttoken-gpu-workers"]) == sorted(
        f"{name}:{svc['environment']['FIRSTTOKEN_METRICS_PORT']}" for name, svc in workers.items()
    )
    for name in ("prometheus", "grafana"):  # the files they mount are in the repository
        for v in services[name]["volumes"]:
            src = v.split(":")[0]
            if src.startswith("./"):
                assert (ROOT / src).exists(), (name, src)

    # every metric the dashboard charts is one the API or a worker exports
    registry = CollectorRegistry()
    JobMetrics(registry, {"worker": "w", "model_name": "m"})
    stats = EngineStats(running=1, waiting=0, kv_blocks_total=10, kv_blocks_used=1, kv_blocks_free=9,
                        prefix_hit_rate=0.0, num_preemptions=0, prompt_tokens_per_s=0.0,
                        generation_tokens_per_s=0.0, steps=1, step_seconds=0.0, kernel_backend="torch",
                        cuda_graphs=False, async_scheduling=False, kv_cache_dtype="float32")
    fake = SimpleNamespace(name="w", model_name="m", engine_stats=stats, in_flight=0,
                           intake=SimpleNamespace(paused=False), sink=SimpleNamespace(buffered=0, store_ok=True))
    registry.register(WorkerCollector(fake))  # type: ignore[arg-type]
    suffixes = {"histogram": ("_bucket", "_count", "_sum"), "counter": ("_total",)}
    families = [*registry.collect(), *ApiMetrics(lambda: None).registry.collect()]
    exported = {f.name + sfx for f in families for sfx in suffixes.get(f.type, ("",))}
    exported |= {"firsttoken:jobs", "firsttoken:queue_lag_seconds"}  # the backlog, read from a store
    dash = json.loads((ROOT / "observability" / "grafana" / "dashboards" / "firsttoken.json").read_text())
    used = {m for p in dash["panels"] for t in p["targets"] for m in re.findall(r"firsttoken:[a-z0-9_]+", t["expr"])}
    assert len(used) >= 10 and sorted(used - exported) == []


def test_one_job_message_fits_the_producer_the_broker_and_the_topics(services: dict):
    """The line limit, the producer's max_request_size and the broker's message.max.bytes agree:
    a job as large as a line can be reaches the queue (a 2 MB prompt once did not)."""
    from pipeline.queue.kafka import MAX_BATCH_BYTES
    from pipeline.queue.kafka_batches import BATCH_HEADER_BYTES
    from schemas.limits import MAX_LINE_BYTES, MAX_MESSAGE_BYTES

    assert MAX_LINE_BYTES + 64 * 1024 <= MAX_MESSAGE_BYTES
    assert MAX_MESSAGE_BYTES + BATCH_HEADER_BYTES <= MAX_BATCH_BYTES
    env = services["kafka"]["environment"]
    assert int(env["KAFKA_MESSAGE_MAX_BYTES"]) == MAX_BATCH_BYTES
    assert int(env["KAFKA_REPLICA_FETCH_MAX_BYTES"]) >= MAX_BATCH_BYTES
    script = (ROOT / "scripts" / "services.sh").read_text()
    assert f"\nmessage.max.bytes={MAX_BATCH_BYTES}\n" in script


def _broker_properties(env: dict) -> dict[str, str]:
    """The broker properties the apache/kafka image makes of its KAFKA_ variables (KAFKA_ dropped,
    lower case, `___` -> `-`, `__` -> `_`, `_` -> `.`)."""
    out = {}
    for name, value in env.items():
        if name.startswith("KAFKA_"):
            key = name[6:].lower().replace("___", "-").replace("__", "\0").replace("_", ".").replace("\0", "_")
            out[key] = str(value)
    return out


def _assert_sasl_only(props: dict[str, str], where: str) -> None:
    protocols = dict(p.split(":") for p in props["listener.security.protocol.map"].split(","))
    listeners = [item.split("://")[0] for item in props["listeners"].split(",")]
    assert listeners and all(protocols[name] == "SASL_PLAINTEXT" for name in listeners), where
    assert props["sasl.enabled.mechanisms"] == "PLAIN", where
    assert props["sasl.mechanism.inter.broker.protocol"] == "PLAIN", where
    assert props["sasl.mechanism.controller.protocol"] == "PLAIN", where
    for name in listeners:
        jaas = props[f"listener.name.{name.lower()}.plain.sasl.jaas.config"]
        assert "PlainLoginModule required" in jaas and 'user_firsttoken="' in jaas, (where, name)


def test_kafka_takes_only_sasl_in_compose_and_the_services_script(services: dict):
    """Every listener of the broker (the clients' and the controller's) is SASL/PLAIN, in compose
    and in scripts/services.sh alike, and every firsttoken service gets the user and password."""
    _assert_sasl_only(_broker_properties(services["kafka"]["environment"]), "compose")
    script = (ROOT / "scripts" / "services.sh").read_text()
    config = script.split('cat > "$KAFKA_DIR/server.properties" <<EOF\n', 1)[1].split("\nEOF\n", 1)[0]
    props = dict(line.split("=", 1) for line in config.splitlines() if line and not line.startswith("#"))
    props = {k: v.replace("$HOST", "127.0.0.1").replace("$jaas", 'PlainLoginModule required user_firsttoken="x";')
             for k, v in props.items()}
    _assert_sasl_only(props, "scripts/services.sh")
    for name, svc in services.items():
        env = svc.get("environment", {})
        if "FIRSTTOKEN_KAFKA_BOOTSTRAP" in env:
            assert env.get("FIRSTTOKEN_KAFKA_USERNAME") == "firsttoken" and env.get("FIRSTTOKEN_KAFKA_PASSWORD"), name
