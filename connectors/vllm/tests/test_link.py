"""The engine link from Python: frames both ways between Python and TypeScript, every refusal a
sidecar sends an engine, and what the connector does after a sidecar restarts or dies."""

from __future__ import annotations

import json
import queue
import socket
import signal
import subprocess
import time
from pathlib import Path

import pytest
from conftest import REPO, wait_for
from google.protobuf.json_format import MessageToDict
from kvengine import KvEngine
from test_transfer import Collector

from kvxfer_vllm._gen.kvxfer.v1 import engine_pb2, layout_pb2
from kvxfer_vllm.link import EngineLink
from kvxfer_vllm.messages import ExpectMsg, PrefillDoneMsg, StepMessages

HERE = Path(__file__).parent


# --- frames, Python <-> TypeScript ---------------------------------------------------------------


@pytest.fixture(scope="module")
def ts_wire():
    proc = subprocess.Popen(["node", str(HERE / "wire.mjs")], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=REPO)

    def ask(req: dict) -> dict:
        assert proc.stdin and proc.stdout
        proc.stdin.write(json.dumps(req) + "\n")
        proc.stdin.flush()
        out = json.loads(proc.stdout.readline())
        assert "error" not in out, out["error"]
        return out

    yield ask
    proc.stdin.close()  # type: ignore[union-attr]
    proc.wait(10)


def sample_layout() -> layout_pb2.KvLayout:
    return layout_pb2.KvLayout(
        num_layers=2, total_kv_heads=8, head_dim=128, dtype="bfloat16", dtype_bytes=2, block_size=32,
        num_blocks=4096, order=layout_pb2.KV_BLOCK_ORDER_HND, tp_size=2, tp_rank=0, block_stride=(1 << 40) + 3,
        slots=[layout_pb2.KvSlotAddress(region=0, offset=(1 << 53) - 1), layout_pb2.KvSlotAddress(region=0, offset=8192)],
        region_bytes=[1 << 45], head_stride=16384, token_stride=256, opaque_blocks=True,
    )


ENGINE_MESSAGES = [
    engine_pb2.EngineToSidecar(register=engine_pb2.RegisterKvCache(
        engine_id="p0", layout=sample_layout(),
        ranks=[engine_pb2.RankKvCache(rank=1, regions=[engine_pb2.RegionFile(path="/dev/shm/ü-1.kv", offset=7, length=1 << 45)])])),
    engine_pb2.EngineToSidecar(prefill_done=engine_pb2.PrefillDone(transfer_id="cmpl-é", block_ids=[0, 4095, 1 << 31], num_tokens=70)),
    engine_pb2.EngineToSidecar(expect_kv=engine_pb2.ExpectKv(transfer_id="t", source="127.0.0.1:7", block_ids=[3, 2],
                                                             num_tokens=64, prefix_tokens=32, source_block_ids=[9, 8], has_source_block_ids=True)),
    engine_pb2.EngineToSidecar(abort=engine_pb2.Abort(transfer_id="t")),
]

SIDECAR_MESSAGES = [
    engine_pb2.SidecarToEngine(registered=engine_pb2.Registered(ok=False, error="ERR_X: y", side_channel="h:1", epoch=(1 << 64) - 1)),
    engine_pb2.SidecarToEngine(kv_ready=engine_pb2.KvReady(transfer_id="t")),
    engine_pb2.SidecarToEngine(kv_failed=engine_pb2.KvFailed(transfer_id="t", reason=engine_pb2.FAILURE_REASON_LEASE_EXPIRED, message="m")),
    engine_pb2.SidecarToEngine(release_blocks=engine_pb2.ReleaseBlocks(transfer_id="t", block_ids=[1, 2], reason=engine_pb2.RELEASE_REASON_EXPIRED)),
    engine_pb2.SidecarToEngine(refused=engine_pb2.Refused(transfer_id="t", code="ERR_BAD_BLOCKS", message="block_ids[0]")),
]


