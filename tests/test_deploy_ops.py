"""What ships in deploy/ and systemd/ for operators: checked by the tools that read it."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

from daemon.ops._metrics import FAILURE_REASONS
from tests._system import require_tool
from tests.conftest import REPO

TIMEOUT = 30.0
PROMETHEUS = REPO / "deploy" / "prometheus"
CKPTD = str(Path(sys.executable).parent / "ckptd")


def run(
    *cmd: str, cwd: Path | None = None, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        cmd, capture_output=True, text=True, timeout=TIMEOUT, cwd=cwd, env=env, check=False
    )


def ckptd_metric_names() -> set[str]:
    """Every ckptd_* family the daemon's code defines (with the suffixes Prometheus sees)."""
    text = "".join(p.read_text() for p in sorted((REPO / "daemon" / "ops").glob("*metrics.py")))
    names = set()
    for kind, name in re.findall(
        r'(Counter|Histogram|Gauge|GaugeMetricFamily)\(\s*"(ckptd_\w+)"', text
    ):
        if kind == "Counter":
            names.add(f"{name}_total")
        elif kind == "Histogram":
            names |= {f"{name}_bucket", f"{name}_count", f"{name}_sum"}
        else:
            names.add(name)
    return names


class TestAlertRules:
    """deploy/prometheus's rules pass promtool's check and their unit tests."""

    def test_promtool_check_rules(self) -> None:
        promtool = require_tool("promtool", "prometheus")
        result = run(promtool, "check", "rules", str(PROMETHEUS / "ckptd-rules.yml"))
        assert result.returncode == 0, result.stdout + result.stderr
        assert "SUCCESS" in result.stdout

    def test_promtool_test_rules(self) -> None:
        promtool = require_tool("promtool", "prometheus")
        result = run(promtool, "test", "rules", "ckptd-rules.test.yml", cwd=PROMETHEUS)
        assert result.returncode == 0, result.stdout + result.stderr
        assert "SUCCESS" in result.stdout

    def test_every_alert_is_unit_tested(self) -> None:
        rules = yaml.safe_load((PROMETHEUS / "ckptd-rules.yml").read_text())
        alerts = {r["alert"] for g in rules["groups"] for r in g["rules"]}
        tests = yaml.safe_load((PROMETHEUS / "ckptd-rules.test.yml").read_text())
        fired = {
            case["alertname"]
            for t in tests["tests"]
            for case in t["alert_rule_test"]
            if case["exp_alerts"]
        }
        assert alerts - {"CkptdJournalStalled"} <= fired  # that one mirrors RootStalled

    def test_rules_name_only_metrics_that_exist(self) -> None:
        text = (PROMETHEUS / "ckptd-rules.yml").read_text()
        used = set(re.findall(r"\bckptd_\w+", text))
        assert used <= ckptd_metric_names(), used - ckptd_metric_names()


class TestDashboard:
    """deploy/grafana's dashboard is valid JSON naming only metrics the daemon exports."""

    def test_dashboard(self) -> None:
        dashboard: dict[str, Any] = json.loads(
            (REPO / "deploy" / "grafana" / "ckptd-dashboard.json").read_text()
        )
        assert dashboard["uid"] == "ckptd" and dashboard["panels"]
        exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
        used = {m for e in exprs for m in re.findall(r"\bckptd_\w+", e)}
        assert used <= ckptd_metric_names(), used - ckptd_metric_names()
        assert {"ckptd_promotions_total", "ckptd_last_promotion_timestamp_seconds"} <= used
        ids = [p["id"] for p in dashboard["panels"]]
        assert len(ids) == len(set(ids))

    def test_failure_reasons_documented(self) -> None:
        readme = (REPO / "docs" / "operations.md").read_text()
        for reason in FAILURE_REASONS:
            assert f"`{reason}`" in readme


