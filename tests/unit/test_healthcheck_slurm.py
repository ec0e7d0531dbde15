"""What `clusterpulse-healthcheck --drain` does to Slurm for each verdict: an unknown
(the agent did not answer) must leave the node alone, drained or not, and must not
even need Slurm's tools to say so."""

from __future__ import annotations

import contextlib

import pytest

from clusterpulse.agent import healthcheck
from clusterpulse.agent.healthcheck import PROBLEM, UNKNOWN, SlurmError, Verdict
from tests.support.httpstub import answering


def test_unknown_neither_drains_nor_resumes_nor_calls_scontrol(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))  # no scontrol: any Slurm call would fail
    verdict = Verdict(UNKNOWN, ["agent unreachable at http://127.0.0.1:9477/metrics"])
    assert healthcheck.apply_to_slurm("gpu-node-1", verdict) == ""


def test_a_problem_does_need_slurm(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(SlurmError, match="scontrol not found"):
        healthcheck.apply_to_slurm("gpu-node-1", Verdict(PROBLEM, ["GPU 1 down"]))


@pytest.mark.parametrize(("argv", "why"), [
    (["--timeout", "nan"], "--timeout must be > 0 and at most 3600 seconds, got nan"),
    (["--max-age", "nan"], "--max-age must be a number of seconds > 0, got nan"),
    (["--ecc-max", "nan"], "--ecc-max must be a count >= 0"),
    (["--agent", "http://[::1"], "--agent must be an http:// or https:// URL"),
    (["--agent", "http://127.0.0.1:port"], "--agent must be an http:// or https:// URL"),
    (["--agent", "http://"], "--agent must be an http:// or https:// URL"),
])
def test_a_setting_it_cannot_use_is_a_usage_error_not_a_traceback(argv, why, capsys):
    """Found by a review: --timeout nan passed `<= 0` and raised in settimeout, and
    'http://[::1' raised ValueError: Slurm saw exit 1 and a traceback, not a verdict
    or a usage error."""
    with pytest.raises(SystemExit) as exit_:
        healthcheck.main(argv)
    assert exit_.value.code == 2
    assert why in capsys.readouterr().err


def _page(xid_counts: dict[tuple[str, str], int]) -> str:
    """A /metrics page of two healthy GPUs with these XID totals ((uuid, code): n)."""
    lines = ["# TYPE clusterpulse_gpu_up gauge"]
    lines += [f'clusterpulse_gpu_up{{node="n",gpu="{g}",uuid="GPU-{g}"}} 1' for g in (0, 1)]
    lines.append("# TYPE clusterpulse_gpu_xid_errors_total counter")
    lines += [f'clusterpulse_gpu_xid_errors_total{{node="n",gpu="{u[-1]}",uuid="{u}",'
              f'xid="{c}"}} {n}' for (u, c), n in xid_counts.items()]
    return "\n".join(lines) + "\n"


def _judge(text: str, judged) -> healthcheck.Verdict:
    return healthcheck.evaluate(text, 0.0, 60.0, healthcheck.CRITICAL_XIDS, 0, judged)


def test_an_xid_dealt_with_is_not_judged_again(tmp_path):
    """Review: the XID totals never go down (the agent keeps them across its restarts
    and reboots), and any count above zero failed the check: one routine XID 63 drained
    its node for good, an operator's resume undone within one HealthCheckInterval.
    Now only the XIDs counted since a reboot, an operator's resume of a node the check
    drained, or --acknowledge are a problem; a count lower than the one acknowledged is
    the agent's state lost: all of it is new."""
    from clusterpulse.agent.healthstate import XidJudged

    state = tmp_path / "state.json"
    judged = XidJudged.load(state)  # none yet: every XID counted is new
    judged.after_boot("boot-1")
    one = _page({("GPU-0", "63"): 1, ("GPU-1", "13"): 4})
    v = _judge(one, judged)
    assert v.status == PROBLEM and v.reasons == ["GPU 0 XID 63 x1"]
    assert v.xids == {"GPU-0": {"63": 1}}  # critical XIDs only
    judged.drained_for, judged.seen = v.xids, v.xids  # as apply_to_slurm and main keep them
    judged.save(state)
    judged = XidJudged.load(state)
    judged.after_boot("boot-1")
    assert _judge(one, judged).status == PROBLEM  # still drained: not dealt with yet
    judged.resumed()  # an operator resumed the node
    assert _judge(one, judged).status == healthcheck.OK
    two = _page({("GPU-0", "63"): 2, ("GPU-1", "79"): 1})
    v = _judge(two, judged)
    assert sorted(v.reasons) == ["GPU 0 XID 63 x1", "GPU 1 XID 79 x1"]
    judged.seen = v.xids
    judged.after_boot("boot-2")  # a reboot: what was seen before it is done
    assert _judge(two, judged).status == healthcheck.OK
    assert _judge(_page({("GPU-0", "63"): 3, ("GPU-1", "79"): 1}), judged).reasons == \
        ["GPU 0 XID 63 x1"]
    judged.acknowledge({"GPU-0": {"63": 3}})  # --acknowledge after a GPU reset
    assert _judge(_page({("GPU-0", "63"): 3, ("GPU-1", "79"): 1}), judged).status == \
        healthcheck.OK
    lost = _judge(_page({("GPU-0", "63"): 1}), judged)  # the agent's state was wiped
    assert lost.reasons == ["GPU 0 XID 63 x1"]
    assert _judge(_page({("GPU-0", "63"): 1}), None).reasons == ["GPU 0 XID 63 x1"]


def test_an_unreadable_state_counts_every_xid_and_a_run_says_when_it_cannot_keep_it(
        tmp_path, capsys):
    """The safe side: a state file that cannot be read is no XID dealt with; one that
    cannot be written is said, and the verdict still comes."""
    from clusterpulse.agent.healthstate import XidJudged

    bad = tmp_path / "state.json"
    bad.write_text("{not json")
    judged = XidJudged.load(bad)
    assert judged.acknowledged == {} and judged.drained_for is None
    assert _judge(_page({("GPU-0", "79"): 1}), judged).status == PROBLEM
    with answering(_page({("GPU-0", "79"): 2}), "text/plain") as url:
        blocked = tmp_path / "file"
        blocked.write_text("")  # a file where the state's directory would be
        rc = healthcheck.main(["--agent", url, "--state", str(blocked / "state.json")])
        out = capsys.readouterr()
        assert rc == PROBLEM and "GPU 0 XID 79 x2" in out.out
        assert "cannot lock" in out.err and "without keeping" in out.err
        # --acknowledge keeps them, and says which
        state = tmp_path / "ok" / "state.json"
        rc = healthcheck.main(["--agent", url, "--state", str(state), "--acknowledge"])
        out = capsys.readouterr()
        assert rc == healthcheck.OK and "acknowledged: GPU-0 XID 79 x2" in out.out
        assert healthcheck.main(["--agent", url, "--state", str(state)]) == healthcheck.OK
        assert healthcheck.main(["--agent", url, "--state", "none"]) == PROBLEM



class _Slurm:
    """`scontrol` as apply_to_slurm sees it (node_state, _scontrol): a node's state and
    reason, and updates that may fail as slurmctld's do."""

    def __init__(self, monkeypatch) -> None:
        self.state, self.reason, self.fail = "IDLE", "", False
        monkeypatch.setattr(healthcheck, "node_state", lambda node: (self.state, self.reason))
        monkeypatch.setattr(healthcheck, "_scontrol", self.update)

    def update(self, *args: str) -> str:
        if self.fail:
            raise SlurmError("scontrol update failed: slurmctld timed out")
        fields = dict(a.split("=", 1) for a in args[1:])
        if fields.get("State") == "DRAIN":
            self.state, self.reason = "IDLE+DRAIN", fields["Reason"]
        elif fields.get("State") == "RESUME":
            self.state, self.reason = "IDLE", ""
        return ""


def _run_once(slurm: _Slurm, judged, page: str) -> healthcheck.Verdict:
    """One --drain run as main makes it: judged, Slurm told, kept."""
    verdict = _judge(page, judged)
    latest = [verdict]

    def rejudge() -> healthcheck.Verdict:
        latest.append(_judge(page, judged))
        return latest[-1]

    with contextlib.suppress(SlurmError):  # slurmctld's failure: the next run tries
        healthcheck.apply_to_slurm("n", verdict, judged, rejudge)
    judged.seen = verdict.xids
    return latest[-1]


def test_a_failed_drain_is_not_taken_for_a_resume(monkeypatch):
    """Review: the XIDs a drain was for were recorded before scontrol ran; a drain that
    failed (slurmctld busy) read at the next run as an operator's resume, the XID was
    acknowledged, and the node was never drained for it."""
    from clusterpulse.agent.healthstate import XidJudged

    slurm, judged = _Slurm(monkeypatch), XidJudged()
    page = _page({("GPU-0", "79"): 1})
    slurm.fail = True
    assert _run_once(slurm, judged, page).status == PROBLEM and judged.drained_for is None
    slurm.fail = False
    assert _run_once(slurm, judged, page).status == PROBLEM
    assert slurm.state == "IDLE+DRAIN" and "XID 79 x1" in slurm.reason


def test_xids_counted_while_drained_are_named_and_not_acknowledged_unseen(monkeypatch):
    """Review: XIDs that came while the node was drained were added to what a resume
    acknowledges, while the drain's reason still named the first only: the operator
    resumed for XID 63 and XID 79 never drained the node. The reason now names them."""
    from clusterpulse.agent.healthstate import XidJudged

    slurm, judged = _Slurm(monkeypatch), XidJudged()
    _run_once(slurm, judged, _page({("GPU-0", "63"): 1}))
    assert slurm.reason == "clusterpulse: GPU 0 XID 63 x1"
    _run_once(slurm, judged, _page({("GPU-0", "63"): 1}))  # nothing new: left alone
    both = _page({("GPU-0", "63"): 1, ("GPU-1", "79"): 1})
    _run_once(slurm, judged, both)
    assert "XID 79 x1" in slurm.reason and "XID 63 x1" in slurm.reason
    slurm.update("update", "NodeName=n", "State=RESUME")  # the operator saw both
    assert _run_once(slurm, judged, both).status == healthcheck.OK
    assert slurm.state == "IDLE"


def test_after_the_agents_counts_began_again_the_node_can_be_cleared(monkeypatch):
    """Review: acknowledged counts only grew; after the agent's XID counts were lost
    and began again, a new XID 79 x1 under an acknowledged x5 drained the node, and
    neither a resume nor --acknowledge cleared it (only deleting the state did)."""
    from clusterpulse.agent.healthstate import XidJudged

    slurm, judged = _Slurm(monkeypatch), XidJudged()
    judged.acknowledge({"GPU-0": {"79": 5}})
    again = _page({("GPU-0", "79"): 1})
    assert _run_once(slurm, judged, again).status == PROBLEM
    slurm.update("update", "NodeName=n", "State=RESUME")
    assert _run_once(slurm, judged, again).status == healthcheck.OK
    assert slurm.state == "IDLE"
    fresh = XidJudged()
    fresh.acknowledge({"GPU-0": {"79": 5}})
    fresh.acknowledge({"GPU-0": {"79": 1}})  # --acknowledge of what is counted now
    assert _judge(again, fresh).status == healthcheck.OK


def test_two_checks_at_once_take_turns_with_the_state(tmp_path):
    """Review: a check waiting on scontrol and an operator's --acknowledge each saved
    the state they had read: the acknowledgement was lost. Each run holds the state's
    lock until it (and its detached child) ends."""
    import subprocess
    import sys

    from clusterpulse.agent.healthstate import hold_lock

    state = tmp_path / "healthcheck.json"
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from pathlib import Path; "
         "from clusterpulse.agent.healthstate import hold_lock; "
         f"assert hold_lock(Path({str(state)!r})); print('held', flush=True); "
         "time.sleep(1.5)"], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        assert not hold_lock(state, wait_s=0.2)  # taken: not within 0.2 s
        assert hold_lock(state, wait_s=10)  # free once the holder ended
    finally:
        holder.kill()
