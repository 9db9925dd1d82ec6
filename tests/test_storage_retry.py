"""Object-store writes against a real S3-compatible server (moto, the `s3_server` fixture) behind a real HTTP proxy
on 127.0.0.1 that answers `503 SlowDown` for as many requests as a test asks (moto injects no faults itself): a
store that fails in passing is retried within the budget and said once; one that keeps failing, or is gone, ends
the write as StorageFull (exit 74) naming the path, what was written and the error."""

from __future__ import annotations

import contextlib
import http.client
import http.server
import io
import json
import logging
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import torch
from support import one_failure_line, run_cli
from worker_hooks import command_hooks

from raytrain_ddp import _ray_compat
from raytrain_ddp.errors import EXIT_STORAGE_FULL, StorageFull
from raytrain_ddp.files import write_atomic
from raytrain_ddp.storage import RETRY_BUDGET_ENV, location, open_for_read, transient

SLOW_DOWN = (
    b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>SlowDown</Code>'
    b"<Message>Please reduce your request rate.</Message></Error>"
)


# not forwarded: they are about the client's connection to the proxy, not the proxy's to the server
HOP_BY_HOP = {"connection", "keep-alive", "expect", "transfer-encoding", "proxy-connection", "te", "upgrade"}


FAULTS = "/raytrain-test-faults/"  # the proxy's own requests: another process (a worker's hook) sets a fault


class FaultyProxy(http.server.ThreadingHTTPServer):
    """Forwards every request to the S3 server, except: the next `failures` requests get 503 SlowDown; until
    `slow_until` (time.monotonic) every request does (a store in trouble for a while); while `down`, every
    request's connection is closed unanswered (a store that stopped); every write (PUT, POST) to a key that holds
    `refused_writes` gets 503 SlowDown (one object the store will not take). GET FAULTS + "slow-down/SECONDS" or
    FAULTS + "down" sets two of them from another process, FAULTS + "up" ends either."""

    def __init__(self, upstream: str) -> None:
        super().__init__(("127.0.0.1", 0), _Forward)
        self.upstream, self.failures, self.lock = urlsplit(upstream).netloc, 0, threading.Lock()
        self.slow_until, self.down, self.refused_writes = 0.0, False, ""

    def take_failure(self, method: str, path: str) -> bool:
        with self.lock:
            if time.monotonic() < self.slow_until:
                return True
            if self.refused_writes and method in ("PUT", "POST") and self.refused_writes in path:
                return True
            if self.failures <= 0:
                return False
            self.failures -= 1
            return True

    def set_fault(self, fault: str) -> None:
        """FAULTS' request path: "slow-down/SECONDS", "down" or "up"."""
        kind, _, seconds = fault.partition("/")
        with self.lock:
            self.slow_until = time.monotonic() + float(seconds) if kind == "slow-down" else 0.0
            self.down = kind == "down"

    def control(self, fault: str) -> str:
        """The URL that sets `fault` (see set_fault)."""
        host, port = self.server_address[:2]
        return f"http://{host}:{port}{FAULTS}{fault}"


class _Forward(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: FaultyProxy

    def _relay(self) -> None:
        body = self._body()
        if self.path.startswith(FAULTS):
            self.server.set_fault(self.path.removeprefix(FAULTS))
            self._answer(200, [], b"")
            return
        if self.server.down:  # nothing answered: the client's connection ends (curl: "Server returned nothing")
            self.close_connection = True
            return
        if self.server.take_failure(self.command, self.path):
            self._answer(503, [("Content-Type", "application/xml")], SLOW_DOWN)
            return
        upstream = http.client.HTTPConnection(self.server.upstream, timeout=30)
        headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP_BY_HOP}
        upstream.request(self.command, self.path, body=body, headers=headers)
        reply = upstream.getresponse()
        self._answer(
            reply.status,
            [(k, v) for k, v in reply.getheaders() if k.lower() not in HOP_BY_HOP | self._sized_here],
            reply.read(),
        )
        upstream.close()

    @property
    def _sized_here(self) -> set[str]:
        """Headers the proxy sets itself: a body's length, except a HEAD's (the size of the object, no body)."""
        return set() if self.command == "HEAD" else {"content-length"}

    def _body(self) -> bytes:
        """The request's body, whether sized or chunked (pyarrow's SDK streams a PUT in chunks)."""
        if "chunked" not in self.headers.get("Transfer-Encoding", ""):
            return self.rfile.read(int(self.headers.get("Content-Length") or 0))
        chunks = []
        while size := int(self.rfile.readline().split(b";")[0], 16):
            chunks.append(self.rfile.read(size))
            self.rfile.readline()
        while self.rfile.readline() not in (b"\r\n", b"\n", b""):  # the trailers
            pass
        return b"".join(chunks)

    def handle_expect_100(self) -> bool:  # the client sends the body only after 100 Continue
        self.send_response_only(100)
        self.end_headers()
        return True

    def _answer(self, status: int, headers: list[tuple[str, str]], body: bytes) -> None:
        self.send_response(status)
        for key, value in headers:
            self.send_header(key, value)
        if not any(key.lower() == "content-length" for key, _ in headers):  # a HEAD's is the object's size
            self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = _relay

    def log_message(self, *args: object) -> None:  # quiet: the test's log is about the client
        pass


