"""What the docs say about defaults is what the code does: the telemetry address is
stated once (docs/agent.md#telemetry-address) and equals agent.protocol's default and
both --help texts, and the socket is the kind it says there, the kind the agent binds,
wherever else it is named; the README's clusterpulse-ctl examples parse as written, with the
settings its block exports, and carry what each command needs; the README's Lightning
and Hugging Face snippets are the code CI runs, verbatim; operators' password hashes
are described, and shown, as `clusterpulse-ctl hash-password` makes them."""

from __future__ import annotations

import re
import shlex
import socket
import textwrap
from pathlib import Path

import pytest

from clusterpulse.agent import channel, core, protocol
from clusterpulse.agent import cli as agent_cli
from clusterpulse.dashboard import auth, ctl
from clusterpulse.trainer import config as trainer_config
from clusterpulse.trainer import instrument
from tests.conftest import socket_path
from tests.support.procs import REPO

AGENT_DOC = REPO / "docs/agent.md"
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")),
        REPO / "deploy/kubernetes/README.md"]
# a telemetry address: a unix: socket path (not a placeholder such as unix:/PATH), or
# the UDP port the docs used to call the default
ADDRESS = re.compile(r"unix:/[a-z$][\w./$-]*|:9401\b")


def chunks(text: str) -> list[str]:
    """Paragraphs, with each table row and list item on its own: one claim each."""
    out = []
    for para in re.split(r"\n\s*\n", text):
        out += re.split(r"\n(?=\s*[|-] )", para)
    return out


def test_docs_agent_md_states_the_default_once_and_it_is_the_code_default():
    text = AGENT_DOC.read_text()
    section = text.split("## Telemetry address", 1)[1].split("\n## ", 1)[0]
    assert f"**default: `{protocol.DEFAULT_TELEMETRY}`**" in section
    assert instrument.DEFAULT_AGENT == protocol.DEFAULT_TELEMETRY


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.relative_to(REPO).as_posix())
def test_no_other_doc_states_a_telemetry_default(doc):
    if doc == AGENT_DOC:
        others = AGENT_DOC.read_text().split("## Telemetry address", 1)[0]
    else:
        others = doc.read_text()
    claims = [c for c in chunks(others) if re.search(r"\bdefault", c, re.I)
              and ADDRESS.search(c) and "telemetry" in c.lower()]
    assert not claims, ("a telemetry default outside docs/agent.md#telemetry-address "
                        f"(link there instead): {claims[0]!r}")
    if doc != AGENT_DOC:
        assert ":9401" not in others, "9401 is no default; say UDP in docs/agent.md only"


def test_help_texts_name_the_code_default():
    assert f"(default: {protocol.DEFAULT_TELEMETRY})" in " ".join(
        agent_cli.build_parser().format_help().split())
    assert f"$CLUSTERPULSE_AGENT or {protocol.DEFAULT_TELEMETRY})" in " ".join(
        trainer_config.build_parser().format_help().split())
    assert ":9401" not in (instrument.__doc__ or "")


# where an operators entry may be described or shown: the docs, the deploy files'
# comments (examples of operators.toml), and hash-password's own --help
HASH_DOCS = [*DOCS, *(f for f in sorted((REPO / "deploy").rglob("*"))
                      if f.suffix in (".yaml", ".yml", ".toml", ".service", ".default", ".txt"))]
# an operators entry's value as an example shows it: name = "SCHEME$PARAMS$...$..."
HASH_EXAMPLE = re.compile(r'= *"(\w+(?:\$\d+)*)\$')


def test_docs_describe_the_operator_hashes_hash_password_makes(capsys):
    """Found in review: docs/dashboard.md said operator hashes are PBKDF2-SHA256 and
    showed `name = "pbkdf2_sha256$..."`, while hash-password prints `scrypt$...`
    (PBKDF2 is only still accepted). Every example entry shows the scheme made, and
    a passage that names PBKDF2 names scrypt too."""
    stored = auth.hash_password("correct horse")
    made = stored.partition("$")[0]
    texts = {str(f.relative_to(REPO)): f.read_text() for f in HASH_DOCS}
    with pytest.raises(SystemExit):
        ctl.main(["hash-password", "--help"])
    texts["clusterpulse-ctl hash-password --help"] = capsys.readouterr().out
    assert made in texts["clusterpulse-ctl hash-password --help"]
    for where, text in texts.items():
        for shown in HASH_EXAMPLE.findall(text):
            assert stored.startswith(shown + "$"), (where, shown)
        for claim in chunks(text):
            if "pbkdf2" in claim.lower():
                assert made in claim, (where, claim)


