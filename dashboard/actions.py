"""Operator actions on a run: find the agents of every node the run is on (through
Prometheus), ask each for the action, report per node (partial failures included),
follow the commands to completion, and audit everything. Shared by the dashboard,
`clusterpulse-ctl` and the remediation policy."""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Collection
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import requests

from clusterpulse.agent import protocol
from clusterpulse.agent.audit import AuditLog
from clusterpulse.agent.tokens import without_comment
from clusterpulse.dashboard.promclient import PrometheusClient

ACTIONS = ("checkpoint-restart", "restart")
# How far back an action on named nodes looks for them: the fault that names a node (a
# slow link) can make its scrapes time out, and Prometheus marks its series stale.
NODE_LOOKBACK = "2m"


def recent_rank_info(selector: str, lookback: str = NODE_LOOKBACK) -> str:
    """PromQL for the rank-info series matching `selector` now or within `lookback`
    ("" for now only)."""
    series = f"clusterpulse_trainer_rank_info{{{selector}}}"
    return f"last_over_time({series}[{lookback}])" if lookback else series


class ActionError(Exception):
    """The action cannot be attempted at all (bad run id, no token, no agents)."""


class OwnersUnknown(ActionError):
    """An agent of the run could not say who runs its ranks (down, busy, timed out):
    nothing was done, and asking again later may succeed."""


@dataclass
class NodeResult:
    node: str
    agent: str
    ok: bool
    command: str = ""
    state: str = ""
    error: str = ""
    # the agent refused: a restart of the run is already in flight there (this is it)
    in_flight: dict | None = None
    # which token went to `agent` (token_id): following the command sends no other
    token_id: str = ""
    # the request went out and no answer came back (a timeout, a connection reset, a
    # page that is not the agent's): unlike a refusal, the agent may have taken it
    unanswered: bool = False


def token_id(token: str) -> str:
    """A token's fingerprint: which token went where, without keeping it twice."""
    return hashlib.sha256(token.encode()).hexdigest()[:16]


def all_in_flight(results: list[NodeResult]) -> bool:
    """True when every node refused because a restart of the run is already under way
    there: nothing was done, and what to tell the asker is that restart, not a failure."""
    return bool(results) and all(r.in_flight is not None for r in results)


def follow_in_flight(results: list[NodeResult]) -> list[NodeResult]:
    """The restarts in flight that refused these results, as results to follow
    (command_states): a refused asker is shown the restart already under way, its
    progress included, rather than only told no."""
    return [NodeResult(r.node, r.agent, True, str(r.in_flight.get("id", "")),
                       str(r.in_flight.get("state", "")), token_id=r.token_id)
            if r.in_flight is not None else r for r in results]


# A command its agent answers 404 for: agents keep commands in memory, so one restarted
# since (or replaced) no longer knows it, and no later answer will say how it ended.
LOST = "lost"
# The states after which a command's agent says nothing new about it.
ENDED = ("completed", "failed", LOST)


def ended(results: list[NodeResult]) -> bool:
    """Whether a restart's every node has finished with it (completed, failed, or lost
    by its agent), or was never reached: the Run page's progress stops waiting, a
    refusal says so."""
    return all(r.state in ENDED or not r.ok for r in results)


def refusal_status(refused: list[NodeResult], asked_at: float, followed: list[NodeResult]
                   ) -> tuple[str, str]:
    """What a refused asker reads beside the restart it now follows, as that restart
    moves on: ("error", ...) while it runs, ("info", ...) once it has ended. The agents'
    answers were shown as they were at the refusal, each node's in full (~900
    characters for two nodes), and still said "state delivered, deadline in 118 s" long
    after; the restart is named once here, its state is the table's."""
    when = time.strftime("%H:%M:%S", time.gmtime(asked_at))
    running = next((r.in_flight for r in refused if r.in_flight), {})
    who = running.get("on_behalf_of") or running.get("requested_by") or "?"
    since = time.strftime("%H:%M:%S", time.gmtime(running.get("created_unix") or asked_at))
    named = (f"a {running.get('action', 'restart')} of this run requested by {who} at {since} "
             f"UTC (command {running.get('id', '?')}) was already in flight")
    if followed and ended(followed):
        how = ("completed" if {r.state for r in followed if r.ok} == {"completed"}
               else "ended (see the table)")
        return ("info", f"Your request at {when} UTC was not sent: {named}, and it has since "
                        f"{how}. Ask again if the run still needs a restart.")
    hint = (" To make it a hard restart now: `clusterpulse-ctl escalate --run "
            f"{running.get('run', '…')} --command {running.get('id', '…')} --reason …`."
            if running.get("action") == "checkpoint-restart" else "")
    return ("error", f"Not sent at {when} UTC: {named}; a run is not restarted twice. Its "
                     f"progress is below.{hint}")