@contextlib.contextmanager
def _serving(upstream: str) -> Iterator[FaultyProxy]:
    server = FaultyProxy(upstream)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture
def proxy(s3_server) -> Iterator[FaultyProxy]:
    with _serving(s3_server) as server:
        yield server


@pytest.fixture(scope="module")
def store_proxy(s3_server) -> Iterator[FaultyProxy]:
    """One proxy for the module's Ray runs (their commands name its port)."""
    with _serving(s3_server) as server:
        yield server


def _run_dir(proxy: FaultyProxy, prefix: str):
    host, port = proxy.server_address[:2]
    return location(f"s3://raytrain/{prefix}?endpoint_override=http://{host}:{port}&scheme=http")


def test_a_store_that_throttles_in_passing_is_retried_and_said_once(proxy, caplog, monkeypatch):
    """More 503 SlowDown answers than pyarrow's own retries absorb: the write still lands, in one
    WARNING naming the path and the error."""
    monkeypatch.setenv(RETRY_BUDGET_ENV, "30")
    target = _run_dir(proxy, "retry-passing") / "metrics.jsonl"
    proxy.failures = 40  # pyarrow (its AWS SDK) retries each request itself: ten or so per attempt of ours
    with caplog.at_level(logging.INFO, logger="raytrain_ddp.storage"):
        write_atomic(target, '{"step": 1}\n')
    assert proxy.failures == 0
    assert target.read_text() == '{"step": 1}\n'
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, warnings
    assert "metrics.jsonl" in warnings[0] and "s3://raytrain/retry-passing/metrics.jsonl" in warnings[0]
    assert "SLOW_DOWN" in warnings[0] or "503" in warnings[0] or "SlowDown" in warnings[0], warnings[0]


def test_a_store_that_keeps_failing_ends_the_write_in_one_line_after_the_budget(proxy, caplog, monkeypatch):
    """503 for ever: StorageFull (exit 74) once the budget is spent, naming what, where and the error; the
    object that was there before is left as it was."""
    monkeypatch.setenv(RETRY_BUDGET_ENV, "8")  # pyarrow spends some 5 s on its own retries of one attempt
    target = _run_dir(proxy, "retry-for-ever") / "summary.json"
    write_atomic(target, "{}")
    proxy.failures = 10**6
    with caplog.at_level(logging.WARNING, logger="raytrain_ddp.storage"), pytest.raises(StorageFull) as ended:
        write_atomic(target, '{"finished": true}')
    proxy.failures = 0
    line = str(ended.value)
    assert "\n" not in line
    assert line.startswith("storage failed: the object store failed (")
    assert "writing summary.json to s3://raytrain/retry-for-ever/summary.json" in line
    assert "bring the store back" in line and "run the same command again to resume" in line
    assert len([r for r in caplog.records if r.levelno == logging.WARNING]) == 1
    assert target.read_text() == "{}"
    assert EXIT_STORAGE_FULL == 74