@pytest.mark.parametrize("msg", ENGINE_MESSAGES, ids=lambda m: m.WhichOneof("msg"))
def test_python_frames_decode_in_typescript(ts_wire, msg):
    got = ts_wire({"decode": "EngineToSidecar", "hex": msg.SerializeToString().hex()})["json"]
    assert got == MessageToDict(msg)


@pytest.mark.parametrize("msg", SIDECAR_MESSAGES, ids=lambda m: m.WhichOneof("msg"))
def test_typescript_frames_decode_in_python(ts_wire, msg):
    raw = bytes.fromhex(ts_wire({"encode": "SidecarToEngine", "json": MessageToDict(msg)})["hex"])
    back = engine_pb2.SidecarToEngine()
    back.ParseFromString(raw)
    assert back == msg


# --- every refusal ---------------------------------------------------------------------------------


class RawEngine:
    """An engine link with no connector logic: what it sends, and every reply, as they are."""

    def __init__(self, socket: str) -> None:
        self.replies: queue.Queue = queue.Queue()
        self.link = EngineLink(socket, self.replies.put)
        self.link.start()

    def ask(self, frames, timeout: float = 10.0) -> engine_pb2.SidecarToEngine:
        if isinstance(frames, engine_pb2.EngineToSidecar):
            self.link.send(frames)
        else:
            self.link.send_raw(frames)
        try:
            return self.replies.get(timeout=timeout)
        except queue.Empty:
            pytest.fail(f"no reply within {timeout} s")

    def close(self) -> None:
        self.link.close()


def refused(reply: engine_pb2.SidecarToEngine) -> str:
    assert reply.WhichOneof("msg") == "refused", reply
    return reply.refused.code


def registered_error(reply: engine_pb2.SidecarToEngine) -> str:
    assert reply.WhichOneof("msg") == "registered" and not reply.registered.ok, reply
    return reply.registered.error.split(":")[0]


def msg(**kw) -> engine_pb2.EngineToSidecar:
    return engine_pb2.EngineToSidecar(**kw)


