"""Shared test helpers.

A test that needs a real backend (bubblewrap, dockerd, runsc, redis, postgres) asks for it
with ``require(name, available, why)``: on a laptop without it the test skips; in CI
(``CI=true``) a missing backend is a failure, never a silent skip.
"""

from __future__ import annotations

import ast
import fcntl
import functools
import json
import os
import select
import shutil
import signal
import tempfile
import time
from collections.abc import Callable, Collection, Generator, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest

T = TypeVar("T")

IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")

# What stockade keeps in the user's home: kill switches and pending approvals. Tests use their
# own folders (below), so the suite leaves the home folder of whoever runs it as it found it.
HOME = Path.home()


def _home_state() -> dict[str, tuple[int, int]]:
    """Every path under ~/.stockade with its size and mtime, and the home folder's own entries
    (a cache under ~/.cache may be filled: the tiers' images are built there on first use)."""
    state: dict[str, tuple[int, int]] = {}
    for entry in os.scandir(HOME):
        if entry.name != ".cache":
            state[entry.name] = (0, 0)
    stockade = HOME / ".stockade"
    if stockade.exists():
        for root, dirs, files in os.walk(stockade):
            for name in dirs + files:
                path = Path(root, name)
                info = path.lstat()
                state[str(path.relative_to(HOME))] = (info.st_size, info.st_mtime_ns)
    return state


# What a sandbox leaves on the host if a close or a collection misses it. The suite takes a
# census before and after and fails on anything new: processes of the tiers (bubblewrap, QEMU,
# runsc, a container's shim, anything run from stockade's folders), sandbox cgroups, mounts of
# stockade, Docker or pytest's folders, stockade's containers and volumes, files in the checkout.
# Where another user of the host runs sandboxes meanwhile (STOCKADE_TEST_SHARED_HOST=1), only
# this process's descendants and the containers it labelled as their creator are counted.
_TIER_PROCESSES = (b"bwrap", b"slirp4netns", b"qemu-system", b"runsc", b"containerd-shim", b"stockade")
_MOUNTED_HERE = ("stockade", "sbx-", "pytest-of-", "/var/lib/docker", "/run/docker", "/run/containerd")
_CHECKOUT = Path(__file__).resolve().parent.parent
_CHECKOUT_CACHES = {
    ".git",
    ".venv",
    ".hypothesis",
    ".pytest_cache",
    ".mypy_cache",
    ".ruff_cache",
    "__pycache__",
    "htmlcov",
}


def shared_host() -> bool:
    """Others run sandboxes (and rely on the host's services) meanwhile."""
    return os.environ.get("STOCKADE_TEST_SHARED_HOST", "") not in ("", "0")


def _in_worker() -> bool:
    """In a worker of a parallel run (pytest-xdist, ``-n N``): the other workers' sandboxes
    come and go meanwhile, as another user's would on a shared host."""
    return "PYTEST_XDIST_WORKER" in os.environ


def _census(*, own_only: bool, creators: Collection[int] = ()) -> dict[str, set[str]]:
    """What the tiers have on this host now. ``own_only``: only this process's descendants and
    the containers labelled with this process (or one of ``creators``) as their creator, not
    the checkout or the host's cgroups and mounts (which others change meanwhile)."""
    from stockade.sandbox import _cgroups

    if own_only:
        mine = {os.getpid(), *creators}
        return {
            "containers": _containers(mine_only=True, creators=mine),
            "processes": {f"{pid} {cmd}" for pid, cmd in _tier_processes(mine_only=True)},
        }
    shared = shared_host()
    found: dict[str, set[str]] = {
        "containers": _containers(mine_only=shared, creators={os.getpid(), *creators})
    }
    found["processes"] = {f"{pid} {cmd}" for pid, cmd in _tier_processes(mine_only=shared)}
    found["checkout"] = _checkout_files()
    if shared:
        return found
    found["cgroups"] = set(_cgroups.leftover_groups())
    found["mounts"] = {
        line.split()[4]
        for line in Path("/proc/self/mountinfo").read_text().splitlines()
        if any(part in line.split()[4] for part in _MOUNTED_HERE)
    }
    return found


