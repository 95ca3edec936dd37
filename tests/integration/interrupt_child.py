"""Starts a sandbox of ``TIER`` and closes it under a SIGALRM that raises KeyboardInterrupt
where ``WHERE`` says: ``create``, while the engine answers a Docker create (in whichever thread
that call runs); ``close``, mid-teardown (in a tier's ``_kill``). Prints, as JSON, the sandbox's
id (when known), the creator's token, and the containers left once the interrupted call raised."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
from types import FrameType

from stockade import Sandbox
from stockade.sandbox import _guest


def _names(frame: FrameType | None) -> list[str]:
    names = []
    while frame is not None:
        names.append(frame.f_code.co_name)
        frame = frame.f_back
    return names


def _sandbox_id(frame: FrameType | None) -> str | None:
    while frame is not None:
        for value in (frame.f_locals.get("sid"), getattr(frame.f_locals.get("self"), "id", None)):
            if isinstance(value, str) and value.startswith("sbx-"):
                return value
        frame = frame.f_back
    return None


def main(tier: str, where: str) -> None:
    fired = False
    sid: str | None = None

    def interrupt(signum: int, frame: FrameType | None) -> None:
        nonlocal fired, sid
        if where == "close":
            waiting = "_kill" in _names(frame)
        else:  # the engine's create waits for its answer, in whichever thread it runs
            others = [f for t, f in sys._current_frames().items() if t != threading.main_thread().ident]
            waiting = any(
                "create_container" in names and names[0] == "readinto"
                for names in map(_names, [frame, *others])
            )
        if fired or not waiting:
            return
        fired = True
        sid = sid or _sandbox_id(frame)
        signal.setitimer(signal.ITIMER_REAL, 0)
        raise KeyboardInterrupt

    token = _guest.current_creator().token
    signal.signal(signal.SIGALRM, interrupt)
    # The timer samples every millisecond: an engine that answered between two ticks left the
    # wait unseen (once in a CI run), and a whole create, closed, is tried again.
    for _ in range(20):
        sid = None  # a create tried before and closed whole is not the one interrupted
        signal.setitimer(signal.ITIMER_REAL, 0.001, 0.001)
        try:
            sbx = Sandbox.create(tier)
            sid = sbx.id
            sbx.close()
        except KeyboardInterrupt:
            pass
        signal.setitimer(signal.ITIMER_REAL, 0)
        if fired:
            break
    assert fired
    left = []
    if tier in ("docker", "gvisor"):
        argv = ["docker", "ps", "-aq", "--filter", f"label=stockade.creator={token}"]
        left = subprocess.run(argv, capture_output=True, text=True, check=True).stdout.split()
    print(json.dumps({"sid": sid, "token": token, "left": left}))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
