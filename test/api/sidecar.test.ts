/**
 * The gRPC API of a real sidecar: exactly-once events for a router that
 * reconnects, AwaitTransfer on real transfers, and the SIGTERM drain.
 */
import { afterEach, describe, expect, it } from "vitest";

import { SidecarClient, type EventWatch } from "../../src/api/client.js";
import { DEFAULT_DEMO } from "../../sim/demo-types.js";
import { startNode, type NodeShape } from "../../sim/demo-node.js";
import type { SimEngineProcess } from "../../sim/engine-client.js";
import type { SidecarProcess } from "../../sim/sidecar-process.js";
import type { SidecarEvent } from "../../src/sidecar/view.js";

const TINY: NodeShape = {
  ...DEFAULT_DEMO,
  pTp: 1,
  dTp: 1,
  pBlock: 16,
  dBlock: 16,
  layers: 1,
  kvHeads: 1,
  headDim: 8,
  mode: "push",
  requestTimeoutMs: 30_000,
};

let sidecars: SidecarProcess[] = [];
let engines: SimEngineProcess[] = [];
let clients: SidecarClient[] = [];

afterEach(async () => {
  for (const c of clients) c.close();
  await Promise.all(engines.map((e) => e.close()));
  await Promise.all(sidecars.map((s) => s.close()));
  sidecars = [];
  engines = [];
  clients = [];
});

async function pair(tag: string, dArgs: string[] = [], blocks = 256) {
  const p = await startNode(TINY, "prefill", `${tag}-p-${process.pid}`, {
    sidecars,
    engines,
    blocks,
  });
  const d = await startNode(TINY, "decode", `${tag}-d-${process.pid}`, {
    sidecars,
    engines,
    blocks,
    extraArgs: dArgs,
  });
  const pApi = new SidecarClient(p.ready.grpc!);
  const dApi = new SidecarClient(d.ready.grpc!);
  clients.push(pApi, dApi);
  return { p, d, pApi, dApi };
}

describe("a router watching a real sidecar", () => {
  it("receives every terminal event exactly once across 10 000 transfers while reconnecting", async () => {
    const { p, d, dApi } = await pair("once");
    const N = 10_000;
    const seen = new Map<string, number>();
    let lastSeq = 0;
    let watch: EventWatch | undefined;
    let deliveries = 0;
    const onEvent = (ev: SidecarEvent): void => {
      // The router's own bookkeeping: resume from the last seq it processed.
      lastSeq = ev.seq;
      seen.set(ev.transferId, (seen.get(ev.transferId) ?? 0) + 1);
      deliveries++;
    };
    const open = (): void => {
      watch = dApi.watch(
        { afterSeq: lastSeq, kinds: ["KV_READY", "FAILED", "EXPIRED", "ABORTED"] },
        onEvent,
      );
      watch.done.catch(() => undefined);
    };
    open();
    let disconnects = 0;
    let next = 0;
    const worker = async (): Promise<void> => {
      while (next < N) {
        const i = next++;
        const id = `once-${i}`;
        await Promise.all([
          p.engine.prefill(id, 16, 0),
          d.engine.expect({ transferId: id, tokens: 16, source: p.ready.sideChannel }),
        ]);
        await d.engine.waitTransfer(id, "verified", 20_000);
        // Drop the stream now and then: transfers go on while the router is away.
        if (i % 1500 === 750) {
          watch?.cancel();
          disconnects++;
          setTimeout(open, 200);
        }
      }
    };
    const t0 = Date.now();
    await Promise.all(Array.from({ length: 16 }, worker));
    const end = Date.now() + 20_000;
    while (seen.size < N && Date.now() < end) await new Promise((r) => setTimeout(r, 50));
    watch?.cancel();
    console.log(
      `${N} transfers in ${((Date.now() - t0) / 1000).toFixed(1)} s; watcher reconnected ${disconnects} times; ${deliveries} deliveries`,
    );
    expect(disconnects).toBeGreaterThanOrEqual(5);
    expect(seen.size).toBe(N);
    expect([...seen.values()].every((n) => n === 1)).toBe(true);
    expect(deliveries).toBe(N);
  }, 600_000);

  it("AwaitTransfer before, during and after a real transfer, and with a deadline that passes", async () => {
    const { p, d, dApi, pApi } = await pair("await", ["--metrics", "127.0.0.1:0"]);
    // Before: the call is waiting when the transfer starts.
    const early = dApi.awaitTransfer("aw-1", 20_000);
    await new Promise((r) => setTimeout(r, 100));
    // During: P computes for a while; the call is made while the transfer is open.
    const pre = p.engine.prefill("aw-1", 64, 500);
    await d.engine.expect({ transferId: "aw-1", tokens: 64, source: p.ready.sideChannel });
    const during = dApi.awaitTransfer("aw-1", 20_000);
    await pre;
    expect((await early).kind).toBe("KV_READY");
    expect((await during).kind).toBe("KV_READY");
    // After: the event is in the log.
    expect((await dApi.awaitTransfer("aw-1", 1000)).kind).toBe("KV_READY");
    expect((await pApi.awaitTransfer("aw-1", 5000, { side: "prefill" })).kind).toBe("RELEASED");
    // A deadline that passes: DEADLINE_EXCEEDED.
    const err = await dApi.awaitTransfer("never", 300).then(
      () => undefined,
      (e: unknown) => e as { code?: number },
    );
    expect(err?.code).toBe(4); // grpc.status.DEADLINE_EXCEEDED
    // The same transfer in D's Prometheus metrics.
    const text = await (await fetch(`http://${d.ready.metrics!}/metrics`)).text();
    expect(text).toMatch(/kvxfer_transfers_ready_total\{mode="push"\} 1/);
    expect(text).toMatch(/kvxfer_transfer_latency_seconds_count\{mode="push"\} 1/);
    expect(text).toMatch(/kvxfer_transfer_bytes_total\{mode="push"\} [1-9]/);
    expect(text).toMatch(/kvxfer_queue_depth\{queue="decode_live"\} 0/);
  }, 120_000);
});

