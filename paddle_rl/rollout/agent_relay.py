"""The first process of an agent program's sandbox (agents.py): it starts the program and is its one way out to the
trainer. It runs INSIDE the sandbox and imports nothing of this project (it is bound in as a file).

Its argument is a descriptor holding its spec (marshal: "argv", "env", "socket": the episode's Unix socket of the
recording proxy, bound into the sandbox; "drop_to": the uid to switch to first, as root; "nproc": RLIMIT_NPROC to
set; "connections": the most relayed at once). It reads and closes it, switches to the sandbox user, listens on
127.0.0.1 (the sandbox's own loopback: the sandbox has no other network), starts the program with
OPENAI_BASE_URL=http://127.0.0.1:PORT/v1 and its stdin / stdout / stderr, and relays each connection to that port
byte for byte to the proxy's socket, in this one thread (a flood of connections makes no thread: past
`connections` at once, a new one is closed as it comes). When the program ends, this process ends with its status
(128 + N for a signal N), and with it the sandbox.
"""
import marshal   # builtin, as the rest: nothing to read from disk but select's and resource's small libraries
import os
import resource
import select
import sys

import _socket   # the C module itself: socket.py (enum, selectors) and subprocess would double a sandbox's start

BUFFER = 1 << 18   # bytes held for one direction of a connection before its reader waits
IN, OUT = select.EPOLLIN, select.EPOLLOUT


def _read_spec(fd: int) -> dict:
    chunks = []
    while True:
        chunk = os.read(fd, 1 << 16)
        if not chunk:
            break
        chunks.append(chunk)
    os.close(fd)
    return marshal.loads(b"".join(chunks))


class Relay:
    """Connections to the listener, each joined to a new connection to the proxy's Unix socket."""

    def __init__(self, poll, socket_path: str, limit: int):
        self.poll, self.socket_path, self.limit = poll, socket_path, limit
        # shut: the ends this relay writes no more to (their peer ended, or their reader is gone); what still comes
        # for one is read and dropped, so the other direction delivers what it holds (a proxy answers a refusal
        # before reading the request's body and closes: the answer reaches the program whole, not reset)
        self.socks, self.peer, self.out, self.eof, self.shut, self.masks = {}, {}, {}, set(), set(), {}

    def accept(self, listener) -> None:
        try:
            fd, _ = listener._accept()
        except OSError:
            return
        client = _socket.socket(fileno=fd)
        if len(self.peer) // 2 >= self.limit:
            client.close()
            return
        upstream = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
        try:
            upstream.setblocking(False)
            upstream.connect(self.socket_path)
        except OSError:   # the proxy refuses (its backlog is full) or the episode has ended
            upstream.close()
            client.close()
            return
        client.setblocking(False)
        for a, b in ((client, upstream), (upstream, client)):
            self.socks[a.fileno()] = a
            self.peer[a], self.out[a] = b, bytearray()
        self._update(client)
        self._update(upstream)

    def _mask(self, s) -> int:
        mask = 0
        if s not in self.eof and len(self.out[self.peer[s]]) < BUFFER:
            mask |= IN
        if self.out[s]:
            mask |= OUT
        return mask

    def _update(self, s) -> None:
        mask, known = self._mask(s), self.masks.get(s)
        if mask == known:
            return
        if known is None:
            self.poll.register(s.fileno(), mask)
        else:
            self.poll.modify(s.fileno(), mask)
        self.masks[s] = mask

    def _close(self, s) -> None:
        for end in (s, self.peer.get(s)):
            if end is None or end not in self.peer:
                continue
            if end in self.masks:
                self.poll.unregister(end.fileno())
                del self.masks[end]
            del self.socks[end.fileno()]
            self.peer.pop(end)
            self.out.pop(end)
            self.eof.discard(end)
            self.shut.discard(end)
            end.close()

    def event(self, fd: int, mask: int) -> None:
        s = self.socks.get(fd)
        peer = self.peer.get(s) if s is not None else None
        if peer is None:
            return
        try:
            if mask & OUT and self.out[s]:
                try:
                    sent = s.send(self.out[s])
                    del self.out[s][:sent]
                except (BrokenPipeError, ConnectionResetError):   # its reader is gone
                    self.out[s].clear()
                    self.shut.add(s)
            if mask & (IN | select.EPOLLHUP | select.EPOLLERR):
                try:
                    data = s.recv(1 << 16)
                except ConnectionResetError:   # closed with our bytes unread: an end, after what it sent
                    data = b""
                if data:
                    if peer not in self.shut:
                        self.out[peer] += data
                else:
                    self.eof.add(s)
            if s in self.eof and not self.out[peer] and peer not in self.shut:
                peer.shutdown(_socket.SHUT_WR)
                self.shut.add(peer)
            if peer in self.eof and not self.out[s] and s not in self.shut:
                s.shutdown(_socket.SHUT_WR)
                self.shut.add(s)
        except (BlockingIOError, InterruptedError):
            pass
        except OSError:
            self._close(s)
            return
        if s in self.eof and peer in self.eof and not self.out[s] and not self.out[peer]:
            self._close(s)
            return
        self._update(s)
        self._update(peer)


def main() -> int:
    spec = _read_spec(int(sys.argv[1]))
    if spec.get("drop_to") is not None:   # as root: bwrap kept only what switching needs
        os.setgroups([])
        os.setgid(spec["drop_to"])
        os.setuid(spec["drop_to"])
    if spec.get("nproc"):
        resource.setrlimit(resource.RLIMIT_NPROC, (spec["nproc"], spec["nproc"]))
    listener = _socket.socket(_socket.AF_INET, _socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)
    listener.setblocking(False)
    env = dict(spec["env"], OPENAI_BASE_URL=f"http://127.0.0.1:{listener.getsockname()[1]}/v1")
    argv = spec["argv"]
    try:   # stdin, stdout and stderr are the program's; the listener and the poll are not inherited
        pid = os.posix_spawn(argv[0], argv, env)
    except OSError as e:
        os.write(2, f"could not start {argv[0]}: {e}\n".encode())
        return 127
    poll = select.epoll()
    ended = os.pidfd_open(pid)
    poll.register(ended, IN)
    poll.register(listener.fileno(), IN)
    relay = Relay(poll, spec["socket"], int(spec.get("connections", 16)))
    while True:
        for fd, mask in poll.poll():
            if fd == ended:
                code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
                return code if code >= 0 else 128 - code
            if fd == listener.fileno():
                relay.accept(listener)
            else:
                relay.event(fd, mask)


if __name__ == "__main__":
    sys.exit(main())
