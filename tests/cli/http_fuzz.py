#!/usr/bin/env python3
"""Random and malformed HTTP requests against a `q3vl serve` on 127.0.0.1, for tests/cli/test_serve_net.sh.

Usage: http_fuzz.py PORT COUNT SEED

Sends COUNT requests, each on its own connection (raw sockets: nothing a client library would refuse to send is
out of reach): random methods, paths (percent-encoded and raw bytes, invalid UTF-8, long, dot segments), headers
(random, huge or negative Content-Length, chunked bodies that lie), bodies (random bytes, invalid UTF-8, JSON of
the wrong shape, and a valid chat request with one field replaced by a random value). Checks every answer:
never a 5xx, and an error status always carries an OpenAI error object when the server wrote the body. Prints one
JSON line: the counts by status, and `ok`, the number of 200s to completion endpoints (for /metrics' counters).
Exits 1 on the first violation, naming the request (its index and the first bytes sent).
"""
import json
import random
import socket
import sys

port, count, seed = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
rnd = random.Random(seed)

VALID = {"model": "q3vl-tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "temperature": 0}
FIELDS = ["model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "n", "seed",
          "stream", "stream_options", "stop", "prompt"]
ROUTES = ["/v1/chat/completions", "/v1/completions", "/health", "/metrics", "/v1/models", "/", "/v1", "/nothere"]


def rbytes(n):
    return bytes(rnd.randrange(256) for _ in range(n))


def rvalue(depth=0):
    """A random JSON value (or a Python one json cannot tell from it)."""
    k = rnd.randrange(10 if depth < 3 else 7)
    if k == 0: return None
    if k == 1: return rnd.choice([True, False])
    if k == 2: return rnd.choice([0, -1, 1, 2 ** 63, -(2 ** 63) - 1, 10 ** 30, 7])
    if k == 3: return rnd.choice([0.5, -1e308, 1e308, 3.25, -0.0])
    if k == 4: return rbytes(rnd.randrange(8)).decode("latin-1")
    if k == 5: return rnd.choice(["", "user", "assistant", "system", "image_url", "text", "data:,", "../x"])
    if k == 6: return "\ud800" if rnd.random() < 0.5 else "\u0000x"
    if k == 7: return [rvalue(depth + 1) for _ in range(rnd.randrange(4))]
    if k == 8: return {rnd.choice(FIELDS + ["type", "text", "url", "role", "content", "image_url"]): rvalue(depth + 1)
                       for _ in range(rnd.randrange(4))}
    return {"role": rnd.choice(["user", "x"]), "content": [{"type": "image_url", "image_url": {"url": rvalue(3)}}]}


def body():
    k = rnd.randrange(8)
    if k == 0: return rbytes(rnd.randrange(200))
    if k == 1: return b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}'
    if k == 2: return b'{"prompt": "a\xc0\xafb", "max_tokens": 2}'
    if k == 3: return json.dumps(rvalue()).encode()
    if k == 4: return json.dumps(VALID)[: rnd.randrange(60)].encode()
    b = dict(VALID)
    for _ in range(1 + rnd.randrange(3)):
        f = rnd.choice(FIELDS)
        if rnd.random() < 0.2: b.pop(f, None)
        else: b[f] = rvalue()
    try:
        return json.dumps(b).encode()
    except (TypeError, ValueError):
        return b"{}"


def path():
    k = rnd.randrange(7)
    if k == 0: return rnd.choice(ROUTES).encode()
    if k == 1: return b"/" + b"".join(b"%%%02X" % rnd.randrange(256) for _ in range(rnd.randrange(1, 12)))
    if k == 2: return b"/" + bytes(rnd.randrange(33, 256) for _ in range(rnd.randrange(1, 20)))
    if k == 3: return b"/v1/../" * rnd.randrange(1, 5) + b"health"
    if k == 4: return b"/" + b"a" * rnd.choice([100, 9000, 70000])
    if k == 5: return rnd.choice(ROUTES).encode() + b"?" + rbytes(rnd.randrange(30)).replace(b" ", b"+")
    return b"*"


