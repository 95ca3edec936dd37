"""``Client``: one service, one token; its sandboxes and its runs.

client = Client("http://127.0.0.1:8080", token)        # or STOCKADE_URL / STOCKADE_TOKEN
run = client.runs.submit("make the tests pass", workspace="project/", model="openai:gpt-4.1")
for event in run.events():                              # live: model calls, tool calls, ...
    print(event.kind, event.data.get("attributes", {}))
run.wait().status                                       # "success", "paused", ...
print(run.diff())
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stockade import exceptions as exc
from stockade._checks import check_acceptance, check_labels, check_timeout
from stockade.client._http import (
    ANSWER_MAX_BYTES,
    DIFF_MAX_BYTES,
    LIST_MAX_BYTES,
    Http,
    bad_answer,
    error_from,
    malformed_archive,
)
from stockade.client._inputs import folder as folder_path
from stockade.client._inputs import host_path, segment
from stockade.client._requests import limits_body, snapshot_id
from stockade.client.sandbox import RemoteSandbox
from stockade.sandbox._archive import Extraction
from stockade.sandbox._archive_gzip import Inflated
from stockade.sandbox.facade import tar_directory
from stockade.sandbox.ops import DOWNLOAD_MAX_BYTES, DOWNLOAD_MAX_ENTRIES
from stockade.types import Limits, Snapshot

__all__ = ["Client", "RemoteRun", "RunEvent", "Runs"]

_ENDED = frozenset({"success", "check_failed", "max_steps", "budget", "killed", "denied", "error"})


@dataclass(frozen=True, kw_only=True)
class RunEvent:
    """One event of a run's stream: an audit event (``seq`` > 0), or ``status`` / ``end``."""

    kind: str
    seq: int
    data: dict[str, Any]


# What the sync and async clients share: the requests' bodies and the answers' parsing; each
# only sends them its way.


def settled(status: str, *, until_paused: bool) -> bool:
    """Whether ``wait`` is done: the run ended, or waits for someone (paused for an approval,
    or broken: its actions kept failing)."""
    return status in _ENDED or (until_paused and status in ("paused", "broken"))


# Data lines of one event: the service sends each in one; a stream past this is not its own.
EVENT_MAX_LINES = 65_536


class EventLines:
    """Server-Sent Events, a line at a time, into ``RunEvent``s; ``done`` after ``end``. An
    ``error`` event (the stream's token was taken out meanwhile: the server ends the stream with
    a problem document) raises the SDK error it stands for, as the same answer to a request
    would: a reader must not take a cut stream for a run that paused or ended. An event that
    is not one (its ``id`` no number, its data no JSON object, over ``limit`` bytes or of more
    than ``max_lines`` data lines) is a ``ServiceError``."""

    def __init__(
        self, url: str = "", limit: int = ANSWER_MAX_BYTES, max_lines: int = EVENT_MAX_LINES
    ) -> None:
        self.url, self.limit, self.max_lines = url, limit, max_lines
        self.kind, self.seq = "message", 0
        # An event's data lines, joined once at its end: added to a string a line at a time,
        # a service splitting one event over a million tiny lines kept the client's CPU busy
        # for minutes (each line copied all that came before)
        self._pieces: list[str] = []
        self._size = 0
        self.done = False

    def feed(self, line: str) -> RunEvent | None:
        if line.startswith("event:"):
            self.kind = line[6:].strip()
        elif line.startswith("id:"):
            seq = line[3:].strip() or "0"
            if not (seq.isdigit() and len(seq) <= 20):
                raise bad_answer(self.url, f"an event whose id is no number ({seq[:40]!r})")
            self.seq = int(seq)
        elif line.startswith("data:"):
            self._add(line[5:].strip())
        elif line == "" and self._size:
            return self._event("".join(self._pieces))
        elif line == "":
            self._pieces = []  # data lines with nothing in them: no event
        return None

    def _add(self, piece: str) -> None:
        self._pieces.append(piece)
        self._size += len(piece)
        if self._size > self.limit:
            raise bad_answer(self.url, f"an event over {self.limit:,} bytes")
        if len(self._pieces) > self.max_lines:  # empty ones too: they add no bytes, yet take memory
            raise bad_answer(self.url, f"an event of more than {self.max_lines:,} data lines")

    def _event(self, text: str) -> RunEvent:
        try:
            data = json.loads(text)
        except ValueError:
            data = None
        if not isinstance(data, dict):
            raise bad_answer(self.url, "an event whose data is no JSON object")
        event = RunEvent(kind=self.kind, seq=self.seq, data=data)
        if event.kind == "error" and event.seq == 0:  # not an audit event of that name
            status = event.data.get("status")
            raise error_from(event.data, status if isinstance(status, int) else 500)
        self.done = self.kind == "end"
        self.kind, self.seq, self._pieces, self._size = "message", 0, [], 0
        return event


