"""Packaging: a slim agent install, and the configuration shipped inside the wheel."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from clusterpulse import configcli

REPO = Path(__file__).resolve().parents[2]
HEAVY = ("torch", "streamlit", "pandas")

# Every agent module, imported the way the CLI does, then the CLI's parser built.
IMPORT_AGENT = f"""
import importlib, pkgutil, sys
import clusterpulse.agent as agent, clusterpulse.agent.cli
for mod in pkgutil.walk_packages(agent.__path__, "clusterpulse.agent."):
    if not mod.name.endswith("__main__"):   # that one runs the agent
        importlib.import_module(mod.name)
clusterpulse.agent.cli.build_parser()
print(",".join(m for m in {HEAVY!r} if m in sys.modules))
"""


def test_agent_imports_none_of_torch_streamlit_pandas():
    """A GPU node installs only the agent's dependencies, so the agent must not need more."""
    out = subprocess.run([sys.executable, "-c", IMPORT_AGENT], cwd=REPO, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "", f"the agent imported {out.stdout.strip()}"


def test_pyproject_keeps_heavy_dependencies_in_extras():
    import tomllib

    meta = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    base = " ".join(meta["dependencies"]).lower()
    assert not [m for m in HEAVY if m in base], base
    extras = meta["optional-dependencies"]
    assert {"agent", "trainer", "dashboard", "lightning", "hf", "all", "dev"} <= set(extras)
    assert meta["license"] == "Apache-2.0"
    assert "Apache License" in (REPO / "LICENSE").read_text()[:200]


def test_config_write_copies_every_shipped_file(tmp_path: Path, capsys):
    assert configcli.main(["write", str(tmp_path)]) == 0
    for _, rel, _ in configcli.shipped():
        assert (tmp_path / rel).read_bytes() == (REPO / "deploy" / rel).read_bytes(), rel
    assert (tmp_path / "local/policy.toml").is_file()
    # what a written file loads is written too: the email/Slack receivers' templates
    # were left out, and every Slack notification failed on an undefined template
    assert (tmp_path / "alertmanager/examples/clusterpulse.tmpl").is_file()
    # A second write would clobber an operator's edits: refused without --force.
    policy = tmp_path / "local/policy.toml"
    policy.write_text(policy.read_text() + "# an operator's edit\n")
    assert configcli.main(["write", str(tmp_path)]) == 2
    assert "1 file(s) exist" in capsys.readouterr().err
    assert "an operator's edit" in policy.read_text()
    assert configcli.main(["write", str(tmp_path), "--force", "--only", "policy"]) == 0
    assert "an operator's edit" not in policy.read_text()


def test_the_documented_victoriametrics_install_runs_on_a_host_set_up_per_deploy_md(
        tmp_path: Path, capsys):
    """docs/deploy.md writes everything into /etc/clusterpulse; docs/scaling.md's systemd
    block then writes `--only victoriametrics` there. Its clusterpulse-config lines, as
    written (the directory moved to the test's), must run: they exited 2, "6 file(s)
    exist ... pass --force", on files that already held what they would write. And they
    give vmalert its own copy of the rules, where the shipped flags read them."""
    etc = tmp_path / "etc-clusterpulse"
    assert configcli.main(["write", str(etc)]) == 0  # docs/deploy.md
    section = (REPO / "docs/scaling.md").read_text().split("### Installing it with systemd\n")[1]
    block = "\n".join(re.findall(r"```bash\n(.*?)```", section.split("\n### ", 1)[0], re.S))
    lines = [shlex.split(x.replace("/etc/clusterpulse", str(etc)))
             for x in block.splitlines() if x.startswith("clusterpulse-config ")]
    assert lines, block
    for argv in lines:
        assert configcli.main(argv[1:]) == 0, capsys.readouterr().err
    rules = sorted((etc / "victoriametrics/rules").glob("*.rules.yml"))
    assert [p.name for p in rules] == ["alerts.rules.yml", "clusterpulse.rules.yml"]
    assert "-rule=/etc/clusterpulse/victoriametrics/rules/*.rules.yml" in (
        etc / "victoriametrics/clusterpulse-vmalert.default").read_text()


def test_an_edit_to_the_installed_prometheus_rules_reaches_vmalerts_copy(
        tmp_path: Path, capsys):
    """docs/scaling.md and the copy's header: edit DIR/prometheus/*.rules.yml and write
    again. The copy was made from the package's rules, so the edit never reached vmalert
    (Prometheus and vmalert silently ran different rules). Without DIR/prometheus the
    copy comes from the package, and its header names the file it came from."""
    assert configcli.main(["write", str(tmp_path)]) == 0
    src = tmp_path / "prometheus/alerts.rules.yml"
    copy = tmp_path / "victoriametrics/rules/alerts.rules.yml"
    assert "for: 7m" not in src.read_text()
    src.write_text(src.read_text().replace("for: 2m", "for: 7m", 1))
    assert configcli.main(["write", str(tmp_path), "--only", "victoriametrics"]) == 2
    assert "pass --force" in capsys.readouterr().err  # the copy is stale: a clash
    assert configcli.main(["write", str(tmp_path), "--only", "victoriametrics",
                           "--force"]) == 0
    assert "for: 7m" in copy.read_text()
    assert f"from {src}:" in copy.read_text().splitlines()[0]
    bare = tmp_path / "bare"
    assert configcli.main(["write", str(bare), "--only", "victoriametrics"]) == 0
    text = (bare / "victoriametrics/rules/alerts.rules.yml").read_text()
    assert "from the package's prometheus/alerts.rules.yml" in text.splitlines()[0]
    assert "for: 7m" not in text


def test_vmalerts_copy_rewrites_every_call_of_increase_and_no_comment():
    """`increase (x[5m])` is PromQL as much as `increase(x[5m])`: it was left as
    MetricsQL's increase() (a node first seen with old counts paged). Names that end in
    increase and comments stay as written."""
    text = ("  - expr: increase (a[5m]) + increase\t(b[1m]) + my_increase(c) "
            "+ job:increase(d)  # increase( stays\n"
            "    # increase (x) in a comment line stays\n")
    assert configcli.vmalert_rules(text, "t.yml").endswith(
        "\n  - expr: increase_prometheus(a[5m]) + increase_prometheus(b[1m]) + my_increase(c) "
        "+ job:increase(d)  # increase( stays\n"
        "    # increase (x) in a comment line stays\n")


def test_the_slurm_health_check_the_docs_name_is_what_config_write_installs(tmp_path: Path):
    """Review (issue #30): docs/deploy.md said no checkout is needed on any host, then
    pointed slurm.conf at /opt/clusterpulse/deploy/slurm/healthcheck.sh, which only a
    checkout has: slurmd would run a missing program and check no node. Every
    HealthCheckProgram the docs and the script name must be what the documented
    `clusterpulse-config write DIR --only slurm` puts there, executable and runnable."""
    docs = (REPO / "docs" / "deploy.md").read_text()
    script = REPO / "deploy" / "slurm" / "healthcheck.sh"
    named = re.findall(r"HealthCheckProgram=(/\S+?)[`\s]", docs + script.read_text())
    assert len(named) >= 2, named
    dest = re.search(r"`clusterpulse-config write (/\S+) --only slurm`", docs)
    assert dest, "docs/deploy.md does not say how a node gets the health check"
    assert configcli.main(["write", str(tmp_path), "--only", "slurm"]) == 0
    for program in named:
        rel = Path(program).relative_to(dest.group(1))  # ValueError: not where it lands
        written = tmp_path / rel
        assert written.read_bytes() == script.read_bytes(), program
        assert os.access(written, os.X_OK), f"{program} is written without its x bit"
    env = tmp_path / "env"
    env.write_text(f"CLUSTERPULSE_HEALTHCHECK={shutil.which('echo')}\n")
    r = subprocess.run([str(tmp_path / rel)], capture_output=True, text=True, timeout=30,
                       env={"CLUSTERPULSE_HEALTHCHECK_ENV": str(env)})
    assert (r.returncode, r.stdout) == (0, "--drain --detach\n"), r.stderr


def test_written_config_passes_promtool_and_amtool_as_written(tmp_path: Path, capsys):
    # Exactly what an operator gets: `clusterpulse-config write DIR`, then each tool on
    # the files where they landed (the example config finds its rules beside it).
    assert configcli.main(["write", str(tmp_path)]) == 0
    # Alertmanager's web config (basic auth) is the exporter-toolkit's format, which
    # promtool checks; the rest of alertmanager/ is Alertmanager's own config.
    checks = [["promtool", "check", "config", str(tmp_path / "prometheus/prometheus.example.yml")]
              ] + [["promtool", "check", "web-config", str(tmp_path / rel)]
                   if rel.endswith("/web.yml") else ["amtool", "check-config", str(tmp_path / rel)]
                   for _, rel, _ in configcli.shipped()
                   if rel.startswith("alertmanager/") and rel.endswith(".yml")]
    assert len(checks) == 4
    # The web config ships with a placeholder where the operator's hash goes (until then
    # nobody is let in); put one in as its comment says, then check the file.
    from clusterpulse.dashboard.auth import bcrypt_hash

    web = tmp_path / "alertmanager/web.yml"
    assert "REPLACE-WITH-A-BCRYPT-HASH" in web.read_text()
    web.write_text(web.read_text().replace("REPLACE-WITH-A-BCRYPT-HASH",
                                           bcrypt_hash("a-password-for-the-test")))
    for cmd in checks:
        assert shutil.which(cmd[0]), f"{cmd[0]} is not installed (the test set-up installs it)"
        r = subprocess.run(cmd, cwd=tmp_path.parent, capture_output=True, text=True,
                           timeout=60)
        assert r.returncode == 0, f"{' '.join(cmd)}: {r.stdout}{r.stderr}"
    assert "SUCCESS" in r.stdout + r.stderr


def test_config_show_unknown_file_is_a_clear_error(capsys):
    assert configcli.main(["show", "prometheus/nope.yml"]) == 2
    err = capsys.readouterr().err
    assert "no shipped file 'prometheus/nope.yml'" in err and "Traceback" not in err


@pytest.mark.parametrize("path", ["../../../../../../../../etc/passwd", "/etc/passwd",
                                  "prometheus/../../../../../../../../etc/passwd",
                                  "../pyproject.toml", "prometheus", "../deploy/local/stack.py"])
def test_config_show_prints_only_the_files_it_ships(path, capsys):
    """Found in review: `clusterpulse-config show ../../../../../../etc/shadow` printed
    the file (as root, the shadow passwords), exit 0: the path was looked up under the
    package's deploy/ as given."""
    assert configcli.main(["show", path]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith(f"clusterpulse-config: error: no shipped file {path!r}")


@pytest.mark.parametrize("path", ["sysctl/90-clusterpulse-training.conf",
                                  "kubernetes/examples/training-job.yaml"])
def test_config_show_prints_a_shipped_file_that_list_does_not_name(path, capsys):
    """docs/deploy.md tells operators to install the sysctl file with `show`; a review
    of the first fix for `../` paths found it refused with every file outside `list`."""
    assert configcli.main(["show", path]) == 0
    assert capsys.readouterr().out == (REPO / "deploy" / path).read_text()


@pytest.mark.slow
def test_wheel_contains_config_and_license(tmp_path: Path):
    """Built like a release: the wheel must carry rules, routing, policy, units, dashboards."""
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", str(REPO),
                    "-w", str(tmp_path)], check=True, capture_output=True, timeout=600)
    (wheel,) = tmp_path.glob("clusterpulse-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    expected = {f"clusterpulse/deploy/{rel}" for _, rel, _ in configcli.FILES
                if (REPO / "deploy" / rel).is_file()}
    assert expected - names == set()
    assert any(n.endswith("/licenses/LICENSE") for n in names)
    # One import namespace: nothing at the top of site-packages but clusterpulse itself
    # (a top-level agent/ or trainer/ would clash with users' modules of those names).
    assert {n.split("/")[0] for n in names} == {"clusterpulse", "clusterpulse-0.1.0.dist-info"}
    assert {"clusterpulse/agent/cli.py", "clusterpulse/trainer/instrument.py",
            "clusterpulse/dashboard/views/cluster.py", "clusterpulse/detection/scoring.py",
            "clusterpulse/integrations/lightning.py", "clusterpulse/integrations/hf.py",
            "clusterpulse/integrations/data.py"} <= names
    # No pages/ beside the dashboard's app.py: Streamlit would serve its legacy
    # multipage mode to a deep link opened first (the page scripts are in views/). A
    # build/ left from before the move put the old files into the wheel.
    assert not {n for n in names if n.startswith("clusterpulse/dashboard/pages/")}
    meta = zipfile.ZipFile(wheel).read(
        next(n for n in names if n.endswith("METADATA"))).decode()
    assert "License-Expression: Apache-2.0" in meta
    assert "Requires-Dist: torch" in meta and 'extra == "trainer"' in meta