def agent_tls() -> str | bool:
    """With CLUSTERPULSE_AGENT_CA_FILE set, agents are reached over HTTPS and their
    certificates checked against that CA bundle (requests' `verify`); else plain HTTP."""
    return os.environ.get("CLUSTERPULSE_AGENT_CA_FILE") or False


def no_answer(err: Exception) -> str:
    """Why an agent's answer could not be used, for a node's result. A page that is
    not JSON (another server at the agent's address, an HTML error page of a proxy)
    or JSON that is not an object was reported "unreachable: JSONDecodeError": it was
    reached, and its answer is what was wrong."""
    if isinstance(err, requests.JSONDecodeError | AttributeError):  # .get of a non-object
        return "answered with something that is not the agent's JSON (is it an agent?)"
    return f"unreachable: {type(err).__name__}"


def _token_lines(token: str) -> list[list[str]]:
    """A token file's words, line by line, without comments and blank lines."""
    lines = [without_comment(ln).split() for ln in token.splitlines()]
    return [ln for ln in lines if ln]


def _token_table(token: str) -> dict[str, str] | None:
    """A token file's `NODE TOKEN` lines as a table, or None when it holds one token for
    every agent."""
    lines = _token_lines(token)
    if len(lines) == 1 and len(lines[0]) == 1:
        return None
    return {ln[0]: ln[1] for ln in lines if len(ln) == 2}


def token_for(token: str | None, node: str) -> str | None:
    """The bearer token for one node's agent.

    The token file holds either one token for every agent, or per-node lines
    `NODE TOKEN` (and optionally `* TOKEN` for the others), so that a token taken from
    one node opens no other node's control API."""
    if not token:
        return None
    table = _token_table(token)
    if table is None:
        return _token_lines(token)[0][0]
    return table.get(node) or table.get("*")


# Target labels that name the node an agent's scrape target is on. The operator's
# scrape configuration or service discovery sets them (`labels: {target_node: ...}` in
# a static_config; `k8s_node` from the pod's node, deploy/kubernetes; `node` too, which
# then replaces the agent's own); an agent cannot: what it exports as `node` is what it
# says about itself.
TARGET_NODE_LABELS = ("target_node", "k8s_node", "node")
# The agents' scrape jobs, as the shipped configurations name them and NodeAgentDown
# reads them: a target of another job (an application's pod labelled with its node) is
# no agent, whatever it exports and however it is labelled.
AGENT_JOBS = 'job=~"clusterpulse.*"'


@dataclass
class RunAgents:
    """The agents of a run's nodes: `urls` node -> agent base URL, where that node's
    token may be sent; `refused` node -> why nothing is sent for that node."""

    urls: dict[str, str]
    refused: dict[str, str]


def run_agents(prom: PrometheusClient, run: str, token: str | None,
               lookback: str = "") -> RunAgents:
    """The agents that export the run's ranks (or did within `lookback`, e.g. "2m": a
    node whose slow link makes its scrapes time out is the node an eviction is for).

    A node is whatever its agent exports as `node`, and the URL is its scrape target.
    With per-node tokens that pairing is checked first: an agent that exported another
    node's name would be sent that node's token and could open its control API. So a
    node's token goes only to a target whose own labels (TARGET_NODE_LABELS) name that
    node; and a node that two targets claim is sent nothing, whatever the tokens."""
    if not protocol.RUN_ID.fullmatch(run):
        raise ActionError(f"invalid run id {run!r}")
    scheme = "https" if agent_tls() else "http"
    series = recent_rank_info(f'run="{run}",{AGENT_JOBS}', lookback)
    claims: dict[str, set[str]] = {}
    for s in prom.query(f"max by (node, instance) ({series})"):
        if "instance" in s.labels and "node" in s.labels:
            claims.setdefault(s.labels["node"], set()).add(s.labels["instance"])
    per_node = bool(token) and _token_table(token) is not None
    named = _target_nodes(prom, series, lookback) \
        if per_node or any(len(held) > 1 for held in claims.values()) else {}

    def names(instance: str, node: str) -> bool:
        return node in (named.get(instance) or {}).values()

    urls: dict[str, str] = {}
    refused: dict[str, str] = {}
    for node, held in sorted(claims.items()):
        if len(held) > 1:
            # the one its target names is the node's; the others only say they are
            held = {i for i in held if names(i, node)} or held
        instance = min(held)
        if len(held) > 1:
            refused[node] = (f"not sent: agents at {', '.join(sorted(held))} all report "
                             f"ranks as node {node}; which is {node} is unknown")
        elif per_node and not names(instance, node):
            labels = named.get(instance, {})
            if labels is None:
                target = ("comes with more than one set of labels (a target relabelled "
                          f"within {lookback or 'the moment'}, or an exporter that adds "
                          "labels to its own `up`)")
            elif labels:
                target = "says " + ", ".join(f"{k}={v}" for k, v in sorted(labels.items()))
            else:
                target = "names no node"
            refused[node] = (
                f"not sent: the agent at {instance} reports node {node}, and its scrape "
                f"target {target}; a node's own token goes only to a target labelled with "
                f"that node ({', '.join(TARGET_NODE_LABELS)}: docs/security.md)")
        else:
            urls[node] = f"{scheme}://{instance}"
    return RunAgents(urls, refused)


