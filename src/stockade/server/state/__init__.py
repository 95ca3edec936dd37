"""What the service keeps in its database, beside the run store and the audit trails.

One database holds everything (``sqlite:///PATH`` embedded, ``postgresql://...`` at scale):
the run store (``runs_*``), each tenant's audit trail (``audit_t_<tenant>_*``) and, here, the
service's own tables (``svc_*``):

- ``svc_runs``: who submitted each run, what it asked for (the spec) and where it is
  (queued, running, paused, ..., as the service knows it; the run store has the details);
- ``svc_workspaces``: uploaded workspaces, packed, by tenant, role and digest (a role's own:
  another role of the tenant neither lists, uses nor deletes them);
- ``svc_artifacts``: a finished run's final workspace, packed;
- ``svc_run_bytes``: what each run keeps in the database (its spec, and its rows in the run
  store as measured each time it stops), counted in its tenant's ``storage_mb``;
- ``svc_sandboxes``: the live sandboxes, the API process that holds each (its ``owner``) and
  what they hold of their tenant's quota;
- ``svc_holds``: the share of their tenant's quota that runs hold while they run (their
  sandbox's CPUs and memory, and one of its sandboxes), so that runs and the API's own
  sandboxes fill one quota;
- ``svc_nodes``: the API processes, each with the address its peers forward requests to and
  its last heartbeat (a sandbox lives in the process that made it: see ``server/routing.py``);
- ``svc_ended``: sandboxes killed (still listed by their process until deleted) or lost with
  their process ("gone"), so that a request for one is answered that, not "not found";
- ``svc_snapshots``: which snapshot store (an id of its folder, and the address of the process
  that wrote there) keeps each tenant's snapshot or paused sandbox, and the role that took it,
  so that a process that does not share that folder tells that role where it is instead of
  "not found";
- ``svc_approvals``: pending requests and decisions (``DatabaseApprovals``);
- ``svc_kills`` / ``svc_live``: kill switches and live runs (``DatabaseKillSource``);
- ``svc_wakes``: when a run nobody holds goes to a worker again (``server/wakes.py``);
- ``svc_keys``: the service's own random keys (the viewer's sessions are signed with one), made
  by the first process that asks, the same for every process;
- ``svc_signouts``: viewer sessions signed out before they expire.

One module per concern: ``schema`` makes the tables; ``rows`` holds the values they hand out
and the run statuses; ``ServiceStore`` (``store``) is composed of ``runs``, ``storage``
(what a tenant keeps), ``quotas`` (what holds a share of a tenant's quota), ``placement``
(API processes, where each sandbox and snapshot is) and ``keys``; ``approvals`` and ``kills``
keep approvals and kill switches for every worker. Import a name from its module; this
package names its public ones.
"""

from stockade.server.state.approvals import DatabaseApprovals
from stockade.server.state.kills import DatabaseKillSource, database_kill_source
from stockade.server.state.rows import Node, Placement, RunRow, SandboxRow
from stockade.server.state.schema import open_database
from stockade.server.state.store import ServiceStore

__all__ = [
    "DatabaseApprovals",
    "DatabaseKillSource",
    "Node",
    "Placement",
    "RunRow",
    "SandboxRow",
    "ServiceStore",
    "database_kill_source",
    "open_database",
]
