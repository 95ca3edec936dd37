"""The sandbox's end of its egress proxy: a relay in the supervisor's event loop.

The sandbox has no network but its own loopback. The relay listens there (127.0.0.1:3128,
where HTTP_PROXY points) and carries each connection, byte for byte, to the proxy on the
host: a Unix socket the tier binds into the sandbox (``Relay``), or, in the microVM, streams
over a virtio-serial port of its own (``egressmux.MuxRelay``). It decides nothing (the proxy does),
so code that connects to the socket itself, or kills nothing (the supervisor is init and
ignores signals), gains nothing.

It runs in the supervisor (not a process of its own) so that code cannot kill it, and at
the supervisor's priority, above the code's. Each direction holds at most ``BUF`` bytes:
a slow reader slows its writer, the supervisor's memory stays bounded. It carries as many
connections at once as the host's proxy serves (``pairs``; the host gives the supervisor
the descriptors for them besides the code's limit): past that, the relay stops accepting
until a connection ends, and the code's further connects wait in the listener's backlog
(before, each was accepted and closed: a package manager's burst of 50 saw resets).

``Relay`` keeps ``warm`` connections to the proxy open ahead of need: a client's connection
is paired with one the proxy has already accepted (and started serving), so a request does
not wait for the connect and the proxy's accept. A warm connection is used only while
younger than ``WARM_MAX_AGE_S`` (the proxy closes one that sends nothing for 30 s) and is
refilled after each use (once the client's first bytes are on their way, off the request's
path), not after the proxy closed it: an idle sandbox holds nothing open for long.
Stdlib only, any python >= 3.8, like the rest of this folder.
"""

import errno
import os
import resource
import select
import socket
import time

BUF = 256 * 1024
CHUNK = 64 * 1024
IN = select.EPOLLIN
OUT = select.EPOLLOUT
MAX_PAIRS = 128  # connections at once unless the host says (``pairs``: its proxy's limit)
OWN_FILES = 32  # descriptors kept for the supervisor's own work, beyond the relay's
WARM_MAX_AGE_S = 20.0  # well inside the proxy's 30 s for a connection's first request
OUT_OF_FDS = (errno.EMFILE, errno.ENFILE)