def test_the_telemetry_socket_is_named_as_the_agent_binds_it():
    """A SOCK_SEQPACKET socket, one connection per rank (docs/agent.md#telemetry-address,
    and what `channel.bind_unix` makes); a Unix datagram socket was an earlier
    release's, and --help and agent.protocol still said so."""
    section = AGENT_DOC.read_text().split("## Telemetry address", 1)[1].split("\n## ", 1)[0]
    assert "`SOCK_SEQPACKET`" in section
    path = socket_path("kind")
    sock = channel.bind_unix(path)
    try:
        assert sock.type == socket.SOCK_SEQPACKET
    finally:
        sock.close()
        channel.unlink_quietly(path)
    texts = {"clusterpulse-agent --help": agent_cli.build_parser().format_help(),
             "clusterpulse-train --help": trainer_config.build_parser().format_help(),
             "agent/protocol.py": f"{protocol.__doc__} {protocol.parse_address.__doc__}",
             "agent/core.py": core.Agent.__init__.__doc__ or "",
             **{p.relative_to(REPO).as_posix(): p.read_text() for p in DOCS}}
    datagram = re.compile(r"\bunix\s+(domain\s+)?datagram\b", re.I)
    wrong = {name: m[0] for name, text in texts.items()
             if (m := datagram.search(" ".join(text.split())))}
    assert not wrong, f"the telemetry socket is SOCK_SEQPACKET: {wrong}"


def readme_ctl_block() -> tuple[dict[str, str], list[list[str]]]:
    """The README's block with clusterpulse-ctl: its exports and its ctl commands."""
    blocks = re.findall(r"```bash\n(.*?)```", (REPO / "README.md").read_text(), re.S)
    (block,) = [b for b in blocks if "clusterpulse-ctl " in b]
    env, cmds = {}, []
    for line in block.replace("\\\n", " ").splitlines():
        words = shlex.split(line, comments=True)
        if words[:1] == ["export"]:
            name, _, value = words[1].partition("=")
            env[name] = value
        elif words[:1] == ["clusterpulse-ctl"]:
            cmds.append(words[1:])
    return env, cmds


def test_readme_ctl_examples_parse_as_written_and_have_what_they_need():
    env, cmds = readme_ctl_block()
    assert {c[0] for c in cmds} >= {"agents", "restart", "evict", "hash-password"}
    for argv in cmds:
        a = ctl.parse(argv, env)
        assert a.prometheus == env["CLUSTERPULSE_PROMETHEUS_URL"]
        if a.cmd in ("restart", "evict"):
            assert str(a.token_file) == env["CLUSTERPULSE_AGENT_TOKEN_FILE"]


def test_ctl_restart_without_a_token_is_a_one_line_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_:
        ctl.parse(["restart", "--run", "r", "--hard", "--reason", "x"], {})
    assert exit_.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        "clusterpulse-ctl: error: restart needs the agents' token: --token-file FILE or "
        "CLUSTERPULSE_AGENT_TOKEN_FILE")


def excerpt(path: Path, name: str) -> str:
    """The lines of `path` between each `# --- README: NAME ---` and the next
    `# --- end README ---`, dedented, the regions a blank line apart: what the README
    shows of that file."""
    regions = re.findall(rf"^[ \t]*# --- README: {name} ---\n(.*?)^[ \t]*# --- end README ---$",
                         path.read_text(), re.S | re.M)
    assert regions, f"no README: {name} region in {path}"
    return "\n\n".join(textwrap.dedent(r).strip("\n") for r in regions) + "\n"


@pytest.mark.parametrize("job, name", [("tests/support/lightning_job.py", "lightning"),
                                       ("tests/support/hf_job.py", "hf")])
def test_readme_framework_snippets_are_the_jobs_ci_runs(job, name):
    """tests/integration/test_lightning.py and test_hf.py run these jobs through a compute
    straggler, a data straggler, a graceful restart and a crash: what the README shows
    is what they run."""
    blocks = re.findall(rf"<!-- {re.escape(job)} -->\n```python\n(.*?)```",
                        (REPO / "README.md").read_text(), re.S)
    assert blocks == [excerpt(REPO / job, name)]


# A drop-in docs/scaling.md gives a ClusterPulse unit for the VictoriaMetrics store:
# its path, the credential it loads, and the ARGS it tells the admin to set.
DROP_IN = re.compile(r"# /etc/systemd/system/(clusterpulse-[\w-]+)\.service\.d/[\w.-]+\.conf\n"
                     r"\[Service\]\nLoadCredential=([\w-]+):(\S+)\n"
                     r"# /etc/default/\1: ARGS=\"\.\.\. (.*?)\"\n```", re.S)


