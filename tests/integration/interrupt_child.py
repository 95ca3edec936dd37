"""Starts (``create``) or closes (``close``) a Docker sandbox under a SIGALRM that raises
KeyboardInterrupt where the engine is being waited for; prints the creator token and the
containers left once the call raised."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from types import FrameType

from stockade import Sandbox
from stockade.sandbox import _guest


def main(where: str) -> None:
    fired = False

    def interrupt(signum: int, frame: FrameType | None) -> None:
        nonlocal fired
        names = []
        while frame is not None:
            names.append(frame.f_code.co_name)
            frame = frame.f_back
        waiting = "start" in names and names[0] in ("wait", "readinto", "recv_into")
        if where == "close":
            waiting = "remove_exited" in names
        if fired or not waiting:
            return
        fired = True
        signal.setitimer(signal.ITIMER_REAL, 0)
        raise KeyboardInterrupt

    creator = _guest.current_creator()
    signal.signal(signal.SIGALRM, interrupt)
    signal.setitimer(signal.ITIMER_REAL, 0.001, 0.001)
    try:
        sbx = Sandbox.create("docker")
        sbx.close()
    except KeyboardInterrupt:
        pass
    signal.setitimer(signal.ITIMER_REAL, 0)
    assert fired
    token = creator.token
    argv = ["docker", "ps", "-aq", "--filter", f"label=stockade.creator={token}"]
    left = subprocess.run(argv, capture_output=True, text=True, check=True).stdout.split()
    print(token, json.dumps(left).replace(" ", ""))


if __name__ == "__main__":
    main(sys.argv[1])
