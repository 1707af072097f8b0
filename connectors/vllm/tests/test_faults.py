"""The connector's own logic under faults, against real sidecars (issue 35): a sidecar that stays
down, P giving up on a push, and what each side holds afterwards. Each test prints what an engine
would see (how long until each request is decided) and checks every block is back on both sides."""

from __future__ import annotations

import socket
import time

from conftest import wait_for
from kvengine import KvEngine
from test_transfer import Collector

from kvxfer_vllm.messages import ExpectMsg, GiveUpMsg, PrefillDoneMsg, StepMessages


def engines(shm_dir, p_sc, d_sc):
    p = KvEngine(str(shm_dir), p_sc.engine_id, backend="CPU_ATTN", tp=1, block_size=32, num_blocks=16)
    d = KvEngine(str(shm_dir), d_sc.engine_id, backend="CPU_ATTN", tp=1, block_size=32, num_blocks=16)
    return p, d


def test_a_sidecar_that_stays_down_fails_every_request_fast_on_both_roles(sidecars, shm_dir):
    """Both sidecars die with a pull and a push in flight and stay down. What was in flight fails
    after ``sidecar_lost_timeout_s``; everything asked after the loss (before and after that bound
    fired, push and pull, P and D) is decided at the next poll: D recomputes, P gets its blocks
    back. Nothing is held on either engine. Once a sidecar is back, transfers move again."""
    p_sc, d_sc = sidecars("prefill"), sidecars("decode")
    p, d = engines(shm_dir, p_sc, d_sc)
    try:
        pw = p.connect(p_sc.socket, lost_timeout_s=0.5)
        dw = d.connect(d_sc.socket, lost_timeout_s=0.5)
        pc, dc = Collector(pw), Collector(dw)
        side = pw.side_channel
        # In flight at the loss: P holds t1 (no D reads it); D waits for a pull (from a P that
        # accepts the connection and never answers) and a push.
        silent = socket.socket()
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        nowhere = f"127.0.0.1:{silent.getsockname()[1]}"
        pw.on_step(StepMessages(prefill_done=[PrefillDoneMsg("p1", "t1", [1], 10)]))
        dw.on_step(StepMessages(expect=[ExpectMsg("d-pull", "tx", [1], 10, 0, nowhere, [5]),
                                        ExpectMsg("d-push", "ty", [2], 10, 0, side, None)]))
        wait_for(lambda: pw.in_flight() == 1 and dw.in_flight() == 2, 5, "the transfers to be sent")
        p_sc.kill()
        d_sc.kill()
        wait_for(lambda: pw.link_down() and dw.link_down(), 10, "both links to drop")
        lost = time.monotonic()
        # Asked while down, before the bound fired: decided at once.
        pw.on_step(StepMessages(prefill_done=[PrefillDoneMsg("p2", "t2", [2], 10)]))
        dw.on_step(StepMessages(expect=[ExpectMsg("d2", "t2", [3], 10, 0, side, [2])]))
        assert "p2" in pc.poll().finished_sending
        assert "d2" in dc.poll().failed_recving and "d2" in dc.r.finished_recving
        # What was in flight waits for the bound, then fails.
        wait_for(lambda: "p1" in pc.poll().finished_sending, 5, "P's in-flight blocks back")
        wait_for(lambda: {"d-pull", "d-push"} <= dc.poll().failed_recving, 5, "D's in-flight loads failed")
        in_flight_s = time.monotonic() - lost
        # The bound fired long ago; the sidecars are still down: every new request, each role and
        # mode, is decided at the very next poll (the first try, not after another bound).
        for i in range(5):
            time.sleep(0.6)  # past the bound again
            pw.on_step(StepMessages(prefill_done=[PrefillDoneMsg(f"p-late{i}", f"tl{i}", [3 + i], 10)]))
            dw.on_step(StepMessages(expect=[ExpectMsg(f"d-late-pull{i}", f"tl{i}", [4 + i], 10, 0, side, [3 + i]),
                                            ExpectMsg(f"d-late-push{i}", f"tm{i}", [10 + i], 10, 0, side, None)]))
            assert f"p-late{i}" in pc.poll().finished_sending
            got = dc.poll()
            assert {f"d-late-pull{i}", f"d-late-push{i}"} <= got.failed_recving & got.finished_recving
        # Nothing is held on either engine, and vLLM's metrics count what was refused.
        assert pw.in_flight() == 0 and dw.in_flight() == 0
        assert pw.stats.snapshot()["link_down"] == 6 and dw.stats.snapshot()["link_down"] == 11
        assert dw.stats.snapshot()["recomputed"] == 13
        print(f"\nin flight at the loss: decided after {in_flight_s:.2f} s (bound 0.5 s); "
              "asked while down: decided at the next poll; held afterwards: P 0, D 0")
        # The sidecars come back (new epochs): the links come up and transfers move again.
        p_sc2 = sidecars("prefill", engine_id=p_sc.engine_id, socket=p_sc.socket)
        sidecars("decode", engine_id=d_sc.engine_id, socket=d_sc.socket)
        wait_for(lambda: not pw.link_down() and not dw.link_down(), 15, "both links back")
        pw.on_step(StepMessages(prefill_done=[PrefillDoneMsg("p9", "t9", [1, 2], 40)]))
        dw.on_step(StepMessages(expect=[ExpectMsg("d9", "t9", [3, 4], 40, 0, p_sc2.side_channel, [1, 2])]))
        wait_for(lambda: "d9" in dc.poll().finished_recving, 15, "a transfer through the new sidecars")
        assert "d9" not in dc.r.failed_recving
        wait_for(lambda: "p9" in pc.poll().finished_sending, 15, "P's blocks back after D read them")
        assert pw.in_flight() == 0 and dw.in_flight() == 0
        silent.close()
    finally:
        p.close()
        d.close()