def test_every_refusal_code(sidecars, shm_dir):
    d_sc = sidecars("decode", "--max-transfers", "2", "--mode", "pull")
    eng = KvEngine(str(shm_dir), d_sc.engine_id, backend="CPU_ATTN", tp=1, block_size=32, num_blocks=8)
    raw = RawEngine(d_sc.socket)
    try:
        good = eng.registration()
        # Framing, before and regardless of registration.
        assert refused(raw.ask(b"\xff\xff\xff\xff")) == "ERR_MALFORMED"
        assert refused(raw.ask([b"a", b"b"])) == "ERR_MALFORMED"
        assert refused(raw.ask(b"")) == "ERR_MALFORMED"  # no oneof member set
        assert refused(raw.ask(b"\0" * ((16 << 20) + 1))) == "ERR_TOO_LARGE"
        assert refused(raw.ask(msg(prefill_done=engine_pb2.PrefillDone(transfer_id="t", block_ids=[1], num_tokens=1)))) == "ERR_NOT_REGISTERED"
        # Registration problems come back as Registered{ok: false, error: "CODE: ..."}.
        bad = engine_pb2.RegisterKvCache()
        bad.CopyFrom(good)
        bad.engine_id = "someone-else"
        assert registered_error(raw.ask(msg(register=bad))) == "ERR_BAD_ENGINE_ID"
        bad.CopyFrom(good)
        bad.layout.num_layers = 0
        assert registered_error(raw.ask(msg(register=bad))) == "ERR_BAD_LAYOUT"
        bad.CopyFrom(good)
        bad.ranks[0].regions[0].length = 10
        assert registered_error(raw.ask(msg(register=bad))) == "ERR_BAD_REGIONS"
        ok = raw.ask(msg(register=good))
        assert ok.registered.ok and ok.registered.epoch != 0, ok
        assert registered_error(raw.ask(msg(register=good))) == "ERR_ALREADY_REGISTERED"
        # Transfer messages: each refusal names the transfer.
        # A P that accepts the connection and never answers: the transfers stay live (handshake
        # timeout 5 s) while the caps and the drain are checked.
        silent = socket.socket()
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        src = f"127.0.0.1:{silent.getsockname()[1]}"
        e = lambda **kw: msg(expect_kv=engine_pb2.ExpectKv(**{"transfer_id": "t1", "source": src, "block_ids": [1],
                                                              "num_tokens": 10, "source_block_ids": [2], "has_source_block_ids": True, **kw}))
        assert refused(raw.ask(e(transfer_id=""))) == "ERR_BAD_TRANSFER_ID"
        assert refused(raw.ask(e(num_tokens=0))) == "ERR_BAD_TOKENS"
        assert refused(raw.ask(e(prefix_tokens=11))) == "ERR_BAD_TOKENS"
        assert refused(raw.ask(e(block_ids=[8]))) == "ERR_BAD_BLOCKS"
        assert refused(raw.ask(e(block_ids=[1, 1], num_tokens=40))) == "ERR_BAD_BLOCKS"
        assert refused(raw.ask(e(source=""))) == "ERR_BAD_SOURCE"
        assert refused(raw.ask(e(source_block_ids=[], has_source_block_ids=False))) == "ERR_NO_SOURCE_BLOCKS"
        assert refused(raw.ask(msg(prefill_done=engine_pb2.PrefillDone(transfer_id="p", block_ids=[1], num_tokens=1)))) == "ERR_WRONG_ROLE"
        # Two live transfers fill this sidecar (--max-transfers 2); one writing into a live one's
        # block, a duplicate and a third are refused.
        raw.link.send(e(transfer_id="live1", block_ids=[1]))
        assert refused(raw.ask(e(transfer_id="clash", block_ids=[1]))) == "ERR_BLOCKS_IN_USE"
        raw.link.send(e(transfer_id="live2", block_ids=[2]))
        assert refused(raw.ask(e(transfer_id="live1"))) == "ERR_DUPLICATE"
        assert refused(raw.ask(e(transfer_id="live3"))) == "ERR_OVERLOADED"
        # Draining (SIGTERM): new transfers are refused while live ones finish.
        d_sc.p.send_signal(signal.SIGTERM)
        reply = wait_for(lambda: _drain_reply(raw, e(transfer_id="late")), 10, "ERR_DRAINING")
        assert refused(reply) == "ERR_DRAINING"
        silent.close()
    finally:
        raw.close()
        eng.close()


def _drain_reply(raw: RawEngine, m):
    """Sends ``m``; returns the refusal once the sidecar says draining (other replies are skipped)."""
    raw.link.send(m)
    try:
        while True:
            r = raw.replies.get(timeout=0.5)
            if r.WhichOneof("msg") == "refused" and r.refused.transfer_id == "late":
                return r if r.refused.code in ("ERR_DRAINING",) else None
    except queue.Empty:
        return None


def test_connector_releases_what_the_sidecar_refuses(sidecars, shm_dir):
    """A refused PrefillDone gives P its blocks back; a refused ExpectKv fails D's load (vLLM
    recomputes). Nothing was started on the sidecar, so nothing can still touch those blocks."""
    p_sc, d_sc = sidecars("prefill"), sidecars("decode")
    p = KvEngine(str(shm_dir), p_sc.engine_id, backend="CPU_ATTN", tp=1, block_size=32, num_blocks=8)
    d = KvEngine(str(shm_dir), d_sc.engine_id, backend="CPU_ATTN", tp=1, block_size=32, num_blocks=8)
    try:
        pw, dw = p.connect(p_sc.socket), d.connect(d_sc.socket)
        pw.on_step(StepMessages(prefill_done=[PrefillDoneMsg("rp", "t", [99], 10)]))  # block 99 of 8
        dw.on_step(StepMessages(expect=[ExpectMsg("rd", "t", [1], 10, 0, "", None)]))  # no source
        pc, dc = Collector(pw), Collector(dw)
        wait_for(lambda: "rp" in pc.poll().finished_sending, 10, "P's refused blocks back")
        wait_for(lambda: "rd" in dc.poll().failed_recving, 10, "D's refused load failed")
        assert "rd" in dc.r.finished_recving
    finally:
        p.close()
        d.close()


