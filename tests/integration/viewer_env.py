"""What the run viewer's tests share: recorded runs (real agent runs on the process tier, with
a scripted model), ``stockade ui`` and ``stockade serve`` started for real, and Debian's
chromium driven by Playwright."""

from __future__ import annotations

import contextlib
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import httpx2

from stockade.assembly import AgentConfig, build_agent
from stockade.models.scripted import ScriptedModel, tool_call
from stockade.policy.schema import CommandRules, PathRules, Policy, TrustRules
from stockade.types import Trust
from tests.conftest import require, wait_for
from tests.integration.service_env import Process, free_port

if TYPE_CHECKING:
    from playwright.sync_api import Browser

CHROMIUM = "/usr/bin/chromium"
# No network here: the flags keep chromium from reaching out (updates, sync, field trials).
CHROMIUM_ARGS = [
    "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
    "--disable-default-apps", "--disable-extensions",
]  # fmt: skip
XSS = "<script>window.__pwned = 1; alert('pwned')</script>"
POLICY = Policy(
    trust=TrustRules(level=Trust.TRUSTED),
    paths=PathRules(deny=("secrets/**",)),
    commands=CommandRules(approve=("rm -r",)),
)


def record_runs(db: Path, workspace: Path) -> tuple[str, str]:
    """Two finished runs in ``db`` (their approvals and kill switches next to it, in
    ``approvals`` and ``kill``): one that did a bit of everything (and printed a script tag),
    one the policy stopped; their ids."""
    workspace.mkdir(exist_ok=True)
    (workspace / "app.py").write_text("def greet(name):\n    return 'hi ' + name\n")
    turns: list[object] = [
        tool_call(
            "write_file", {"path": "app.py", "content": "def greet(name):\n    return f'hello {name}'\n"}
        ),
        tool_call("run_code", {"code": f"print({XSS!r})", "language": "python"}),
        tool_call("write_file", {"path": "secrets/token.txt", "content": "x"}),
        tool_call("run_tests", {"command": "python3 -c 'import sys; sys.exit(3)'"}),
        "Done: greet says hello. <img src=x onerror=alert(2)>",
    ]
    ids = []
    for name, script in (
        ("busy", turns),
        ("stopped", [tool_call("write_file", {"path": "secrets/a", "content": "x"})] * 3),
    ):
        config = AgentConfig(
            model=ScriptedModel(script, name=f"scripted-{name}"),  # type: ignore[arg-type]
            policy=POLICY, tier="process", audit=f"sqlite:///{db}",
            kill_target=str(db.parent / "kill"), approval_dir=db.parent / "approvals",
        )  # fmt: skip
        with build_agent(config) as agent:
            result = agent.run_sync(f"the {name} run: make greet say hello", workspace=workspace)
        ids.append(result.run_id)
    return ids[0], ids[1]


class Ui(Process):
    """``stockade ui`` on a free port, reading the approvals in ``approvals`` (never the default
    in the home folder); ``key`` is the one it printed."""

    def __init__(self, db: Path, folder: Path, approvals: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        super().__init__(
            ["ui", "--db", f"sqlite:///{db}", "--port", str(self.port), "--approval-dir", str(approvals)],
            folder / "ui.log",
            cwd=folder,
        )
        try:
            found = wait_for(
                lambda: re.search(r"key=(\S+)", self.output()), what="stockade ui to print its key"
            )
            assert found is not None
            self.key = found.group(1)

            def up() -> bool:
                assert self.proc.poll() is None, self.output()
                try:
                    return httpx2.get(self.url + "/ui/login", timeout=1).status_code == 200
                except httpx2.TransportError:
                    return False

            wait_for(up, what="stockade ui to listen", timeout_s=30)
        except BaseException:
            self.stop()
            raise


@contextlib.contextmanager
def chromium() -> Iterator[Browser]:
    """Debian's chromium, headless, driven by Playwright (skips outside CI when either is missing)."""
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        require("playwright", False, 'pip install "stockade[dev]"')
    require(
        "chromium", Path(CHROMIUM).exists() and shutil.which(CHROMIUM) is not None, "scripts/setup-browser.sh"
    )
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            yield browser
        finally:
            browser.close()
