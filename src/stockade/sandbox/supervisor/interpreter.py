"""The stateful Python interpreter behind ``run_code``; runs inside the sandbox.

One process keeps a namespace between calls. The value of a trailing expression comes back
as a MIME bundle (``text/plain``, plus ``text/html``/``image/png``/... when the object knows
how to show itself); open matplotlib figures come back as ``image/png``; an exception comes
back as (name, value, traceback) with this module's frames removed.
Standard library only, and little of it at import: this module is imported on the first
``run_code`` of every sandbox, so what it imports is that call's wait (``ast``, ``inspect``,
``traceback``, ``base64`` and ``typing`` cost ~25 ms together, more than the interpreter
process itself). Only C modules here; the rest is imported where it is used.
"""

from __future__ import annotations

import _ast
import _signal
import builtins
import fcntl
import io
import mmap
import os
import sys
import types

from protocol import (  # type: ignore[import-not-found]
    MAX_BUNDLE_ENTRIES,
    MAX_CODE_REPLY,
    MAX_CODE_REPORT,
    MAX_NAME,
    MAX_RESULT_COUNT,
    MAX_RESULT_ENTRIES,
    MAX_TEXT,
    MAX_VALUE,
    FrameError,
    FrameReader,
    dumps,
    encode,
    over_cap,
)

TYPE_CHECKING = False  # not typing.TYPE_CHECKING: importing typing costs milliseconds here
if TYPE_CHECKING:
    from typing import Any, Callable, Optional

CELL = "<cell>"
# What one run may send back: a larger value is cut or dropped with a mark, never the
# interpreter. The run's header says how much (``cap``: the sandbox's Limits.output_bytes):
# its error and results together at most that many bytes of JSON (escapes included), made
# here so that no more crosses the channel (60 figures were 54 MB of results against an
# output_bytes of 64 KiB, all of it held by the host). Never more than MAX_CODE_REPORT, so
# that with the error's name and the marks a report stays under protocol.MAX_CODE_REPLY.
MAX_RESULTS = MAX_CODE_REPORT
_MIME_METHODS = (
    ("text/html", "_repr_html_"),
    ("text/markdown", "_repr_markdown_"),
    ("image/svg+xml", "_repr_svg_"),
    ("image/png", "_repr_png_"),
    ("image/jpeg", "_repr_jpeg_"),
    ("text/latex", "_repr_latex_"),
    ("application/json", "_repr_json_"),
)


def _b64(data: bytes) -> str:
    import binascii  # C, unlike base64 (which imports re)

    return binascii.b2a_base64(data, newline=False).decode()


def _as_text(value: Any) -> str:
    if isinstance(value, bytes):
        return _b64(value)
    if isinstance(value, str):
        return value
    import json

    return json.dumps(value, default=str)


def cut_mark(chars: int, note: str = "") -> str:
    """The mark left where ``chars`` characters of a text were cut: ``stockade._cuts``'s
    (the redactor knows it), made again here, where only the standard library is."""
    return f"\n[… {chars:,} characters cut{' ' + note if note else ''} …]\n"


def mime_bundle(obj: Any) -> dict[str, str]:
    bundle: dict[str, str] = {}
    try:
        text = repr(obj)
    except Exception as exc:  # a broken __repr__ must not kill the kernel
        text = f"<unrepresentable {type(obj).__name__}: {exc!r}>"
    bundle["text/plain"] = text if len(text) <= MAX_TEXT else text[:MAX_TEXT] + cut_mark(len(text) - MAX_TEXT)
    for mime, method in _MIME_METHODS:
        fn = getattr(obj, method, None)
        if callable(fn) and not isinstance(obj, type):
            try:
                value = fn()
                if value is not None:
                    bundle[mime] = _as_text(value)
            except Exception:
                continue
    mb = getattr(obj, "_repr_mimebundle_", None)
    if callable(mb) and not isinstance(obj, type):
        try:
            extra = mb()
            data = extra[0] if isinstance(extra, tuple) else extra
            for mime, value in dict(data).items():
                bundle[str(mime)] = _as_text(value)
        except Exception:
            pass
    if _is_figure(obj):
        bundle["image/png"] = _figure_png(obj)
    for mime in [m for m, v in bundle.items() if len(v) > MAX_VALUE and m != "text/plain"]:
        size = len(bundle.pop(mime))
        bundle["text/plain"] += f"\n[stockade: {mime} dropped: {size} characters, over the cap]"
    return bundle