# --- restarts ------------------------------------------------------------------------------------------


def test_sidecar_restart_fails_in_flight_and_registers_again(sidecars, shm_dir):
    """kill -9 of D's sidecar with a push in flight; a new sidecar on the same socket: the connector
    registers again (new epoch), fails the transfer the old one forgot (D recomputes), and the next
    transfer moves through the new sidecar."""
    p_sc = sidecars("prefill")
    d_sc = sidecars("decode")
    p = KvEngine(str(shm_dir), p_sc.engine_id, backend="CPU_ATTN", tp=1, block_size=32, num_blocks=8)
    d = KvEngine(str(shm_dir), d_sc.engine_id, backend="CPU_ATTN", tp=1, block_size=32, num_blocks=8)
    try:
        pw, dw = p.connect(p_sc.socket), d.connect(d_sc.socket)
        first_epoch = dw.epoch
        # A push registration that P will never serve: D's transfer stays in flight.
        dw.on_step(StepMessages(expect=[ExpectMsg("r1", "t1", [1], 10, 0, pw.side_channel, None)]))
        dc = Collector(dw)
        d_sc.kill()
        d_sc2 = sidecars("decode", engine_id=d_sc.engine_id, socket=d_sc.socket)
        wait_for(lambda: "r1" in dc.poll().failed_recving, 15, "the forgotten transfer to fail")
        # r1 fails as soon as the restart is noticed (the connection dropping, or the new sidecar
        # answering ERR_NOT_REGISTERED); the new epoch comes with the registration's answer.
        wait_for(lambda: dw.epoch not in (0, first_epoch), 15, "the registration with the new sidecar")
        assert dw.epoch not in (0, first_epoch) and dw.restarts == 1
        # The next transfer goes through the restarted sidecar.
        pw.on_step(StepMessages(prefill_done=[PrefillDoneMsg("p2", "t2", [3, 6], 40)]))
        dw.on_step(StepMessages(expect=[ExpectMsg("r2", "t2", [4, 5], 40, 0, pw.side_channel, [3, 6])]))
        wait_for(lambda: "r2" in dc.poll().finished_recving, 15, "a transfer through the new sidecar")
        assert "r2" not in dc.r.failed_recving
        assert d_sc2.status()["epoch"] == str(dw.epoch)
    finally:
        p.close()
        d.close()


def test_sidecar_gone_for_good_fails_in_flight_after_the_bound(sidecars, shm_dir):
    p_sc, d_sc = sidecars("prefill"), sidecars("decode")
    p = KvEngine(str(shm_dir), p_sc.engine_id, backend="CPU_ATTN", tp=1, block_size=32, num_blocks=8)
    d = KvEngine(str(shm_dir), d_sc.engine_id, backend="CPU_ATTN", tp=1, block_size=32, num_blocks=8)
    try:
        pw = p.connect(p_sc.socket, lost_timeout_s=0.5)
        dw = d.connect(d_sc.socket)
        pw.on_step(StepMessages(prefill_done=[PrefillDoneMsg("rp", "t", [1], 10)]))  # held by P's lease
        pc = Collector(pw)
        p_sc.kill()
        wait_for(lambda: "rp" in pc.poll().finished_sending, 10, "P's blocks back after its sidecar died")
        dw.close()
    finally:
        p.close()
        d.close()


def test_unknown_engine_answer_reregisters(sidecars, shm_dir):
    """ERR_NOT_REGISTERED for a message the connector sent: the sidecar forgot this engine without
    the connection dropping; the connector fails what it had in flight and registers again."""
    d_sc = sidecars("decode")
    d = KvEngine(str(shm_dir), d_sc.engine_id, backend="CPU_ATTN", tp=1, block_size=32, num_blocks=8)
    try:
        dw = d.connect(d_sc.socket)
        dw.on_step(StepMessages(expect=[ExpectMsg("r1", "t1", [1], 10, 0, "127.0.0.1:1", None)]))
        dc = Collector(dw)
        dw._on_message(engine_pb2.SidecarToEngine(refused=engine_pb2.Refused(transfer_id="t1", code="ERR_NOT_REGISTERED")))
        assert "r1" in dc.poll().failed_recving
        assert dw.restarts == 1
    finally:
        d.close()