def _target_nodes(prom: PrometheusClient, ranks: str, lookback: str
                  ) -> dict[str, dict[str, str] | None]:
    """instance -> its scrape target's node-naming labels, read from the `up` of the
    agents' jobs, for the instances that export `ranks` (a series selector).

    `up` carries the target's labels, but a target may also export a metric named `up`,
    with labels of its choosing beside the target's (a fake `k8s_node` where the target
    sets `target_node`). Such a series, like the old labels of a target relabelled
    within `lookback`, is a second label set for the instance: None, which names no
    node. The join keeps the query one size whatever the run's size (a regex of 1,024
    instances was over VictoriaMetrics' 16 KB query limit)."""
    up = f"up{{{AGENT_JOBS}}}"
    up = f"last_over_time({up}[{lookback}])" if lookback else up
    found: dict[str, dict[str, str] | None] = {}
    for s in prom.query(f"group by (instance, {', '.join(TARGET_NODE_LABELS)}) "
                        f"({up} and on (instance) group by (instance) ({ranks}))"):
        instance = s.labels.get("instance", "")
        labels = {k: s.labels[k] for k in TARGET_NODE_LABELS if s.labels.get(k)}
        found[instance] = labels if found.get(instance, labels) == labels else None
    return found


def rank_owners(agents: dict[str, str], run: str, token: str) -> dict[int | None, set[str]]:
    """uid -> the nodes where a process of that user reports a rank of `run`, from each
    agent's own list (kernel credentials). An alert's run label, and Prometheus's, are
    only what ranks reported: another user's process could report a rank of someone
    else's run and have the policy restart it. The key None gathers the ranks whose
    process the agent could not verify (UDP, a PID namespace it cannot see, exited):
    unknown, which the policy never acts for. The agents are asked at once; one that
    does not answer fails the whole check (ActionError): what it holds is unknown too."""

    def ask(node: str, url: str) -> list | str:
        node_token = token_for(token, node)
        if node_token is None:
            return "no token for this node"
        try:
            r = requests.get(f"{url}/v1/ranks", timeout=3, verify=agent_tls(),
                             headers={"Authorization": f"Bearer {node_token}"})
            if r.status_code != 200:
                return f"HTTP {r.status_code}"
            ranks = r.json().get("ranks")
        except (requests.RequestException, ValueError, AttributeError) as err:
            return no_answer(err)
        return ranks if isinstance(ranks, list) else "no rank list in its answer"

    owners: dict[int | None, set[str]] = {}
    with ThreadPoolExecutor(max_workers=min(16, max(1, len(agents)))) as pool:
        answers = {node: pool.submit(ask, node, url) for node, url in agents.items()}
    silent = {node: a.result() for node, a in answers.items() if isinstance(a.result(), str)}
    if silent:
        raise OwnersUnknown(
            f"cannot tell who runs {run!r}: "
            + "; ".join(f"the agent on {node} did not answer ({why})"
                        for node, why in sorted(silent.items()))
            + "; nothing is done while a node's ranks are unknown")
    for node, answer in answers.items():
        for rank in answer.result():
            if isinstance(rank, dict) and rank.get("run") == run:
                uid = rank.get("uid")
                owners.setdefault(uid if isinstance(uid, int) else None, set()).add(node)
    return owners