def _checkout_files() -> set[str]:
    files: set[str] = set()
    for root, dirs, names in os.walk(_CHECKOUT):
        dirs[:] = [d for d in dirs if d not in _CHECKOUT_CACHES]
        kept = (n for n in names if not n.startswith(".coverage"))
        files.update(str(Path(root, n).relative_to(_CHECKOUT)) for n in kept)
    return files


def _tier_processes(*, mine_only: bool) -> list[tuple[int, str]]:
    parents: dict[int, int] = {}
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit() and int(name) != os.getpid():
            try:
                cmdline = Path(f"/proc/{name}/cmdline").read_bytes()
                stat = Path(f"/proc/{name}/stat").read_bytes()
                parents[int(name)] = int(stat.rsplit(b")", 1)[1].split()[1])
            except OSError:
                continue  # gone meanwhile
            # pytest is this process's parent or a helper; postgres names its connections by user
            ours = not (b"pytest" in cmdline or cmdline.startswith(b"postgres"))
            if ours and any(word in cmdline for word in _TIER_PROCESSES):
                found.append((int(name), cmdline.replace(b"\0", b" ").decode(errors="replace")[:120]))
    if mine_only:  # this process's descendants (a sandbox of another process is that one's)
        found = [(pid, cmd) for pid, cmd in found if _descends(pid, os.getpid(), parents)]
    return found


def _descends(pid: int, ancestor: int, parents: dict[int, int]) -> bool:
    while pid > 1:
        pid = parents.get(pid, 0)
        if pid == ancestor:
            return True
    return False


def _containers(*, mine_only: bool, creators: Collection[int] = ()) -> set[str]:
    try:
        from stockade.sandbox._docker_engine import engine_client

        client = engine_client(None, 10)
    except Exception:  # no SDK or no engine: nothing of ours can be there
        return set()
    try:
        label = "stockade.sandbox"
        labelled: list[dict[str, Any]] = client.containers(all=True, filters={"label": f"{label}=1"})
        volumes: dict[str, Any] = {} if mine_only else client.volumes(filters={"label": label})
    except Exception:
        return set()
    finally:
        client.close()
    pids = {str(pid) for pid in creators} or {str(os.getpid())}
    found = {
        f"container {c['Id'][:12]} {(c.get('Labels') or {}).get('stockade.id', '')}"
        for c in labelled
        if not mine_only or (c.get("Labels") or {}).get("stockade.pid") in pids
    }
    return found | {f"volume {v['Name']}" for v in volumes.get("Volumes") or []}


def _traces_left(
    before: dict[str, set[str]], census: Callable[[], dict[str, set[str]]]
) -> dict[str, set[str]]:
    """What ``census`` finds beyond ``before``, once what dies asynchronously had a while to go."""
    left: dict[str, set[str]] = {}

    def nothing_new() -> bool:
        nonlocal left
        left = {kind: items - before.get(kind, set()) for kind, items in census().items()}
        left = {kind: items for kind, items in left.items() if items}
        return not left

    deadline = time.monotonic() + 30
    while not nothing_new() and time.monotonic() < deadline:
        time.sleep(0.5)
    return left


@pytest.fixture(scope="session", autouse=True)
def _the_suite_leaves_no_trace() -> Iterator[None]:
    # A worker of a parallel run counts what it started (its descendants, its containers); the
    # controller counts the rest, host-wide, once every worker has ended (pytest_sessionfinish).
    own_only = _in_worker()
    before = _census(own_only=own_only)
    yield
    # What lives as long as its backend (a QEMU started ahead, a spare) ends with it: drop the
    # tiers' backends as the process's exit would. What processes the tests killed on purpose
    # left is `stockade gc`'s (which never takes a live creator's), then what dies
    # asynchronously has a while to go.
    import gc

    from stockade.sandbox import _gc, _registry

    _registry._cache.clear()
    gc.collect()
    collected = _gc.collect()
    left = _traces_left(before, lambda: _census(own_only=own_only))
    traces = {k: sorted(v)[:10] for k, v in left.items()}
    assert not left, f"the tests left traces on this host: {traces} (gc had removed {collected})"


# The controller of a parallel run (pytest-xdist, ``-n N``) runs no test: it takes the census
# before its workers start and after they have all ended, host-wide (or, on a shared host, the
# checkout and the containers its workers labelled), which a worker cannot do while the other
# workers' sandboxes come and go.
_CENSUS_BEFORE = pytest.StashKey[dict[str, set[str]]]()
_WORKER_PIDS = pytest.StashKey[set[int]]()


