"""The sandbox's end of its egress proxy: a relay in the supervisor's event loop.

The sandbox has no network but its own loopback. The relay listens there (127.0.0.1:3128,
where HTTP_PROXY points) and carries each connection, byte for byte, to the proxy on the
host: a Unix socket the tier binds into the sandbox (``Relay``), or, in the microVM, streams
over a virtio-serial port of its own (``MuxRelay``). It decides nothing (the proxy does),
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
import io
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


def _max_pairs(wanted):
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


class _Listening:
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


class Relay(_Listening):
    """Listens on the sandbox's loopback; each connection goes to the host's socket."""

    def __init__(self, sel, config):
        super().__init__(sel, config)
        self.target = str(config["socket"])
        self.ends = {}
        self.warm = max(0, int(config.get("warm", 0)))
        self.idle = {}  # fd -> (socket, when connected): warm connections not yet given out
        self.max_pairs = _max_pairs(int(config.get("pairs", MAX_PAIRS)))
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


# -- the microVM: every connection over one virtio-serial port ------------------------------
#
# A frame is a 9-byte header (type, stream id: 4 bytes, length: 4 bytes, big-endian) and
# its payload. The guest opens streams; each side may have WINDOW bytes of a stream in
# flight and returns credit (ACK) as it delivers them, so neither side ever holds more
# than WINDOW per stream. HELLO (a fresh relay, after a reset) drops every stream.
OPEN, DATA, EOF, CLOSE, ACK, HELLO = 1, 2, 3, 4, 5, 6
WINDOW = 256 * 1024
HEADER = 9
PORT_HIGH = 1024 * 1024  # stop reading the code's sockets while this much waits for the port
PORT_READ = 256 * 1024  # the port is read into one buffer of this size
MUX_STREAMS = 64


def frame(kind, sid, payload=b""):
    return bytes((kind,)) + sid.to_bytes(4, "big") + len(payload).to_bytes(4, "big") + payload


class _Stream:
    __slots__ = ("credit", "delivered", "eof_host", "eof_in", "events", "out", "sid", "sock")

    def __init__(self, sid, sock):
        self.sid = sid
        self.sock = sock
        self.out = bytearray()  # from the host, waiting for the code's socket
        self.credit = WINDOW  # what we may still send the host
        self.delivered = 0  # written to the code's socket since our last ACK
        self.eof_in = False
        self.eof_host = False
        self.events = 0


class MuxRelay(_Listening):
    """Listens on the sandbox's loopback; every connection is a stream over one port."""

    def __init__(self, sel, config):
        super().__init__(sel, config)
        self.port = int(config["fd"])
        os.set_blocking(self.port, False)
        self.port_out = bytearray()
        self.port_in = bytearray()
        self.port_file = io.FileIO(self.port, "r", closefd=False)
        self.port_buf = memoryview(bytearray(PORT_READ))
        self.port_events = IN
        self.streams = {}  # sid -> _Stream
        self.by_fd = {}
        self.next_sid = 1
        self.max_streams = min(MUX_STREAMS, 2 * _max_pairs(MUX_STREAMS))  # a stream is one
        sel.register(self.port, IN, ("egress", self))
        self._send(frame(HELLO, 0))

    def renew(self):
        """For the next user (a reset in place): every stream of the last user's code
        dropped, here and (HELLO) on the host, and its connections not yet accepted closed.
        What the host still sends for them is dropped as it comes (no stream has its id);
        the port's byte stream itself goes on where it was."""
        for stream in list(self.streams.values()):
            self._drop(stream, tell=False)
        self._relisten()
        self._send(frame(HELLO, 0))

    # -- events ----------------------------------------------------------------------------

    def on_event(self, fd, events):
        if fd == self.listener.fileno():
            self._accept()
        elif fd == self.port:
            if events & OUT:
                self._flush_port()
            if events & (IN | select.EPOLLHUP | select.EPOLLERR):
                self._read_port()
        else:
            stream = self.by_fd.get(fd)
            if stream is not None:
                try:
                    if events & OUT:
                        self._flush(stream)
                    if events & (IN | select.EPOLLHUP | select.EPOLLERR):
                        self._read(stream)
                except OSError:
                    self._drop(stream, tell=True)
        self._settle()

    def _accept(self):
        while True:
            if self._full():  # the rest wait in the backlog
                self._pause()
                return
            try:
                client, _ = self.listener.accept()
            except OSError as exc:  # nothing waiting; or out of descriptors
                if exc.errno in OUT_OF_FDS:
                    if self.streams:  # it waits for a stream to end
                        self._pause()
                    else:  # none will: that one refused, not left to spin the loop
                        self.spare.refuse(self.listener)
                return
            client.setblocking(False)
            client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sid = self.next_sid
            self.next_sid = self.next_sid % 0xFFFFFFF0 + 1
            stream = _Stream(sid, client)
            self.streams[sid] = stream
            self.by_fd[client.fileno()] = stream
            stream.events = IN
            self.sel.register(client.fileno(), IN, ("egress", self))
            self._send(frame(OPEN, sid))

    def _full(self):
        return len(self.streams) >= self.max_streams

    def _read(self, stream):
        if stream.eof_in or stream.credit <= 0 or len(self.port_out) >= PORT_HIGH:
            return
        try:
            data = stream.sock.recv(min(CHUNK, stream.credit))
        except (BlockingIOError, InterruptedError):
            return
        if data:
            stream.credit -= len(data)
            self._send(frame(DATA, stream.sid, data))
        else:
            stream.eof_in = True
            self._send(frame(EOF, stream.sid))
        self._maybe_done(stream)

    def _flush(self, stream):
        while stream.out:
            try:
                sent = stream.sock.send(stream.out[:CHUNK])
            except (BlockingIOError, InterruptedError):
                break
            del stream.out[:sent]
            stream.delivered += sent
        if stream.delivered >= WINDOW // 4 or (stream.delivered and not stream.out):
            self._send(frame(ACK, stream.sid, stream.delivered.to_bytes(4, "big")))
            stream.delivered = 0
        if stream.eof_host and not stream.out:
            try:
                stream.sock.shutdown(socket.SHUT_WR)
            except OSError:
                pass
            self._maybe_done(stream)

    def _read_port(self):
        # Into one buffer, kept: a virtio-serial read returns at most one of the guest's
        # receive buffers (a page), and os.read(n) allocates n bytes for each. Under TCG that
        # allocation, not the port, was the ceiling: 3 MB/s, against 53 MB/s this way
        # (bench/microvm_port.py).
        while True:
            try:
                got = self.port_file.readinto(self.port_buf)
            except (BlockingIOError, InterruptedError):
                break
            except OSError:
                return
            if not got:  # None: nothing more for now; 0: the port closed
                break
            self.port_in += self.port_buf[:got]
        buf = self.port_in
        pos = 0
        with memoryview(buf) as view:  # payloads go to their streams with one copy
            while len(buf) - pos >= HEADER:
                kind = buf[pos]
                sid = int.from_bytes(view[pos + 1 : pos + 5], "big")
                size = int.from_bytes(view[pos + 5 : pos + 9], "big")
                if len(buf) - pos - HEADER < size:
                    break
                start, pos = pos + HEADER, pos + HEADER + size
                self._on_frame(kind, sid, view[start:pos])  # not kept: the buffer shrinks below
        del buf[:pos]

    def _on_frame(self, kind, sid, payload):
        stream = self.streams.get(sid)
        if stream is None:
            return  # a stream we dropped: what was in flight for it goes nowhere
        if kind == DATA:
            stream.out += payload
            try:
                self._flush(stream)
            except OSError:
                self._drop(stream, tell=True)
        elif kind == EOF:
            stream.eof_host = True
            try:
                self._flush(stream)
            except OSError:
                self._drop(stream, tell=True)
        elif kind == ACK and len(payload) == 4:
            stream.credit += int.from_bytes(payload, "big")
        elif kind == CLOSE:
            self._drop(stream, tell=False)

    # -- the port ---------------------------------------------------------------------------

    def _send(self, data):
        self.port_out += data
        self._flush_port()

    def _flush_port(self):
        while self.port_out:
            try:
                with memoryview(self.port_out) as view:  # no copy of what is written
                    sent = os.write(self.port, view[:CHUNK])
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                self.port_out.clear()
                return
            del self.port_out[:sent]

    def _maybe_done(self, stream):
        if stream.eof_in and stream.eof_host and not stream.out and stream.sid in self.streams:
            self._drop(stream, tell=True)

    def _drop(self, stream, tell):
        if self.streams.pop(stream.sid, None) is None:
            return
        fd = stream.sock.fileno()
        self.by_fd.pop(fd, None)
        try:
            self.sel.unregister(fd)
        except KeyError:
            pass
        stream.sock.close()
        if tell:
            self._send(frame(CLOSE, stream.sid))
        self._resume()

    def _settle(self):
        """What each socket waits for next (reading stops without credit or room)."""
        room = len(self.port_out) < PORT_HIGH
        for stream in list(self.streams.values()):
            want = 0
            if not stream.eof_in and stream.credit > 0 and room:
                want |= IN
            if stream.out:
                want |= OUT
            if want != stream.events:
                stream.events = want
                self.sel.modify(stream.sock.fileno(), want)
        want = IN | (OUT if self.port_out else 0)
        if want != self.port_events:
            self.port_events = want
            self.sel.modify(self.port, want)

    def close(self):
        for stream in list(self.streams.values()):
            self._drop(stream, tell=False)
        self._unlisten()
        self.spare.close()
        try:
            self.sel.unregister(self.port)
        except KeyError:
            pass


def make(sel, config):
    """The relay the host asked for: to a socket bound in, or over the microVM's port.
    ``files`` (the sandbox's trust bundle, where no folder is bound in) go to ``dir``."""
    write_files(config)
    return MuxRelay(sel, config) if "fd" in config else Relay(sel, config)


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