def request_action(prom: PrometheusClient, run: str, action: str, reason: str, who: str,
                   token: str | None, audit: AuditLog, deadline_s: float = 120,
                   source: str = "dashboard", nodes: Collection[str] | None = None,
                   leave_s: float = 0.0, audited_as: str | None = None,
                   alert: dict | None = None, one_owner: bool = False) -> list[NodeResult]:
    """Ask the agents of the run's nodes (of `nodes` only, if given) for `action`;
    `leave_s`: those nodes sit the graceful restart out that long (evict-node);
    `alert`: the labels of the alert a policy acts on, kept in the audit record (which
    rank on which node the action was for); `one_owner`: do nothing when the run's
    ranks are reported by processes of more than one user (`rank_owners`: the policy,
    which acts on what ranks reported; an operator decides for themselves).

    An agent with a restart of the run in flight refuses another (HTTP 409, its result's
    `in_flight`); when every node refused so, the request is audited as "refused": no
    action was taken. When none took it and a node gave no answer (`unanswered`), it is
    audited as "unconfirmed": that node may have taken it."""
    if action not in ACTIONS:
        raise ActionError(f"action must be one of {', '.join(ACTIONS)}")
    if not reason.strip():
        raise ActionError("a reason is required; it goes to the audit log")
    if not token:
        raise ActionError("no agent token configured (CLUSTERPULSE_AGENT_TOKEN_FILE)")
    found = run_agents(prom, run, token, lookback=NODE_LOOKBACK if nodes is not None else "")
    agents, refused = found.urls, found.refused
    if not agents and not refused:
        raise ActionError(f"no agent reports ranks of run {run!r} (agents are the targets "
                          "of the scrape jobs named clusterpulse*)")
    if one_owner and refused:
        raise ActionError(f"cannot tell who runs {run!r}: " + "; ".join(
            f"{node}: {why}" for node, why in sorted(refused.items()))
            + "; nothing is done while a node's agent is in doubt")
    owners = rank_owners(agents, run, token) if one_owner else {}
    if None in owners:
        raise ActionError(
            f"run {run!r} has ranks whose process the agent could not verify (on "
            f"{', '.join(sorted(owners[None]))}): nothing is done for what an unknown "
            "sender reported; find it with GET /v1/ranks (uid null) on those agents")
    if len(owners) > 1:
        where = "; ".join(f"uid {uid} on {', '.join(sorted(on))}"
                          for uid, on in sorted(owners.items(), key=lambda kv: kv[0] or 0))
        raise ActionError(
            f"run {run!r} is reported by processes of more than one user ({where}): a run "
            "id is a name any process on a node can report under, so nothing is done; "
            "find the process that does not belong (GET /v1/ranks on those agents)")
    if nodes is not None:
        agents = {node: url for node, url in agents.items() if node in nodes}
        refused = {node: why for node, why in refused.items() if node in nodes}
        if not agents and not refused:
            raise ActionError(f"run {run!r} has no ranks on {', '.join(sorted(nodes))}")
    payload = {"action": action, "reason": reason, "requested_by": who,
               "deadline_s": deadline_s, **({"leave_s": leave_s} if leave_s else {})}
    results = [NodeResult(node, "", False, error=why) for node, why in sorted(refused.items())]
    for node, url in sorted(agents.items()):
        node_token = token_for(token, node)
        if node_token is None:
            results.append(NodeResult(node, url, False, error="no token for this node in the "
                                      "agent token file"))
            continue
        try:
            r = requests.post(f"{url}/v1/runs/{run}/actions", timeout=5, verify=agent_tls(),
                              headers={"Authorization": f"Bearer {node_token}"},
                              json=payload)
            body = r.json()
            ok = r.status_code == 202
            running = body.get("in_flight") if r.status_code == 409 else None
            results.append(NodeResult(node, url, ok, body.get("id", ""), body.get("state", ""),
                                      "" if ok else body.get("error") or body.get("detail")
                                      or f"HTTP {r.status_code}",
                                      running if isinstance(running, dict) else None,
                                      token_id(node_token)))
        except (requests.RequestException, ValueError, AttributeError) as err:
            results.append(NodeResult(node, url, False, error=no_answer(err),
                                      unanswered=True))
    results.sort(key=lambda r: r.node)
    accepted = sum(r.ok for r in results)
    # "failed" said no agent took it when one that never answered may have
    outcome = "accepted" if accepted == len(results) else (
        "partial" if accepted else "refused" if all_in_flight(results)
        else "unconfirmed" if any(r.unanswered for r in results) else "failed")
    audit.write(who, audited_as or action, reason, outcome, run=run, source=source,
                nodes={r.node: (r.command or r.error) for r in results},
                **({"leave_s": leave_s} if leave_s else {}), **({"alert": alert} if alert else {}))
    return results


