"""`clusterpulse-config`: write the configuration files shipped in the package.

A node installed with ``pip install clusterpulse`` has no repository checkout, yet
Prometheus needs the rules, Alertmanager the routing and ``clusterpulse-remediate``
its policy. This command copies them out of the installed package so that an
installation never depends on a git clone.
"""

from __future__ import annotations

import argparse
import re
import sys
from importlib import resources
from importlib.resources.abc import Traversable
from pathlib import Path

# (group, path inside deploy/, what it is). Paths are relative to the package's
# deploy/ folder and are written under the same relative path in DIR.
FILES: tuple[tuple[str, str, str], ...] = (
    ("prometheus", "prometheus/clusterpulse.rules.yml", "recording rules"),
    ("prometheus", "prometheus/alerts.rules.yml", "alerting rules"),
    ("prometheus", "prometheus/prometheus.example.yml", "example scrape config"),
    ("alertmanager", "alertmanager/alertmanager.yml", "routing and inhibition"),
    ("alertmanager", "alertmanager/examples/email-slack.yml", "email/Slack receivers"),
    # the receivers' templates: email-slack.yml loads it, and without it every Slack
    # notification failed ('template "clusterpulse.evidence_url" not defined')
    ("alertmanager", "alertmanager/examples/clusterpulse.tmpl", "templates of those receivers"),
    ("alertmanager", "alertmanager/web.yml",
     "web config: basic auth on Alertmanager's API (--web.config.file)"),
    ("alertmanager", "alertmanager/prometheus-alertmanager.default",
     "/etc/default/prometheus-alertmanager: the web config on, the gossip port off"),
    ("policy", "local/policy.toml", "remediation policy for clusterpulse-remediate"),
    ("grafana", "grafana/clusterpulse-fleet.json", "Grafana dashboard: fleet"),
    ("grafana", "grafana/clusterpulse-node.json", "Grafana dashboard: node"),
    ("grafana", "grafana/clusterpulse-run.json", "Grafana dashboard: training run"),
    ("grafana", "grafana/dcgm-compat.rules.yml",
     "opt-in rules: ClusterPulse metrics under dcgm-exporter's names"),
    ("systemd", "systemd/clusterpulse-agent.service", "agent unit"),
    ("systemd", "systemd/clusterpulse-dashboard.service", "dashboard unit"),
    ("systemd", "systemd/clusterpulse-remediate.service", "remediation unit"),
    ("systemd", "systemd/clusterpulse.sysusers.conf", "sysusers.d: the clusterpulse user"),
    ("systemd", "systemd/clusterpulse.tmpfiles.conf", "tmpfiles.d: state directories"),
    ("systemd", "systemd/clusterpulse-agent.default", "agent flags (EnvironmentFile)"),
    ("systemd", "systemd/clusterpulse-dashboard.default", "dashboard flags"),
    ("systemd", "systemd/clusterpulse-remediate.default", "remediation flags"),
    ("systemd", "systemd/clusterpulse-egress",
     "the Prometheus host: only its monitoring users reach the agents' port"),
    ("systemd", "systemd/clusterpulse-egress.service", "egress filter unit"),
    ("systemd", "systemd/clusterpulse-egress.default", "egress filter settings"),
    ("systemd", "systemd/prometheus-clusterpulse-scrape.conf",
     "prometheus.service drop-in: the group the egress filter lets through"),
    ("slurm", "slurm/healthcheck.sh",
     "slurm.conf HealthCheckProgram: drains a node with a GPU problem (executable)"),
    ("slurm", "slurm/policy.toml", "remediation policy for Slurm: drain-node"),
    ("slurm", "slurm/train.sbatch", "multi-node torchrun job with an agent step per node"),
    # Past one machine (docs/scaling.md): vmagent scrape shards, vmalert, VictoriaMetrics.
    ("victoriametrics", "victoriametrics/vmagent.yml",
     "scrape config for the vmagent shards (hashmod of each agent's address)"),
    ("victoriametrics", "victoriametrics/store-scrape.yml",
     "the store's own scrape config: the remediation receiver on its host's loopback"),
    ("victoriametrics", "victoriametrics/clusterpulse-vmagent@.service",
     "scrape shard unit (instance = shard number)"),
    ("victoriametrics", "victoriametrics/clusterpulse-vmagent.default",
     "scrape shard flags and the shard count"),
    ("victoriametrics", "victoriametrics/clusterpulse-vmalert.service", "vmalert unit: the rules"),
    ("victoriametrics", "victoriametrics/clusterpulse-vmalert.default", "vmalert flags"),
    ("victoriametrics", "victoriametrics/victoria-metrics.default",
     "/etc/default/victoria-metrics: flags for Debian's victoria-metrics unit"),
    ("victoriametrics", "victoriametrics/victoria-metrics-secrets.conf",
     "victoria-metrics.service drop-in: the store's secrets from a root-only file"),
)
# Written from a shipped file, not shipped as such: (group, path written, what, source).
# vmalert's copy of the rules (docs/scaling.md, "Rules on vmalert"): one source of truth,
# prometheus/*.rules.yml, turned into what vmalert evaluates as Prometheus does.
GENERATED: tuple[tuple[str, str, str, str], ...] = (
    ("victoriametrics", "victoriametrics/rules/clusterpulse.rules.yml",
     "recording rules for vmalert (from prometheus/clusterpulse.rules.yml)",
     "prometheus/clusterpulse.rules.yml"),
    ("victoriametrics", "victoriametrics/rules/alerts.rules.yml",
     "alerting rules for vmalert (from prometheus/alerts.rules.yml)",
     "prometheus/alerts.rules.yml"),
)
GROUPS = sorted({g for g, _, _ in FILES})