def max_pairs(wanted):
    """Pairs at once (a pair is two descriptors): ``wanted``, or fewer where the
    supervisor's descriptors are fewer than the host sized them for, ``OWN_FILES`` kept."""
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if soft == resource.RLIM_INFINITY:
        return wanted
    return max(1, min(wanted, (soft - OWN_FILES) // 2))


class _Spare:
    """A descriptor kept for one thing: out of descriptors, the listener's next connection is
    accepted with it and closed. Left in the backlog of a level-triggered poller, that
    connection would wake the loop for ever (and the code would wait on it unanswered).
    A socket, not a file: nothing of the filesystem the sandbox's rules may close."""

    def __init__(self):
        self.sock = self._open()

    @staticmethod
    def _open():
        try:
            return socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        except OSError:
            return None

    def refuse(self, listener):
        self.close()
        try:
            client, _ = listener.accept()
            client.close()
        except OSError:
            pass
        self.sock = self._open()

    def close(self):
        if self.sock is not None:
            self.sock.close()
            self.sock = None


class _End:
    __slots__ = ("client", "eof_in", "events", "out", "peer", "shut_pending", "sock")

    def __init__(self, sock, client=False):
        self.sock = sock
        self.client = client  # the code's end (the other is the proxy's)
        self.out = bytearray()  # waiting to be written to this end
        self.eof_in = False  # this end will send nothing more
        self.shut_pending = False  # shut our writing side once ``out`` is written
        self.events = 0
        self.peer = None


def _quiet(sock):
    """Whether a warm connection is still open with nothing said on it (the proxy may have
    closed it, or refused it with a 503, since the poller last looked)."""
    try:
        sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
    except (BlockingIOError, InterruptedError):
        return True  # nothing to read: open and quiet
    except OSError:
        return False
    return False  # closed (nothing but EOF) or answered


class Listening:
    """What both relays share: the socket on the sandbox's loopback (where HTTP_PROXY
    points), out of the poller while the relay is full (``_full``: what code connects
    meanwhile waits in the backlog) and back in once a connection ends."""

    def __init__(self, sel, config):
        self.sel = sel
        self.config = config
        self.paused = False  # full: the listener out of the poller until a connection ends
        self.spare = _Spare()
        self.listener = self._listen()

    def _full(self):
        raise NotImplementedError

    def _listen(self):
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", int(self.config.get("listen", 3128))))
        listener.listen(128)
        listener.setblocking(False)
        self.sel.register(listener.fileno(), IN, ("egress", self))
        return listener

    def _pause(self):
        """Stop accepting: what code connects meanwhile waits in the listener's backlog."""
        if not self.paused:
            self._unregister_listener()
            self.paused = True

    def _resume(self):
        """Accept again once not full (level-triggered: what waited wakes the loop at once)."""
        if self.paused and not self._full():
            if self.listener.fileno() >= 0:
                self.sel.register(self.listener.fileno(), IN, ("egress", self))
            self.paused = False

    def _relisten(self):
        """Listen afresh (a reset in place): the connections code made that were not accepted
        yet (the backlog) close with the old socket, none of them carried to the next user."""
        self._unlisten()
        self.listener = self._listen()
        self.paused = False

    def _unlisten(self):
        self._unregister_listener()
        self.listener.close()

    def _unregister_listener(self):
        try:
            self.sel.unregister(self.listener.fileno())
        except KeyError:
            pass


class Relay(Listening):
    """Listens on the sandbox's loopback; each connection goes to the host's socket."""

    def __init__(self, sel, config):
        super().__init__(sel, config)
        self.target = str(config["socket"])
        self.ends = {}
        self.warm = max(0, int(config.get("warm", 0)))
        self.idle = {}  # fd -> (socket, when connected): warm connections not yet given out
        self.max_pairs = max_pairs(int(config.get("pairs", MAX_PAIRS)))
        self._refill()

    def on_event(self, fd, events):
        if fd == self.listener.fileno():
            self._accept()
            return
        if fd in self.idle:  # the proxy closed (or answered) a connection nobody used: gone
            self._forget(fd)
            return
        end = self.ends.get(fd)
        if end is None:
            return
        try:
            if events & (IN | select.EPOLLHUP | select.EPOLLERR):
                self._read(end)
            if end.sock.fileno() in self.ends and events & OUT:
                self._flush(end)
        except OSError:
            self._drop(end)
            return
        self._settle(end)

    def _accept(self):
        # One per wake-up: the listener is level-triggered, so another connection waiting
        # wakes the loop again, and the usual one spares the accept that finds nothing.
        if self._full():
            self._pause()
            return
        try:
            client, _ = self.listener.accept()
        except OSError as exc:  # nothing waiting; or out of descriptors
            if exc.errno in OUT_OF_FDS:
                if self.ends:  # it waits for a pair to end
                    self._pause()
                else:  # none will: that one refused, not left to spin the loop
                    self.spare.refuse(self.listener)
            return
        upstream = self._take_warm() or self._connect()
        if upstream is None:
            client.close()
            return
        # The code's end stays a blocking socket that every call asks not to block
        # (MSG_DONTWAIT): one system call fewer than making it non-blocking.
        # No Nagle: a reply relayed in pieces would wait for the client's delayed ACK (40 ms).
        # gVisor's netstack does not pass it on from the listener, so it is set on each.
        client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        a, b = _End(client, client=True), _End(upstream)
        a.peer, b.peer = b, a
        for end in (a, b):
            self.ends[end.sock.fileno()] = end
            end.events = IN
            self.sel.register(end.sock.fileno(), IN, ("egress", self))

    def _full(self):
        return len(self.ends) >= 2 * self.max_pairs

    def _connect(self):
        try:  # out of descriptors too: that connection is refused, the supervisor goes on
            upstream = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_NONBLOCK)
        except OSError:
            return None
        try:
            upstream.connect(self.target)
        except OSError:  # the proxy is gone, or its backlog is full
            upstream.close()
            return None
        return upstream

    def _take_warm(self):
        """The oldest warm connection still young enough; stale ones are closed on the way."""
        now = time.monotonic()
        for fd, (sock, since) in list(self.idle.items()):
            if now - since < WARM_MAX_AGE_S and _quiet(sock):
                del self.idle[fd]
                self.sel.unregister(fd)  # registered again as an end of its pair
                return sock
            self._forget(fd)
        return None

    def _refill(self):
        while len(self.idle) < self.warm and len(self.ends) + len(self.idle) < 2 * self.max_pairs:
            sock = self._connect()
            if sock is None:
                return
            self.idle[sock.fileno()] = (sock, time.monotonic())
            self.sel.register(sock.fileno(), IN, ("egress", self))

    def _forget(self, fd):
        sock, _ = self.idle.pop(fd)
        try:
            self.sel.unregister(fd)
        except KeyError:
            pass
        sock.close()

    def _read(self, end):
        peer = end.peer
        if end.eof_in or len(peer.out) >= BUF:
            return
        try:
            data = end.sock.recv(CHUNK, socket.MSG_DONTWAIT)
        except (BlockingIOError, InterruptedError):
            return
        if data:
            peer.out += data
            self._flush(peer)
            if end.client:
                # Refilled once the request is on its way, while the proxy works on it: a
                # connect here (about 0.1 ms on gVisor, whose host sockets go through its
                # gofer) would be on the request's path.
                self._refill()
            return
        end.eof_in = True
        if peer.eof_in and not peer.out and not end.out:
            return  # both ways are done: the pair is closed next, and the close says the rest
        peer.shut_pending = True
        self._flush(peer)

    def _flush(self, end):
        while end.out:
            try:
                chunk = end.out[:CHUNK] if len(end.out) > CHUNK else end.out
                sent = end.sock.send(chunk, socket.MSG_DONTWAIT)
            except (BlockingIOError, InterruptedError):
                return
            del end.out[:sent]
        if end.shut_pending:
            end.shut_pending = False
            try:
                end.sock.shutdown(socket.SHUT_WR)
            except OSError as exc:
                if exc.errno != errno.ENOTCONN:
                    raise

    def _settle(self, end):
        """Watch what each end can do next, and close the pair once both ways are done."""
        for e in (end, end.peer):
            if e.sock.fileno() not in self.ends:
                return
        if end.eof_in and end.peer.eof_in and not end.out and not end.peer.out:
            self._drop(end)
            return
        for e in (end, end.peer):
            want = 0
            if not e.eof_in and len(e.peer.out) < BUF:
                want |= IN
            if e.out:
                want |= OUT
            if want == e.events:
                continue
            fd = e.sock.fileno()
            if not want:  # out of the poller rather than in it for nothing: no call at the close
                self.sel.unregister(fd)
            elif not e.events:
                self.sel.register(fd, want, ("egress", self))
            else:
                self.sel.modify(fd, want)
            e.events = want

    def _drop(self, end):
        for e in (end, end.peer):
            fd = e.sock.fileno()
            if fd in self.ends:
                del self.ends[fd]
                if e.events:
                    self.sel.unregister(fd)
            e.sock.close()
        self._refill()  # a client that sent nothing took one too
        self._resume()

    def renew(self):
        """For the next user (a reset in place): every connection of the last user's code
        closed, those it made and the relay had not accepted yet too. The warm connections
        stay: the proxy accepted them, and nothing was said on them."""
        for end in list(self.ends.values()):
            self._drop(end)
        self._relisten()

    def close(self):
        self.warm = 0  # nothing refilled on the way out
        for end in list(self.ends.values()):
            self._drop(end)
        for fd in list(self.idle):
            self._forget(fd)
        self._unlisten()
        self.spare.close()


def make(sel, config):
    """The relay the host asked for: to a socket bound in, or over the microVM's port.
    ``files`` (the sandbox's trust bundle, where no folder is bound in) go to ``dir``."""
    write_files(config)
    if "fd" in config:
        from egressmux import MuxRelay  # the microVM's alone: no other tier imports it

        return MuxRelay(sel, config)
    return Relay(sel, config)


def write_files(config):
    """The trust bundle, written again by a reset in place (which empties /tmp)."""
    if config.get("files"):
        folder = str(config["dir"])
        os.makedirs(folder, mode=0o755, exist_ok=True)
        for name, text in config["files"].items():
            path = os.path.join(folder, os.path.basename(name))
            try:  # a copy of ours (read-only) where the reset did not empty its folder
                os.unlink(path)
            except FileNotFoundError:
                pass
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o444)
            with open(fd, "w") as fh:
                fh.write(text)
