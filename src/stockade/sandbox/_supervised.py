"""The ``Instance`` shared by every tier that runs the in-sandbox supervisor.

A tier only has to start the supervisor inside its boundary, hand over a byte stream to it,
and know how to kill the whole sandbox (``Boundary``). Everything else (commands, run_code,
files, output caps, timeouts) behaves identically on every tier because it is this code.

``SupervisedInstance`` is made of parts, each a base class of its own: the instance's life
(``_supervised_life``: its channel, owner and end) under commands and run_code
(``_supervised_calls``) and snapshots between calls (``_supervised_snapshots``). Here: the
start (the handshake, the rules held) and the dispatch of each op, with what a crash means.
What a tier sends before a start is ``_supervised_config``'s, the file requests are
``_transfers``'s, the replies are decoded in ``_replies``, the boundary is ``_boundary``'s,
and what a snapshot keeps of the settings is ``_snapshot_state``'s (the names in
``__all__`` are importable from here, where the tiers have always found them).
"""

from __future__ import annotations

import dataclasses
import secrets
import time
from collections.abc import Callable
from typing import Any

from stockade import exceptions as exc
from stockade.sandbox import _rules
from stockade.sandbox._boundary import Boundary
from stockade.sandbox._replies import judged_between
from stockade.sandbox._snapshot_state import (
    enforcement_from_state,
    enforcement_state,
    spec_from_state,
    spec_state,
)
from stockade.sandbox._supervised_calls import (
    GRACE_S,
    TIMEOUT_MARGIN_S,
    UNPRIORITIZED_TIMEOUT_MARGIN_S,
    SupervisedCalls,
)
from stockade.sandbox._supervised_config import WORKSPACE, sandbox_id, supervisor_config
from stockade.sandbox._supervised_snapshots import SupervisedSnapshots
from stockade.sandbox._transfers import FILE_OP_TIMEOUT_S, MAX_FRAME, TRANSFER_CHUNK, archive_chunks
from stockade.sandbox.base import OpResult, OutputSink
from stockade.sandbox.ops import (
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
from stockade.sandbox.supervisor.protocol import HMAC_SHA256, MACS, Seal

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


class SupervisedInstance(SupervisedCalls, SupervisedSnapshots):
    """One sandbox whose supervisor this host talks to: the calls and snapshots of its parts,
    and here its start and the dispatch of each op."""

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