def run_info(url: str, info: object) -> dict[str, Any]:
    """A run as the service describes it, once it names its id and status."""
    if not (
        isinstance(info, dict) and isinstance(info.get("run_id"), str) and isinstance(info.get("status"), str)
    ):
        raise bad_answer(url, "a run without its run_id and status")
    return info


def answer_list(url: str, found: object, what: str) -> list[Any]:
    if not isinstance(found, list):
        raise bad_answer(url, f"{what} that is no list")
    return found


def answer_field(url: str, found: object, key: str) -> Any:
    if not (isinstance(found, dict) and key in found):
        raise bad_answer(url, f"an answer without its {key!r}")
    return found[key]


def submit_body(
    task: str, *, model: str | None, scripted: Sequence[object] | None, workspace_id: str | None,
    tier: str | None, trust: str | None, max_steps: int | None, max_cost_usd: float | None,
    check: str | None, labels: Mapping[str, str] | None, idempotency_key: str | None,
    sandbox_limits: Limits | None,
) -> dict[str, Any]:  # fmt: skip
    body: dict[str, Any] = {
        "task": task, "model": model, "scripted": list(scripted) if scripted is not None else None,
        "workspace": workspace_id, "tier": tier, "trust": trust,
        "check": check_acceptance(check) if check is not None else None,
        "sandbox_limits": limits_body(sandbox_limits),
        "labels": check_labels(labels), "idempotency_key": idempotency_key,
    }  # fmt: skip
    limits = {k: v for k, v in (("max_steps", max_steps), ("max_cost_usd", max_cost_usd)) if v is not None}
    if limits:
        body["limits"] = limits
    return {k: v for k, v in body.items() if v is not None}


def kill_all_body(reason: str, tenant: str | None, all_tenants: bool) -> dict[str, Any]:
    body: dict[str, Any] = {"reason": reason, "all_tenants": all_tenants}
    if tenant is not None:
        body["tenant"] = tenant
    return body


def list_params(status: str | None, label: str | None, limit: int) -> dict[str, Any]:
    params: dict[str, Any] = {"limit": limit}
    if status is not None:
        params["status"] = status
    if label is not None:
        params["label"] = label
    return params


TAR_HEADERS = {"Content-Type": "application/x-tar"}