@pytest.mark.parametrize("unit", ["clusterpulse-dashboard", "clusterpulse-remediate"])
def test_scaling_md_points_every_store_reader_at_the_store_with_flags_it_knows(unit, capsys):
    """On the VictoriaMetrics path the dashboard and clusterpulse-remediate must read the
    store with its password: remediate was left at its default 127.0.0.1:9090, so its
    check that an alert still fires failed closed and remediation never acted. Each
    drop-in loads the password as a credential, and its ARGS name flags the program
    knows (its --help), the password file at that credential's path."""
    from clusterpulse.dashboard import cli as dashboard_cli
    from clusterpulse.dashboard import remediation

    mains = {"clusterpulse-dashboard": dashboard_cli.main,
             "clusterpulse-remediate": remediation.main}
    found = {m[0]: m[1:] for m in DROP_IN.findall((REPO / "docs/scaling.md").read_text())}
    assert unit in found, sorted(found)
    credential, source, args = found[unit]
    assert source == "/etc/clusterpulse/victoria-metrics-password"
    argv = shlex.split(args.replace("\n#", " "))
    assert argv == ["--prometheus", "http://victoria-metrics:8428", "--prometheus-password-file",
                    f"/run/credentials/{unit}.service/{credential}"], argv
    with pytest.raises(SystemExit):
        mains[unit](["--help"])
    help_text = capsys.readouterr().out
    for flag in argv[::2]:
        assert re.search(rf"(^|\s){re.escape(flag)}\b", help_text), (unit, flag)


def help_text(main, argv: list[str], capsys) -> str:
    """What `PROG ARGV --help` prints."""
    with pytest.raises(SystemExit):
        main([*argv, "--help"])
    return capsys.readouterr().out


def example_lines(text: str) -> list[str]:
    """The lines of a --help's examples block, as printed."""
    return text.partition("\nexamples:\n")[2].split("\n\n")[0].splitlines()


@pytest.mark.parametrize("prog, argv", [
    ("clusterpulse-ctl", ["restart"]), ("clusterpulse-ctl", ["escalate"]),
    ("clusterpulse-ctl", ["evict"]), ("clusterpulse-ctl", ["agents"]),
    ("clusterpulse-config", ["list"]), ("clusterpulse-config", ["show"])])
def test_each_subcommand_help_shows_examples_that_parse_as_written(prog, argv, capsys):
    """Found in review: these subcommands' --help had no example. Each shows one of
    itself at least, and each parses as its parser takes it."""
    from clusterpulse import configcli

    env = {"CLUSTERPULSE_AGENT_TOKEN_FILE": "/etc/clusterpulse/token"}
    main, parse = {"clusterpulse-ctl": (ctl.main, lambda a: ctl.parse(a, env)),
                   "clusterpulse-config": (configcli.main,
                                           configcli.build_parser().parse_args)}[prog]
    shown = [shlex.split(line, comments=True) for line in example_lines(
        help_text(main, argv, capsys))]
    shown = [words[1:] for words in shown if words and words[0] == prog]
    assert [words for words in shown if argv[0] in words], shown
    for words in shown:
        # up to a pipe or a redirection: what the shell leaves to the command
        args = words[:next((i for i, w in enumerate(words) if w in ("|", ">")), None)]
        assert parse(args).cmd == argv[0], args


@pytest.mark.parametrize("prog", ["clusterpulse-dashboard", "clusterpulse-ctl",
                                  "clusterpulse-remediate", "clusterpulse-detect",
                                  "clusterpulse-config"])
def test_help_examples_continue_their_lines_as_a_shell_reads_them(prog, capsys):
    """Found in review: a `\\` at a line's end in a plain Python string joined the two
    lines, and --help printed `... victoria-metrics:8428       --prometheus-password-file
    ...` on one. A line that goes on ends in `\\`, and the next is indented under it."""
    from clusterpulse import configcli
    from clusterpulse.dashboard import cli as dashboard_cli
    from clusterpulse.dashboard import remediation
    from clusterpulse.detection import cli as detect_cli

    main = {"clusterpulse-dashboard": dashboard_cli.main, "clusterpulse-ctl": ctl.main,
            "clusterpulse-remediate": remediation.main, "clusterpulse-detect": detect_cli.main,
            "clusterpulse-config": configcli.main}[prog]
    lines = example_lines(help_text(main, [], capsys))
    assert lines, prog
    for line, after in zip(lines, [*lines[1:], ""], strict=True):
        assert not re.search(r"[^\s#]\s{3,}--", line), line  # two lines made one
        if line.endswith("\\"):
            assert after.startswith(" " * 6), (line, after)
