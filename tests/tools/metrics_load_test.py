#!/usr/bin/env python3
"""The metrics endpoint under load and abuse while `strata train` runs.

Against the live endpoint: many idle and trickling connections (a slowloris) while a scraper
still gets its answers and the number of open connections stays bounded; oversized request
lines, headers and bodies (4xx, connection closed); a small body on GET and pipelined requests
(answered, in order). Then load from wrk, alternating with none in equal phases: wrk gets no
more answers than the server's pace allows, and the median training step with the load on is
held against the median with it off, from the same run.

wrk runs at nice 19: on a machine of two cores a load generator at normal priority would take a
core from training, and the ratio would measure wrk. A real scraper runs elsewhere; what is
measured here is what answering it costs training.

Usage: metrics_load_test.py STRATA [--timing]. Without --timing (sanitized builds) the step-time
ratio is printed but not checked. Exits 77 (skipped) without wrk.
"""
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

MAX_CONNECTIONS = 64          # MetricsServerOptions::max_connections
HEADER_LIMIT = 8 * 1024       # kMaxRequestHeaderBytes
MAX_RATE = 100                # MetricsServerOptions::max_requests_per_second
BURST = 100                   # MetricsServerOptions::request_burst
STEP_RATIO_BOUND = 1.25       # median step with load on / off
PHASE_SECONDS = 3.0


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get_status(port, timeout=5):
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/status", timeout=timeout) as r:
        return json.loads(r.read())


