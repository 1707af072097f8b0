"""kvxfer_vllm.client, a router's gRPC client, against real sidecars moving real KV: awaiting a
transfer before, during and after it completes; a watch whose connection a proxy cuts resumes with
no event lost or repeated."""

from __future__ import annotations

import asyncio
import contextlib

import pytest
from conftest import unique, wait_for
from kvengine import KvEngine

from kvxfer_vllm.client import SidecarClient, SidecarError, WatchError
from kvxfer_vllm.messages import ExpectMsg, PrefillDoneMsg, StepMessages
from kvxfer_vllm.worker import Results

TOKENS = 40  # two blocks of 32


class Pair:
    """A prefill and a decode engine (vLLM's CPU layout, TP 1) with their sidecars."""

    def __init__(self, sidecars, shm_dir, d_flags: tuple[str, ...] = ()) -> None:
        self.p_sc = sidecars("prefill")
        self.d_sc = sidecars("decode", *d_flags)
        self.p = KvEngine(str(shm_dir), self.p_sc.engine_id, backend="CPU_ATTN", tp=1, block_size=32, num_blocks=8)
        self.d = KvEngine(str(shm_dir), self.d_sc.engine_id, backend="CPU_ATTN", tp=1, block_size=32, num_blocks=8)
        self.pw = self.p.connect(self.p_sc.socket)
        self.dw = self.d.connect(self.d_sc.socket)
        self.p.fill_random(1)
        self.p_done = Results()
        self.d_done = Results()

    def expect(self, tid: str) -> None:
        """D's engine expects the transfer (push: D registers with P, which waits for prefill)."""
        self.dw.on_step(StepMessages(expect=[ExpectMsg(f"d-{tid}", tid, [1, 2], TOKENS, 0, self.pw.side_channel,
                                                       None)]))

    def prefill_done(self, tid: str) -> None:
        self.pw.on_step(StepMessages(prefill_done=[PrefillDoneMsg(f"p-{tid}", tid, [3, 4], TOKENS)]))

    def finished(self, tid: str) -> bool:
        """Both engines heard the end: D has its KV, P has its blocks back."""
        for worker, acc in ((self.pw, self.p_done), (self.dw, self.d_done)):
            got = worker.take_results()
            acc.finished_sending |= got.finished_sending
            acc.finished_recving |= got.finished_recving
            acc.failed_recving |= got.failed_recving
        assert f"d-{tid}" not in self.d_done.failed_recving
        return f"d-{tid}" in self.d_done.finished_recving and f"p-{tid}" in self.p_done.finished_sending

    def close(self) -> None:
        self.p.close()
        self.d.close()


@contextlib.contextmanager
def pair(sidecars, shm_dir, d_flags: tuple[str, ...] = ()):
    pr = Pair(sidecars, shm_dir, d_flags)
    try:
        yield pr
    finally:
        pr.close()


async def until(predicate, timeout: float, what: str) -> None:
    """Polls ``predicate`` without blocking the event loop; fails after ``timeout`` seconds."""
    end = asyncio.get_running_loop().time() + timeout
    while not predicate():
        if asyncio.get_running_loop().time() > end:
            pytest.fail(f"timed out after {timeout} s waiting for {what}")
        await asyncio.sleep(0.02)


def test_await_kv_before_during_and_after_a_real_transfer(sidecars, shm_dir):
    with pair(sidecars, shm_dir) as pr:
        tid = unique("t")

        async def main() -> None:
            async with SidecarClient(pr.d_sc.grpc) as c:
                # Before: D's sidecar has not heard of the transfer yet.
                before = asyncio.create_task(c.await_kv(tid, 30))
                await asyncio.sleep(0.3)
                assert not before.done()
                # During: D registered with P, which waits for its prefill.
                pr.expect(tid)
                await until(lambda: pr.d_sc.status()["transfersByState"].get("decode:MOVING") == 1, 10,
                            "D's transfer MOVING")
                during = asyncio.create_task(c.await_kv(tid, 30))
                await asyncio.sleep(0.3)
                assert not before.done() and not during.done()
                pr.prefill_done(tid)
                ev_before, ev_during = await before, await during
                # After: answered at once from the sidecar's log.
                ev_after = await c.await_kv(tid, 5)
                assert ev_before == ev_during == ev_after
                assert ev_after.ready and ev_after.kind == "KV_READY"
                assert (ev_after.transfer_id, ev_after.side, ev_after.mode) == (tid, "decode", "push")
                assert ev_after.bytes > 0 and ev_after.seq > 0
                # A transfer that never comes: TimeoutError at the deadline, not a hang.
                with pytest.raises(TimeoutError, match="has not ended within 0.5 s"):
                    await c.await_kv(unique("never"), 0.5)
                # A malformed id: the sidecar's refusal, by status.
                with pytest.raises(SidecarError) as bad:
                    await c.await_kv("", 5)
                assert bad.value.code.name == "INVALID_ARGUMENT"
                with pytest.raises(ValueError):
                    await c.await_kv(tid, 0)

        asyncio.run(main())
        wait_for(lambda: pr.finished(tid), 20, "both engines to hear the end")