def test_p_giving_up_on_a_push_fails_d_at_once(sidecars, shm_dir):
    """Push: D registered its blocks with P's sidecar while P computes. P's request then ends
    without KV (aborted, or finished with nothing to send): P tells its sidecar, which tells D; D
    recomputes within a second instead of after its transfer timeout (60 s here). Both orders:
    P gives up after D registered, and before (D's registration is then refused at once)."""
    p_sc = sidecars("prefill", "--mode", "push")
    d_sc = sidecars("decode", "--mode", "push", "--transfer-timeout-ms", "60000")
    p, d = engines(shm_dir, p_sc, d_sc)
    try:
        pw, dw = p.connect(p_sc.socket), d.connect(d_sc.socket)
        pc, dc = Collector(pw), Collector(dw)
        side = pw.side_channel
        # D first: its registration waits on P's sidecar.
        dw.on_step(StepMessages(expect=[ExpectMsg("d1", "g1", [1, 2], 40, 0, side, None, token="tok1")]))
        wait_for(lambda: _by_state(p_sc).get("prefill:WAITING", 0) == 1, 15, "D's registration on P")
        assert not dc.poll().finished_recving  # still waiting for P
        t0 = time.monotonic()
        pw.on_step(StepMessages(give_up=[GiveUpMsg("p1", "g1")]))
        wait_for(lambda: "d1" in dc.poll().failed_recving, 10, "D to recompute after P gave up")
        after_reg = time.monotonic() - t0
        # P first: its sidecar remembers; D's registration is answered with a failure at once.
        pw.on_step(StepMessages(give_up=[GiveUpMsg("p2", "g2")]))
        time.sleep(0.3)
        t0 = time.monotonic()
        dw.on_step(StepMessages(expect=[ExpectMsg("d2", "g2", [3, 4], 40, 0, side, None, token="tok2")]))
        wait_for(lambda: "d2" in dc.poll().failed_recving, 10, "D's late registration refused")
        before_reg = time.monotonic() - t0
        assert after_reg < 5 and before_reg < 5
        assert [f[:2] for f in dw.failures] == [("g1", "FAILURE_REASON_PEER_FAILED"), ("g2", "FAILURE_REASON_PEER_FAILED")]
        assert dw.in_flight() == 0 and pw.in_flight() == 0
        # P gave up on requests it never held: nothing was reported to vLLM for them.
        assert not pc.poll().finished_sending
        # A push that P does serve is untouched.
        dw.on_step(StepMessages(expect=[ExpectMsg("d3", "g3", [5, 6], 40, 0, side, None, token="tok3")]))
        pw.on_step(StepMessages(prefill_done=[PrefillDoneMsg("p3", "g3", [7, 8], 40, token="tok3")]))
        wait_for(lambda: "d3" in dc.poll().finished_recving, 15, "a push after the give-ups")
        assert "d3" not in dc.r.failed_recving
        wait_for(lambda: "p3" in pc.poll().finished_sending, 15, "P's blocks back after the push")
        print(f"\nP gave up after D registered: D recomputes after {after_reg:.2f} s; "
              f"before: after {before_reg:.2f} s (transfer timeout 60 s); held afterwards: P 0, D 0")
    finally:
        p.close()
        d.close()


def _by_state(sc) -> dict[str, int]:
    return sc.status().get("transfersByState", {})


