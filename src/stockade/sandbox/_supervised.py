"""The ``Instance`` shared by every tier that runs the in-sandbox supervisor.

A tier only has to start the supervisor inside its boundary, hand over a byte stream to it,
and know how to kill the whole sandbox (``Boundary``). Everything else (commands, run_code,
files, output caps, timeouts) behaves identically on every tier because it is this code.

Here: commands and run_code, snapshots between calls, and the instance's life. The file
requests are ``_transfers``'s, the replies are decoded in ``_replies``, the boundary is
``_boundary``'s, and what a snapshot keeps of the settings is ``_snapshot_state``'s (all
importable from here, where the tiers have always found them).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import logging
import math
import os
import re
import secrets
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from stockade import _exit
from stockade import exceptions as exc
from stockade._display import visible
from stockade.egress.proxy import MAX_CONNECTIONS
from stockade.sandbox import _rules, _rules_execs
from stockade.sandbox._approver import ANSWER_BY, answered, cut_requested
from stockade.sandbox._boundary import Boundary, EgressHandle
from stockade.sandbox._channel import Channel, Stream
from stockade.sandbox._replies import (
    OutputCollector,
    command_result,
    execution,
    int_field,
    judged_between,
    timed_out_command,
    timed_out_execution,
)
from stockade.sandbox._snapshot_state import (
    enforcement_from_state,
    enforcement_state,
    spec_from_state,
    spec_state,
)
from stockade.sandbox._transfers import (
    FILE_OP_TIMEOUT_S,
    MAX_FRAME,
    TRANSFER_CHUNK,
    FileRequests,
    archive_chunks,
)
from stockade.sandbox.base import Instance, OpResult, OutputSink, SandboxSpec
from stockade.sandbox.ops import (
    Area,
    GetArchive,
    ListDir,
    MakeDir,
    Op,
    Pause,
    PutArchive,
    ReadFile,
    Remove,
    Reset,
    RunCode,
    RunCommand,
    Stat,
    TakeExecs,
    TakeSnapshot,
    WriteFile,
)
from stockade.sandbox.snapshots import Reservation, SnapshotStore
from stockade.sandbox.supervisor.protocol import (
    HMAC_SHA256,
    MACS,
    MAX_BUNDLE_ENTRIES,
    MAX_RESULT_COUNT,
    MAX_RESULT_ENTRIES,
    Seal,
)
from stockade.types import (
    CommandResult,
    Enforcement,
    Execution,
    Limits,
    Snapshot,
    SnapshotKind,
)

# Past its own deadline the supervisor has this long to report before the host kills the
# whole sandbox: the supervisor shares the sandbox with the code and may be starved or dead.
GRACE_S = 5.0
# How long the host waits for the supervisor to end a call nobody waits for any more.
CANCEL_S = 10.0
# A call past its timeout_s has stopped within this much more, however busy the host: the
# supervisor kills it at the deadline (it runs at a higher priority than the code). Each
# sandbox states its own (``Enforcement.timeout_margin_s``): this where its kernel honours
# that priority (the host's, a KVM guest's), ...
TIMEOUT_MARGIN_S = Enforcement.timeout_margin_s  # 1 s
# ... and this where it cannot: gVisor's kernel schedules every task alike, and a guest
# emulated under TCG runs its clock and its kills at a fraction of the host's speed, so on a
# busy host the kill waits its turn behind the code's processes for the host's cores.
# Measured with four processes spinning outside, a 3 s call of 17 spinning processes: on
# gVisor 0.1-0.35 s late on an idle 2-core host, 1.1 s on a slower shared one; under TCG 1.6 s.
UNPRIORITIZED_TIMEOUT_MARGIN_S = 2.5
WORKSPACE = "/workspace"
# The supervisor's egress relay carries as many connections at once as the host's proxy
# serves, two descriptors each (supervisor/egress.py): a package manager's burst fits.
RELAY_FILES = 2 * MAX_CONNECTIONS
# What the JSON of a report may make: a list and an object per result, four values per MIME
# entry (key, value, their separators), the error and the cap's notes. Parsed, the worst
# report of this size is a few MiB of objects (a 30 MB report of empty results was 2.5 GB).
MAX_CODE_VALUES = 2 * MAX_RESULT_COUNT + 4 * (MAX_RESULT_ENTRIES + MAX_BUNDLE_ENTRIES) + 64
SNAPSHOT_MAX_ENTRIES = 1 << 24
_SANDBOX_ID = re.compile(r"^sbx-[0-9a-f]{12}$")

__all__ = [
    "FILE_OP_TIMEOUT_S",
    "GRACE_S",
    "MAX_FRAME",
    "TIMEOUT_MARGIN_S",
    "TRANSFER_CHUNK",
    "UNPRIORITIZED_TIMEOUT_MARGIN_S",
    "WORKSPACE",
    "Boundary",
    "SupervisedInstance",
    "enforcement_from_state",
    "enforcement_state",
    "sandbox_id",
    "spec_from_state",
    "spec_state",
    "supervisor_config",
]

log = logging.getLogger(__name__)
RestoreFilter = dict[str, object] | None  # what of a restore the rules let in (``_globs.unpack_filter``)


class SupervisedInstance(Instance):
    def __init__(
        self,
        *,
        id: str,
        tier: str,
        stream: Stream,
        boundary: Boundary,
        spec: SandboxSpec,
        enforcement: Enforcement,
        max_frame: int = MAX_FRAME,
    ) -> None:
        self.id = id
        self.tier = tier
        self.spec = spec
        self.rules = spec.rules
        self.enforcement = enforcement
        self.boundary = boundary
        self.channel = Channel(stream, max_body=max_frame, name=id, on_stall=boundary.kill)
        self.files = FileRequests(self.channel, close=self.close, alive=lambda: self.alive)
        self._closed = False
        # Calls in flight, and whether a snapshot holds new ones back until it is taken.
        self._gate = threading.Condition()
        self._active = 0
        self._frozen = False
        # A forked child inherits this object, not the sandbox: its calls would write into the
        # parent's channel (whose reader is the parent's) and its close would kill the parent's.
        self._owner = os.getpid()
        # A sandbox nobody closed dies with its last reference, or at interpreter exit (its
        # owner's: a forked child's exit leaves it alone).
        self._finalizer = _exit.finalize(self, _tear_down, self.channel, boundary)

    # -- lifecycle ----------------------------------------------------------------------

    def handshake(
        self, config: dict[str, Any], timeout_s: float, rules: _rules.RulesPlan | None = None
    ) -> dict[str, Any]:
        """Send the configuration frame and wait for ``ready``; with ``rules``, check that
        the kernel inside holds them (or say, with ``allow_weaker``, what is weaker)."""
        if rules is not None and rules.config is not None:
            config = {**config, "rules": rules.config}
        try:
            header, _ = self.channel.call({"op": "init", "config": config}).result(
                time.monotonic() + timeout_s
            )
        except TimeoutError:
            raise exc.SandboxStartError(f"supervisor did not answer within {timeout_s}s") from None
        except exc.SandboxCrashed as err:
            raise exc.SandboxStartError(f"sandbox failed to start: {err}") from None
        if header.get("ev") != "ready":
            raise exc.SandboxStartError(f"unexpected first reply: {header!r}")
        if config.get("seal"):  # code can reach the supervisor's pipes here: frames are sealed
            mac = header.get("mac", HMAC_SHA256)  # the one its Python computes cheapest
            if mac not in MACS:
                raise exc.SandboxStartError(f"the supervisor seals with {mac!r}, unknown here")
            self.channel.seal(secrets.token_bytes(Seal.SIZE), mac=mac)
        if self.spec.snapshot is not None:
            self.seed(self.spec.snapshot)
        if rules is not None:
            self.hold(rules, header.get("rules"))
        return header

    def hold(self, rules: _rules.RulesPlan, report: Any) -> None:
        """Check that the kernel inside holds ``rules``, by what the supervisor said of them
        (``report``), and state what this sandbox enforces: raise ``LimitNotEnforceable``, or,
        with ``allow_weaker``, say what is weaker."""
        weaker = _rules.check_ready(self.spec, rules, report)
        weakened = (*self.enforcement.weakened, *rules.weakened, *weaker)
        held = {k: v for k, v in rules.enforcement.items() if not any(w.startswith(k) for w in weaker)}
        e = self.enforcement
        self.enforcement = dataclasses.replace(
            e,
            commands=held.get("commands", e.commands),
            paths=held.get("paths", e.paths),
            programs=held.get("programs", e.programs),
            weakened=weakened,
        )

    def start(
        self,
        config: Callable[[], dict[str, Any]],
        timeout_s: float,
        rules: _rules.RulesPlan | None,
        *,
        log: Callable[[], str],
    ) -> None:
        """The handshake, or the sandbox closed: one that did not start is never handed out.

        ``config`` is built inside (working out limits can fail too); a start error carries
        what the tier's own log says (bubblewrap's, runsc's, the container's, the console).
        """
        try:
            self.handshake(config(), timeout_s, rules)
        except exc.SandboxStartError as err:
            said = log()
            self.close()
            raise exc.SandboxStartError(f"{err}{': ' + said if said else ''}") from None
        except BaseException:  # the kernel inside cannot hold the rules, or we were interrupted
            self.close()
            raise

    @property
    def alive(self) -> bool:
        return not self._closed and self.channel.open and self._owner == os.getpid() and self.boundary.alive()

    def close(self) -> None:
        if self._closed or self._owner != os.getpid():  # a forked child's: the parent's to close
            return
        self._closed = True
        self._finalizer()

    def cut_running(self) -> None:
        if self._closed or self._owner != os.getpid() or self.channel.cut is not None:
            return
        # beside the op it cuts: the channel sends and answers calls from any thread
        with contextlib.suppress(TimeoutError, exc.StockadeError):
            self.channel.call({"op": "cut"}).result(time.monotonic() + FILE_OP_TIMEOUT_S)

    def _check_owner(self) -> None:
        if self._owner != os.getpid():
            raise exc.SandboxClosed(
                f"sandbox {self.id} belongs to process {self._owner} (this one's parent before a fork): "
                "a forked child can neither use nor close it; create a sandbox in the child"
            )

    def _check_open(self) -> None:
        self._check_owner()
        cut = self.channel.cut
        if cut is not None:  # a call of ours was interrupted mid-send: the sandbox is no more use
            self.close()
            raise exc.SandboxClosed(f"sandbox {self.id} is closed: {cut}; create a new one")
        if self._closed:
            raise exc.SandboxClosed(f"sandbox {self.id} is closed")

    def _check_egress(self) -> None:
        """A sandbox whose egress port was cut for breaking its protocol runs nothing more: only
        a supervisor that is no longer ours (guest root) sends such frames, and a reset would
        ask that same supervisor to make the sandbox fresh for its next user."""
        egress = self.boundary.egress
        why = egress.violation if egress is not None else None
        if why is not None:
            self.close()
            raise exc.SandboxCrashed(
                f"sandbox {self.id} sent on its egress port what its supervisor never sends ({why}): "
                "the host closed it; create a new one",
                cause="protocol",
            )

    # -- dispatch -----------------------------------------------------------------------

    def handle(self, op: Op[Any], sink: OutputSink | None) -> OpResult:
        self._check_owner()  # first: the gate's state is the parent's at the fork, its calls gone
        if isinstance(op, TakeSnapshot | Pause):
            return self._snapshot(op)
        with self._gate:
            while self._frozen:
                self._gate.wait()
            self._active += 1
        try:
            return self._guarded(op, sink)
        finally:
            with self._gate:
                self._active -= 1
                self._gate.notify_all()

    def _guarded(self, op: Op[Any], sink: OutputSink | None) -> OpResult:
        self._check_open()
        self._check_egress()
        oom_before, locks_before = self.boundary.oom_kills(), self.boundary.lock_kills()
        try:
            return self._handle(op, sink)
        except exc.SandboxCrashed as err:
            if err.cause == "unresponsive":  # taken down here (a send that stalled kills it too)
                self.close()
            oom_after = self.boundary.oom_kills()
            if self.boundary.lock_kills() > locks_before:
                said, cause = (
                    "a process held more file locks than a sandbox may (4,096; POSIX locks and "
                    "flock locks held through mappings are kernel memory no limit counts)",
                    "file_locks",
                )
            elif oom_before is not None and oom_after is not None and oom_after > oom_before:
                said, cause = (
                    f"the sandbox ran out of memory (memory_mb={self.spec.limits.memory_mb}; files "
                    "in /workspace, /tmp and /dev/shm are memory and count against it)",
                    "out_of_memory",
                )
            else:
                if err.cause == "unknown":
                    err.cause = self.boundary.death_cause()
                words = self.boundary.last_words() if err.cause == "unknown" else ""
                if not words:
                    raise
                # no cause found: what the sandbox's kernel said last may tell
                said, cause = f"the sandbox's kernel said last: {words}", err.cause
            raise exc.SandboxCrashed(
                f"{err}: {said}", cause=cause, stdout=err.stdout, stderr=err.stderr
            ) from None

    def _handle(self, op: Op[Any], sink: OutputSink | None) -> OpResult:
        match op:
            case RunCommand():
                return self._run_command(op, sink)
            case RunCode():
                return self._run_code(op, sink)
            case ReadFile():
                return self.files.read(op)
            case WriteFile():
                return self.files.write(op)
            case MakeDir():
                return self.files.make_dir(op)
            case Stat():
                return self.files.stat(op)
            case ListDir():
                return self.files.list_dir(op)
            case Remove():
                self.files.request("remove", {"path": op.path, "recursive": op.recursive})
                return None
            case PutArchive():
                self.files.put_stream(op.area, archive_chunks(op), path=op.path)
                return None
            case GetArchive():
                return self.files.get_archive(op, sink)
            case Reset():
                self._reset(op)
                return None
            case TakeExecs():
                return judged_between(self.files.request("execs", {})[0])
        raise exc.ConfigurationError(f"unsupported operation {op!r}")  # pragma: no cover

    def _reset(self, op: Reset) -> None:
        """A sandbox that cannot be made as fresh as it started is never used again."""
        try:
            header, _ = self.files.answer({"op": "reset", "warm": op.warm_interpreter})
        except TimeoutError:
            header = {"ev": "error", "message": "the supervisor did not answer in time"}
        if header.get("ev") != "done":
            self.close()
            raise exc.SandboxCrashed(
                f"sandbox {self.id} could not be reset ({str(header.get('message', ''))[:500]}); "
                "it was closed: create a new one"
            )
        if self.boundary.egress is not None:
            # After the supervisor's reset (the last user's code gone, the relay renewed): the
            # host's proxy too, or a request pipelined by the last user would go out later,
            # in the next user's session, and the budgets and kept connections carry over.
            # Its credentials are read again there: one that cannot be read closes the sandbox.
            try:
                self.boundary.egress.renew()
            except exc.StockadeError:
                self.close()
                raise
            except Exception as err:
                self.close()
                raise exc.SandboxCrashed(
                    f"sandbox {self.id} could not be reset (its egress proxy was not renewed: "
                    f"{type(err).__name__}); it was closed: create a new one"
                ) from err

    # -- snapshots ----------------------------------------------------------------------

    def memory_snapshots(self) -> str | None:
        """None when this sandbox can keep the memory of its processes in a snapshot, else
        why it cannot (a tier that can overrides this and ``save_memory``)."""
        return f"the {self.tier} tier keeps files only in a snapshot (workspace, /tmp, environment)"

    def memory_image_bytes(self) -> int:
        """The most a memory image of this sandbox should take: room held before it is written."""
        return self.spec.limits.memory_mb * (1 << 20)

    def save_memory(self, room: Reservation, *, stop: bool) -> tuple[dict[str, str], dict[str, Any]]:
        """The tier's memory image of the sandbox, as objects of the store, written within
        ``room`` (role -> digest) and what the tier needs to restore it; ``stop``: the sandbox
        need not run on."""
        raise exc.LimitNotEnforceable(self.memory_snapshots() or "no memory snapshots here")

    def _snapshot(self, op: TakeSnapshot | Pause) -> Snapshot:
        """Take a snapshot between calls: new calls wait, running ones are waited for."""
        self._check_open()
        if self.spec.network.credentials:
            raise exc.LimitNotEnforceable(
                "a sandbox with brokered credentials cannot be snapshotted: its credentials stay "
                "on the host and are never written to the snapshot store",
                setting="snapshot",
                fix="snapshot a sandbox made without credentials, and give network= with them to "
                "Sandbox.create(snapshot=...)",
            )
        why = self.memory_snapshots()
        if op.memory and why is not None:
            # memory=None would keep memory where it could: only False asks for files
            fix = "pass memory=False to keep the files only"
            if self.tier not in ("microvm", "gvisor"):
                fix += ", or use the microvm or gvisor tier"
            raise exc.LimitNotEnforceable(
                f"{why}; this snapshot must keep the memory of the processes",
                setting="snapshot memory",
                fix=fix,
            )
        with self._quiet(), op.store.reserve() as room:
            self._check_open()
            memory = op.memory is not False and why is None
            if memory:
                sealed = self.channel.seal_state()  # nothing in flight: the supervisor's counts
                room.expect(self.memory_image_bytes())
                blobs, tier_state = self.save_memory(room, stop=isinstance(op, Pause))
                tier_state = {**tier_state, "enforcement": enforcement_state(self.enforcement)}
                if sealed is not None:
                    # The restored supervisor seals with this key and these counts (its memory
                    # is this one's); the store is the host's alone (0700).
                    key, sent, received, mac = sealed
                    tier_state["seal"] = {"key": key.hex(), "sent": sent, "received": received, "mac": mac}
            else:
                blobs, tier_state = self.save_files(room), {}
            snapshot = op.store.save(
                kind=SnapshotKind.MEMORY if memory else SnapshotKind.FILES,
                tier=self.tier,
                source=self.id,
                spec=spec_state(self.spec),
                blobs=blobs,
                tier_state=tier_state,
                ref=("paused", self.id) if isinstance(op, Pause) else ("kept", ""),
            )
        if isinstance(op, Pause):
            self.close()
        return snapshot

    @contextlib.contextmanager
    def _quiet(self) -> Iterator[None]:
        with self._gate:
            while self._frozen:
                self._gate.wait()
            self._frozen = True
            try:
                while self._active:
                    self._gate.wait()
            except BaseException:
                self._frozen = False
                self._gate.notify_all()
                raise
        try:
            yield
        finally:
            with self._gate:
                self._frozen = False
                self._gate.notify_all()

    def save_files(self, room: Reservation) -> dict[str, str]:
        """The workspace and /tmp, each a tar object of the store, streamed from the sandbox
        into the ``room`` reserved for them: a chunk that would not fit ends the snapshot
        (``SnapshotStoreFull``) before it is written, and nothing of it stays."""
        digests: dict[str, str] = {}
        with contextlib.ExitStack() as files:
            paths: dict[str, Path] = {}
            for area in ("workspace", "tmp"):
                path, write = files.enter_context(room.open(area))
                digest = hashlib.sha256()

                def sink(_: int, chunk: bytes, write: Any = write, digest: Any = digest) -> None:
                    write(chunk)  # the host's cap: the sandbox's own check is only a courtesy
                    digest.update(chunk)

                # Both areas share the room left, and neither may keep more than its own size:
                # a restore writes the files whole (a sparse file's holes too) into a tmpfs of
                # that size. The supervisor refuses a tree whose file contents, by apparent
                # size, pass the cap, as soon as its walk sees the file.
                own = self._area_bytes(area)
                left = room.room()
                cap = min(own, left)
                try:
                    op = GetArchive(
                        area=area, max_bytes=cap, max_entries=SNAPSHOT_MAX_ENTRIES, refuse_deep=True
                    )
                    self.files.get_archive(op, sink)
                except exc.FileTooLarge as error:
                    raise self._too_large(
                        area, str(error), store_room=own > left, cap=cap, room=room
                    ) from None
                paths[area], digests[area] = path, digest.hexdigest()
            # Into the objects only once both are whole: a refused /tmp leaves no workspace behind.
            return {area: room.store.add_file(paths[area], digest=digests[area]) for area in paths}

    def _too_large(
        self, area: Area, said: str, *, store_room: bool, cap: int, room: Reservation
    ) -> exc.SnapshotError:
        """What a snapshot refused by the supervisor's cap on ``area``'s archive raises:
        ``store_room``, whether that cap was the store's room left (else the area's own size).
        Only a refusal of bytes the store has no room for is the store's; too many entries is
        no room's fault (``PathTooLong``, ``TreeTooDeep`` are no ``FileTooLarge`` at all)."""
        # The supervisor's words are a download's ("cannot download '/workspace': ...; pass a
        # larger max_bytes"): only what it found is said.
        found = said.split(": ", 1)[-1].split("; pass a larger", 1)[0]
        if "max_bytes" not in found:
            return exc.SnapshotIncompatible(
                f"cannot snapshot sandbox {self.id}: its {area} is past what a snapshot takes: {found}"
            )
        if not store_room:
            return exc.SnapshotIncompatible(
                f"cannot snapshot sandbox {self.id}: its {area}'s files are larger than "
                f"the {area} itself ({self._area_setting(area)}), so no restore could put "
                f"them back: {found} (a sparse file counts whole: a snapshot keeps its "
                "holes as bytes); remove or shrink that file and snapshot again"
            )
        return exc.SnapshotStoreFull(
            f"the sandbox's {area} does not fit the snapshot store (room for {cap // (1 << 20)} "
            f"MiB of its {room.store.max_bytes // (1 << 20)} MiB; STOCKADE_SNAPSHOT_MAX_MB "
            f"raises it): {found}"
        )

    def _area_bytes(self, area: Area) -> int:
        """The size of the sandbox's tmpfs at ``area``: all its files can ever take."""
        limits = self.spec.limits
        return (limits.workspace_mb if area == "workspace" else limits.tmp_size_mb) << 20

    def _area_setting(self, area: Area) -> str:
        limits = self.spec.limits
        return f"disk_mb={limits.workspace_mb}" if area == "workspace" else f"tmp_mb={limits.tmp_size_mb}"

    def _area_files(self, area: Area) -> str:
        limits = self.spec.limits
        if area == "workspace":
            return f"inodes={limits.workspace_inodes}"
        return f"{limits.scratch_inodes} files, an eighth of inodes={limits.workspace_inodes}"

    def reseed(self, resumed: dict[str, Any] | None = None) -> None:
        """First thing in a sandbox restored from a memory snapshot: the interpreter's next run
        draws new seeds for the generators in its memory (Python reseeds them at a fork; a
        restore is none), so forks of one snapshot do not repeat each other's numbers.
        ``resumed``: what of its configuration the snapshot was made without (a microVM's ready
        image): ``env``, its whole environment; ``egress``, its relay (in the same request)."""
        self.files.request("reseed", dict(resumed or {}))

    def seed(self, snapshot: Snapshot) -> None:
        """Put a snapshot's files (workspace, /tmp) into this fresh sandbox, streamed a chunk
        at a time and hashed on the way: the host's memory stays a few MiB whatever the
        objects' size, and an object is moved into place inside only once it hashed to its
        name. Any failure leaves the sandbox to be closed (``start``): never handed out.

        The workspace comes back under this sandbox's rules, not the snapshot's: what they
        hide or do not let the run read stays out, as it stays out of a folder uploaded (a
        policy that hides more since the snapshot was taken hides it from the restore too)."""
        store = SnapshotStore(Path(snapshot.store))
        manifest = store.load(snapshot)
        missing = [a for a in ("workspace", "tmp") if a not in manifest.blobs]
        if missing:
            raise exc.SnapshotIncompatible(
                f"snapshot {snapshot.id} keeps the {snapshot.tier} tier's memory, not files: "
                f"restore it on the {snapshot.tier} tier"
            )
        from stockade._globs import unpack_filter
        from stockade.sandbox._requests import VCS_FOLDERS  # imports this module

        rules = self.spec.rules
        keep = unpack_filter(rules.hide, rules.read, {".git", *VCS_FOLDERS}) if rules else None
        self._restore_area(snapshot, store, "workspace", manifest.blobs["workspace"], keep)
        self._restore_area(snapshot, store, "tmp", manifest.blobs["tmp"], None)

    def _restore_area(
        self, snapshot: Snapshot, store: SnapshotStore, area: Area, digest: str, keep: RestoreFilter
    ) -> None:
        chunks = store.stream_object(digest, TRANSFER_CHUNK)
        try:
            # closed here: a refusal's traceback keeps the suspended stream, its file open, alive
            with contextlib.closing(chunks):
                skipped = self.files.put_stream(area, chunks, keep=keep)
        except exc.SnapshotCorrupt:
            raise
        except exc.StockadeError as error:
            # What the sandbox refused may be a corrupt object's doing (a header claiming a
            # huge file): the object is checked (its verified stamp, else hashed) first.
            store.check_object(digest)
            if not isinstance(error, exc.WorkspaceFull):
                raise
            found = str(error).removeprefix("put_archive '': ")
            if " entries " in found:  # unpack.py: its files outnumber what the place can hold
                what, room, fields = "holds more files than", self._area_files(area), "inodes"
            else:
                what, room, fields = "is larger than", self._area_setting(area), "disk_mb or tmp_mb"
            raise exc.SnapshotIncompatible(
                f"snapshot {snapshot.id} does not fit this sandbox: its {area} {what} the "
                f"sandbox's ({room}): {found}; create it with Limits that hold the snapshot's files "
                f"(memory_mb, and {fields})"
            ) from None
        if skipped:  # what a download leaves out too: no workspace content, never restored
            named = ", ".join(f"{e.path!r} ({e.kind})" for e in skipped[:10])
            more = f" and {len(skipped) - 10} more" if len(skipped) > 10 else ""
            log.warning("snapshot %s: its %s came back without %s%s", snapshot.id, area, named, more)

    # -- commands -----------------------------------------------------------------------

    def _timeout(self, value: float | None) -> float:
        return self.spec.limits.timeout_s if value is None else value

    def _stream(
        self, header: dict[str, Any], body: bytes, timeout: float, sink: OutputSink | None
    ) -> tuple[tuple[dict[str, Any], bytes] | None, dict[int, OutputCollector], dict[str, Any] | None]:
        """Send a request, pass output to ``sink`` as it comes, return the final frame (and
        the ``between`` frame before it: the execs judged while no call ran).

        None means the supervisor missed its own deadline by ``GRACE_S``: the sandbox is
        then taken down whole, and the output seen so far is returned.
        """
        cap = self.spec.limits.output_bytes
        streams = {1: OutputCollector(cap), 2: OutputCollector(cap)}
        between: dict[str, Any] | None = None
        deadline = time.monotonic() + timeout + GRACE_S  # the send of a large stdin included
        hold_cap = self.spec.limits.approval_wait_s
        header = {**header, "approval_wait": hold_cap}
        first_asked: float | None = None
        credited = 0.0
        try:
            call = self.channel.call(header, body, deadline)
        except TimeoutError:
            self.close()
            return None, streams, between
        try:
            for h, chunk in call.frames(deadline):
                ev = h.get("ev")
                if ev == "out":
                    fd = 1 if h.get("fd") == 1 else 2
                    part = streams[fd].add(chunk)
                    if sink is not None and part:
                        sink(fd, part)
                elif ev == "approve":
                    # The time a human takes is not the command's: the supervisor holds the
                    # job's deadline back while an exec waits, up to approval_wait_s of the
                    # call (``jobs.Job.hold``). The host's follows by no less: the whole span
                    # from the first ask to the last answer, within the same cap.
                    first_asked = time.monotonic() if first_asked is None else first_asked
                    self._approve(h, first_asked + hold_cap)
                    span = min(time.monotonic() - first_asked, hold_cap)
                    call.extend(span - credited)
                    credited = span
                elif ev == "between" and between is None:  # one per call: a second is not ours
                    between = h
                elif ev in ("exit", "result"):
                    return (h, chunk), streams, between
                elif ev == "error":
                    raise exc.ProtocolError(f"supervisor refused {header['op']}: {h.get('message')}")
        except TimeoutError:
            self.close()
            return None, streams, between
        except exc.SandboxCrashed as err:  # what the call printed explains the death
            if not (err.stdout or err.stderr):
                err.stdout = streams[1].text(len(streams[1].data))[0]
                err.stderr = streams[2].text(len(streams[2].data))[0]
            raise
        except BaseException:  # a Ctrl-C, a cancelled task, a sink that raised: nobody waits for it
            self._cancel(call.rid)
            raise
        raise exc.ProtocolError(f"{header['op']} ended without a report")  # pragma: no cover

    def _cancel(self, rid: int) -> None:
        """Have the supervisor end the command or run ``rid`` now (kill it, or take it from the
        queue), not at its timeout: the next call finds the sandbox idle. A supervisor of an
        older snapshot that knows no cancel lets it run to its timeout, as before."""
        if not self.channel.open:
            return
        with contextlib.suppress(exc.StockadeError, TimeoutError):
            self.channel.call({"op": "cancel", "req": rid}).result(time.monotonic() + CANCEL_S)

    def _approve(self, h: dict[str, Any], answer_by: float) -> None:
        """An exec inside waits for a human: ask the sandbox's approver, answer the supervisor.
        Past ``answer_by`` (the call's approval_wait_s spent) an async approver is given up."""
        (record,) = _rules_execs.exec_records({"execs": [h]})
        record = dataclasses.replace(record, own_code=h.get("own") is True)
        approver = self.spec.approver
        waiting = ANSWER_BY.set(answer_by)
        try:
            allow, why = answered(approver(record)) if approver is not None else (False, "")
        except Exception as error:  # an approver that fails says no
            allow, why = False, f"the approver raised {type(error).__name__}: {visible(str(error))[:200]}"
        finally:
            ANSWER_BY.reset(waiting)
        if allow and cut_requested():  # the caller gave up while the approver thought
            allow, why = False, "the call was cancelled while the approver was asked"
        if why:
            log.warning("sandbox %s: exec %s refused: %s", self.id, record.argv[:8], why)
        verdict: dict[str, Any] = {"op": "verdict", "req": int_field(h.get("req")), "allow": allow}
        if why:  # the supervisor shows it with the rule (the record, the program's stderr)
            verdict["why"] = why
        call = self.channel.call(verdict)
        with contextlib.suppress(TimeoutError):
            call.result(time.monotonic() + FILE_OP_TIMEOUT_S)

    def _run_command(self, op: RunCommand, sink: OutputSink | None) -> CommandResult:
        if not op.argv:
            raise exc.ConfigurationError("empty command")
        timeout = self._timeout(op.timeout_s)
        header = {
            "op": "exec",
            "argv": list(op.argv),
            "cwd": op.cwd,
            "env": dict(op.envs),
            "timeout": timeout,
            "stdin": op.stdin is not None,
        }
        oom_before, locks_before = self.boundary.oom_kills(), self.boundary.lock_kills()
        started = time.monotonic()
        final, streams, between = self._stream(header, op.stdin or b"", timeout, sink)
        if final is not None:
            return command_result(
                final[0], streams, lambda settle: self._oom_since(oom_before, settle=settle), between,
                locks_killed=self.boundary.lock_kills() > locks_before,
            )  # fmt: skip
        return timed_out_command(streams, time.monotonic() - started)

    def _oom_since(self, before: int | None, *, settle: bool) -> bool:
        """Whether the memory limit killed something since ``before``.

        Some counters lag the kill they count (a remote engine's events): when a process
        died of SIGKILL we did not send, give the counter a moment before saying no.
        """
        if before is None:
            return False
        for wait in (0.0, 0.05, 0.1, 0.2, 0.4) if settle else (0.0,):
            if wait:  # (a sleep of 0 still waits for the timer: ~90 us, every command)
                time.sleep(wait)
            after = self.boundary.oom_kills()
            if after is None:
                return False
            if after > before:
                return True
        return False

    # -- run_code -----------------------------------------------------------------------

    def _run_code(self, op: RunCode, sink: OutputSink | None) -> Execution:
        timeout = self._timeout(op.timeout_s)
        oom_before, locks_before = self.boundary.oom_kills(), self.boundary.lock_kills()
        started = time.monotonic()
        header = {"op": "code", "timeout": timeout}
        final, streams, between = self._stream(
            header, op.code.encode("utf-8", "surrogatepass"), timeout, sink
        )
        if final is not None:
            h, body = final
            payload = self.files.json_body(body, max_values=MAX_CODE_VALUES, what="run_code report")
            return execution(
                h, payload, streams, lambda settle: self._oom_since(oom_before, settle=settle), between,
                locks_killed=self.boundary.lock_kills() > locks_before,
            )  # fmt: skip
        return timed_out_execution(streams, time.monotonic() - started)