def test_a_workers_sample_ids_wait_for_a_store_in_trouble(proxy, monkeypatch):
    """A rank's own write into the bucket (its sample ids: the folder asked for, then the object) is retried too."""
    import numpy as np

    from raytrain_ddp import TrainConfig
    from raytrain_ddp.worker.loop import save_sample_ids

    monkeypatch.setenv(RETRY_BUDGET_ENV, "30")
    config = TrainConfig(storage_path=_run_dir(proxy, "retry-ids").uri, name="ids", record_sample_ids=True)
    proxy.failures = 100  # more than pyarrow's own retries of the folder's bucket check absorb (some 60)
    save_sample_ids(config, 1, 0, [np.arange(8)])
    assert proxy.failures == 0
    written = np.load(io.BytesIO((config.run_dir / "sample_ids" / "epoch-1-rank-0.npy").read_bytes()))
    assert written.tolist() == list(range(8))


def test_a_delete_on_a_store_in_trouble_is_retried_and_said_as_a_delete(proxy, caplog, monkeypatch):
    """Deletes (a launched script's file it removed, an unfinished checkpoint) are retried as writes are, and the
    warning says what was done: deleting, not writing."""
    monkeypatch.setenv(RETRY_BUDGET_ENV, "30")
    target = _run_dir(proxy, "retry-delete") / "checkpoint" / "old.txt"
    target.write_bytes(b"old")
    proxy.failures = 40
    with caplog.at_level(logging.WARNING, logger="raytrain_ddp.storage"):
        target.unlink()
    assert proxy.failures == 0 and not target.exists()
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and warnings[0].startswith(
        "Deleting old.txt from s3://raytrain/retry-delete/checkpoint/old.txt failed ("
    ), warnings


def test_the_download_of_the_checkpoint_a_rank_resumes_from_waits_for_a_store_in_trouble(proxy, monkeypatch, tmp_path):
    """A rank resuming from a checkpoint on the store downloads it (Ray Train's Checkpoint.as_directory) inside the
    retry budget: a store in trouble at that moment is waited for, not a rank failure."""
    import pyarrow.fs
    from ray.train import Checkpoint

    from raytrain_ddp.checkpoint.saver import loaded, save
    from raytrain_ddp.checkpoint.state import Position
    from raytrain_ddp.storage import copy_tree

    monkeypatch.setenv(RETRY_BUDGET_ENV, "30")
    run_dir = _run_dir(proxy, "retry-resume")
    training_state, run_info = {"scheduler": {}, "scaler": {}, "world_size": 2}, {"config": {}, "data_spec": {}}
    save(str(tmp_path), {"weight": torch.ones(2)}, {}, training_state, Position(epoch=3), {}, run_info)
    copy_tree(tmp_path, run_dir / "checkpoint_1")
    filesystem, path = pyarrow.fs.FileSystem.from_uri((run_dir / "checkpoint_1").uri)
    proxy.failures = 100  # more than pyarrow's own retries absorb
    with loaded(Checkpoint(path, filesystem), run_dir) as state:
        assert state["epoch"] == 3 and torch.equal(state["model"]["weight"], torch.ones(2))
    assert proxy.failures == 0


def test_a_503_without_a_body_counts_as_passing():
    """A HEAD's 503 has no body, so pyarrow's error names no AWS error, only its status (the words below are
    what the bucket check that starts a checkpoint's upload said, in a run behind the proxy)."""
    head = (
        "When testing for existence of bucket 'raytrain': AWS Error UNKNOWN (HTTP status 503) during HeadBucket "
        "operation: No response body."
    )
    assert transient(OSError(head)) and transient(OSError(head.replace("503", "429")))
    assert not transient(OSError(head.replace("503", "403")))


def test_a_store_that_is_gone_ends_the_write_in_one_line(s3_server, monkeypatch):
    """Nothing listening on the store's port (a stopped server): connection refused, retried, then StorageFull."""
    monkeypatch.setenv(RETRY_BUDGET_ENV, "2")
    with http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Forward) as closed:
        port = closed.server_address[1]  # closed at the end of the block: nothing answers there after it
    target = location(f"s3://raytrain/gone?endpoint_override=http://127.0.0.1:{port}&scheme=http") / "steps.jsonl"
    with pytest.raises(StorageFull) as ended:
        write_atomic(target, "{}\n")
    assert "writing steps.jsonl to s3://raytrain/gone/steps.jsonl" in str(ended.value)


