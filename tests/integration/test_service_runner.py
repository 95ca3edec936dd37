"""``Runner.execute`` given a run again (on a real SQLite database and the process tier): a
broker's second copy, or a waker's send of a run whose first worker was slow to claim it, must
leave the run to the process that holds it; a copy of a paused or broken run's message leaves it
waiting for a person; a run whose worker died after its end was recorded still gets its
artifacts. And a run that cannot go on as it was left: its approvals decided before it had
paused, its tenant's quota cut below its sandbox while it waited, its acceptance check no longer
its role's to run."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest

from stockade import exceptions as exc
from stockade.assembly import AgentSession
from stockade.audit.events import EventKind
from stockade.policy.approval import ApprovalRequest, Choice
from stockade.policy.schema import Decisions
from stockade.runs.seeds import pack_workspace, unpack_seed
from stockade.runs.store import RunStore
from stockade.server.run_artifacts import LEFT_OUT
from stockade.server.runner import Runner
from stockade.server.state.approvals import DatabaseApprovals
from stockade.server.state.kills import DatabaseKillSource
from stockade.server.state.rows import WAITING
from stockade.server.state.schema import open_database
from stockade.server.state.store import ServiceStore
from stockade.server.tenants import Tenant
from stockade.types import MiB
from tests.conftest import require_tier
from tests.integration.service_env import runner_on_sqlite, write_tenants

pytestmark = [pytest.mark.process]


@pytest.fixture
def runner(tmp_path: Path) -> Iterator[Runner]:
    require_tier("process")
    path, _ = write_tenants(tmp_path)
    with runner_on_sqlite(path, tmp_path) as made:
        yield made


def test_a_delivery_that_finds_the_run_starting_elsewhere_leaves_it_to_that_process(runner: Runner) -> None:
    spec: dict[str, object] = {"task": "t", "scripted": ["done"]}
    assert runner.store.add_run(run_id="r1", tenant="acme", role="dev", spec=spec, labels={}, max_active=10)
    # another worker has started it: it holds the run's lease, no checkpoint written yet
    other = RunStore(open_database(runner.config.database), namespace="runs")
    lease = other.claim("r1", new=True)
    try:
        with pytest.raises(exc.RunLeased):
            runner.execute("r1", runner.config.tenants.current().tenants["acme"])
        row = runner.store.run("r1")
        # before, this copy wrote "error" (and freed the run's quota) while the other ran it on;
        # now it writes nothing at all: the run is its holder's to write
        assert row is not None and row.status == "queued" and row.attempts == 0, row
        assert sandboxes_started(runner, "r1") == 0
    finally:
        lease.release()
        other.close()


def sandboxes_started(runner: Runner, run_id: str) -> int:
    trail = runner.audit.get(_acme(runner))
    trail.flush()
    return sum(event.kind is EventKind.SANDBOX_START for event in trail.store.events(run_id=run_id))


def test_a_copy_of_a_running_runs_message_starts_no_sandbox_and_leaves_its_record_alone(
    runner: Runner,
) -> None:
    """A waker's resend or the broker's redelivery of a run that runs in another process."""
    _submit(runner, "r1", ["done"])
    assert runner.store.set_status("r1", "running", worker="worker-a", started=True)
    other = RunStore(open_database(runner.config.database), namespace="runs")
    lease = other.claim("r1", new=True)  # worker-a runs it
    try:
        for _ in range(3):
            with pytest.raises(exc.RunLeased):
                runner.execute("r1", _acme(runner))
        # before, each copy started a whole sandbox (outside the quota: the run's share was
        # held already), and wrote itself in as the run's worker, one attempt more: 4 attempts
        assert sandboxes_started(runner, "r1") == 0
        row = runner.store.run("r1")
        assert row is not None and (row.status, row.worker, row.attempts) == ("running", "worker-a", 1), row
    finally:
        lease.release()
        other.close()


def test_two_deliveries_of_a_run_at_once_start_one_sandbox(runner: Runner) -> None:
    """Two workers (each a runner of its own) take the same run at the same moment: the lease
    is taken before the sandbox starts, so the second starts none."""
    slow = {"name": "run_code", "args": {"language": "bash", "code": "sleep 2"}}
    _submit(runner, "r1", [slow, "done"])
    second = Runner(runner.config, name="worker-b")
    try:
        together = threading.Barrier(2)
        outcomes: list[str] = []

        def deliver(by: Runner) -> None:
            together.wait()
            try:
                outcomes.append(by.execute("r1", _acme(by)).status)
            except exc.RunLeased:
                outcomes.append("leased elsewhere")

        threads = [threading.Thread(target=deliver, args=(by,)) for by in (runner, second)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        second.close()
    assert sorted(outcomes) == ["leased elsewhere", "success"]
    # before, both started a sandbox (the second found the lease taken only once it had one)
    assert sandboxes_started(runner, "r1") == 1
    row = runner.store.run("r1")
    assert row is not None and row.attempts == 1, row


def _acme(runner: Runner) -> Tenant:
    return runner.config.tenants.current().tenants["acme"]


def _submit(runner: Runner, run_id: str, turns: list[object], **spec: object) -> None:
    made = {"task": "t", "scripted": turns, **spec}
    assert runner.store.add_run(run_id=run_id, tenant="acme", role="dev", spec=made, labels={}, max_active=10)


def _called(runner: Runner, run_id: str) -> list[str]:
    return [record.call.name for record in runner.runs.tool_calls(run_id)]


FAILING = {"name": "run_code", "args": {"code": "raise ValueError('still broken')", "language": "python"}}
AFTER = {"name": "write_file", "args": {"path": "went_on.txt", "content": "nobody resumed me"}}


def test_a_copy_of_a_broken_runs_message_leaves_it_broken_until_a_person_resumes_it(runner: Runner) -> None:
    _submit(runner, "r1", [FAILING] * 5 + [AFTER, "done"])
    assert runner.execute("r1", _acme(runner)).status == "broken"
    calls = _called(runner, "r1")
    assert "write_file" not in calls
    # a waker's resend, the broker's copy of a dead worker's message: before, this closed the
    # breaker and ran the write queued after it opened ("success")
    assert runner.execute("r1", _acme(runner)).status == "broken"
    row = runner.store.run("r1")
    assert row is not None and row.status == "broken" and row.attempts == 1, row
    assert _called(runner, "r1") == calls
    # POST /v1/runs/{id}/resume queues it, then sends it: that goes on
    assert runner.store.set_status("r1", "queued", only_from=("broken",))
    assert runner.execute("r1", _acme(runner)).status == "success"
    assert _called(runner, "r1")[-1] == "write_file"


def test_a_broken_run_whose_worker_died_before_saying_so_is_not_resumed_by_its_next_delivery(
    runner: Runner,
) -> None:
    _submit(runner, "r1", [FAILING] * 5 + [AFTER, "done"])
    assert runner.execute("r1", _acme(runner)).status == "broken"
    # as a worker SIGKILLed between the run store's "broken" and the service's leaves the run
    assert runner.store.set_status("r1", "running", only_from=("broken",))
    assert runner.execute("r1", _acme(runner)).status == "broken"
    row = runner.store.run("r1")
    assert row is not None and row.status == "broken", row
    assert "write_file" not in _called(runner, "r1")
    assert runner.store.holds("acme") == []


def test_a_copy_of_a_paused_runs_message_starts_nothing_until_its_approval_is_decided(runner: Runner) -> None:
    needs_approval = {"name": "run_code", "args": {"code": "rm -r nothing || true", "language": "bash"}}
    _submit(runner, "r1", [needs_approval, "done"])
    assert runner.execute("r1", _acme(runner)).status == "paused"
    [request] = runner.approvals.pending("r1")
    # before, each copy started a sandbox (an attempt) and paused again
    assert runner.execute("r1", _acme(runner)).status == "paused"
    row = runner.store.run("r1")
    assert row is not None and row.status == "paused" and row.attempts == 1, row
    # it says how a service's run is decided: `stockade approve` is a local command
    assert row.error is not None and "stockade approve" not in row.error, row.error
    assert f"POST /v1/runs/r1/approvals/{request['id']}" in row.error, row.error
    # a decision queues it, then sends it (decide_approval)
    runner.approvals.decide("r1", request["id"], Choice.APPROVED, by="test")
    assert runner.store.set_status("r1", "queued", only_from=("paused",))
    assert runner.execute("r1", _acme(runner)).status == "success"


def test_a_run_whose_worker_died_before_keeping_its_artifacts_gets_them_when_given_again(
    runner: Runner, tmp_path: Path
) -> None:
    write = {"name": "write_file", "args": {"path": "out/result.txt", "content": "kept"}}
    _submit(runner, "r1", [write, "done"])
    assert runner.execute("r1", _acme(runner)).status == "success"
    # as a worker SIGKILLed between the run store's end and the artifacts leaves the run
    assert runner.store.delete_artifacts("r1")
    assert runner.store.set_status("r1", "running", only_from=("success",))
    # before, the end was written and the artifacts were "no artifacts (yet)" for ever
    assert runner.execute("r1", _acme(runner)).status == "success"
    data = runner.store.artifacts("r1")
    assert data is not None
    unpack_seed(data, tmp_path / "got")
    assert (tmp_path / "got" / "out" / "result.txt").read_text() == "kept"


def test_a_runs_artifacts_leave_out_a_planted_repository_config_and_name_it(
    runner: Runner, tmp_path: Path
) -> None:
    """Kept at the run's end and rebuilt from the run store alike: a `.git/config` the run's
    code wrote (its `core.fsmonitor` ran on `git status` where the artifacts were unpacked) is
    not in them; the note inside them names it; the rest is there."""
    plant = {"name": "write_file", "args": {"path": "sub/.git/config", "content": "[core]\nfsmonitor = x\n"}}
    head = {"name": "write_file", "args": {"path": "sub/.git/HEAD", "content": "ref: refs/heads/main\n"}}
    _submit(runner, "r1", [plant, head, "done"])
    assert runner.execute("r1", _acme(runner)).status == "success"
    for got in (tmp_path / "kept", tmp_path / "rebuilt"):
        data = runner.store.artifacts("r1")
        assert data is not None
        unpack_seed(data, got)
        assert not (got / "sub/.git/config").exists() and (got / "sub/.git/HEAD").exists()
        assert "'sub/.git/config'" in (got / LEFT_OUT).read_text()
        # as a worker SIGKILLed between the run store's end and the artifacts leaves the run
        assert runner.store.delete_artifacts("r1")
        assert runner.store.set_status("r1", "running", only_from=("success",))
        assert runner.execute("r1", _acme(runner)).status == "success"


def test_a_run_that_called_no_tool_gets_the_workspace_it_started_from_as_artifacts(
    runner: Runner, tmp_path: Path
) -> None:
    (tmp_path / "seed").mkdir()
    (tmp_path / "seed" / "README.md").write_text("seed")
    seed = pack_workspace(tmp_path / "seed")
    runner.store.put_workspace("acme", "dev", seed.digest, seed.data, len(seed.data), max_bytes=MiB * 100)
    digest = seed.digest
    _submit(runner, "r1", ["nothing to do"], workspace=digest)
    assert runner.execute("r1", _acme(runner)).status == "success"
    assert runner.store.delete_artifacts("r1")
    assert runner.store.set_status("r1", "running", only_from=("success",))
    assert runner.execute("r1", _acme(runner)).status == "success"
    data = runner.store.artifacts("r1")
    assert data is not None
    unpack_seed(data, tmp_path / "got")
    assert (tmp_path / "got" / "README.md").read_text() == "seed"


def test_a_run_submitted_before_workspaces_had_a_role_starts_from_the_one_kept_then(
    runner: Runner, tmp_path: Path
) -> None:
    """The upgrade gives an older upload no role (role ''); a run of role dev queued before it
    named that upload, and still starts from it."""
    (tmp_path / "seed").mkdir()
    (tmp_path / "seed" / "README.md").write_text("from before")
    seed = pack_workspace(tmp_path / "seed")
    runner.store.put_workspace("acme", None, seed.digest, seed.data, len(seed.data), max_bytes=MiB * 100)
    _submit(runner, "r1", ["nothing to do"], workspace=seed.digest)
    assert runner.execute("r1", _acme(runner)).status == "success"
    data = runner.store.artifacts("r1")
    assert data is not None
    unpack_seed(data, tmp_path / "got")
    assert (tmp_path / "got" / "README.md").read_text() == "from before"


class ApprovesOnSight(DatabaseApprovals):
    """A person who approves each request the moment it is listed: before its run has paused
    (its sandbox is being kept for seconds meanwhile), when the decision sends nothing on."""

    def submit(self, request: ApprovalRequest) -> None:
        super().submit(request)
        self.decide(request.run_id, request.id, Choice.APPROVED, by="quick")


def test_a_run_whose_approvals_were_decided_while_it_paused_is_queued_and_goes_on(runner: Runner) -> None:
    runner.approvals = ApprovesOnSight(runner.store)
    needs_approval = {"name": "run_code", "args": {"code": "rm -r nothing || true", "language": "bash"}}
    _submit(runner, "r1", [needs_approval, "done"])
    # before, it was written "paused" with nothing pending: nothing sent it on, ever
    with pytest.raises(exc.RunDeferred):  # the executor runs it again at once
        runner.execute("r1", _acme(runner))
    row = runner.store.run("r1")
    assert row is not None and row.status == "queued", row
    assert runner.wakes.at("r1") is not None  # a waker sends it should this worker die now
    assert runner.store.holds("acme") == []
    assert runner.execute("r1", _acme(runner)).status == "success"
    assert _called(runner, "r1") == ["run_code"]


def _with_policy(tenant: Tenant, **changes: object) -> Tenant:
    """``tenant`` as its tenants file says once its policy was changed so."""
    return dataclasses.replace(tenant, policy=tenant.policy.model_copy(update=changes))


def _denials(runner: Runner, run_id: str) -> list[Mapping[str, object]]:
    trail = runner.audit.get(_acme(runner))
    trail.flush()
    return [e.attributes for e in trail.store.events(run_id=run_id) if e.kind is EventKind.POLICY_DECISION]


def test_a_run_whose_check_its_tenants_policy_came_to_deny_ends_denied_before_its_sandbox(
    runner: Runner,
) -> None:
    """The check was judged when the run was submitted; the policy changed in the tenants file
    while it waited. Before, the worker ran it all the same, outside the policy's guards."""
    _submit(runner, "r1", ["done"], check="echo PWNED > pwned.txt")
    locked = _with_policy(_acme(runner), decisions=Decisions(deny=("execute",)))
    outcome = runner.execute("r1", locked)
    assert outcome.status == "denied", outcome
    assert outcome.error is not None and "execute is denied" in outcome.error, outcome
    row = runner.store.run("r1")
    assert row is not None and (row.status, row.attempts) == ("denied", 0), row
    assert sandboxes_started(runner, "r1") == 0 and runner.store.holds("acme") == []
    [denial] = _denials(runner, "r1")
    assert (denial["level"], denial["rule"]) == ("check", "decisions.deny: execute"), denial