def test_reregistration_refused_by_the_same_sidecar_is_retried(sidecars, shm_dir):
    """After a reconnect the sidecar hands the link to the new connection only once it has seen the
    old one end; until then it answers ERR_ENGINE_LINK_TAKEN at the
    same epoch. The connector asks again (bounded) and loses nothing; a transfer still works."""
    p_sc, d_sc = sidecars("prefill"), sidecars("decode")
    p = KvEngine(str(shm_dir), p_sc.engine_id, backend="CPU_ATTN", tp=1, block_size=32, num_blocks=8)
    d = KvEngine(str(shm_dir), d_sc.engine_id, backend="CPU_ATTN", tp=1, block_size=32, num_blocks=8)
    try:
        pw, dw = p.connect(p_sc.socket), d.connect(d_sc.socket)
        epoch = dw.epoch
        dw._on_message(engine_pb2.SidecarToEngine(registered=engine_pb2.Registered(
            ok=False, error="ERR_ENGINE_LINK_TAKEN: another live connection owns this engine link", epoch=epoch)))
        assert dw._already_retries == 1
        # The retry reaches the sidecar, which (this connection owns the link) answers "already
        # registered" (ERR_ALREADY_REGISTERED): no further retry, nothing failed.
        time.sleep(1.0)
        assert dw._already_retries == 1 and dw.epoch == epoch and dw.restarts == 0
        dc = Collector(dw)
        pw.on_step(StepMessages(prefill_done=[PrefillDoneMsg("p1", "t1", [3, 6], 40)]))
        dw.on_step(StepMessages(expect=[ExpectMsg("r1", "t1", [4, 5], 40, 0, pw.side_channel, [3, 6])]))
        wait_for(lambda: "r1" in dc.poll().finished_recving, 15, "a transfer after the retried registration")
        assert "r1" not in dc.r.failed_recving
    finally:
        p.close()
        d.close()


def test_p_sidecar_killed_with_a_cached_peer_fails_the_pull_and_frees_d(sidecars, shm_dir):
    """D pulled from P before (its sidecar caches P's endpoint); P's sidecar is then SIGKILLed and
    D pulls again: the reads can never complete, yet D's load fails and its blocks come back
    within the peer timeout plus a grace, so vLLM can recompute."""
    p_sc = sidecars("prefill")
    d_sc = sidecars("decode", "--peer-timeout-ms", "1000", "--heartbeat-ms", "200")
    p = KvEngine(str(shm_dir), p_sc.engine_id, backend="CPU_ATTN", tp=1, block_size=32, num_blocks=8)
    d = KvEngine(str(shm_dir), d_sc.engine_id, backend="CPU_ATTN", tp=1, block_size=32, num_blocks=8)
    try:
        pw, dw = p.connect(p_sc.socket), d.connect(d_sc.socket)
        pc, dc = Collector(pw), Collector(dw)
        pw.on_step(StepMessages(prefill_done=[PrefillDoneMsg("p1", "t1", [1, 2], 40)]))
        dw.on_step(StepMessages(expect=[ExpectMsg("d1", "t1", [3, 4], 40, 0, pw.side_channel, [1, 2])]))
        wait_for(lambda: "d1" in dc.poll().finished_recving, 15, "a first pull")
        assert "d1" not in dc.r.failed_recving
        side = pw.side_channel
        p_sc.kill()
        dw.on_step(StepMessages(expect=[ExpectMsg("d2", "t2", [5, 6], 40, 0, side, [1, 2])]))
        wait_for(lambda: "d2" in dc.poll().failed_recving, 15, "D's pull from a dead P to fail and free its blocks")
        assert "d2" in dc.r.finished_recving
    finally:
        p.close()
        d.close()
