"""stockade's own records never enter a sandbox with the workspace that holds them.

The folder stockade runs from is often the agent's workspace, and its ``.stockade/`` holds the
audit trail (every earlier run's events and the keys that erasure destroys) and the run store.
Code in the sandbox must find none of it, nor a store the configuration put elsewhere in the
workspace; the run's own bookkeeping in ``.stockade/`` (the diff's baseline) still travels.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path

from stockade import Sandbox
from stockade.agent import RunLimits
from stockade.assembly import AgentConfig, build_agent
from stockade.models import ScriptedModel, tool_call
from stockade.runs import open_run_store
from tests.conftest import require_tier

EXAMPLE_POLICY = Path(__file__).parents[2] / "examples" / "policy.toml"

LIST_ALL = (
    "import os\n"
    "found = sorted(os.path.relpath(os.path.join(d, n)) for d, ds, fs in os.walk('.') for n in ds + fs)\n"
    "open('listing.txt', 'w').write('\\n'.join(found))\n"
)


def _workspace(root: Path) -> Path:
    ws = root / "ws"
    (ws / "sub" / ".stockade").mkdir(parents=True)
    (ws / "inventory.py").write_text("STOCK = {}\n")
    (ws / "sub" / ".stockade" / "service.db").write_text("another stockade's records")
    return ws


def _listing(ws: Path, audit: str, runs_url: str | None, tmp_path: Path) -> list[str]:
    model = ScriptedModel([tool_call("run_code", {"code": LIST_ALL, "language": "python"}), "done"])
    config = AgentConfig(
        model=model,
        policy=EXAMPLE_POLICY,
        tier="process",
        audit=audit,
        runs_url=runs_url,
        limits=RunLimits(max_steps=4),
        approval_dir=tmp_path / "approvals",
        kill_target=str(tmp_path / "kill"),
        anomaly=False,
    )
    with build_agent(config) as agent, agent.session(workspace=ws, run_id="look") as session:
        result = session.run_sync("list the workspace")
        assert result.ok, result.state.error
        return session.sandbox.files.read("listing.txt").splitlines()


def test_the_default_records_folder_stays_out(tmp_path: Path) -> None:
    require_tier("process")
    ws = _workspace(tmp_path)
    db = ws / ".stockade" / "audit.db"
    seen = _listing(ws, f"sqlite:///{db}", None, tmp_path)
    assert "inventory.py" in seen
    assert not [name for name in seen if "audit.db" in name or "service.db" in name], seen
    # what the run itself wrote there inside the sandbox, and nothing from the host's
    assert [name for name in seen if ".stockade" in name] == [".stockade", ".stockade/baseline.json"], seen
    with sqlite3.connect(db) as con:  # the trail the sandbox did not see is there, and whole
        assert con.execute("SELECT COUNT(*) FROM audit_events").fetchone()[0] > 0
    # the run's kept seed (what `stockade replay` starts from) leaves them out too
    store = open_run_store(f"sqlite:///{db}")
    try:
        assert store.restore_seed("look", tmp_path / "seed")
    finally:
        store.close()
    kept = sorted(p.relative_to(tmp_path / "seed").as_posix() for p in (tmp_path / "seed").rglob("*"))
    assert kept == ["inventory.py", "sub"], kept


def test_a_store_configured_inside_the_workspace_stays_out(tmp_path: Path) -> None:
    require_tier("process")
    ws = _workspace(tmp_path)
    (ws / "records").mkdir()
    seen = _listing(ws, f"sqlite:///{ws / 'records' / 'trail.db'}", f"sqlite:///{ws / 'runs.db'}", tmp_path)
    assert "inventory.py" in seen and "records" in seen
    assert not [name for name in seen if name.endswith(("trail.db", "runs.db")) or ".db-" in name], seen


def test_a_sandbox_seeded_with_a_records_folder_gets_only_the_runs_bookkeeping(tmp_path: Path) -> None:
    """``Sandbox.create(workspace=...)`` and ``files.upload_dir`` alike: a saved workspace's
    baseline travels (a resumed run diffs against it), the records beside it do not."""
    require_tier("process")
    ws = _workspace(tmp_path)
    (ws / ".stockade" / "snapshots").mkdir(parents=True)
    (ws / ".stockade" / "audit.db").write_text("the trail")
    (ws / ".stockade" / "baseline.json").write_text("{}")
    (ws / "hard.db").hardlink_to(ws / ".stockade" / "audit.db")  # another name of a hidden file
    with Sandbox.create("process", workspace=ws) as sbx:
        seen = sorted(e.path for e in sbx.files.list("", depth=3))
        sbx.files.upload_dir(ws, "again")
        again = sorted(e.path for e in sbx.files.list("again", depth=3))
    assert seen == [".stockade", ".stockade/baseline.json", "inventory.py", "sub"], seen
    assert again == ["again/" + name for name in seen], again
