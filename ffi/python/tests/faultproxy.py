"""A TCP proxy in front of `objectcache serve` that turns faults on and off, for the tests of
failed loads inside vLLM. Every connection passes through unchanged in mode ``pass``. The
other modes act on the store as a client sees it:

* ``stall``: bytes from the server on gather connections (those whose first 8 bytes are the
  gather preface ``OCGATHER``) are held until the mode changes; lookups (HTTP) still answer.
  A store that stops sending in the middle of a load.
* ``kill``: once 256 KiB of a gather answer went through, every open connection is closed and
  new ones are refused until the mode changes: a gateway killed in the middle of a load.
* ``slow``: bytes from the server on gather connections pass at ``rate`` bytes per second
  (default 5 MB/s): a store slowed so that a load is still in flight when its request ends.
* ``slow_saves``: bytes from clients on connections other than gather (S3 requests: saves'
  PUTs) pass at ``rate`` bytes per second: a store slow to take saves, so that they queue.
* ``down``: lookups (HTTP) pass until a client sends on a gather connection (a load starts);
  then every open connection is closed and new ones are refused until the mode changes: a
  store that goes down between a request's lookup and its load.

``gather_answers`` counts gather connections on which the server answered, ``refused`` the
connections refused.
"""

import socket
import threading
import time

PREFACE = b"OCGATHER"
KILL_AFTER = 256 * 1024


class FaultProxy:
    def __init__(self, upstream):
        host, port = upstream.rsplit(":", 1)
        self.upstream = (host, int(port))
        self.lsock = socket.create_server(("127.0.0.1", 0))
        self.addr = "127.0.0.1:%d" % self.lsock.getsockname()[1]
        self.cv = threading.Condition()
        self._mode = "pass"
        self.conns = set()
        self.gather_answers = 0
        self.refused = 0
        self.closed = False
        self.rate = 5e6
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def mode(self):
        return self._mode

    def set_mode(self, mode):
        assert mode in ("pass", "stall", "kill", "down", "slow", "slow_saves"), mode
        with self.cv:
            self._mode = mode
            self.cv.notify_all()

    def _die(self):
        """The store is gone: close every connection, refuse new ones (mode ``dead``)."""
        with self.cv:
            self._mode = "dead"
        self._close_all()

    def _close_all(self):
        with self.cv:
            socks, self.conns = list(self.conns), set()
        for s in socks:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()

    def close(self):
        self.closed = True
        self.set_mode("pass")
        self.lsock.close()
        self._close_all()

    def _accept(self):
        while not self.closed:
            try:
                c, _ = self.lsock.accept()
            except OSError:
                return
            if self._mode == "dead":
                self.refused += 1
                c.close()
                continue
            try:
                u = socket.create_connection(self.upstream)
            except OSError:
                c.close()
                continue
            with self.cv:
                self.conns |= {c, u}
            conn = {"gather": None, "sent": 0}
            threading.Thread(target=self._pump, args=(c, u, conn, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(u, c, conn, False), daemon=True).start()

    def _pump(self, src, dst, conn, upward):
        head = b""
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                if upward and conn["gather"] is None:
                    head += data
                    if len(head) >= len(PREFACE):
                        conn["gather"] = head.startswith(PREFACE)
                if upward and not conn["gather"] and self._mode == "slow_saves":
                    time.sleep(len(data) / self.rate)
                if upward and conn["gather"] and self._mode == "down":
                    self._die()
                    return
                if not upward and conn["gather"]:
                    if conn["sent"] == 0:
                        self.gather_answers += 1
                    with self.cv:
                        while self._mode == "stall" and not self.closed:
                            self.cv.wait()
                    conn["sent"] += len(data)
                    if self._mode == "slow":
                        time.sleep(len(data) / self.rate)
                    if self._mode == "kill" and conn["sent"] > KILL_AFTER:
                        self._die()
                        return
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