def _controls_workers(config: pytest.Config) -> bool:
    return not _in_worker() and config.pluginmanager.has_plugin("dsession")


def pytest_configure(config: pytest.Config) -> None:
    workeroutput = getattr(config, "workeroutput", None)
    if workeroutput is not None:  # the controller learns which containers were this worker's
        workeroutput["pid"] = os.getpid()


def pytest_sessionstart(session: pytest.Session) -> None:
    if _controls_workers(session.config):
        session.config.stash[_WORKER_PIDS] = set()
        session.config.stash[_CENSUS_BEFORE] = _census(own_only=False)


@pytest.hookimpl(optionalhook=True)  # an xdist hook: unknown to a pytest without it
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """``--dist loadgroup``: the microVM's tests (their ids name it, or they are marked
    ``microvm``: a tier's probe starts a guest) are one unit of work, which one worker runs
    one after another (handed out first, the longest unit), every other test its own. QEMU
    under TCG keeps a core busy while its guest runs, and the guest's deadlines (a command's
    timeout, a boot) are on its clock: two guests at once, beside the other worker's tests,
    miss them. The tests marked ``alone`` of the other tiers are one unit too, handed out
    second: one worker runs them back to back holding the lock from one to the next
    (``_alone_when_marked``), so that the other worker stops once for all of them instead of
    once for each, and they do not wait one by one for its current test to end. (xdist's own
    groups go by ``xdist_group`` marks, which it cannot apply under pytest 9.)"""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling  # type: ignore[import-untyped]

    root = config.rootpath

    class MicrovmApart(LoadScopeScheduling):  # type: ignore[misc]  # xdist has no types
        def _split_scope(self, nodeid: str) -> str:
            if "microvm" in nodeid:
                return "microvm"
            path, _, name = nodeid.partition("::")
            function = name.split("[")[0].rsplit("::", 1)[-1]  # a class's test: its method
            for mark in _UNITS:
                if function in _marked(root / path, mark):
                    return mark
            return nodeid

    return MicrovmApart(config, log)


# The marks that make a unit of work of their own in a parallel run (the microVM's first).
_UNITS = ("microvm", "alone")


@functools.cache
def _marked(path: Path, mark: str) -> frozenset[str]:
    """The names of a test file's functions decorated ``@pytest.mark.<mark>``, read from its
    source: the controller of a parallel run has the tests' ids, never their marks.
    ``pytest_collection_modifyitems`` checks that every test so marked is found so."""
    try:
        tree = ast.parse(path.read_text())
    except (OSError, SyntaxError, ValueError):  # not a file of tests (a doctest's id, say)
        return frozenset()
    return frozenset(
        node.name
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and any(_mark_name(decorator) == f"pytest.mark.{mark}" for decorator in node.decorator_list)
    )


def _mark_name(decorator: ast.expr) -> str:
    """``pytest.mark.alone`` for ``@pytest.mark.alone`` and ``@pytest.mark.alone(before=...)``."""
    return ast.unparse(decorator.func if isinstance(decorator, ast.Call) else decorator)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        for mark in _UNITS:
            marked = item.get_closest_marker(mark) is not None
            if marked and getattr(item, "originalname", item.name) not in _marked(item.path, mark):
                raise pytest.UsageError(
                    f"{item.nodeid} is marked {mark} other than by @pytest.mark.{mark} on its function: "
                    "a parallel run would not hand it to the unit of work of its kind (tests/conftest.py)"
                )
    # The microVM unit's `alone` tests first (a stable sort: the rest keep their order). The
    # unit is the run's longest, so its waits are the run's: in its middle, each such test
    # waited for the other workers' current tests to end before it could start (and they for
    # it); first, nothing runs yet, and they hold the lock back to back.
    items.sort(key=lambda item: not (_microvm_unit(item) and item.get_closest_marker("alone") is not None))


def _microvm_unit(item: pytest.Item) -> bool:
    """Whether the parallel run's scheduler hands ``item`` to the microVM's unit of work."""
    return "microvm" in item.nodeid or item.get_closest_marker("microvm") is not None