# ------------------------------------------------------------------ Ray runs whose store fails mid-run
# 8 optimizer steps per epoch, a checkpoint every 4: epoch 1's two are uploaded whole; as epoch 2 starts, rank 0
# (a worker hook) starts the store's fault, which epoch 2's checkpoint at step 4 meets (the driver writes nothing
# then: its epoch 1 records are written, epoch 2's come only at its end). Two runs of one command serve every rule
# below (each costs some 20 s of Ray Train's start): the first meets a store gone for good, the same command
# again (which resumes at epoch 2) a store in trouble for a while.
CHECKPOINT_UPLOAD = "the checkpoint of epoch 2 at step 4"
FAULTY = "faulty"  # the run of the store gone, then in trouble


def _train(ray_address: str, proxy: FaultyProxy, name: str) -> list[str]:
    host, port = proxy.server_address[:2]
    storage = f"s3://raytrain/store-faults?endpoint_override=http://{host}:{port}&scheme=http"
    return [
        *("--address", ray_address, "--storage-path", storage, "--name", name),
        *("--epochs", "2", "--train-size", "1024", "--val-size", "256", "--checkpoint-every-steps", "4"),
        *("--no-report", "--no-tensorboard"),
    ]


def _bucket(s3_server: str):
    """The store itself, not through the proxy: what the runs left there."""
    return location(f"s3://raytrain/store-faults?endpoint_override={s3_server}&scheme=http")


