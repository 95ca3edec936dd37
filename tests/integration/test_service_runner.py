"""``Runner.execute`` against a run another delivery is starting (on a real SQLite database and
the process tier): a broker's second copy, or a waker's send of a run whose first worker was
slow to claim it, must leave the run to the process that holds it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from stockade import exceptions as exc
from stockade.runs.store import RunStore
from stockade.server.runner import Runner
from stockade.server.state import open_database
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
        # before, this copy wrote "error" (and freed the run's quota) while the other ran it on
        assert row is not None and row.status == "running", row
        assert runner.store.holds("acme") == ["r1"]
    finally:
        lease.release()
        other.close()
