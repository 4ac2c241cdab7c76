#!/usr/bin/env python3
"""Slow clients, pipelining and HTTP/1.0 against a `q3vl serve` on 127.0.0.1, for tests/cli/test_serve_net.sh.

Usage: http_slow.py PORT slow N SECONDS    N clients trickle a request head a byte at a time, one byte a second, for
                                            SECONDS; meanwhile GET /health every 0.5 s. Prints one JSON line: the
                                            slowest /health in seconds, how many probes failed, and how the slow
                                            connections ended (408 answers, closed, still open).
       http_slow.py PORT pipeline N        N GET /health in one write on one connection: prints the answers' count.
       http_slow.py PORT http10            a streamed completion as HTTP/1.0: prints its head's framing headers, the
                                            number of SSE events, whether [DONE] came and the connection closed.
"""
import json
import socket
import sys
import threading
import time

port, cmd = int(sys.argv[1]), sys.argv[2]


def connect(timeout=10):
    return socket.create_connection(("127.0.0.1", port), timeout=timeout)


def health():
    t0 = time.time()
    try:
        s = connect(5)
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        data = b""
        while chunk := s.recv(4096):
            data += chunk
        s.close()
        return time.time() - t0, data.startswith(b"HTTP/1.1 200")
    except OSError:
        return time.time() - t0, False


if cmd == "slow":
    n, seconds = int(sys.argv[3]), float(sys.argv[4])
    head = b"GET /v1/models HTTP/1.1\r\nHost: x\r\n" + b"X-Slow: " + b"a" * 1000
    socks, ends = [], {"408": 0, "closed": 0, "open": 0}
    for _ in range(n):
        s = connect()
        s.setblocking(False)
        socks.append(s)
    stop = time.time() + seconds

    def trickle():
        i = 0
        while time.time() < stop:
            for s in socks:
                try:
                    s.send(head[i:i + 1])
                except OSError:
                    pass
            i += 1
            time.sleep(1)

    t = threading.Thread(target=trickle)
    t.start()
    worst, failed, probes = 0.0, 0, 0
    time.sleep(1.5)  # every slow client has begun its head
    while time.time() < stop - 0.5:
        dt, ok = health()
        worst, failed, probes = max(worst, dt), failed + (not ok), probes + 1
        time.sleep(0.5)
    t.join()
    for s in socks:
        try:
            data = s.recv(4096)
            ends["408" if data.startswith(b"HTTP/1.1 408") else "closed" if not data else "open"] += 1
        except BlockingIOError:
            ends["open"] += 1
        except OSError:
            ends["closed"] += 1
        s.close()
    print(json.dumps({"worst": round(worst, 3), "failed": failed, "probes": probes, "ends": ends}))
elif cmd == "pipeline":
    n = int(sys.argv[3])
    s = connect()
    s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n" * (n - 1) + b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    data = b""
    try:
        while chunk := s.recv(4096):
            data += chunk
    except socket.timeout:
        pass
    print(data.count(b"HTTP/1.1 200"))
elif cmd == "http10":
    body = json.dumps({"prompt": "hi", "max_tokens": 3, "stream": True, "temperature": 0}).encode()
    s = connect()
    s.sendall(b"POST /v1/completions HTTP/1.0\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
    data, closed = b"", False
    try:
        while True:
            chunk = s.recv(4096)
            if not chunk:
                closed = True
                break
            data += chunk
    except socket.timeout:
        pass
    head, _, rest = data.partition(b"\r\n\r\n")
    framing = sorted(l.decode() for l in head.split(b"\r\n")[1:]
                     if l.lower().split(b":")[0] in (b"transfer-encoding", b"content-length", b"connection"))
    print(json.dumps({"status": head.split(b" ")[1].decode() if head else None, "framing": framing,
                      "events": rest.count(b"data: "), "done": rest.rstrip().endswith(b"data: [DONE]"), "closed": closed}))