def test_a_paused_run_whose_role_lost_its_command_tool_resumes_to_denied_its_check_not_run(
    runner: Runner,
) -> None:
    needs_approval = {"name": "run_code", "args": {"code": "rm -r nothing || true", "language": "bash"}}
    _submit(runner, "r1", [needs_approval, "done"], check="echo PWNED > pwned.txt")
    assert runner.execute("r1", _acme(runner)).status == "paused"
    [request] = runner.approvals.pending("r1")
    runner.approvals.decide("r1", request["id"], Choice.APPROVED, by="test")
    assert runner.store.set_status("r1", "queued", only_from=("paused",))
    acme = _acme(runner)
    reader = acme.policy.roles["dev"].model_copy(update={"tools": ("read_file", "list_files")})
    outcome = runner.execute("r1", _with_policy(acme, roles={**acme.policy.roles, "dev": reader}))
    assert outcome.status == "denied", outcome
    assert outcome.error is not None and "may not use the tool 'shell'" in outcome.error, outcome
    row = runner.store.run("r1")
    assert row is not None and (row.status, row.attempts) == ("denied", 1), row
    state = runner.runs.load("r1")
    assert state is not None and state.checks == []  # its check never ran
    assert [d["rule"] for d in _denials(runner, "r1")] == ["roles.dev.tools"]