def _tear_down(channel: Channel, boundary: Boundary) -> None:
    channel.close()
    boundary.kill()


def supervisor_config(
    spec: SandboxSpec, rlimits: dict[str, int] | None = None, egress: EgressHandle | None = None,
    *, seal: bool = False, refuse_kernel: bool = False, host_network: bool = False,
    refuse_filters: bool = False, refuse_memfds: bool = False,
) -> dict[str, Any]:  # fmt: skip
    """The ``init`` frame every tier sends: the environment, caps and default timeout; with
    ``egress`` (a ``stockade.egress.Attachment``), the proxy's variables and the relay.
    ``seal``: code in the sandbox can open the supervisor's pipes (gVisor's ``/proc``), so
    every frame after ``ready`` is sealed (``protocol.Seal``). ``refuse_kernel``: a tier whose
    own filter does not refuse it (a container engine's profile) has the supervisor refuse
    what takes host memory or a host-wide quota uncharged (``_seccomp``'s list: AIO contexts,
    netlink, UDP where the loopback is the only network). ``host_network``: the sandbox
    shares the host's network namespace, whose sockets are not the sandbox's to account for
    at a reset. ``refuse_filters``: the code's kernel is the host's, where each seccomp filter
    is JIT code no cgroup charges, counted against the host's shared ``bpf_jit_limit``: once
    its own filters are in place, the supervisor lets no process add one
    (``confine.refuse_filters``). ``refuse_memfds``: no exec listener refuses memfds where a
    written program must not run (gVisor's kernel has none): the supervisor's own filter does
    (``confine.deny_calls``)."""
    env = {
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "HOME": "/tmp",
        "LANG": "C.UTF-8",
        "USER": "sandbox",
        "TMPDIR": "/tmp",
        "MPLBACKEND": "Agg",
    }
    # Numeric libraries start a thread per core they see (the host's, on most tiers): on a
    # large host that is more threads than the sandbox's pids allow. One per CPU it was given.
    threads = str(max(1, math.ceil(spec.limits.cpus)))
    env.update(OMP_NUM_THREADS=threads, OPENBLAS_NUM_THREADS=threads, MKL_NUM_THREADS=threads)
    if rlimits is not None and "RLIMIT_AS" in rlimits:
        # Under a per-process address-space limit glibc's arena per thread (64 MiB reserved)
        # left a process about a dozen threads whatever memory_mb: one arena, and a thread
        # costs its stack (8 MiB), so memory_mb / 8 MiB of them, less what the process maps.
        env["MALLOC_ARENA_MAX"] = "1"
    if egress is not None:
        env.update(egress.env)
    env.update(spec.envs)
    config: dict[str, Any] = {
        "env": env,
        "workspace": WORKSPACE,
        "output_cap": spec.limits.output_bytes,
        "timeout": spec.limits.timeout_s,
        # Descriptors per process, so that the sandbox's processes hold open_files in all.
        "rlimits": {"RLIMIT_NOFILE": spec.limits.files_per_process, **(rlimits or {})},
        # The supervisor's own (supervisor.own_files): the code's and its relay's besides.
        "files": supervisor_files(spec.limits),
    }
    if egress is not None:
        config["egress"] = dict(egress.relay)
    if seal:
        config["seal"] = True
    if host_network:
        config["own_network"] = False
    if refuse_filters:
        config["no_filters"] = True
    if refuse_memfds:
        config["no_memfd"] = True
    if refuse_kernel:
        config["kernel"] = {"datagrams": not spec.network.unrestricted}
    if spec.rules is not None and spec.rules.judges_paths:
        config["links"] = False  # files calls are judged by the path they name: no link followed
    return config


def supervisor_files(limits: Limits) -> int:
    """RLIMIT_NOFILE of the supervisor: a process's of the code (``files_per_process``) and
    ``RELAY_FILES`` besides, for its egress relay's connections. What it starts has the
    code's (the tiers give the sandbox this much; the supervisor lowers it for the code)."""
    return limits.files_per_process + RELAY_FILES


def sandbox_id(spec: SandboxSpec) -> str:
    """The id of a sandbox being started: the spec's (a paused one resumes under its own),
    else a new one. It names host folders and cgroups: only ``sbx-`` and 12 hex digits."""
    if spec.sandbox_id is None:
        return "sbx-" + secrets.token_hex(6)
    if not _SANDBOX_ID.match(spec.sandbox_id):
        raise exc.InvalidArgument(f"{spec.sandbox_id!r} is no sandbox id", argument="sandbox_id")
    return spec.sandbox_id
