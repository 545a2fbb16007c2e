"""The DMLC_* environment contract of SPEC.md section 8."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from pskv.errors import ClusterError
from pskv.ps.node import JobEnv

BASE = {"DMLC_ROLE": "worker", "DMLC_PS_ROOT_URI": "127.0.0.1", "DMLC_PS_ROOT_PORT": "9000", "DMLC_NUM_WORKER": "3", "DMLC_NUM_SERVER": "2"}


def test_reads_the_contract() -> None:
    env = JobEnv.from_environ({**BASE, "DMLC_WORKER_ID": "2"})
    assert (env.role, env.num_workers, env.num_servers, env.worker_id) == ("worker", 3, 2, 2)
    assert env.scheduler_endpoint == "tcp://127.0.0.1:9000"
    assert env.advertised_host() == "127.0.0.1"
    assert JobEnv.from_environ({**BASE, "DMLC_NODE_HOST": "10.1.2.3"}).advertised_host() == "10.1.2.3"
    assert JobEnv.from_environ({**BASE, "DMLC_INTERFACE": "lo"}).advertised_host() == "127.0.0.1"


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"DMLC_ROLE": ""}, "DMLC_ROLE is not set"),
        ({"DMLC_ROLE": "boss"}, "DMLC_ROLE='boss'"),
        ({"DMLC_PS_ROOT_URI": ""}, "DMLC_PS_ROOT_URI"),
        ({"DMLC_PS_ROOT_PORT": "x"}, "DMLC_PS_ROOT_PORT='x' is not an integer"),
        ({"DMLC_PS_ROOT_PORT": "0"}, "DMLC_PS_ROOT_PORT=0 is not a port"),  # both waited PSKV_START_TIMEOUT
        ({"DMLC_PS_ROOT_PORT": "70000"}, "DMLC_PS_ROOT_PORT=70000 is not a port"),
        ({"DMLC_NUM_WORKER": "0"}, "DMLC_NUM_WORKER=0 must be >= 1"),
        ({"DMLC_NUM_WORKER": "99999999999999999999"}, "DMLC_NUM_WORKER=99999999999999999999 is more than a job can have"),  # a server's
        ({"DMLC_NUM_SERVER": "100000"}, "DMLC_NUM_SERVER=100000 is more than a job can have"),  # traceback; a scheduler's full memory
        ({"DMLC_NUM_SERVER": ""}, "DMLC_NUM_SERVER is not set"),
        ({"DMLC_WORKER_ID": "3"}, "DMLC_WORKER_ID=3 but the job has DMLC_NUM_WORKER=3"),
        ({"DMLC_INTERFACE": "nosuchif0"}, "DMLC_INTERFACE='nosuchif0'"),
        ({"DMLC_PS_ROOT_URI": "nosuchhost.invalid"}, "DMLC_PS_ROOT_URI='nosuchhost.invalid': cannot resolve"),  # these two
        ({"DMLC_NODE_HOST": "nosuchhost.invalid"}, "DMLC_NODE_HOST='nosuchhost.invalid': cannot resolve"),  # (was advertised)
        ({"DMLC_NUM_SERVER": "0"}, r"the job has no servers \(DMLC_NUM_SERVER=0"),  # waited, or blamed the launch
    ],
)
def test_bad_environment_names_the_variable(change: dict[str, str], match: str) -> None:
    with pytest.raises(ClusterError, match=match):
        JobEnv.from_environ({**BASE, **change}).advertised_host()


def test_a_server_shares_the_hosts_cores_with_the_jobs_processes_on_it(monkeypatch: pytest.MonkeyPatch) -> None:
    from pskv import config

    monkeypatch.setattr(config.os, "sched_getaffinity", lambda pid: set(range(16)))
    monkeypatch.delenv("PSKV_SERVER_THREADS", raising=False)
    assert [config.server_threads(n) for n in (2, 4, 9, 40)] == [8, 4, 1, 1]  # 1 worker + 1 server, 2 + 2, ...
    monkeypatch.setenv("PSKV_SERVER_THREADS", "3")
    assert config.server_threads(2) == 3
    monkeypatch.setenv("PSKV_SERVER_THREADS", "-1")
    with pytest.raises(ValueError, match="PSKV_SERVER_THREADS='-1'"):
        config.server_threads(2)


def test_ps_lites_ps_verbose_turns_the_log_on(monkeypatch: pytest.MonkeyPatch) -> None:
    """MXNet users debug a job with ps-lite's ``PS_VERBOSE=1`` (or 2): pskv did not read it."""
    from pskv import config
    from pskv.launch.spec import FORWARDED

    monkeypatch.delenv("PSKV_VERBOSE", raising=False)
    for value, on in (("", False), ("0", False), ("1", True), ("2", True)):
        monkeypatch.setenv("PS_VERBOSE", value)
        assert config.verbose() is on, value
    monkeypatch.setenv("PS_VERBOSE", "loud")
    with pytest.raises(ValueError, match="PS_VERBOSE='loud'"):
        config.verbose()
    assert "PS_VERBOSE=2".startswith(FORWARDED)  # to processes on other hosts too