class TestSystemdUnits:
    """The units pass ``systemd-analyze verify``, with and without the metrics drop-in."""

    def _verify(self, units: Path) -> subprocess.CompletedProcess[str]:
        analyze = require_tool("systemd-analyze", "systemd")
        env = {**os.environ, "SYSTEMD_UNIT_PATH": f"{units}:"}
        return run(analyze, "verify", "ckptd.socket", "ckptd.service", cwd=units, env=env)

    def _units(self, tmp_path: Path) -> Path:
        units = tmp_path / "units"
        units.mkdir()
        shutil.copy(REPO / "systemd" / "ckptd.socket", units)
        service = (REPO / "systemd" / "ckptd.service").read_text()
        # verify checks that ExecStart= exists: point it at this checkout's ckptd.
        (units / "ckptd.service").write_text(service.replace("/usr/local/bin/ckptd", CKPTD))
        return units

    def test_units_verify(self, tmp_path: Path) -> None:
        result = self._verify(self._units(tmp_path))
        assert result.returncode == 0 and not result.stderr.strip(), result.stderr

    def test_metrics_drop_in_verifies(self, tmp_path: Path) -> None:
        units = self._units(tmp_path)
        drop_in = units / "ckptd.service.d"
        drop_in.mkdir()
        conf = (REPO / "systemd" / "ckptd-metrics.conf").read_text()
        (drop_in / "metrics.conf").write_text(conf)
        result = self._verify(units)
        assert result.returncode == 0 and not result.stderr.strip(), result.stderr
        assert "AF_INET" in conf
        # The drop-in is read: a bad line in it is reported.
        (drop_in / "metrics.conf").write_text(conf + "RestrictAddressFamilies=AF_BOGUS\n")
        assert "AF_BOGUS" in self._verify(units).stderr

    def test_reload_and_stack_dump_documented(self) -> None:
        service = (REPO / "systemd" / "ckptd.service").read_text()
        assert "ExecReload=/bin/kill -HUP $MAINPID" in service
        assert "USR1" in service


class TestKubernetes:
    """The sidecar probes with ``ckptd health`` and exposes the metrics port to scrapes."""

    def test_sidecar(self) -> None:
        docs = list(
            yaml.safe_load_all((REPO / "deploy" / "k8s" / "ckptd-sidecar.yaml").read_text())
        )
        pod = next(d for d in docs if d["kind"] == "Pod")
        annotations = pod["metadata"]["annotations"]
        assert annotations["prometheus.io/scrape"] == "true"
        sidecar = next(c for c in pod["spec"]["initContainers"] if c["name"] == "ckptd")
        for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
            assert sidecar[probe]["exec"]["command"][:2] == ["ckptd", "health"]
        ports = {p["name"]: p["containerPort"] for p in sidecar["ports"]}
        assert str(ports["metrics"]) == annotations["prometheus.io/port"]
        config = next(d for d in docs if d["kind"] == "ConfigMap")["data"]["ckptd.toml"]
        assert f'metrics_listen = ":{ports["metrics"]}"' in config


class TestSlurmNoAdmin:
    """``ckptd-node.sh serve`` runs a daemon; ``wait`` returns once it is healthy."""

    def test_serve_wait_stop(self, short_dir: Path, root: Path) -> None:
        script = REPO / "deploy" / "slurm" / "ckptd-node.sh"
        env = {
            **os.environ,
            "SLURM_JOB_ID": "4242",
            "CKPTD_RUN_DIR": str(short_dir / "job"),
            "CKPTD_BIN": CKPTD,
        }
        env.pop("CKPTD_SOCKET", None)
        serve = subprocess.Popen(
            [str(script), "serve", "--root", str(root)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        try:
            waited = run(str(script), "wait", env=env)
            assert waited.returncode == 0, waited.stderr
            sock = short_dir / "job" / "ckptd.sock"
            assert run(CKPTD, "health", "--socket", str(sock)).returncode == 0
            serve.send_signal(signal.SIGTERM)  # what srun forwards at the end of the job
            assert serve.wait(TIMEOUT) == 0
        finally:
            if serve.poll() is None:
                serve.kill()
                serve.wait()
            assert serve.stdout is not None
            out = serve.stdout.read().decode()
            serve.stdout.close()
        assert '"event":"daemon.stopped"' in out
        assert (short_dir / "job").stat().st_mode & 0o777 == 0o700

    def test_scripts_parse(self) -> None:
        names = ("ckptd-node.sh", "example-noadmin.sbatch", "prolog.sh", "epilog.sh")
        for name in (*names, "example.sbatch"):
            result = run("bash", "-n", str(REPO / "deploy" / "slurm" / name))
            assert result.returncode == 0, result.stderr
        text = (REPO / "deploy" / "slurm" / "ckptd-node.sh").read_text()
        # One daemon a node: the task count is given, never inherited from the job.
        assert '--ntasks="$nodes" --ntasks-per-node=1' in text
        example = (REPO / "deploy" / "slurm" / "example-noadmin.sbatch").read_text()
        assert '"$NODE_SH" start' in example and '"$NODE_SH" stop' in example