def request():
    method = rnd.choice([b"GET", b"POST", b"POST", b"POST", b"PUT", b"DELETE", b"HEAD", b"OPTIONS", b"BREW", b"",
                         rbytes(5)])
    p = path()
    if rnd.random() < 0.5:
        p = rnd.choice([b"/v1/chat/completions", b"/v1/completions"])
        method = b"POST"
    version = rnd.choice([b"HTTP/1.1", b"HTTP/1.1", b"HTTP/1.0", b"HTTP/2", b"", b"HTTP/1.1 x"])
    b = body()
    headers = [b"Host: 127.0.0.1", b"Content-Type: application/json"]
    k = rnd.randrange(10)
    if k == 0: headers.append(b"Content-Length: " + rnd.choice([b"-1", b"99999999999999999999", b"abc", b"1e3"]))
    elif k == 1: headers.append(b"Content-Length: %d" % max(0, len(b) - rnd.randrange(1, 5)))  # cuts the body
    elif k == 2:
        headers.append(b"Transfer-Encoding: chunked")
        b = b"%x\r\n" % (len(b) + rnd.choice([0, 0, 3])) + b + b"\r\n0\r\n\r\n"
    elif k == 3: headers.append(rbytes(rnd.randrange(1, 40)).replace(b"\r", b"").replace(b"\n", b""))
    elif k == 4: headers.append(b"X-Long: " + b"v" * rnd.choice([100, 9000]))
    elif k == 5: headers += [b"Expect: 100-continue", b"Content-Length: %d" % len(b)]
    elif k == 6: headers.append(b"Range: bytes=" + rbytes(6).replace(b"\r", b"").replace(b"\n", b""))
    else: headers.append(b"Content-Length: %d" % len(b))
    return method, p, method + b" " + p + b" " + version + b"\r\n" + b"\r\n".join(headers) + b"\r\n\r\n" + b


def answer(data):
    """(status, headers, body) of the first response in data, or (None, b"", b"") where the server closed without
    one. The body ends where Content-Length says (a connection may carry more answers) or is a chunked one's first
    chunk."""
    if not data.startswith(b"HTTP/1."):
        return None, b"", b""
    head, _, rest = data.partition(b"\r\n\r\n")
    if head.startswith(b"HTTP/1.1 100 "):  # Expect: 100-continue's interim answer; the answer follows
        return answer(rest)
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            rest = rest[: int(line.split(b":")[1])]
        elif line.lower() == b"transfer-encoding: chunked":
            size, _, rest = rest.partition(b"\r\n")
            rest = rest[: int(size, 16)]
    return int(head.split(b" ")[1]), head, rest


def complete(data, head_request):
    """Whether data holds a whole answer (after any 100 Continue; a HEAD request's has no body)."""
    while data.startswith(b"HTTP/1.1 100 ") and b"\r\n\r\n" in data:
        data = data.partition(b"\r\n\r\n")[2]
    head, sep, rest = data.partition(b"\r\n\r\n")
    if not sep:
        return False
    if head_request:
        return True
    for line in head.lower().split(b"\r\n"):
        if line.startswith(b"content-length:"):
            return len(rest) >= int(line.split(b":")[1])
        if line == b"transfer-encoding: chunked":
            return rest.endswith(b"0\r\n\r\n")
    return head.startswith(b"HTTP/1.1 1") or b" 204 " in head.split(b"\r\n")[0]


statuses, ok = {}, 0
for i in range(count):
    method, p, raw = request()
    import time; t0 = time.time()
    s = socket.create_connection(("127.0.0.1", port), timeout=30)
    data = b""
    try:  # until the first whole answer (no half-close: the server takes that for a client that left)
        s.sendall(raw)
        while len(data) < 1 << 20 and not complete(data, method == b"HEAD"):
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
    except (ConnectionResetError, BrokenPipeError):
        pass  # the server may close on a request it refuses before reading all of it
    finally:
        s.close()
    import time; t1 = time.time() - t0
    if t1 > 1 and "-v" in sys.argv: print(f"slow {t1:.1f}: {raw[:200]!r} -> {data[:200]!r}")
    status, head, rest = answer(data)
    if status is None and "-v" in sys.argv: print(f"closed: {raw[:200]!r}")
    statuses[str(status)] = statuses.get(str(status), 0) + 1
    where = f"request {i} (seed {seed}): {raw[:160]!r} -> {data[:300]!r}"
    if status is not None and status >= 500:
        print("FAIL: a 5xx answer to " + where)
        sys.exit(1)
    if status and status >= 400 and method != b"HEAD" and b"application/json" in head:
        try:
            err = json.loads(rest)["error"]
            assert isinstance(err["message"], str) and err["type"], err
        except Exception as e:  # noqa: BLE001 - any failure to read the error object is the finding
            print(f"FAIL: no OpenAI error object ({e}) in the answer to " + where)
            sys.exit(1)
    if status == 200 and method == b"POST" and p in (b"/v1/chat/completions", b"/v1/completions"):
        ok += 1
print(json.dumps({"statuses": statuses, "ok": ok}))