def test_news_that_came_with_the_node_table_goes_to_the_caller() -> None:
    """The scheduler may send news right after a node's table (SERVER_LOST: a backup took a server's
    place as the job started): join read both in one batch and dropped the news, and the worker went
    on sending to the lost server until its deadline."""
    from pskv.ps.message import Message, Type, json_frame
    from pskv.ps.node import Node

    table = Message(Type.NODES, meta={"rank": 0}, frames=[json_frame({"servers": [{}, {}], "workers": [{}, {}, {}]})])
    lost = Message(Type.SERVER_LOST, meta={"rank": 1})

    class OneBatch:  # the scheduler's connection, as the node's van shows it
        identity: object = None

        def connect(self, *args: object, **kwargs: object) -> None: ...

        def send(self, *args: object) -> None: ...

        def recv(self, timeout: float) -> list[tuple[str, Message]]:
            return [("scheduler", table), ("scheduler", Message(Type.HEARTBEAT_ACK)), ("scheduler", lost)]

    node = Node(JobEnv.from_environ({**BASE, "DMLC_WORKER_ID": "0"}))
    node.van.close(linger=0)
    node.van = OneBatch()  # type: ignore[assignment]
    assert node.join(None) == [("scheduler", lost)]
    assert (node.rank, len(node.servers)) == (0, 2)


def test_what_a_peer_sent_before_its_connection_closed_comes_before_its_end(monkeypatch: pytest.MonkeyPatch) -> None:
    """The scheduler's last message (a lost worker's NODE_FAILED) and its connection's end are both there
    when a poll sees only the end: the message was dropped for "the scheduler closed its connection"
    (a worker stopped while it was declared lost got that error, not the one naming it)."""
    import time

    from pskv.ps.message import Message, Type
    from pskv.ps.van import PeerGone, Van

    monkeypatch.delenv("PSKV_SECRET", raising=False)
    scheduler, worker = Van("scheduler"), Van("worker")
    try:
        worker.connect("scheduler", scheduler.listen("tcp://127.0.0.1:0"), watch=True)
        worker.send("scheduler", Message(Type.HEARTBEAT))
        until, got = time.monotonic() + 10, []
        while not got and time.monotonic() < until:
            got = scheduler.recv(0.1)
        scheduler.send(got[0][0], Message(Type.NODE_FAILED, meta={"reason": "no heartbeat"}))
        scheduler.close(linger=5.0)
        monitor, (sock, _) = next(iter(worker._monitors.items()))
        while not (monitor.poll(0) and sock.poll(0)) and time.monotonic() < until:
            time.sleep(0.05)
        assert monitor.poll(0) and sock.poll(0), "the message and the connection's end did not arrive in 10 s"
        monkeypatch.setattr(worker._poller, "poll", lambda timeout: [(monitor, 1)])  # a poll that saw the end only
        got = worker.recv(0)
        assert [(peer, type(m).__name__) for peer, m in got] == [("scheduler", "Message"), ("scheduler", "PeerGone")], got
        assert got[0][1].type == Type.NODE_FAILED and isinstance(got[1][1], PeerGone)
    finally:
        worker.close(linger=0)