def test_a_run_whose_tenants_quota_was_cut_below_its_sandbox_ends_error_saying_so(runner: Runner) -> None:
    _submit(runner, "r1", ["done"], sandbox_limits={"cpus": 2, "memory_mb": 512})
    acme = _acme(runner)
    cut = dataclasses.replace(acme, quotas=dataclasses.replace(acme.quotas, cpus=1.0))
    # before, QuotaExceeded each time: queued for ever, asking, holding a place of `runs`
    outcome = runner.execute("r1", cut)
    assert outcome.status == "error", outcome
    assert outcome.error is not None and "needs 2 cpus" in outcome.error and "(1)" in outcome.error, outcome
    row = runner.store.run("r1")
    assert row is not None and row.status == "error" and row.attempts == 0, row
    assert runner.store.holds("acme") == [] and runner.wakes.at("r1") is None


class _KilledWhileKeepingArtifacts(Runner):
    """A runner whose run is killed (as ``POST /v1/runs/{id}/kill`` does) in the gap after the
    agent's run has returned, while its workspace is packed as the artifacts (seconds, for a
    large one): what that kill found, said."""

    found_leased: bool | None = None

    def _keep_artifacts(self, run_id: str, tenant: Tenant, session: AgentSession) -> None:
        self.found_leased = self.runs.leased(run_id)
        if not self.store.set_status(run_id, "killed", error="stop", only_from=WAITING):
            self.kills.kill(run_id, "stop")
            if not self.found_leased:  # no process holds it: the kill ends it there and then
                self.store.set_status(run_id, "killed", error="stop", only_from=("running",))
        super()._keep_artifacts(run_id, tenant, session)