def test_a_restarted_engine_under_a_running_sidecar_registers_once_the_old_one_is_gone(sidecars, shm_dir):
    """vLLM restarted alone (the kubelet restarts one container): the new engine's registration
    names other memory. The sidecar refuses it while the old engine may still be alive, stops
    (exit 75) once the old one is provably gone (here: its link away for --engine-lease-ms; its
    files stay, as after a SIGKILL), and the sidecar started in its place (the kubelet again)
    accepts it: the connector asks again until ``register_timeout_s`` instead of failing."""
    import threading

    sc = sidecars("prefill", "--engine-lease-ms", "1500")
    old = KvEngine(str(shm_dir), sc.engine_id, backend="CPU_ATTN", tp=1, block_size=32, num_blocks=8)
    # Another process's files (their names carry the pid): another folder here.
    (shm_dir / "new").mkdir()
    new = KvEngine(str(shm_dir / "new"), sc.engine_id, backend="CPU_ATTN", tp=1, block_size=32, num_blocks=8)
    try:
        old.connect(sc.socket).close()  # the old engine's process is gone: its link closes
        t0 = time.monotonic()
        done: dict = {}
        th = threading.Thread(target=lambda: done.update(w=new.connect(sc.socket)), daemon=True)
        th.start()
        wait_for(lambda: sc.p.poll() is not None, 10, "the sidecar to stop for the new engine")
        assert sc.p.returncode == 75
        sc2 = sidecars("prefill", engine_id=sc.engine_id, socket=sc.socket)
        th.join(20)
        assert "w" in done, "the new engine never registered"
        w = done["w"]
        assert w.epoch == int(sc2.ready["epoch"]) and not w.link_down()
        print(f"\nrestarted engine registered {time.monotonic() - t0:.1f} s after it started (engine lease 1.5 s)")
    finally:
        old.close()
        new.close()
        (shm_dir / "new").rmdir()


def test_a_push_for_another_prompt_is_refused_before_any_write(sidecars, shm_dir):
    """Push: a request for another prompt presents the real transfer's id and token (a forgery sent
    straight to a decode engine). Its token is bound to its own prompt, so P's sidecar refuses it
    by name before writing anything, while the real decode engine, which registered after it,
    gets the KV; P's blocks come back as soon as the real transfer is done."""
    from kvxfer_vllm.params import bind_token, prompt_digest

    p_sc = sidecars("prefill", "--mode", "push")
    f_sc = sidecars("decode", "--mode", "push")
    d_sc = sidecars("decode", "--mode", "push")
    p = KvEngine(str(shm_dir), p_sc.engine_id, backend="CPU_ATTN", tp=1, block_size=32, num_blocks=16)
    f = KvEngine(str(shm_dir), f_sc.engine_id, backend="CPU_ATTN", tp=1, block_size=32, num_blocks=16)
    d = KvEngine(str(shm_dir), d_sc.engine_id, backend="CPU_ATTN", tp=1, block_size=32, num_blocks=16)
    try:
        pw, fw, dw = p.connect(p_sc.socket), f.connect(f_sc.socket), d.connect(d_sc.socket)
        pc, fc, dc = Collector(pw), Collector(fw), Collector(dw)
        side = pw.side_channel
        real, other = [5, 9, 2, 7] * 10, [5, 9, 2, 8] * 10
        token = "router-token"
        bound = lambda ids: bind_token(token, prompt_digest(ids, 40))
        fw.on_step(StepMessages(expect=[ExpectMsg("f1", "t", [1, 2], 40, 0, side, None, token=bound(other))]))
        wait_for(lambda: _by_state(p_sc).get("prefill:WAITING", 0) == 1, 15, "the forged registration on P")
        dw.on_step(StepMessages(expect=[ExpectMsg("d1", "t", [3, 4], 40, 0, side, None, token=bound(real))]))
        time.sleep(0.5)  # the real registration reaches P too (kept aside until PrefillDone)
        pw.on_step(StepMessages(prefill_done=[PrefillDoneMsg("p1", "t", [5, 6], 40, token=bound(real))]))
        wait_for(lambda: "d1" in dc.poll().finished_recving, 15, "the real transfer")
        assert "d1" not in dc.r.failed_recving
        wait_for(lambda: "f1" in fc.poll().failed_recving, 15, "the forgery refused")
        assert [x[0] for x in fw.failures] == ["t"] and "not the decode engine this transfer names" in fw.failures[0][2]
        wait_for(lambda: "p1" in pc.poll().finished_sending, 15, "P's blocks back after the real transfer")
        assert pw.in_flight() == 0 and fw.in_flight() == 0 and dw.in_flight() == 0
        print(f"\nforged push refused: {fw.failures[0][2]}; real transfer landed; held afterwards: P 0, D 0, forger 0")
    finally:
        p.close()
        f.close()
        d.close()