def test_a_server_beats_between_the_requests_of_a_long_batch(offline_server: Any) -> None:
    """A server sent its heartbeat once per batch of messages (up to 256 from its socket): a batch of big requests
    (8 workers' inits and pushes of 30,000 keys each, with PSKV_HEARTBEAT_TIMEOUT=4) kept the live server silent past
    the deadline and the scheduler declared it dead; 16 workers with 100,000 keys would at the default 30 s. Now it
    beats between requests when one is due: here always due, after each of a batch of 5."""
    from pskv.ps.message import Message, Type

    off = offline_server()
    server = off.server
    server.join = lambda endpoint: [("w0", Message(Type.GET_STATES, i)) for i in range(5)]  # the first batch

    def recv(timeout: float) -> list[Any]:
        server.status = 0  # the second batch: none, and the loop ends
        return []

    server.van.recv = recv
    server.hb_interval = 0.0
    off.replies.clear()
    assert server.run() == 0
    assert [m.type for _, m in off.replies] == [Type.DATA, Type.HEARTBEAT] * 5 + [Type.HEARTBEAT] * 2  # (and after each batch)


def test_a_node_table_over_a_megabyte_reaches_every_node(inproc_job: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The node table went in the NODES message's metadata, at most 1 MB (~5,000 nodes' rows): the scheduler
    could not encode it, logged that and sent nothing, and every node waited PSKV_START_TIMEOUT for a table that
    was never coming. Here 4 nodes of 300 KB host identities make a 1.2 MB table: it travels in a JSON frame now."""
    from pskv.ps import node

    monkeypatch.setenv("PSKV_START_TIMEOUT", "20")
    monkeypatch.setattr(node, "host_identity", lambda: "h" * 300_000)  # (what a node registers with: its row)
    job = inproc_job(1, 3)
    with job.worker() as kv:
        assert len(kv._client.servers) == 3 and kv._client.servers[2]["shm_host"] == "h" * 300_000  # type: ignore[attr-defined]
        kv.init(3, torch.ones(4))
        kv.push(3, torch.ones(4))
        out = torch.empty(4)
        kv.pull(3, out)
        assert out.tolist() == [1.0] * 4


def test_a_reply_too_big_to_send_is_answered_with_an_error_naming_why(monkeypatch: pytest.MonkeyPatch) -> None:
    """Van.post logged a message it could not encode (metadata over 1 MB) and dropped it: its peer, waiting for the
    answer, waited its whole timeout (PSKV_TIMEOUT, 330 s) without a word. It gets an ERROR saying why now."""
    import time

    from pskv.ps.message import MAX_META, Message, Type
    from pskv.ps.van import Van

    monkeypatch.delenv("PSKV_SECRET", raising=False)
    server, worker = Van("server"), Van("worker")
    try:
        worker.connect("server", server.listen("tcp://127.0.0.1:0"))
        worker.send("server", Message(Type.GET_STATES, req_id=7))
        until, got = time.monotonic() + 10, []
        while not got and time.monotonic() < until:
            got = server.recv(0.1)
        peer, request = got[0]
        server.post(peer, request.reply(Type.DATA, meta={"big": "x" * (MAX_META + 1)}))
        answer = []
        while not answer and time.monotonic() < until:
            answer = worker.recv(0.1)
        assert answer, "no answer in 10 s"
        reply = answer[0][1]
        assert (reply.type, reply.req_id) == (Type.ERROR, 7), reply
        assert reply.meta["kind"] == "ProtocolError" and f"at most {MAX_META}" in reply.meta["message"], reply.meta
    finally:
        worker.close(linger=0)
        server.close(linger=0)
