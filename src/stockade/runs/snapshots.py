"""An agent run's sandbox, kept in a snapshot store while the run waits to be resumed.

A run that pauses (an approval to wait for, an interruption) keeps a snapshot of its sandbox:
its memory where the tier can (the microVM: the interpreter's variables, processes), its files
otherwise (the workspace, /tmp, the environment). The snapshot store keeps it under the ref
``run/<run id>`` (``run/h-<hash of the id>`` for an id that cannot name a file or begins with
``h-``: no id takes another's ref; the ref names its run, and a run touches no other's) and the
run's checkpoint names it (``RunState.snapshot``); the session that
resumes the run starts its sandbox from it, then lets it go (a later crash must not bring back
memory older than the workspace the run store restores). A run that ends lets it go too, and
so does a run its owner ends while it waits (a service's kill, delete or retention: the service
knows its runs; ``kept_runs`` lists what a store keeps). ``stockade gc`` keeps every ``run`` ref:
it cannot tell a run that ended from one that waits. ``erase`` removes a run's snapshot at once
(``stockade runs erase``).

A run's process that dies (SIGKILL, a lost machine) cannot take a snapshot as it dies, and a
killed or interrupted run's sandbox is dead once its kill switch is pulled: such a run resumes
from the snapshot taken after its last tool call when ``each_call`` is set (a snapshot per
call: off by default, a memory snapshot of a microVM costs seconds and its RAM in disk),
otherwise with its files only, from the run store's ledger.
"""

from __future__ import annotations

import hashlib
import logging
import re
from collections.abc import Sequence
from dataclasses import dataclass

from stockade import exceptions as exc
from stockade.sandbox._supervised import spec_from_state
from stockade.sandbox.facade import Sandbox
from stockade.sandbox.snapshots import SnapshotStore
from stockade.types import Limits, NetworkPolicy, SandboxRules, Snapshot, SnapshotKind

__all__ = ["RunSnapshots", "erase_run_snapshots", "kept_runs", "ref_name", "release_run_snapshots"]

log = logging.getLogger(__name__)

REF = "run"
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_HASHED = "h-"


def ref_name(run_id: str) -> str:
    """The ref of a run's snapshot: its id, or the id's hash when the id cannot name a file or
    could be taken for a hash (an id ``h-<hash of another id>`` must not name that id's ref)."""
    if _NAME.match(run_id) and not run_id.startswith(_HASHED):
        return run_id
    return _HASHED + hashlib.sha256(run_id.encode()).hexdigest()[:40]


@dataclass(frozen=True)
class RunSnapshots:
    """The ``SandboxKeeper`` of the run stores: snapshots of runs' sandboxes in ``store``."""

    store: SnapshotStore
    each_call: bool = False  # also after every tool call that returned (crashes resume from it)

    def keep(self, run_id: str, sandbox: Sandbox) -> str | None:
        """Snapshot ``sandbox`` (memory where its tier can) as the run's; the one kept before
        goes. None when the sandbox cannot be kept (dead, credentials, a full store)."""
        if not sandbox.alive:
            return None
        name = ref_name(run_id)
        before = _ref(self.store, run_id)
        if (before is None or before[0] != name) and _taken(self.store, name):  # case folded
            log.warning("run %s: its sandbox was not kept (another run's holds ref %s)", run_id, name)
            return None
        try:
            taken = sandbox.snapshot(store=self.store)
            # The run's ref first, then the caller's ref the op made goes: never unreferenced.
            self.store.set_ref(REF, name, taken.id, run=run_id)  # its id, for listings
            self.store.drop_ref("kept", taken.id)
        except (exc.StockadeError, exc.RunStopped, OSError) as err:
            # The run still pauses: resumed, it gets its files back from the run store.
            log.warning("run %s: its sandbox was not kept (%s: %s)", run_id, type(err).__name__, err)
            return None
        if before is not None:
            if before[0] != name:  # kept under the name an earlier version gave it
                self.store.drop_ref(REF, before[0])
            if before[1] != taken.id:
                self._forget(run_id, before[1])  # now: a snapshot per call must not pile up
        return taken.id

    def kept(self, run_id: str) -> Snapshot | None:
        """What the run kept last, if it is still there."""
        ref = _ref(self.store, run_id)
        if ref is None:
            return None
        try:
            return self.store.get(ref[1])
        except exc.SnapshotNotFound:
            return None

    def restorable(
        self,
        run_id: str,
        *,
        tier: str,
        limits: Limits,
        network: NetworkPolicy,
        rules: SandboxRules | None = None,
    ) -> Snapshot | None:
        """What the run kept, if a sandbox of ``tier`` with ``limits``, ``network`` and ``rules``
        (what the resumed run would get) can start from it: a files snapshot always, a memory
        one only on its own tier with the same settings (its machine goes on as it was, its
        supervisor with the rules it was given: a network or a rule the policy no longer has
        must not come back with it)."""
        kept = self.kept(run_id)
        if kept is None or kept.kind is not SnapshotKind.MEMORY:
            return kept
        try:
            spec = spec_from_state(self.store.load(kept).spec)
        except exc.SnapshotError as err:
            log.warning("run %s: its kept sandbox cannot be restored (%s)", run_id, err)
            return None
        if kept.tier == tier and (spec.limits, spec.network, spec.rules) == (limits, network, rules):
            return kept
        log.warning(
            "run %s: its sandbox was kept on %s with other limits, network or rules than it gets "
            "now: it resumes with its files",
            run_id,
            kept.tier,
        )
        return None

    def release(self, run_id: str) -> None:
        """The run no longer needs its snapshot: it goes (its objects too, unless another
        snapshot shares them; what a crash leaves half-done, ``stockade gc`` removes)."""
        ref = _ref(self.store, run_id)
        if ref is not None:
            self.store.drop_ref(REF, ref[0])
            self._forget(run_id, ref[1])

    def _forget(self, run_id: str, snapshot_id: str) -> None:
        """Drop a snapshot the run no longer refers to; a failure leaves it to ``stockade gc``
        (nothing keeps it), and never fails the run."""
        try:
            _drop(self.store, snapshot_id)
        except (exc.StockadeError, OSError) as err:
            log.warning("run %s: snapshot %s left for gc (%s)", run_id, snapshot_id, err)