class CuttableProxy:
    """A TCP proxy on loopback in front of a gRPC address: ``cut()`` drops every connection and
    refuses new ones until ``restore()``."""

    def __init__(self, target: str) -> None:
        host, port = target.rsplit(":", 1)
        self.target = (host, int(port))
        self.up = True
        self.conns: set[asyncio.StreamWriter] = set()
        self.server: asyncio.base_events.Server | None = None
        self.address = ""

    async def start(self) -> None:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.address = f"127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if not self.up:
            writer.close()
            return
        try:
            ur, uw = await asyncio.open_connection(*self.target)
        except OSError:
            writer.close()
            return
        self.conns |= {writer, uw}

        async def pipe(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            with contextlib.suppress(Exception):
                while data := await r.read(65536):
                    w.write(data)
                    await w.drain()
            w.close()

        await asyncio.gather(pipe(reader, uw), pipe(ur, writer))
        self.conns -= {writer, uw}

    def cut(self) -> None:
        self.up = False
        for w in list(self.conns):
            w.transport.abort()
        self.conns.clear()

    def restore(self) -> None:
        self.up = True

    async def close(self) -> None:
        self.cut()
        if self.server is not None:
            self.server.close()
            await self.server.wait_closed()


def test_watch_resumes_after_a_cut_connection_with_nothing_lost_or_repeated(sidecars, shm_dir):
    with pair(sidecars, shm_dir) as pr:
        ids = [unique("w") for _ in range(4)]

        async def transfer(tid: str) -> None:
            pr.expect(tid)
            pr.prefill_done(tid)
            await until(lambda: pr.finished(tid), 20, f"transfer {tid}")

        async def main() -> None:
            proxy = CuttableProxy(pr.d_sc.grpc)
            await proxy.start()
            seen: list = []
            try:
                async with SidecarClient(proxy.address) as c:
                    w = c.watch(kinds=("KV_READY",))

                    async def consume() -> None:
                        async for ev in w:
                            seen.append(ev)
                            if len(seen) == len(ids):
                                return

                    consumer = asyncio.create_task(consume())
                    await transfer(ids[0])
                    await until(lambda: len(seen) == 1, 10, "the first event")
                    # The connection drops; two transfers end while the router is away.
                    proxy.cut()
                    await transfer(ids[1])
                    await transfer(ids[2])
                    await asyncio.sleep(0.5)
                    assert len(seen) == 1
                    proxy.restore()
                    await transfer(ids[3])
                    await asyncio.wait_for(consumer, 20)
                    assert w.reconnects >= 1
                # Every event once, in log order, none missing: the same as a fresh watch from 0.
                assert [e.transfer_id for e in seen] == ids
                seqs = [e.seq for e in seen]
                assert seqs == sorted(set(seqs))
                async with SidecarClient(pr.d_sc.grpc) as direct:
                    replay = []
                    fresh = direct.watch(kinds=("KV_READY",))
                    async for ev in fresh:
                        replay.append(ev)
                        if len(replay) == len(ids):
                            break
                    assert replay == seen
                    # A resume into another epoch (as after a sidecar restart) is refused, not guessed.
                    with pytest.raises(WatchError) as err:
                        async for _ in direct.watch(from_seq=seqs[-1], epoch=fresh.epoch ^ 1):
                            pass
                    assert err.value.code.name == "FAILED_PRECONDITION"
            finally:
                await proxy.close()

        asyncio.run(main())