class RemoteRun:
    """A run of the service, by id; ``info`` is its last known state (``refresh()``)."""

    def __init__(self, client: Client, info: object) -> None:
        self.client = client
        self.info = run_info(client.http.url, info)

    @property
    def id(self) -> str:
        return str(self.info["run_id"])

    @property
    def _at(self) -> str:
        """Its path in the API: the id the service gave, one segment of it (a ``/`` or ``..``
        in it names no other resource)."""
        return f"/v1/runs/{segment(self.id, 'run_id')}"

    @property
    def status(self) -> str:
        return str(self.info["status"])

    def refresh(self) -> RemoteRun:
        self.info = run_info(self.client.http.url, self.client.http.request("GET", self._at).json())
        return self

    def wait(self, *, timeout_s: float = 600.0, poll_s: float = 0.25, until_paused: bool = True) -> RemoteRun:
        """Until the run ends (or waits for someone: paused for an approval, or broken: its
        actions kept failing); ``TimeoutError`` past ``timeout_s``."""
        timeout_s = check_timeout(timeout_s) or 0.0
        poll_s = check_timeout(poll_s, argument="poll_s") or 0.0
        deadline = time.monotonic() + timeout_s
        while True:
            self.refresh()
            if settled(self.status, until_paused=until_paused):
                return self
            if time.monotonic() > deadline:
                raise exc.RunWaitTimeout(f"run {self.id} is still {self.status} after {timeout_s:.0f} s")
            time.sleep(poll_s)

    def events(self, *, after: int = 0) -> Iterator[RunEvent]:
        """The run's events as they happen, until it ends or pauses (Server-Sent Events)."""
        with self.client.http.stream(
            "GET", f"{self._at}/events", params={"after": after}, timeout=None
        ) as response:
            lines = EventLines(self.client.http.url)
            for line in self.client.http.lines(response):
                event = lines.feed(line)
                if event is not None:
                    yield event
                    if lines.done:
                        return

    def approvals(self) -> list[dict[str, str]]:
        found: list[dict[str, str]] = self.client.http.request("GET", f"{self._at}/approvals").json()
        return found

    def approve(self, request_id: str) -> RemoteRun:
        return self._decide(request_id, "approve")

    def deny(self, request_id: str) -> RemoteRun:
        return self._decide(request_id, "deny")

    def _decide(self, request_id: str, decision: str) -> RemoteRun:
        path = f"{self._at}/approvals/{segment(request_id, 'request_id')}"
        return self._is(self.client.http.request("POST", path, json={"decision": decision}).json())

    def kill(self, reason: str = "killed through the API") -> RemoteRun:
        return self._is(self.client.http.request("POST", f"{self._at}/kill", json={"reason": reason}).json())

    def resume(self) -> RemoteRun:
        """Resume a run its breaker stopped ("broken"), once someone has looked at why."""
        return self._is(self.client.http.request("POST", f"{self._at}/resume").json())

    def _is(self, info: object) -> RemoteRun:
        self.info = run_info(self.client.http.url, info)
        return self

    def diff(self) -> str:
        return self.client.http.request("GET", f"{self._at}/diff", limit=DIFF_MAX_BYTES).text

    def artifacts(
        self,
        dest: str | Path,
        *,
        max_bytes: int = DOWNLOAD_MAX_BYTES,
        max_entries: int = DOWNLOAD_MAX_ENTRIES,
    ) -> Path:
        """Unpack the run's final workspace into ``dest`` as ``files.download_dir`` unpacks a
        sandbox's folder (the run's code made it: every byte is hostile): all or nothing,
        nothing written outside ``dest``, a link that leads out left out, at most
        ``max_bytes`` and ``max_entries`` (``FileTooLarge``); unpacked as it arrives."""
        host_path(dest, "dest")
        try:
            with (
                Extraction(dest, max_bytes=max_bytes, max_entries=max_entries) as unpack,
                self.client.http.stream("GET", f"{self._at}/artifacts") as response,
            ):
                inflated = Inflated(unpack.feed)
                for chunk in self.client.http.bulk(response):
                    inflated.feed(chunk)
                inflated.finish()
                unpack.finish()
        except exc.ProtocolError as error:
            raise malformed_archive(self.client.http.url, error) from None
        return Path(dest)

    def delete_artifacts(self) -> None:
        """Forget the run's kept final workspace (its bytes are free of ``storage_mb``)."""
        self.client.http.request("DELETE", f"{self._at}/artifacts")

    def delete(self) -> None:
        """Erase the run (``Runs.delete``)."""
        self.client.runs.delete(self.id)

    def __repr__(self) -> str:
        return f"<RemoteRun {self.id} {self.status}>"