describe("SIGTERM", () => {
  it("flips health to NOT_SERVING, lets the in-flight transfer end on both sides, refuses new ones, then exits", async () => {
    const { p, d, pApi, dApi } = await pair("drain", ["--drain-ms", "15000"]);
    expect(await dApi.health()).toBe("SERVING");
    // In flight: D has registered, P is still computing.
    const pre = p.engine.prefill("drain-1", 64, 1500);
    await d.engine.expect({ transferId: "drain-1", tokens: 64, source: p.ready.sideChannel });
    // D's sidecar has the transfer (not only its engine): it is in flight when SIGTERM lands.
    const listed = Date.now() + 10_000;
    while (!(await dApi.listTransfers()).transfers.some((t) => t.transferId === "drain-1")) {
      if (Date.now() > listed) throw new Error("D's sidecar never listed drain-1");
      await new Promise((r) => setTimeout(r, 10));
    }
    const terminal = dApi.awaitTransfer("drain-1", 20_000);
    const exited = new Promise<number | null>((resolve) =>
      d.sidecar.child.on("exit", (code) => resolve(code)),
    );
    d.sidecar.kill("SIGTERM");
    const healthEnd = Date.now() + 5000;
    let health = await dApi.health();
    while (health !== "NOT_SERVING" && Date.now() < healthEnd) {
      await new Promise((r) => setTimeout(r, 20));
      health = await dApi.health();
    }
    expect(health).toBe("NOT_SERVING");
    // A new transfer is refused while draining.
    await d.engine.expect({ transferId: "drain-2", tokens: 16, source: p.ready.sideChannel });
    const refused = await d.engine.waitEvent(
      (e) => e.event === "refused" && e.transferId === "drain-2",
      10_000,
    );
    expect(refused.code).toBe("ERR_DRAINING");
    await pre;
    const ev = await terminal;
    expect(ev.kind).toBe("KV_READY");
    expect((await d.engine.waitTransfer("drain-1", "verified", 10_000)).ok).toBe(true);
    expect((await pApi.awaitTransfer("drain-1", 10_000, { side: "prefill" })).kind).toBe(
      "RELEASED",
    );
    const code = await Promise.race([
      exited,
      new Promise((r) => setTimeout(() => r("timeout"), 20_000)),
    ]);
    expect(code).toBe(0);
  }, 120_000);
});