def test_a_kill_while_a_finished_run_keeps_its_artifacts_finds_it_held_and_ends_it_killed(
    runner: Runner,
) -> None:
    """The agent's run released its lease as it returned: a kill then found the run "running"
    with no holder, ended it "killed" (its quota freed while its sandbox lived), and the
    runner then wrote "success" over it. The lease is kept to the end written: the kill is left
    to the switch, which the end written then finds pulled: "killed" (it was "success", the
    kill answered "running")."""
    _submit(runner, "r1", ["done"])
    killing = _KilledWhileKeepingArtifacts(runner.config, name="worker-k")
    try:
        assert killing.execute("r1", _acme(runner)).status == "killed"
    finally:
        killing.close()
    assert killing.found_leased is True
    row = runner.store.run("r1")
    assert row is not None and (row.status, row.error) == ("killed", "stop"), row
    assert runner.store.holds("acme") == []
    assert not runner.runs.leased("r1")  # released once the end was written
    assert runner.kills.reason_now("r1") is None  # the switch went with the end


class _PulledAsTheWatchBegins(DatabaseKillSource):
    """The service's switches, one pulled (as ``POST /v1/runs/{id}/kill`` does, finding the run
    "running") as a run's session begins to watch it, its sandbox started: just after this
    worker's last read of the table for its runs (once a minute here)."""

    def __init__(self, store: ServiceStore) -> None:
        super().__init__(store, poll_s=60.0)
        self.pulled = False

    def mark_live(self, run_id: str, info: str) -> None:
        super().mark_live(run_id, info)
        if not self.pulled:
            self.reason(run_id)  # the table as it was a moment ago
            self.kill(run_id, "stop")
            self.pulled = True