class Runs:
    def __init__(self, client: Client) -> None:
        self.client = client

    def upload_workspace(self, folder: str | Path) -> str:
        """Send a folder (as a tar); returns the id a run's ``workspace`` takes."""
        data = tar_directory(folder_path(folder, "folder"))
        response = self.client.http.request("POST", "/v1/workspaces", content=data, headers=TAR_HEADERS)
        return str(answer_field(self.client.http.url, response.json(), "id"))

    def submit(
        self,
        task: str,
        *,
        model: str | None = None,
        scripted: Sequence[object] | None = None,
        workspace: str | Path | None = None,
        tier: str | None = None,
        trust: str | None = None,
        sandbox_limits: Limits | None = None,
        max_steps: int | None = None,
        max_cost_usd: float | None = None,
        check: str | None = None,
        labels: Mapping[str, str] | None = None,
        idempotency_key: str | None = None,
    ) -> RemoteRun:
        """Queue an agent task; ``workspace`` is a local folder (uploaded) or an uploaded id.
        ``sandbox_limits`` are its sandbox's: while it runs, they hold a share of the tenant's
        quota (a run with no room waits queued, its ``error`` saying so)."""
        workspace_id: str | None = None
        if workspace is not None:
            path = folder_path(workspace, "workspace")
            workspace_id = self.upload_workspace(path) if path.is_dir() else str(workspace)
        body = submit_body(
            task, model=model, scripted=scripted, workspace_id=workspace_id, tier=tier, trust=trust,
            max_steps=max_steps, max_cost_usd=max_cost_usd, check=check, labels=labels,
            idempotency_key=idempotency_key, sandbox_limits=sandbox_limits,
        )  # fmt: skip
        response = self.client.http.request("POST", "/v1/runs", json=body)
        return RemoteRun(self.client, response.json())

    def kill_all(
        self, reason: str = "killed through the API (kill-all)", *, tenant: str | None = None,
        all_tenants: bool = False,
    ) -> list[dict[str, Any]]:  # fmt: skip
        """Stop every run of this token's tenant (an admin token: of ``tenant``, or of
        ``all_tenants``): the live ones' switches are pulled, the waiting ones (queued, paused,
        interrupted, broken) end at once; returns them (run_id, tenant, where: a live run's
        host and process, or what a waiting one was)."""
        body = kill_all_body(reason, tenant, all_tenants)
        found = self.client.http.request("POST", "/v1/runs/kill", json=body).json()
        return answer_list(
            self.client.http.url, answer_field(self.client.http.url, found, "killed"), "killed"
        )

    def get(self, run_id: str) -> RemoteRun:
        path = f"/v1/runs/{segment(run_id, 'run_id')}"
        return RemoteRun(self.client, self.client.http.request("GET", path).json())

    def list(
        self, *, status: str | None = None, label: str | None = None, limit: int = 50
    ) -> list[RemoteRun]:
        params = list_params(status, label, limit)
        found = self.client.http.request("GET", "/v1/runs", params=params, limit=LIST_MAX_BYTES).json()
        return [RemoteRun(self.client, r) for r in answer_list(self.client.http.url, found, "runs")]

    def delete(self, run_id: str) -> None:
        """Erase a run that ended: its spec, conversation, tool outputs, approvals and artifacts
        (its bytes are free of your ``storage_mb``); its id stays taken and its audit events
        stay. ``RunConflict`` while it runs or waits (kill it first)."""
        self.client.http.request("DELETE", f"/v1/runs/{segment(run_id, 'run_id')}")


class Client:
    """The service at ``url`` (``STOCKADE_URL``), with ``token`` (``STOCKADE_TOKEN``)."""

    def __init__(
        self,
        url: str | None = None,
        token: str | None = None,
        *,
        timeout_s: float | None = 120.0,
        transport: Any = None,
    ) -> None:
        self.http = Http(url, token, timeout_s=timeout_s, transport=transport)
        self.runs = Runs(self)

    def sandbox(self, tier: str | None = None, **options: Any) -> RemoteSandbox:
        """``RemoteSandbox.create(tier, ..., client=self)``."""
        return RemoteSandbox.create(tier, client=self, **options)

    def sandboxes(self) -> list[dict[str, Any]]:
        found: list[dict[str, Any]] = self.http.request("GET", "/v1/sandboxes", limit=LIST_MAX_BYTES).json()
        return found

    def snapshots(self) -> list[dict[str, Any]]:
        """Your tenant's snapshots and paused sandboxes (``paused``: the sandbox's id)."""
        found: list[dict[str, Any]] = self.http.request("GET", "/v1/snapshots", limit=LIST_MAX_BYTES).json()
        return found

    def delete_snapshot(self, snapshot: Snapshot | str) -> None:
        """Forget a snapshot (a paused sandbox's: the sandbox is gone with it); its disk is
        free of your ``snapshot_mb`` quota."""
        self.http.request("DELETE", f"/v1/snapshots/{segment(snapshot_id(snapshot), 'snapshot')}")

    def workspaces(self) -> list[dict[str, Any]]:
        """Your uploaded workspaces (``id``, ``bytes``, ``uploaded_at``), newest first."""
        found: list[dict[str, Any]] = self.http.request("GET", "/v1/workspaces", limit=LIST_MAX_BYTES).json()
        return found

    def delete_workspace(self, workspace_id: str) -> None:
        """Forget an uploaded workspace (``RunConflict`` while a run that starts from it has
        not ended); its bytes are free of your ``storage_mb`` quota."""
        self.http.request("DELETE", f"/v1/workspaces/{segment(workspace_id, 'workspace_id')}")

    def verify_audit(self) -> dict[str, Any]:
        found: dict[str, Any] = self.http.request("GET", "/v1/audit/verify").json()
        return found

    def close(self) -> None:
        self.http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
