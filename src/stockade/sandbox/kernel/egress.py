"""The sandbox's end of its egress proxy: a relay in the supervisor's event loop.

The sandbox has no network but its own loopback. The relay listens there (127.0.0.1:3128,
where HTTP_PROXY points) and carries each connection, byte for byte, to the proxy on the
host: a Unix socket the tier binds into the sandbox. It decides nothing (the proxy does),
so code that connects to the socket itself, or kills nothing (the supervisor is init and
ignores signals), gains nothing.

It runs in the supervisor (not a process of its own) so that code cannot kill it, and at
the supervisor's priority, above the code's. Each direction holds at most ``BUF`` bytes:
a slow reader slows its writer, the supervisor's memory stays bounded.
Stdlib only, any python >= 3.8, like the rest of this folder.
"""

import errno
import select
import socket

BUF = 256 * 1024
CHUNK = 64 * 1024
IN = select.EPOLLIN
OUT = select.EPOLLOUT
MAX_PAIRS = 256  # connections at once; the host's proxy caps them too


class _End:
    __slots__ = ("eof_in", "events", "out", "peer", "shut_pending", "sock")

    def __init__(self, sock):
        self.sock = sock
        self.out = bytearray()  # waiting to be written to this end
        self.eof_in = False  # this end will send nothing more
        self.shut_pending = False  # shut our writing side once ``out`` is written
        self.events = 0
        self.peer = None


class Relay:
    """Listens on the sandbox's loopback; each connection goes to the host's socket."""

    def __init__(self, sel, config):
        self.sel = sel
        self.target = str(config["socket"])
        self.ends = {}
        self.listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.listener.bind(("127.0.0.1", int(config.get("listen", 3128))))
        self.listener.listen(128)
        self.listener.setblocking(False)
        sel.register(self.listener.fileno(), IN, ("egress", self))

    def on_event(self, fd, events):
        if fd == self.listener.fileno():
            self._accept()
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
        while True:
            try:
                client, _ = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:  # out of descriptors: the connection waits in the backlog
                return
            if len(self.ends) >= 2 * MAX_PAIRS:
                client.close()
                continue
            upstream = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                upstream.setblocking(False)
                upstream.connect(self.target)
            except OSError:
                upstream.close()
                client.close()
                continue
            client.setblocking(False)
            # No Nagle: a reply relayed in pieces would wait for the client's delayed ACK (40 ms).
            client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            a, b = _End(client), _End(upstream)
            a.peer, b.peer = b, a
            for end in (a, b):
                self.ends[end.sock.fileno()] = end
                end.events = IN
                self.sel.register(end.sock.fileno(), IN, ("egress", self))

    def _read(self, end):
        peer = end.peer
        if end.eof_in or len(peer.out) >= BUF:
            return
        try:
            data = end.sock.recv(CHUNK)
        except (BlockingIOError, InterruptedError):
            return
        if data:
            peer.out += data
            self._flush(peer)
            return
        end.eof_in = True
        peer.shut_pending = True
        self._flush(peer)

    def _flush(self, end):
        while end.out:
            try:
                sent = end.sock.send(end.out[:CHUNK] if len(end.out) > CHUNK else end.out)
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
            if want != e.events:
                e.events = want
                self.sel.modify(e.sock.fileno(), want)

    def _drop(self, end):
        for e in (end, end.peer):
            fd = e.sock.fileno()
            if fd in self.ends:
                del self.ends[fd]
                try:
                    self.sel.unregister(fd)
                except KeyError:
                    pass
            e.sock.close()

    def close(self):
        for end in list(self.ends.values()):
            self._drop(end)
        try:
            self.sel.unregister(self.listener.fileno())
        except KeyError:
            pass
        self.listener.close()