def _epochs(run_dir) -> list[int]:
    return [json.loads(line)["epoch"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def store_gone(ray_address, s3_server, store_proxy):
    """The store stops answering for good as epoch 2 starts: (the run's output, what it left in the store). Budget
    2 s: each write the run still tries (the checkpoint, summary.json, the run's files) gives up after one attempt
    of ours, not after the default 60 s."""
    hooks = command_hooks("StoreFault", control=store_proxy.control("down"), epoch=2)
    try:
        first = run_cli(
            "raytrain_ddp.run", *_train(ray_address, store_proxy, FAULTY), env={**hooks, RETRY_BUDGET_ENV: "2"}
        )
    finally:
        store_proxy.set_fault("up")
    print(first.stderr)  # what the user saw, on failure
    run_dir = _bucket(s3_server) / FAULTY
    recorded = _ray_compat.checkpoints_newest_first(_ray_compat.read_snapshot(run_dir) or {})
    left = {
        "names": sorted(path.name for path in run_dir.iterdir()),
        "recorded": recorded,
        "latest": torch.load(open_for_read(run_dir / recorded[0] / "checkpoint.pt"), weights_only=True),
    }
    return first, left


@pytest.fixture(scope="module")
def resumed_through_trouble(s3_server, store_gone, store_proxy, ray_address):
    """The store back, the same command again: it resumes at epoch 2, where the store answers 503 SlowDown to
    everything for 12 s: longer than pyarrow's own retries of one attempt absorb (some 5 s), so the upload is
    retried by ours, well inside the retry budget (the default, 60 s). (Its output, what it left.)"""
    hooks = command_hooks("StoreFault", control=store_proxy.control("slow-down/12"), epoch=2)
    try:
        again = run_cli("raytrain_ddp.run", *_train(ray_address, store_proxy, FAULTY), env=hooks)
    finally:
        store_proxy.set_fault("up")
    print(again.stderr)
    run_dir = _bucket(s3_server) / FAULTY
    return again, {"epochs": _epochs(run_dir), "summary": json.loads((run_dir / "summary.json").read_text())}


@pytest.mark.ray
def test_a_store_gone_mid_run_ends_it_once_in_one_line_with_exit_code_74(store_gone):
    first, _ = store_gone
    output, said = first.stderr, one_failure_line(first, EXIT_STORAGE_FULL)
    assert re.fullmatch(
        rf"Training failed: storage failed: the object store failed \(.+\) writing {CHECKPOINT_UPLOAD} to "
        rf"s3://raytrain/store-faults/{FAULTY}; bring the store back \(or fix its access\) and run the same command "
        r"again to resume",
        said,
    ), said
    assert "Traceback" not in output and "restarted the workers" not in output, output[-3000:]
    # summary.json cannot reach the store: it is the one JSON line on stderr
    summary = json.loads([line for line in output.splitlines() if line.startswith("{")][-1])
    assert summary["restarts"] == 0 and summary["storage_full"]["writing"] == CHECKPOINT_UPLOAD, summary


@pytest.mark.ray
def test_a_store_gone_mid_run_keeps_the_latest_whole_checkpoint_and_the_same_command_resumes(
    store_gone, resumed_through_trouble
):
    (_, left), (again, after) = store_gone, resumed_through_trouble
    assert (left["latest"]["epoch"], left["latest"]["step_in_epoch"]) == (1, 0), left["names"]
    assert again.returncode == 0, again.stderr[-3000:]
    assert "Resuming from checkpoint " in again.stderr, again.stderr[-3000:]
    assert after["epochs"] == [1, 2] and after["summary"]["status"] == "finished", after


@pytest.mark.ray
def test_a_store_in_trouble_mid_run_is_waited_for_and_the_run_finishes(resumed_through_trouble):
    result, after = resumed_through_trouble
    output = result.stderr
    assert result.returncode == 0, output[-3000:]
    retried = [line for line in output.splitlines() if "retrying for up to" in line]
    upload = [line for line in retried if line.startswith(f"rank 0: Writing {CHECKPOINT_UPLOAD} to ")]
    assert len(upload) == 1, output[-3000:]  # said once, however many tries it took
    assert f"s3://raytrain/store-faults/{FAULTY} failed (" in upload[0], upload
    assert "SLOW_DOWN" in upload[0] or "HTTP status 503" in upload[0], upload
    assert len(retried) == len({line.split(" failed (")[0] for line in retried}), retried  # once per write
    assert "restarted the workers" not in output and "Traceback" not in output, output[-3000:]
    summary = after["summary"]
    assert summary["status"] == "finished" and summary["restarts"] == 0, summary
    assert after["epochs"] == [1, 2]


@pytest.mark.ray
def test_a_store_that_refuses_ray_trains_own_records_ends_the_run_once_in_one_line(ray_address, s3_server, proxy):
    """Ray Train's controller writes the run's checkpoint records (checkpoint_manager_snapshot.json) itself, with no
    retry of ours: a store that refuses them ends the run as a store that is gone does (exit 74, one line naming
    what was written), not as exit 1 with Ray's traceback."""
    proxy.refused_writes = _ray_compat.SNAPSHOT_FILE
    result = run_cli("raytrain_ddp.run", *_train(ray_address, proxy, "records-refused"))
    said = one_failure_line(result, EXIT_STORAGE_FULL)
    assert re.fullmatch(
        r"Training failed: storage failed: the object store failed \(.+\) writing Ray Train's checkpoint records to "
        r"s3://raytrain/store-faults/records-refused; bring the store back \(or fix its access\) and run the same "
        r"command again to resume",
        said,
    ), said
    assert "Traceback" not in result.stderr and "restarted the workers" not in result.stderr, result.stderr[-3000:]
    summary = json.loads((_bucket(s3_server) / "records-refused" / "summary.json").read_text())
    assert summary["restarts"] == 0 and summary["storage_full"]["writing"] == "Ray Train's checkpoint records", summary


@pytest.mark.ray
def test_a_launched_scripts_checkpoint_upload_that_the_store_refuses_ends_the_run_with_exit_code_74(
    ray_address, s3_server, proxy
):
    """A script's session.report uploads its checkpoint folder (rank 0, with object storage) inside the retry
    budget; a store that keeps refusing it ends the run as storage (exit 74, the one line), not as a rank's
    failure restarted (--max-restarts 2) and ended with exit 1."""
    proxy.refused_writes = "checkpoint/snapshot.txt"
    host, port = proxy.server_address[:2]
    storage = f"s3://raytrain/store-faults?endpoint_override=http://{host}:{port}&scheme=http"
    script = Path(__file__).parent / "scripts" / "uploads_to_a_refusing_store.py"
    result = run_cli(
        "raytrain_ddp.launch",
        *("--address", ray_address, "--storage-path", storage, "--name", "script-refused", "--num-workers", "2"),
        *("--max-restarts", "2", str(script)),
        env={RETRY_BUDGET_ENV: "2"},
    )
    said = one_failure_line(result, EXIT_STORAGE_FULL)
    assert re.fullmatch(
        r"Training failed: storage failed: the object store failed \(.+\) writing snapshot.txt to "
        r"s3://raytrain/store-faults/script-refused/checkpoint/snapshot.txt; bring the store back \(or fix its "
        r"access\) and run the same command again to resume",
        said,
    ), said
    summary = json.loads((_bucket(s3_server) / "script-refused" / "summary.json").read_text())
    assert summary["restarts"] == 0, summary
