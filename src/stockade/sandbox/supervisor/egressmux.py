"""The microVM's end of its egress relay: every connection of the code a stream over one
virtio-serial port (``MuxRelay``).

The microVM has no socket of the host's bound in: its relay carries each connection accepted
on the sandbox's loopback as a stream of frames over a port of its own, which the host's end
(``stockade.egress._mux``) splits back into connections to the proxy. Apart from ``egress``
(the listener both relays share, and ``Relay``, the other tiers'), which imports this module
only where the host asked for the port (``egress.make``). Stdlib only, any python >= 3.8.
"""

import io
import os
import select
import socket

from egress import CHUNK, IN, OUT, OUT_OF_FDS, Listening, max_pairs

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


class MuxRelay(Listening):
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
        self.max_streams = min(MUX_STREAMS, 2 * max_pairs(MUX_STREAMS))  # a stream is one
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
