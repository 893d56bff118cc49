#!/usr/bin/env python3
"""Scrapes `strata train --metrics-port` while it trains and checks the endpoint.

/metrics must parse with prometheus_client's own parser (the reference Python implementation of
the text format) and carry the engine's and the trainer's series; /status must be JSON; unknown
paths are 404, other methods 405, and a request that is not HTTP gets 400.
Usage: metrics_scrape.py STRATA. Exits 77 (skipped) when prometheus_client is missing.
"""
import json
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

try:
    from prometheus_client.parser import text_string_to_metric_families
except ImportError:
    print("prometheus_client is not installed (python3-prometheus-client)")
    sys.exit(77)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(url):
    with urllib.request.urlopen(url, timeout=5) as response:
        return response.status, response.headers.get("Content-Type"), response.read().decode()


def raw(port, request):
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(request)
        data = b""
        while chunk := s.recv(4096):
            data += chunk
    return data.decode(errors="replace")


def main():
    strata = sys.argv[1]
    port = free_port()
    with tempfile.TemporaryDirectory() as nvme:
        train = subprocess.Popen(
            [strata, "train", "--model", "tiny", "--batch", "2", "--seq", "32",
             "--steps", "100000", "--eval-every", "0", "--json", "--nvme-path", nvme,
             "--metrics-port", str(port)],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        try:
            deadline = time.time() + 60
            status = None
            while time.time() < deadline:
                try:
                    _, _, body = get(f"http://127.0.0.1:{port}/status")
                    status = json.loads(body)
                    if status["step"] >= 3:
                        break
                except (urllib.error.URLError, ConnectionError):
                    pass
                time.sleep(0.2)
            assert status is not None and status["step"] >= 3, f"no progress: {status}"
            assert status["placement"] == {"optimizer_states": "nvme", "params": "host"}, status
            device = status["tiers"]["device"]
            assert device["peak_bytes"] <= device["budget_bytes"], device

            code, content_type, page = get(f"http://127.0.0.1:{port}/metrics")
            assert code == 200, code
            assert content_type.startswith("text/plain; version=0.0.4"), content_type
            families = {f.name: f for f in text_string_to_metric_families(page)}
            for name in ["strata_tier_bytes", "strata_optimizer_params", "strata_steps",
                         "strata_tier_used_bytes", "strata_tier_budget_bytes",
                         "strata_step_seconds", "strata_train_loss",
                         "strata_train_tokens_per_second", "strata_inflight",
                         "strata_trainer_stall_seconds", "strata_update_wait_seconds",
                         "strata_tier_bandwidth_bytes_per_second",
                         "strata_optimizer_params_per_second"]:
                assert name in families, f"{name} missing from /metrics; have {sorted(families)}"
            moved = {(s.labels["from"], s.labels["to"]): s.value
                     for s in families["strata_tier_bytes"].samples if s.name.endswith("_total")}
            assert moved[("host", "nvme")] > 0 and moved[("device", "host")] > 0, moved
            in_flight = {s.labels["resource"] for s in families["strata_inflight"].samples}
            assert in_flight == {"nvme_read", "nvme_write", "host_to_device", "device_to_host",
                                 "cpu_optimizer"}, in_flight
            stalls = {s.labels["resource"]: s.value
                      for s in families["strata_trainer_stall_seconds"].samples
                      if s.name.endswith("_total")}
            assert stalls["step"] > 0, stalls
            loss = [s.value for s in families["strata_train_loss"].samples][0]
            assert 0 < loss < 6, loss

            try:
                get(f"http://127.0.0.1:{port}/nope")
                raise AssertionError("/nope did not fail")
            except urllib.error.HTTPError as e:
                assert e.code == 404, e.code
            reply = raw(port, b"POST /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                              b"Content-Length: 0\r\n\r\n")
            assert reply.startswith("HTTP/1.1 405"), reply
            reply = raw(port, b"this is not http\r\n\r\n")
            assert reply.startswith("HTTP/1.1 400"), reply
            # Training went on while it was scraped.
            assert train.poll() is None, train.stderr.read().decode()
        finally:
            train.terminate()
            train.wait(timeout=30)
    print(f"ok: {len(families)} metric families parsed, /status at step {status['step']}")


if __name__ == "__main__":
    main()