def test_a_kill_as_a_resumed_run_starts_stops_it_before_its_approved_action(runner: Runner) -> None:
    """Before, the switch's source answered from its read of the table for half a second: the
    approved action ran, the run ended "success", and the kill had answered "running"."""
    needs_approval = {"name": "run_code", "args": {"code": "rm -r nothing || echo RAN", "language": "bash"}}
    _submit(runner, "r1", [needs_approval, "done"])
    assert runner.execute("r1", _acme(runner)).status == "paused"
    [request] = runner.approvals.pending("r1")
    runner.approvals.decide("r1", request["id"], Choice.APPROVED, by="test")
    assert runner.store.set_status("r1", "queued", only_from=("paused",))
    runner.kills = killing = _PulledAsTheWatchBegins(runner.store)
    outcome = runner.execute("r1", _acme(runner))
    assert killing.pulled and outcome.status == "killed", outcome
    row = runner.store.run("r1")
    assert row is not None and row.status == "killed", row
    assert "run_code" not in _called(runner, "r1")  # the approved action never ran
    assert runner.kills.reason_now("r1") is None


class _EndedElsewhereWhileKeepingArtifacts(Runner):
    """A runner whose run is written "killed" by another hand while its artifacts are packed
    (its lease gone meanwhile: the store unreachable past the lease's end, say)."""

    def _keep_artifacts(self, run_id: str, tenant: Tenant, session: AgentSession) -> None:
        assert self.store.set_status(run_id, "killed", error="stop", only_from=("running",))
        super()._keep_artifacts(run_id, tenant, session)


def test_an_end_written_while_the_run_kept_its_artifacts_is_not_written_over(runner: Runner) -> None:
    """The runner's end was written whatever the run's status had become: "killed" (its quota
    freed, its kill answered) turned "success"."""
    _submit(runner, "r1", ["done"])
    ending = _EndedElsewhereWhileKeepingArtifacts(runner.config, name="worker-e")
    try:
        outcome = ending.execute("r1", _acme(runner))
    finally:
        ending.close()
    assert outcome.status == "killed"
    row = runner.store.run("r1")
    assert row is not None and (row.status, row.error) == ("killed", "stop"), row
    assert runner.store.holds("acme") == []