def exchange(port, request, timeout=5):
    """Sends `request` and reads until the server closes (or `timeout`)."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        try:
            s.sendall(request)
        except (BrokenPipeError, ConnectionResetError):
            pass  # Refused before all of it was sent; the answer is still there to read.
        data = b""
        try:
            while chunk := s.recv(65536):
                data += chunk
        except (socket.timeout, ConnectionResetError):
            pass
    return data.decode(errors="replace")


def open_sockets(pid):
    count = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            count += os.readlink(f"/proc/{pid}/fd/{fd}").startswith("socket:")
        except OSError:
            pass
    return count


def check_slowloris(port, pid):
    baseline = open_sockets(pid)
    idle = []
    for i in range(5 * MAX_CONNECTIONS):
        s = socket.create_connection(("127.0.0.1", port), timeout=5)
        if i % 2:
            s.sendall(b"GET /metrics HTTP/1.1\r\nX-Slow: ")  # A request that never ends.
        idle.append(s)
    time.sleep(0.5)
    held = open_sockets(pid) - baseline
    assert held <= MAX_CONNECTIONS + 2, f"{held} connections held open; bound {MAX_CONNECTIONS}"
    for _ in range(20):
        start = time.monotonic()
        status = get_status(port, timeout=2)
        assert time.monotonic() - start < 1.0, "a scraper waited behind idle connections"
        assert "step" in status
    for s in idle:
        s.close()
    return held


def check_abuse(port):
    reply = exchange(port, b"GET /" + b"a" * (HEADER_LIMIT + 100) + b" HTTP/1.1\r\n\r\n")
    assert reply.startswith("HTTP/1.1 414"), reply[:100]
    reply = exchange(port, b"GET /metrics HTTP/1.1\r\nX-Pad: " + b"b" * (4 * HEADER_LIMIT)
                     + b"\r\n\r\n")
    assert reply.startswith("HTTP/1.1 431"), reply[:100]
    reply = exchange(port, b"GET /metrics HTTP/1.1\r\nContent-Length: 1000000\r\n\r\n"
                     + b"c" * 1000000)
    assert reply.startswith("HTTP/1.1 413"), reply[:100]
    reply = exchange(port, b"GET /status HTTP/1.1\r\nContent-Length: 5\r\nConnection: close"
                     b"\r\n\r\nhello")
    assert reply.startswith("HTTP/1.1 200"), reply[:100]
    burst = b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n" * 49 + \
        b"GET /status HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    reply = exchange(port, burst, timeout=10)
    assert reply.count("HTTP/1.1 200 OK") == 50, reply.count("HTTP/1.1 200 OK")
    assert reply.rstrip().endswith("}"), "the last pipelined answer is not /status"


def run_wrk(port, seconds):
    out = subprocess.run(
        ["nice", "-n", "19", "wrk", "-t1", "-c16", f"-d{seconds}s", "--timeout", "2s",
         f"http://127.0.0.1:{port}/metrics"], capture_output=True, text=True, check=True).stdout
    assert "Non-2xx" not in out, out
    requests_per_second = float(out.split("Requests/sec:")[1].split()[0])
    errors = out.split("Socket errors:")[1].split("\n")[0] if "Socket errors:" in out else ""
    assert "timeout 0" in errors or not errors, f"wrk saw errors: {errors}"
    # A phase may begin with a whole burst; past it, the server answers at its pace.
    paced = MAX_RATE + BURST / seconds
    assert requests_per_second <= 1.1 * paced, \
        f"wrk got {requests_per_second:.0f} answers/s; the server's pace allows {paced:.0f}"
    return requests_per_second


def main():
    if shutil.which("wrk") is None:
        print("wrk is not installed (Debian package wrk)")
        sys.exit(77)
    strata, timing = sys.argv[1], "--timing" in sys.argv[2:]
    port = free_port()
    # Sanitized, a step takes 10-20x longer: 200 still give dozens of steps per phase kind.
    steps = 1400 if timing else 200
    with tempfile.TemporaryDirectory() as scratch, \
            open(f"{scratch}/out", "w+") as out, open(f"{scratch}/err", "w+") as err:
        # Files, not pipes: the JSON document is larger than a pipe holds, and nothing reads it
        # before training ends.
        train = subprocess.Popen(
            [strata, "train", "--model", "tiny", "--batch", "8", "--seq", "128",
             "--steps", str(steps), "--eval-every", "0", "--json", "--nvme-path", scratch,
             "--metrics-port", str(port)],
            stdout=out, stderr=err, text=True)
        try:
            deadline = time.time() + 60
            while time.time() < deadline:
                try:
                    if get_status(port)["step"] >= 3:
                        break
                except OSError:
                    pass
                time.sleep(0.1)
            held = check_slowloris(port, train.pid)
            check_abuse(port)

            # Phases: off, on, off, on, ... until training ends; the step reached at each edge.
            phases = []  # (load_on, first_step, last_step)
            rates = []
            load_on = False
            step = get_status(port)["step"]
            while train.poll() is None:
                if load_on:
                    rates.append(run_wrk(port, int(PHASE_SECONDS)))
                else:
                    time.sleep(PHASE_SECONDS)
                try:
                    now = get_status(port)["step"]
                except OSError:
                    break  # Training ended during the phase.
                phases.append((load_on, step + 2, now))  # Its first step may straddle the edge.
                step, load_on = now, not load_on
            train.wait(timeout=60)
        finally:
            if train.poll() is None:
                train.kill()
                train.wait()
        out.seek(0)
        err.seek(0)
        assert train.returncode == 0, err.read()
        document = json.load(out)
    seconds = {s["step"]: s["seconds"] for s in document["steps"]}
    on = [seconds[k] for load, a, b in phases if load for k in range(a, b + 1) if k in seconds]
    off = [seconds[k] for load, a, b in phases if not load for k in range(a, b + 1)
           if k in seconds]
    assert len(on) >= 20 and len(off) >= 20, f"too few steps measured: {len(on)} on, {len(off)} off"
    ratio = statistics.median(on) / statistics.median(off)
    print(f"metrics under load: slowloris of {5 * MAX_CONNECTIONS} held {held} connections; "
          f"wrk {statistics.median(rates):.0f} requests/s (median of {len(rates)} phases); "
          f"step {statistics.median(on) * 1e3:.2f} ms with load, "
          f"{statistics.median(off) * 1e3:.2f} ms without ({len(on)}/{len(off)} steps): "
          f"ratio {ratio:.3f} (bound {STEP_RATIO_BOUND})")
    if timing:
        assert ratio <= STEP_RATIO_BOUND, f"load on the endpoint slowed training by {ratio:.3f}x"


if __name__ == "__main__":
    main()
