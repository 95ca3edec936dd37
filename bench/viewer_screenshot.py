"""The run viewer's screenshot in the docs (docs/run-viewer.png), made the way a user sees it:
the demo's run (a scripted model fixes a failing test on the process tier: a failing test run,
a read, a retried read, a patch, a passing run, the acceptance check) recorded in a SQLite
store, ``stockade ui`` over it, and Debian's headless chromium driven by Playwright.

    PYTHONPATH=src python bench/viewer_screenshot.py [--out docs/run-viewer.png]
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM = "/usr/bin/chromium"
ARGS = [
    "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "run-viewer.png")
    parser.add_argument("--port", type=int, default=8799)
    options = parser.parse_args()
    out = options.out.resolve()
    with tempfile.TemporaryDirectory(prefix="stockade-shot-") as tmp:
        os.environ["STOCKADE_KILL_DIR"] = f"{tmp}/kill"  # nothing of this lands in the home folder
        os.environ["STOCKADE_APPROVAL_DIR"] = f"{tmp}/approvals"
        from stockade.demo import run_demo
        from stockade.runs.store import open_run_store

        db = f"sqlite:///{tmp}/audit.db"
        with open_run_store(db) as runs:
            result = run_demo(audit=db, checkpointer=runs)
        print(f"demo run {result.run_id}: {result.status.value}", file=sys.stderr)
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
        }
        command = [sys.executable, "-m", "stockade.cli.main", "ui", "--db", db, "--port", str(options.port)]
        ui = subprocess.Popen(command, stderr=subprocess.PIPE, text=True, env=env)
        try:
            assert ui.stderr is not None
            line = ui.stderr.readline()
            found = re.search(r"(http://\S+)", line)
            if found is None:
                raise SystemExit(f"stockade ui said: {line}")
            time.sleep(1.5)
            shoot(found.group(1), result.run_id, out)
        finally:
            ui.terminate()
            ui.wait(20)
    print(f"wrote {out}", file=sys.stderr)


def shoot(login: str, run_id: str, out: Path) -> None:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        try:
            page = browser.new_page(viewport={"width": 1180, "height": 900}, device_scale_factor=1)
            page.goto(login)
            page.goto(login.split("/ui/", maxsplit=1)[0] + f"/ui/runs/{run_id}")
            page.wait_for_selector(".timeline .entry")
            page.locator(".entry.k-tool details").first.evaluate("node => node.open = true")
            page.screenshot(path=str(out), full_page=True)
        finally:
            browser.close()


if __name__ == "__main__":
    main()