def escalate_command(prom: PrometheusClient, run: str, command: str, reason: str, who: str,
                     token: str | None, audit: AuditLog, source: str = "cli") -> NodeResult:
    """Escalate a graceful restart in flight (`command`, as the refusal of a second
    restart named it) to a hard restart now, on the agent that holds it: the one way to
    force a hard restart over it, and it names what it overrides. Audited as `who`."""
    if not reason.strip():
        raise ActionError("a reason is required; it goes to the audit log")
    if not token:
        raise ActionError("no agent token configured (CLUSTERPULSE_AGENT_TOKEN_FILE)")
    found = run_agents(prom, run, token)
    agents = found.urls
    # command ids are NODE-UNIXTIME-N: the longest node name that prefixes it holds it
    holders = sorted((n for n in [*agents, *found.refused] if command.startswith(f"{n}-")),
                     key=len)
    if not holders:
        raise ActionError(f"no agent of run {run!r} holds command {command!r}")
    node = holders[-1]
    if node in found.refused:
        raise ActionError(f"{node}: {found.refused[node]}")
    node_token = token_for(token, node)
    if node_token is None:
        raise ActionError(f"no token for node {node} in the agent token file")
    try:
        r = requests.post(f"{agents[node]}/v1/commands/{command}/escalate", timeout=5,
                          verify=agent_tls(), headers={"Authorization": f"Bearer {node_token}"},
                          json={"reason": reason, "requested_by": who})
        body = r.json()
        ok = r.status_code == 202
        result = NodeResult(node, agents[node], ok, command, body.get("state", ""),
                            "" if ok else body.get("error") or f"HTTP {r.status_code}",
                            token_id=token_id(node_token))
    except (requests.RequestException, ValueError, AttributeError) as err:
        result = NodeResult(node, agents[node], False, command, error=no_answer(err))
    audit.write(who, "escalate", reason, "accepted" if result.ok else "failed", run=run,
                source=source, nodes={node: command if result.ok else result.error})
    return result


def command_states(results: list[NodeResult], token: str | None) -> list[NodeResult]:
    """Refresh each node's command state (pending, delivered, escalated, completed...).

    The token file is read again while a request is followed (the Run page, every 2 s);
    each agent is sent only the token its request went with: one changed since (per-node
    tokens after a suspected leak) was never checked against that agent (`run_agents`).

    A command seen in a final state (ENDED) keeps it and its agent is not asked again:
    the agent restarted since, or its book of finished commands rolled over, answers
    404, and a completed restart turned "lost" ("Some nodes failed" on the Run page)."""
    out = []
    for r in results:
        if not r.ok or not r.command or r.state in ENDED:
            out.append(r)
            continue
        node_token = token_for(token, r.node)
        if node_token is None or token_id(node_token) != r.token_id:
            out.append(NodeResult(r.node, r.agent, r.ok, r.command, r.state,
                                  "not followed: the agent token file changed since the "
                                  "request (request again to follow it)", token_id=r.token_id))
            continue
        try:
            answer = requests.get(f"{r.agent}/v1/commands/{r.command}", timeout=5,
                                  verify=agent_tls(),
                                  headers={"Authorization": f"Bearer {node_token}"})
            out.append(_followed(r, answer.status_code, answer.json()))
        except (requests.RequestException, ValueError, AttributeError) as err:
            out.append(NodeResult(r.node, r.agent, r.ok, r.command, r.state, no_answer(err),
                                  token_id=r.token_id))
    return out


def _followed(r: NodeResult, status: int, body: dict) -> NodeResult:
    """`r` as its agent's answer (HTTP `status`, JSON `body`) about its command leaves it.

    Every answer was read as a state: the 404 of an agent restarted mid-restart (it no
    longer knows the command) became state "?", its message was dropped, and the Run
    page and `clusterpulse-ctl --wait` waited for an end no answer would bring. A 404
    ends a command not yet seen final as LOST, with the agent's words (one seen final
    keeps that state: its agent forgetting it later changes nothing); another refusal
    (a token rotated, the agent busy) keeps the last known state, with why it is not
    newer."""
    said = body.get("error") or body.get("detail") or f"HTTP {status}"
    if r.state in ENDED:
        return r
    if status == 404:
        return NodeResult(r.node, r.agent, True, r.command, LOST,
                          f"the agent no longer knows this command (restarted since?): "
                          f"{said}", token_id=r.token_id)
    if status != 200:
        return NodeResult(r.node, r.agent, r.ok, r.command, r.state,
                          f"state not refreshed: {said}", token_id=r.token_id)
    return NodeResult(r.node, r.agent, True, r.command, body.get("state", "?"),
                      body.get("detail", ""), token_id=r.token_id)