@pytest.fixture
def stamina_log() -> Iterator[list[Any]]:
    """What stamina logs of its retries (its structlog line), with its hooks as shipped: the CLI
    turns them off for its own process, and a test of the CLI may have run in this one."""
    import stamina.instrumentation
    import structlog.testing

    hooks = stamina.instrumentation.get_on_retry_hooks()
    stamina.instrumentation.set_on_retry_hooks([stamina.instrumentation.StructlogOnRetryHook])
    try:
        with structlog.testing.capture_logs() as logs:
            yield logs
    finally:
        stamina.instrumentation.set_on_retry_hooks(hooks)


# The item a worker runs after this one (pytest knows it when it runs a test; a fixture does not).
_NEXT_ITEM = pytest.StashKey["pytest.Item | None"]()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    item.stash[_NEXT_ITEM] = nextitem


@pytest.hookimpl(optionalhook=True)  # an xdist hook: unknown to a pytest without it
def pytest_testnodedown(node: Any, error: object) -> None:
    pid = getattr(node, "workeroutput", {}).get("pid")
    if pid is not None:
        node.config.stash[_WORKER_PIDS].add(pid)


@pytest.hookimpl(wrapper=True)
def pytest_sessionfinish(session: pytest.Session) -> Generator[None, None, None]:
    yield  # the workers have ended (xdist's own finish waits for them)
    config = session.config
    if _CENSUS_BEFORE not in config.stash:
        return
    pids = config.stash[_WORKER_PIDS]
    left = _traces_left(config.stash[_CENSUS_BEFORE], lambda: _census(own_only=False, creators=pids))
    if left:
        traces = {k: sorted(v)[:10] for k, v in left.items()}
        reporter = config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            reporter.write_line(f"\nthe tests left traces on this host: {traces}", red=True, bold=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


class _RunLocks:
    """A worker's two lock files, in the folder the workers' temporary folders share: a
    turnstile, and the lock a test marked ``alone`` holds alone and every other test shares.
    ``alone``: this worker holds both for its tests marked so, from one to the next."""

    def __init__(self, folder: Path) -> None:
        self.turnstile = os.open(folder / "turnstile.lock", os.O_RDWR | os.O_CREAT, 0o600)
        self.lock = os.open(folder / "alone.lock", os.O_RDWR | os.O_CREAT, 0o600)
        self.alone = False

    def shared(self) -> None:
        # flock converts a lock this file already holds: an exclusive one held past its
        # last alone test (one skipped before its fixtures ran) becomes the shared one
        fcntl.flock(self.turnstile, fcntl.LOCK_EX)  # waits while an alone test waits or runs
        fcntl.flock(self.turnstile, fcntl.LOCK_UN)
        fcntl.flock(self.lock, fcntl.LOCK_SH)
        self.alone = False

    def exclusive(self) -> None:
        if not self.alone:
            fcntl.flock(self.turnstile, fcntl.LOCK_EX)
            fcntl.flock(self.lock, fcntl.LOCK_EX)
            self.alone = True

    def release(self) -> None:
        """Either lock (the turnstile is held only by an exclusive holder)."""
        fcntl.flock(self.lock, fcntl.LOCK_UN)
        fcntl.flock(self.turnstile, fcntl.LOCK_UN)
        self.alone = False

    def close(self) -> None:
        os.close(self.turnstile)
        os.close(self.lock)


@pytest.fixture(scope="session")
def _run_locks(tmp_path_factory: pytest.TempPathFactory) -> Iterator[_RunLocks | None]:
    """In a worker: its locks (``_RunLocks``)."""
    if not _in_worker():
        yield None
        return
    locks = _RunLocks(tmp_path_factory.getbasetemp().parent)
    try:
        yield locks
    finally:
        locks.close()


@pytest.fixture(autouse=True)
def _alone_when_marked(request: pytest.FixtureRequest, _run_locks: _RunLocks | None) -> Iterator[None]:
    """A test marked ``alone`` measures something host-wide that a test of another worker would
    move (the host's open files): in a parallel run it waits until no other test runs, and no
    other test starts until it ends. Every other test shares the lock; the turnstile keeps a
    stream of them from starving a waiting ``alone`` test. When this worker's next test is
    marked ``alone`` too, the lock is kept for it. ``@pytest.mark.alone(before="fixture")``:
    that fixture (what the test needs built, not measured: a machine of its own) is set up
    first, under the shared lock, so that the other workers go on beside it."""
    if _run_locks is None:
        yield
        return
    marker = request.node.get_closest_marker("alone")
    if marker is None:
        _run_locks.shared()
        try:
            yield
        finally:
            _run_locks.release()
        return
    if _microvm_unit(request.node):
        # The microVM's probe boots a guest on its first ask in a worker (the tier fixture's,
        # under the lock): made before it, the other workers run on meanwhile instead of
        # waiting for that boot too. The probe is kept: the test's own ask costs nothing.
        tier_available("microvm")
    before = marker.kwargs.get("before")
    if before is not None:  # built as an ordinary test runs: beside others, never beside an `alone` one
        _run_locks.shared()  # (an exclusive lock kept from this worker's last test becomes shared)
        try:
            request.getfixturevalue(before)
        finally:
            _run_locks.release()  # held, it would deadlock with an `alone` test waiting at the turnstile
    _run_locks.exclusive()
    try:
        yield
    finally:
        following = request.node.stash.get(_NEXT_ITEM, None)
        if following is None or following.get_closest_marker("alone") is None:
            _run_locks.release()


# Whether this worker has run a test of the microVM's unit (it is handed that unit first).
_RAN_MICROVM_UNIT = pytest.StashKey[bool]()


@pytest.fixture(autouse=True)
def _no_guest_outside_the_microvm_unit(request: pytest.FixtureRequest) -> Iterator[None]:
    """In a parallel run a microVM guest starts only on the worker of the microVM's unit (its
    guests' deadlines are on an emulated clock: two at once miss them). A test outside it that
    starts one anyway (a CLI choosing its tier by trust, a probe of every tier) paid a boot
    (seconds under TCG) beside that worker's guest: it fails, told to say its tier or be marked
    ``microvm``. Seen by the boot images in the worker's snapshot store, which any start or
    probe of a guest builds first; not after this worker's own microVM tests (theirs build on
    in the background)."""
    config = request.config
    if _microvm_unit(request.node):
        config.stash[_RAN_MICROVM_UNIT] = True
    if not _in_worker() or config.stash.get(_RAN_MICROVM_UNIT, False):
        yield
        return
    boot = Path(os.environ.get("STOCKADE_SNAPSHOT_DIR", "")) / "refs" / "boot"
    before = _entries(boot)
    yield
    started = sorted(_entries(boot) - before)
    if started:
        pytest.fail(
            f"{request.node.nodeid} started a microVM guest outside the microVM's unit (boot images "
            f"{started}): give it a tier that is not the microVM's, or mark it @pytest.mark.microvm"
        )


def _entries(folder: Path) -> set[str]:
    try:
        return set(os.listdir(folder))
    except OSError:  # none yet
        return set()


@pytest.fixture(scope="session", autouse=True)
def _home_is_left_untouched() -> Iterator[None]:
    before = _home_state()
    yield
    after = _home_state()
    changed = sorted(set(before.items()) ^ set(after.items()))
    assert not changed, f"the tests changed the home folder {HOME}: {changed[:10]}"


@pytest.fixture(scope="session", autouse=True)
def _own_snapshot_store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Snapshots (and the microVM's boot images) in a folder of the session's own, set before
    any tier is created (a backend keeps the store it was made with). Removed at the end: a
    microVM snapshot is its whole memory, a worker's session wrote 20 GB of them, and pytest
    keeps a session's own folders for its last three runs whatever the retention policy."""
    before = os.environ.get("STOCKADE_SNAPSHOT_DIR")
    store = tmp_path_factory.mktemp("snapshots")
    os.environ["STOCKADE_SNAPSHOT_DIR"] = str(store)
    yield
    shutil.rmtree(store, ignore_errors=True)
    if before is None:
        os.environ.pop("STOCKADE_SNAPSHOT_DIR", None)
    else:
        os.environ["STOCKADE_SNAPSHOT_DIR"] = before


@pytest.fixture(scope="session", autouse=True)
def _suite_state_folders(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """The same for what runs before a test's own folders exist: a module's fixtures (a server,
    ``stockade ui``) and the processes they start would otherwise default to the home folder."""
    state = tmp_path_factory.mktemp("stockade-suite-state")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("STOCKADE_KILL_DIR", str(state / "kill"))
        patch.setenv("STOCKADE_APPROVAL_DIR", str(state / "approvals"))
        # the egress proxies on what `stockade[all]` gives them, asyncio's loop (the dev extra
        # installs uvloop for its own test)
        patch.setenv("STOCKADE_EGRESS_LOOP", os.environ.get("STOCKADE_EGRESS_LOOP", "asyncio"))
        # the process tier's masked program folders: where a sandbox's uid can reach them
        # (not below pytest's private folder), on /usr's file system when the temporary
        # folder is (hard links), else each program is bound on its own
        masks = Path(tempfile.mkdtemp(prefix="stockade-masks-"))
        masks.chmod(0o755)
        patch.setenv("STOCKADE_MASK_CACHE", str(masks))
        try:
            yield
        finally:
            shutil.rmtree(masks, ignore_errors=True)


@pytest.fixture(autouse=True)
def _own_state_folders(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """Kill switches and approvals of each test in folders of its own (subprocesses inherit them)."""
    state = tmp_path_factory.mktemp("stockade-state")
    monkeypatch.setenv("STOCKADE_KILL_DIR", str(state / "kill"))
    monkeypatch.setenv("STOCKADE_APPROVAL_DIR", str(state / "approvals"))


def require(name: str, available: bool, why: str = "") -> None:
    """Skip (locally) or fail (in CI) when ``name`` is not available."""
    if available:
        return
    message = f"{name} is not available{': ' + why if why else ''}"
    if IN_CI:
        pytest.fail(f"{message} (CI=true: missing backends fail instead of skipping)")
    pytest.skip(message)


def wait_for(
    condition: Callable[[], T],
    *,
    what: str | Callable[[], str],
    timeout_s: float = 10.0,
    interval_s: float = 0.02,
) -> T:
    """Poll ``condition`` until it returns something true, and return that. Past ``timeout_s``
    the test fails, saying ``what`` it waited for (a callable: asked then, so that it can tell
    the state things were left in). ``condition`` may raise to stop early."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() >= deadline:
            pytest.fail(f"waited {timeout_s:g} s for {what() if callable(what) else what}")
        time.sleep(interval_s)


def in_forked_child(body: Callable[[], object], *, timeout_s: float = 20.0) -> object:
    """What ``body`` returns (JSON) in a forked child (what it raised: ``{"raised": repr}``);
    the test fails if the child hangs."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child's
        try:
            os.close(read)
            try:
                result = body()
            except BaseException as error:
                result = {"raised": repr(error)}
            os.write(write, json.dumps(result).encode())
        finally:
            os._exit(0)
    os.close(write)
    try:
        ready, _, _ = select.select([read], [], [], timeout_s)
        if not ready:
            os.kill(pid, signal.SIGKILL)
            pytest.fail(f"the forked child still ran after {timeout_s:g} s: it hung")
        return json.loads(os.read(read, 65536))
    finally:
        os.close(read)
        os.waitpid(pid, 0)


async def wait_for_async(
    condition: Callable[[], T], *, what: str, timeout_s: float = 10.0, interval_s: float = 0.02
) -> T:
    """``wait_for`` on an event loop: the loop runs on between polls."""
    import asyncio

    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() >= deadline:
            pytest.fail(f"waited {timeout_s:g} s for {what}")
        await asyncio.sleep(interval_s)


def tier_available(tier: str) -> tuple[bool, str]:
    from stockade.sandbox import _registry

    report = _registry.probe(tier)
    return report.available, report.detail


def require_tier(tier: str) -> None:
    ok, detail = tier_available(tier)
    require(f"tier {tier!r}", ok, detail)


def host_processes(matching: bytes) -> list[int]:
    """Pids of host processes whose command line contains ``matching`` (NULs between args)."""
    from pathlib import Path

    found = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                cmdline = Path(f"/proc/{name}/cmdline").read_bytes()
            except OSError:
                continue  # gone meanwhile
            if matching in cmdline:
                found.append(int(name))
    return found


def processes_of_uid(uid: int) -> list[int]:
    """Pids of live host processes running as ``uid`` (a zombie only waits for its reaper,
    which for a sandbox's orphans is the host's init)."""
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                if os.stat(f"/proc/{name}").st_uid != uid:
                    continue
                with open(f"/proc/{name}/stat", "rb") as fh:
                    state = fh.read().rsplit(b")", 1)[1].split()[0]
            except OSError:
                continue  # gone meanwhile
            if state not in (b"Z", b"X"):
                found.append(int(name))
    return found
