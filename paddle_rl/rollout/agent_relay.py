"""The first process of an agent program's sandbox (agents.py): it starts the program and is its one way out to the
trainer. It runs INSIDE the sandbox and imports nothing of this project (it is bound in as a file).

Its argument is a descriptor holding its spec (JSON: "argv", "env", "socket": the episode's Unix socket of the
recording proxy, bound into the sandbox; "drop_to": the uid to switch to first, as root; "nproc": RLIMIT_NPROC to
set; "connections": the most relayed at once). It reads and closes it, switches to the sandbox user, listens on
127.0.0.1 (the sandbox's own loopback: the sandbox has no other network), starts the program with
OPENAI_BASE_URL=http://127.0.0.1:PORT/v1 and its stdin / stdout / stderr, and relays each connection to that port
byte for byte to the proxy's socket, in this one thread (a flood of connections makes no thread: past
`connections` at once, a new one is closed as it comes). When the program ends, this process ends with its status
(128 + N for a signal N), and with it the sandbox.
"""
import json
import os
import resource
import selectors
import socket
import subprocess
import sys

BUFFER = 1 << 18   # bytes held for one direction of a connection before its reader waits


def _read_spec(fd: int) -> dict:
    chunks = []
    while True:
        chunk = os.read(fd, 1 << 16)
        if not chunk:
            break
        chunks.append(chunk)
    os.close(fd)
    return json.loads(b"".join(chunks))


class Relay:
    """Connections to the listener, each joined to a new connection to the proxy's Unix socket."""

    def __init__(self, selector, socket_path: str, limit: int):
        self.selector, self.socket_path, self.limit = selector, socket_path, limit
        self.peer, self.out, self.eof, self.shut = {}, {}, set(), set()

    def accept(self, listener) -> None:
        try:
            client, _ = listener.accept()
        except OSError:
            return
        if len(self.peer) // 2 >= self.limit:
            client.close()
            return
        upstream = socket.socket(socket.AF_UNIX)
        try:
            upstream.setblocking(False)
            upstream.connect(self.socket_path)
        except OSError:   # the proxy refuses (its backlog is full) or the episode has ended
            upstream.close()
            client.close()
            return
        client.setblocking(False)
        for a, b in ((client, upstream), (upstream, client)):
            self.peer[a], self.out[a] = b, bytearray()
        self._update(client)
        self._update(upstream)

    def _mask(self, s) -> int:
        mask = 0
        if s not in self.eof and len(self.out[self.peer[s]]) < BUFFER:
            mask |= selectors.EVENT_READ
        if self.out[s]:
            mask |= selectors.EVENT_WRITE
        return mask

    def _update(self, s) -> None:
        mask = self._mask(s)
        registered = s in self.selector.get_map()
        if mask and registered:
            self.selector.modify(s, mask, "pipe")
        elif mask:
            self.selector.register(s, mask, "pipe")
        elif registered:
            self.selector.unregister(s)

    def _close(self, s) -> None:
        for end in (s, self.peer.get(s)):
            if end is None or end not in self.peer:
                continue
            if end in self.selector.get_map():
                self.selector.unregister(end)
            self.peer.pop(end)
            self.out.pop(end)
            self.eof.discard(end)
            self.shut.discard(end)
            end.close()

    def event(self, s, mask: int) -> None:
        peer = self.peer.get(s)
        if peer is None:
            return
        try:
            if mask & selectors.EVENT_WRITE and self.out[s]:
                sent = s.send(self.out[s])
                del self.out[s][:sent]
            if mask & selectors.EVENT_READ:
                data = s.recv(1 << 16)
                if data:
                    self.out[peer] += data
                else:
                    self.eof.add(s)
            if s in self.eof and not self.out[peer] and peer not in self.shut:
                peer.shutdown(socket.SHUT_WR)
                self.shut.add(peer)
            if peer in self.eof and not self.out[s] and s not in self.shut:
                s.shutdown(socket.SHUT_WR)
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
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)
    listener.setblocking(False)
    env = dict(spec["env"], OPENAI_BASE_URL=f"http://127.0.0.1:{listener.getsockname()[1]}/v1")
    try:
        program = subprocess.Popen(spec["argv"], env=env, cwd=os.getcwd(), close_fds=True)
    except OSError as e:
        print(f"could not start {spec['argv'][0]}: {e}", file=sys.stderr)
        return 127
    selector = selectors.DefaultSelector()
    ended = os.pidfd_open(program.pid)
    selector.register(ended, selectors.EVENT_READ, "ended")
    selector.register(listener, selectors.EVENT_READ, "listener")
    relay = Relay(selector, spec["socket"], int(spec.get("connections", 16)))
    while True:
        for key, mask in selector.select():
            if key.data == "ended":
                code = os.waitstatus_to_exitcode(os.waitpid(program.pid, 0)[1])
                return code if code >= 0 else 128 - code
            if key.data == "listener":
                relay.accept(listener)
            else:
                relay.event(key.fileobj, mask)


if __name__ == "__main__":
    sys.exit(main())