VMALERT_HEADER = """\
# Written by `clusterpulse-config write DIR` from {source}: DIR/{rel} when that file
# exists (so an edit there reaches vmalert), else the package's copy. To change a rule,
# edit DIR/{rel} and run `clusterpulse-config write DIR --only victoriametrics --force`.
# For vmalert (VictoriaMetrics), which would count otherwise: increase() is
# increase_prometheus() (MetricsQL's increase() takes a series' first value for growth,
# so a node or rank first seen with old counts was paged); keep_firing_for is left out
# (vmalert before 1.92, e.g. Debian 12's 1.79, exits on it; those alerts then resolve at
# the first evaluation that no longer holds).
"""
# A call of increase, whatever the spacing before its parenthesis (`increase (x[5m])` is
# PromQL too); not a name that ends in increase (`foo_increase(`, `job:increase(`).
_INCREASE = re.compile(r"(?<![\w:])increase\s*\(")
# A YAML or PromQL comment: `#` at the start of a line or after whitespace.
_COMMENT = re.compile(r"(^|\s)#")
_KEEP_FIRING = re.compile(r"^(\s*)(keep_firing_for:.*)$", re.M)


def vmalert_rules(text: str, source: str, rel: str | None = None) -> str:
    """The Prometheus rule file `text` as vmalert must run it to count as Prometheus
    does; comments are left as written (only the code before a `#` changes), so that
    a comment that mentions increase() is not rewritten into a false statement."""
    lines = []
    for line in text.splitlines(keepends=True):
        m = _COMMENT.search(line)
        code, comment = (line[:m.start()], line[m.start():]) if m else (line, "")
        lines.append(_INCREASE.sub("increase_prometheus(", code) + comment)
    body = _KEEP_FIRING.sub(r"\1# \2  (left out for vmalert < 1.92)", "".join(lines))
    return VMALERT_HEADER.format(source=source, rel=rel or source) + body


EXAMPLES = """\
examples:
  # list what the package ships
  clusterpulse-config list

  # everything into /etc/clusterpulse (prometheus/, alertmanager/, local/policy.toml, ...)
  clusterpulse-config write /etc/clusterpulse

  # a Slurm node: slurm.conf's HealthCheckProgram=/etc/clusterpulse/slurm/healthcheck.sh
  clusterpulse-config write /etc/clusterpulse --only slurm

  # only the Prometheus rules, replacing older copies
  clusterpulse-config write /etc/prometheus/clusterpulse --only prometheus --force

  # print one file to stdout
  clusterpulse-config show prometheus/alerts.rules.yml
"""
LIST_EXAMPLES = """\
examples:
  clusterpulse-config list                        # group, path, what each file is
  clusterpulse-config list | grep '^systemd'      # the paths `show` and --only take
"""
SHOW_EXAMPLES = """\
examples:
  clusterpulse-config show prometheus/alerts.rules.yml
  clusterpulse-config show local/policy.toml > /etc/clusterpulse/policy.toml
"""


class UsageError(Exception):
    """Bad input; printed as one line, exit code 2."""


def _root() -> Traversable:
    return resources.files("clusterpulse") / "deploy"