def erase_run_snapshots(store: SnapshotStore, run_ids: Sequence[str]) -> int:
    """Remove the snapshots of these runs now, objects included (unless another snapshot
    shares them); returns how many runs had one."""
    erased = 0
    for run_id in dict.fromkeys(run_ids):
        ref = _ref(store, run_id)
        if ref is not None:
            store.drop_ref(REF, ref[0])
            _drop(store, ref[1])
            erased += 1
    return erased


def release_run_snapshots(store: SnapshotStore, run_ids: Sequence[str]) -> int:
    """``erase_run_snapshots`` for runs that ended for good, never failing the caller: what is
    left, a service drops at its next sweep (``TenantSnapshots.drop_ended_runs``)."""
    try:
        return erase_run_snapshots(store, run_ids)
    except (exc.StockadeError, OSError) as error:
        log.warning("the kept sandboxes of runs %s left for the next sweep: %s", ", ".join(run_ids), error)
        return 0


def kept_runs(store: SnapshotStore) -> list[str]:
    """The ids of the runs whose sandbox ``store`` keeps (a ref that names no run is no run's)."""
    if not (store.root / "refs" / REF).is_dir():
        return []
    found = (store.ref(REF, name) or {} for name, _ in store.refs(REF))
    return sorted({ref["run"] for ref in found if "run" in ref})


def _ref(store: SnapshotStore, run_id: str) -> tuple[str, str] | None:
    """The name of the run's ref and the snapshot it keeps, read without creating the store
    (most runs never keep a sandbox). Only a ref that says it is this run's: a ref another run
    wrote is never restored, replaced or dropped for this one. An id of the form ``h-...`` was
    its own ref's name before (it could be another id's hash): such a ref is still found."""
    if not (store.root / "refs" / REF).is_dir():
        return None
    names = [ref_name(run_id)]
    if run_id.startswith(_HASHED) and _NAME.match(run_id):
        names.append(run_id)
    for name in names:
        ref = store.ref(REF, name)
        if ref is not None and ref.get("run") == run_id and "snapshot" in ref:
            return name, ref["snapshot"]
    return None


def _taken(store: SnapshotStore, name: str) -> bool:
    """Whether a ref of that name exists (then another run's, when ``_ref`` did not find it)."""
    return (store.root / "refs" / REF).is_dir() and store.ref(REF, name) is not None


def _drop(store: SnapshotStore, snapshot_id: str) -> None:
    """Delete a snapshot and remove its objects now (those no other snapshot uses, nor one
    being written)."""
    store.discard(snapshot_id)