def test_a_users_own_trainer_and_agent_modules_do_not_shadow_ours(tmp_path: Path):
    """A training script next to its own trainer.py and agent/ imports both, and ours."""
    (tmp_path / "trainer.py").write_text("WHO = 'user trainer'\n")
    (tmp_path / "agent").mkdir()
    (tmp_path / "agent" / "__init__.py").write_text("WHO = 'user agent'\n")
    (tmp_path / "train.py").write_text(
        "import agent, trainer\n"
        "from clusterpulse.trainer.instrument import Pulse\n"
        "from clusterpulse.agent.protocol import decode\n"
        "print(trainer.WHO, agent.WHO, Pulse.__module__, decode.__module__, sep=',')\n")
    out = subprocess.run([sys.executable, "train.py"], cwd=tmp_path, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().split(",") == [
        "user trainer", "user agent", "clusterpulse.trainer.instrument",
        "clusterpulse.agent.protocol"]


def test_alertmanager_reads_the_webhook_token_where_deploy_md_puts_it_for_it():
    """Debian's Alertmanager runs as `prometheus`, which cannot enter /etc/clusterpulse
    (0750 root:clusterpulse): with the token read from there every notification failed
    with "permission denied" and no alert reached the remediation policy. The routing
    reads its own copy, which the install makes and gives to prometheus, and the
    install puts the routing itself in place."""
    import yaml

    routing = yaml.safe_load((REPO / "deploy/alertmanager/alertmanager.yml").read_text())
    paths = {w["http_config"]["authorization"]["credentials_file"]
             for r in routing["receivers"] for w in r.get("webhook_configs", [])
             if "authorization" in w.get("http_config", {})}
    assert paths == {"/etc/prometheus/clusterpulse-webhook-token"}, paths
    (path,) = paths
    docs = (REPO / "docs/deploy.md").read_text()
    assert f"cp /etc/clusterpulse/webhook-token {path}" in docs
    assert f"chown prometheus {path}" in docs
    assert "cp /etc/clusterpulse/alertmanager/alertmanager.yml /etc/prometheus/alertmanager.yml" \
        in docs