def shipped() -> list[tuple[str, str, str]]:
    """The files of FILES that this installation holds (dashboards may be absent)."""
    root = _root()
    out = []
    for group, rel, what in FILES:
        node = root
        for part in rel.split("/"):
            node = node / part
        if node.is_file():
            out.append((group, rel, what))
    return out


def generated() -> list[tuple[str, str, str]]:
    """The files written from shipped ones (GENERATED) whose source this installation
    holds."""
    have = {rel for _, rel, _ in shipped()}
    return [(g, rel, what) for g, rel, what, src in GENERATED if src in have]


def _read(rel: str, dest: Path | None = None) -> bytes:
    """What `write` puts at DEST/`rel`. vmalert's copy of a rule file is made from
    DEST/prometheus/<file> when that exists: the docs tell an operator to edit the
    installed Prometheus rules and write again, and a copy made from the package would
    silently drop the edit (Prometheus and vmalert running different rules)."""
    for _, out, _, src in GENERATED:
        if rel == out:
            installed = dest / src if dest is not None else None
            if installed is not None and installed.is_file():
                try:
                    text = installed.read_text()
                except (OSError, UnicodeDecodeError) as err:
                    raise UsageError(f"cannot read {installed}: {err}") from err
                return vmalert_rules(text, str(installed), src).encode()
            return vmalert_rules(_read(src).decode(), f"the package's {src}", src).encode()
    # any file under the package's deploy/ (the docs name files that `list` does not:
    # sysctl/90-clusterpulse-training.conf, the helm chart), and nothing outside it: a
    # path looked up as given (`show ../../../etc/shadow`) printed whatever it named
    parts = rel.split("/")
    node = _root()
    for part in parts:
        node = node / part
    if any(part in ("", ".", "..") for part in parts) or not node.is_file():
        known = ", ".join(r for _, r, _ in shipped() + generated())
        raise UsageError(f"no shipped file {rel!r}; known: {known}")
    return node.read_bytes()


def write(dest: Path, only: list[str] | None, force: bool) -> list[Path]:
    """Copy the shipped files under DEST; refuse to overwrite one that differs unless
    FORCE. A file already as it would be written is no clash (written again as it is):
    writing one group after everything was written (docs/scaling.md after
    docs/deploy.md) must not ask for --force, which would also replace edited files."""
    chosen = [(g, r) for g, r, _ in shipped() + generated() if not only or g in only]
    targets = [(dest / r, r) for _, r in chosen]
    clash = [str(p) for p, r in targets if p.exists() and not _same(p, r, dest)]
    if clash and not force:
        raise UsageError(f"{len(clash)} file(s) exist, e.g. {clash[0]}; pass --force to "
                         "replace them")
    written = []
    for path, rel in targets:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            data = _read(rel, dest)
            path.write_bytes(data)
            if data.startswith(b"#!"):  # a script: slurmd or systemd runs it as it lands
                path.chmod(0o755)
        except OSError as err:
            raise UsageError(f"cannot write {path}: {err.strerror}") from err
        written.append(path)
    return written


def _same(path: Path, rel: str, dest: Path) -> bool:
    """Whether `path` already holds what `rel` would write there."""
    try:
        return path.read_bytes() == _read(rel, dest)
    except OSError:
        return False


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="clusterpulse-config",
        description="Write out the configuration shipped with ClusterPulse: Prometheus "
        "rules, Alertmanager routing, the remediation policy, Grafana dashboards, "
        "systemd units and the Slurm health check.",
        epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = p.add_subparsers(dest="cmd", required=True, metavar="{list,write,show}")
    sub.add_parser("list", help="list the shipped files", epilog=LIST_EXAMPLES,
                   formatter_class=argparse.RawDescriptionHelpFormatter)
    w = sub.add_parser("write", help="copy the shipped files into DIR",
                       epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    w.add_argument("dir", type=Path, help="destination folder (created if missing)")
    w.add_argument("--only", action="append", choices=GROUPS,
                   help="write only this group (repeatable)")
    w.add_argument("--force", action="store_true", help="replace existing files")
    s = sub.add_parser("show", help="print one shipped file", epilog=SHOW_EXAMPLES,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    s.add_argument("path", help="path as `list` prints it, e.g. prometheus/alerts.rules.yml")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.cmd == "list":
            for group, rel, what in shipped() + generated():
                print(f"{group:<13} {rel:<42} {what}")
        elif args.cmd == "write":
            for path in write(args.dir, args.only, args.force):
                print(path)
        else:
            sys.stdout.buffer.write(_read(args.path))
    except UsageError as err:
        print(f"clusterpulse-config: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