def _fit(text: str, room: int, *, end: bool = False) -> tuple[str, bool]:
    """``text`` in at most ``room`` bytes of JSON (its quotes aside): whole, or its head (with
    ``end`` its end) and a mark of how much was cut; and whether it was cut."""
    size = len(dumps(text)) - 2
    if size <= room:
        return text, False
    # A character takes 1 to 12 bytes of JSON: shrunk in proportion until it fits (twice or
    # so for a text of one kind of character).
    n = min(len(text), max(room, 0))
    while n:
        size = len(dumps(text[len(text) - n :] if end else text[:n])) - 2
        if size <= room:
            break
        n = min(n - 1, n * room // size)
    part = (text[len(text) - n :] if end else text[:n]) if n else ""
    mark = cut_mark(len(text) - n, "past the sandbox's output_bytes")
    return (mark + part if end else part + mark), True


def _bounded(results: list[dict[str, str]], room: int) -> tuple[list[dict[str, str]], bool]:
    """At most ``room`` bytes of JSON, MAX_RESULT_COUNT results and MAX_RESULT_ENTRIES MIME
    entries (a display() loop can make millions), and whether any was cut. Results are kept
    whole in order while they fit; the first that does not keeps its text, cut to the room
    left, its other MIME values dropped with a note (a figure's PNG is no use in part); the
    rest are dropped, one note saying how many."""
    out: list[dict[str, str]] = []
    entries = 0
    cut = False
    for i, bundle in enumerate(results):
        if len(bundle) > MAX_BUNDLE_ENTRIES:
            kept = dict(list(bundle.items())[: MAX_BUNDLE_ENTRIES - 1])
            note = f"\n[stockade: {len(bundle) - len(kept)} more MIME types dropped, over the cap]"
            kept["text/plain"] = kept.get("text/plain", "") + note
            bundle, cut = kept, True
        size = len(dumps(bundle)) + 1
        entries += len(bundle)
        last = i == MAX_RESULT_COUNT - 1 and len(results) > MAX_RESULT_COUNT
        if entries > MAX_RESULT_ENTRIES or last or room <= 0:
            out.append({"text/plain": f"[stockade: {len(results) - i} more results dropped, over the cap]"})
            return out, True
        if size > room:
            text = bundle.get("text/plain", "")
            notes = "".join(
                f"\n[stockade: {mime} dropped: {len(value)} characters, past the sandbox's output_bytes]"
                for mime, value in bundle.items()
                if mime != "text/plain"
            )
            # its text whole or in part, then the notes (never cut: they say what is missing)
            text, _ = _fit(text, room - len(dumps(notes)) - 20)
            out.append({"text/plain": text + notes})
            if i + 1 < len(results):
                more = len(results) - i - 1
                note = f"[stockade: {more} more results dropped, past the sandbox's output_bytes]"
                out.append({"text/plain": note})
            return out, True
        room -= size
        out.append(bundle)
    return out, cut


def _safe_str(exc: BaseException) -> str:
    try:
        text = str(exc)
    except BaseException:  # an exception's __str__ is user code too
        return f"<unprintable {type(exc).__name__}>"
    return text if len(text) <= MAX_TEXT else text[:MAX_TEXT] + "…"


def _error(exc: BaseException, cap: int) -> tuple[dict[str, str], bool]:
    """The report of ``exc``: its value and its traceback each in at most a quarter of
    ``cap`` (the traceback's end: it says where it failed), so that half is left for the
    results at least; and whether either was cut."""
    try:
        tb = _format_traceback(exc)
    except BaseException:
        tb = ""
    if len(tb) > MAX_TEXT:
        tb = "…" + tb[-MAX_TEXT:]
    value, value_cut = _fit(_safe_str(exc), cap // 4)
    tb, tb_cut = _fit(tb, cap // 4, end=True)
    name = type(exc).__name__
    return {"name": name[:MAX_NAME], "value": value, "traceback": tb}, value_cut or tb_cut


def _is_figure(obj: Any) -> bool:
    mpl = sys.modules.get("matplotlib.figure")
    return mpl is not None and isinstance(obj, mpl.Figure)


def _figure_png(fig: Any) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", bbox_inches="tight")
    return _b64(buf.getvalue())


def _open_figures() -> list[dict[str, str]]:
    plt = sys.modules.get("matplotlib.pyplot")
    if plt is None:
        return []
    out = []
    for num in plt.get_fignums():
        fig = plt.figure(num)
        out.append({"text/plain": repr(fig), "image/png": _figure_png(fig)})
    plt.close("all")
    return out


class _Reserve:
    """Address space kept back for our own work once code has run out: a run that ended in
    MemoryError with its data still held (a global list) left nothing for its report or the
    next request's frame, and the interpreter died on the next request, taking the code's
    state with it. An anonymous mapping never touched: address space (what RLIMIT_AS counts),
    no memory. Released at a MemoryError, taken again once a request is answered if there is
    room by then."""

    SIZE = 4 << 20

    def __init__(self) -> None:
        self._map: "Optional[mmap.mmap]" = None
        self.renew()

    def release(self) -> None:
        if self._map is not None:
            self._map.close()
            self._map = None

    def renew(self) -> None:
        if self._map is None:
            try:
                self._map = mmap.mmap(-1, self.SIZE)
            except (OSError, MemoryError, ValueError):
                pass  # still full: the next request has what was released


class Interpreter:
    def __init__(self) -> None:
        self.namespace: dict[str, Any] = {"__name__": "__main__", "__builtins__": builtins}
        self._displayed: list[dict[str, str]] = []
        self.namespace["display"] = self.display
        self.reserve = _Reserve()

    def display(self, *objs: Any) -> None:
        for obj in objs:
            self._displayed.append(mime_bundle(obj))

    def run(self, code: str, cap: int = MAX_RESULTS) -> dict[str, Any]:
        """Run ``code``; its report holds at most ``cap`` bytes of JSON of results and error
        (besides the error's name and the marks of what was cut)."""
        self._displayed = []
        error = None
        cut = False
        try:
            value = _interruptible(self._execute, code)
            if value is not None:
                self.namespace["_"] = value
                self._displayed.append(mime_bundle(value))
                if _is_figure(value):  # shown once, not again with the open figures
                    plt = sys.modules.get("matplotlib.pyplot")
                    if plt is not None:
                        plt.close(value)
        except BaseException as exc:  # SystemExit and KeyboardInterrupt are the code's too
            if isinstance(exc, MemoryError):
                self.reserve.release()  # room to report it, and to serve the next request
            error, cut = _error(exc, cap)
        finally:
            for stream in (sys.stdout, sys.stderr):
                try:
                    stream.flush()
                except Exception:
                    pass
        try:
            self._displayed.extend(_open_figures())
        except Exception:
            pass
        room = cap - (len(dumps(error)) if error is not None else 0)
        results, results_cut = _bounded(self._displayed, room)
        reply: dict[str, Any] = {"results": results, "error": error}
        if cut or results_cut:
            reply["truncated"] = True
        return reply

    def _execute(self, code: str) -> Any:
        # _ast, not ast: the same node classes and flags, without ast's imports.
        flags = _ast.PyCF_ALLOW_TOP_LEVEL_AWAIT
        tree = compile(code, CELL, "exec", flags | _ast.PyCF_ONLY_AST, dont_inherit=True)
        assert isinstance(tree, _ast.Module)
        last = None
        if tree.body and isinstance(tree.body[-1], _ast.Expr):
            last = _ast.Expression(tree.body.pop().value)
        body = compile(tree, CELL, "exec", flags, dont_inherit=True)
        _await(eval(body, self.namespace))
        if last is None:
            return None
        return _await(eval(compile(last, CELL, "eval", flags, dont_inherit=True), self.namespace))


def _await(value: Any) -> Any:
    if isinstance(value, types.CoroutineType):  # inspect.iscoroutine, without importing inspect
        import asyncio

        return asyncio.run(value)
    return value


def _format_traceback(exc: BaseException) -> str:
    # Imported on the first error, with the workspace on sys.path: a traceback.py of the
    # code's own stands in for it, as for the code's imports. That only spoils the code's
    # own report, which the host treats as untrusted anyway (json and asyncio are alike).
    import traceback

    tb: types.TracebackType | None = exc.__traceback__
    # Drop this module's frames: the code's own frames start at the first <cell> frame.
    while tb is not None and tb.tb_frame.f_code.co_filename != CELL:
        tb = tb.tb_next
    if isinstance(exc, SyntaxError):
        tb = None
    return "".join(traceback.format_exception(type(exc), exc, tb))


_site_loaded = False


def preload() -> None:
    """Import what every interpreter needs, once, in the process that forks interpreters.

    The supervisor starts with -S for speed; user code wants site-packages. Loading them
    before forking makes each new interpreter (after a timeout or a pool reset) a bare fork.
    """
    global _site_loaded
    if not _site_loaded:
        import site

        site.main()
        _site_loaded = True


def reseed() -> None:
    """New seeds for the generators that live in this process's memory, after a restore from
    a memory snapshot: every sandbox restored from one snapshot has the same memory, so
    ``random`` and ``tempfile``'s names would repeat from fork to fork. Python reseeds them at
    ``fork()``; a restore is no fork. ``os.urandom`` is already fresh (the kernel's)."""
    rnd = sys.modules.get("random")
    if rnd is not None:
        rnd.seed()  # from os.urandom
    tmp = sys.modules.get("tempfile")
    if tmp is not None:
        tmp._name_sequence = None  # made again, from a fresh random.Random(), at its next use
    numpy_random = sys.modules.get("numpy.random")
    if numpy_random is not None:
        try:
            numpy_random.seed()
        except Exception:
            pass
    # OpenSSL keeps its generators in our memory too, and reseeds them only when the pid
    # changes or after long: copies of one snapshot drew the same `ssl.RAND_bytes` (and so
    # would TLS's secrets). Fresh bytes added to it reseed them; so for the copy of OpenSSL a
    # `cryptography` wheel brings with it, where it is loaded.
    ssl = sys.modules.get("ssl")
    if ssl is not None:
        ssl.RAND_add(os.urandom(48), 48.0)
    binding = sys.modules.get("cryptography.hazmat.bindings.openssl.binding")
    if binding is not None:
        try:
            seed = os.urandom(48)
            binding.Binding().lib.RAND_add(seed, len(seed), float(len(seed)))
        except Exception:
            pass


def _forget_supervisor_modules() -> None:
    """Drop our own modules from ``sys.modules``: the user's ``protocol.py`` or ``reaper.py``
    must import as theirs, not resolve to the supervisor's (the references we hold stay)."""
    here = os.path.dirname(os.path.abspath(__file__))
    prefix = here + os.sep
    sys.path[:] = [entry for entry in sys.path if entry.rstrip(os.sep) != here]
    # By the folder's names, not a walk of sys.modules: a fork that touches every module
    # copies its page of the zygote's (~90 pages, a tenth of a fresh interpreter's start).
    for entry in os.listdir(here):
        name, dot, ext = entry.rpartition(".")
        module = sys.modules.get(name) if dot and ext == "py" else None
        path = getattr(module, "__file__", None)
        if isinstance(path, str) and path.startswith(prefix):  # absolute: sys.path entry is
            del sys.modules[name]


class _Streams:
    """Standard output and error as each cell starts: what a cell closed or made unwritable
    (``os.close(1)``, ``sys.stdout = None``, ``sys.stdout.close()``) is put back, so that one
    cell's mistake does not silence the next. What still works is left as the cell set it (it
    may send fd 1 or ``sys.stdout`` to a file on purpose)."""

    def __init__(self) -> None:
        # Copies of the pipes to the supervisor, above the low fds and close-on-exec (no
        # program the code starts holds them): from 64, or from the top of a lower limit
        # (F_DUPFD fails at or above RLIMIT_NOFILE; a sandbox may allow 32 per process).
        import resource  # C, small

        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        low = 64 if soft == resource.RLIM_INFINITY or soft > 66 else max(3, soft - 2)
        self._pipes: dict[int, int] = {}
        for fd in (1, 2):
            try:
                self._pipes[fd] = fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, low)
            except OSError:  # none free that high: a cell that closes it loses it for good
                pass

    def restore(self) -> None:
        for fd in (1, 2):
            try:
                os.fstat(fd)
            except OSError:  # closed by the code: its pipe again
                try:
                    os.dup2(self._pipes[fd], fd)
                except (KeyError, OSError):  # no copy, or the code closed it too: nothing to put back
                    continue
            current = sys.stdout if fd == 1 else sys.stderr
            if current is None or getattr(current, "closed", False):
                self.open(fd)

    @staticmethod
    def open(fd: int) -> None:
        """Unbuffered text on ``fd``: what a cell prints is in order with what its children print."""
        raw = io.FileIO(fd, "w", closefd=False)
        text = io.TextIOWrapper(raw, encoding="utf-8", errors="backslashreplace", write_through=True)
        setattr(sys, "stdout" if fd == 1 else "stderr", text)


def _python_signals() -> None:
    """The dispositions CPython sets at its start, which a fork of the zygote never went
    through (its shim set every signal back to default, as a command needs them): SIGPIPE
    and SIGXFSZ ignored, so that a write to a closed peer or past the file-size limit raises
    (BrokenPipeError, OSError) instead of killing us with the code's state; SIGINT raising
    KeyboardInterrupt (``_interrupt``). What the code starts gets the defaults back as under
    ``python3`` (subprocess's ``restore_signals``, an exec's reset of handlers)."""
    _signal.signal(_signal.SIGPIPE, _signal.SIG_IGN)
    _signal.signal(_signal.SIGXFSZ, _signal.SIG_IGN)
    _signal.signal(_signal.SIGINT, _interrupt)


_code_runs = False  # while a run's code runs: see _interrupt


def _interrupt(signum: int, frame: Any) -> None:
    """SIGINT: KeyboardInterrupt in the code that runs, as under ``python3``. Between runs it
    interrupts no code and is dropped, as by a notebook's idle kernel: raised in our loop
    (where the handler runs whenever the signal came), it ended the interpreter."""
    if _code_runs:
        _signal.default_int_handler(signum, frame)


def _interruptible(execute: "Callable[[str], Any]", code: str) -> Any:
    global _code_runs
    _code_runs = True
    try:
        return execute(code)
    finally:
        _code_runs = False


def _close_quietly(*fds: int) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


def main(ctl_in: int, ctl_out: int) -> None:
    """Serve run requests on two pipe fds until the supervisor closes them."""
    _python_signals()
    # Before any code runs (so it cannot be forged): who we are, for the supervisor, which
    # ends every process a run started, but not us, when the run ends.
    os.write(ctl_out, encode({"ev": "hello", "pid": os.getpid()}))
    # The supervisor learns of our death by the end of the reply pipe: a process the code
    # forks (multiprocessing's workers) must not hold it open, or a run whose interpreter was
    # killed (for memory) waits for its timeout behind that child.
    os.register_at_fork(after_in_child=lambda: _close_quietly(ctl_in, ctl_out))
    preload()
    _forget_supervisor_modules()
    streams = _Streams()
    streams.open(1)
    streams.open(2)
    sys.argv = [""]
    interp = Interpreter()
    reader = FrameReader(max_body=1 << 30)
    # A fork's first run copies the pages it writes (shared with the zygote until then): one
    # request of our own now, read, run and answered as any (but not written to the pipe),
    # off the first call's wait. A pool's reset answers at our hello, so this overlaps it.
    reader.feed(encode({"id": 0}, b"pass"))
    for header, body in reader.frames():
        encode({"id": header.get("id")}, dumps(interp.run(body.decode("utf-8", "replace"))).encode())
    while True:
        try:
            chunk = os.read(ctl_in, 1 << 16)
        except InterruptedError:
            continue
        if not chunk:
            return
        reader.feed(chunk)
        try:
            frames = reader.frames()
        except FrameError:
            return
        for header, body in frames:
            if header.get("reseed"):
                reseed()
            streams.restore()
            env = header.get("env")
            if isinstance(env, dict):  # the sandbox's, given after we started: as at our start
                os.environ.clear()
                os.environ.update(env)
            cap = header.get("cap")
            if not isinstance(cap, int) or not 0 <= cap <= MAX_RESULTS:
                cap = MAX_RESULTS
            reply = interp.run(body.decode("utf-8", "replace"), cap)
            # In the body, not the header: a header is capped at 1 MiB, results are not.
            payload = dumps(reply).encode()
            # The caps above keep its bytes under it; its text can be four times them (one
            # character past U+FFFF in it), which the host counts too: never send more.
            if over_cap(payload, MAX_CODE_REPLY):
                note = f"the report was {len(payload)} bytes, its text more, over the cap"
                payload = dumps({"results": [], "error": {"name": "ReportTooLarge", "value": note}}).encode()
            data = encode({"id": header.get("id")}, payload)
            while data:
                data = data[os.write(ctl_out, data) :]
            interp.reserve.renew()
