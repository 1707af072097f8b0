/**
 * End to end across processes: sidecars and simulated engines as separate
 * processes, UCX between them, every byte checked by D's engine.
 */
import { afterAll, beforeAll, describe, expect, it } from "vitest";

import { SidecarClient } from "../../../src/api/client.js";
import { DEFAULT_DEMO, type DemoOptions } from "../../../sim/demo-types.js";
import { runDemo } from "../../../sim/demo.js";
import { startNode, type Node } from "../../../sim/demo-node.js";
import type { SimEngineProcess } from "../../../sim/engine-client.js";
import type { SidecarProcess } from "../../../sim/sidecar-process.js";
import type { TransferInfo, TransferState } from "../../../src/sidecar/view.js";
import { awaitListed } from "./fixtures.js";
import { kvxfer } from "../../cli/run.js";
import { OP_STEPS } from "../fakes.js";
import { canCreateNetns, createNetnsPair, type NetnsPair } from "../../../bench/native/netns.js";

/**
 * Small shapes: the point is every pairing, not volume (2 cores). KV in files, as engines place it
 * by default (the demo's own default, segments, has its test below).
 */
const SMALL: DemoOptions = {
  ...DEFAULT_DEMO,
  kvMemory: "file",
  prefill: 1,
  decode: 1,
  pTp: 1,
  dTp: 1,
  layers: 2,
  requests: 4,
  promptTokens: [40, 200],
  computeMs: 5,
  concurrency: 2,
  requestTimeoutMs: 30_000,
};

async function demo(over: Partial<DemoOptions>): Promise<Awaited<ReturnType<typeof runDemo>>> {
  const s = await runDemo({ ...SMALL, ...over });
  if (!s.verified) console.log(JSON.stringify(s, null, 2));
  expect(s.failures).toEqual([]);
  expect(s.mismatches).toBe(0);
  expect(s.leakedBlocks).toBe(0);
  expect(s.checkedBytes).toBeGreaterThan(0);
  expect(s.verified).toBe(true);
  return s;
}

describe("transfers across processes over shared memory, byte-verified", () => {
  it("1P1D push", async () => {
    const s = await demo({ mode: "push" });
    expect(s.byMode).toEqual({ push: 4 });
  });

  it("1P1D pull", async () => {
    const s = await demo({ mode: "pull", dispatch: "sequential" });
    expect(s.byMode).toEqual({ pull: 4 });
  });

  it("1P1D auto: pull when the router has P's block ids, push when it has not", async () => {
    expect((await demo({ mode: "auto", dispatch: "sequential" })).byMode).toEqual({ pull: 4 });
    expect((await demo({ mode: "auto", dispatch: "concurrent" })).byMode).toEqual({ push: 4 });
  });

  it.each(["concurrent", "sequential"] as const)(
    "a request larger than P's cache fails alone, D's side is aborted, the others are verified (%s dispatch)",
    async (dispatch) => {
      // Each engine has 2 blocks: 48 tokens need 3 of P's (16 tokens each), only 2 of D's (32).
      // P refuses at once; D's blocks, when it took them, must come back by the router's abort.
      const s = await runDemo({
        ...SMALL,
        dispatch,
        blocks: 2,
        pBlock: 16,
        dBlock: 32,
        promptTokens: [16, 48],
        requests: 4,
      });
      expect([...s.failures].sort()).toEqual([
        expect.stringMatching(/^req-1-\S+: need 3 blocks, the cache has 2 in all$/),
        expect.stringMatching(/^req-3-\S+: need 3 blocks, the cache has 2 in all$/),
      ]);
      expect(s.failed).toBe(2);
      expect(s.mismatches).toBe(0);
      expect(s.leakedBlocks).toBe(0);
      expect(s.checkedBytes).toBeGreaterThan(0);
    },
  );

  it.each(["file", "segment"] as const)(
    "2P2D, P TP 2 -> D TP 4, block 16 -> 32, KV in %s",
    async (kvMemory) => {
      await demo({
        prefill: 2,
        decode: 2,
        pTp: 2,
        dTp: 4,
        pBlock: 16,
        dBlock: 32,
        requests: 6,
        kvMemory,
      });
    },
  );

  it("P TP 4 -> D TP 1, block 32 -> 16", async () => {
    await demo({ pTp: 4, dTp: 1, pBlock: 32, dBlock: 16 });
  });

  it("MLA (DeepSeek-style latent), P TP 2 -> D TP 4", async () => {
    await demo({ model: "deepseek-mla", layers: 2, pTp: 2, dTp: 4, mode: "push" });
  });

  it("strided layouts: vLLM's CPU layout on P, K and V fused per row on D, TP 2 -> 4", async () => {
    await demo({
      pTp: 2,
      dTp: 4,
      pBlock: 16,
      dBlock: 32,
      pScheme: "one-region-kv-in-block",
      dScheme: "region-per-layer-kv-in-cell",
      prefixTokens: 21,
    });
  });

  it("a cached prefix on D (not block-aligned), NHD with a head split, pull", async () => {
    await demo({
      layout: "nhd",
      pTp: 2,
      dTp: 4,
      prefixTokens: 37,
      mode: "pull",
      dispatch: "sequential",
    });
  });
});

// Creating namespaces needs root and iproute2 (CI runs as root after scripts/setup.sh).
describe.skipIf(!canCreateNetns())("transfers between two network namespaces over TCP", () => {
  let ns: NetnsPair;
  beforeAll(() => {
    ns = createNetnsPair("e");
  });
  afterAll(() => ns.destroy());

  it("P TP 2 -> D TP 4 in push and in pull, byte-verified", async () => {
    const hosts = {
      prefill: { prefix: ns.prefix(0), listenHost: ns.addresses[0], netDevice: ns.devices[0] },
      decode: { prefix: ns.prefix(1), listenHost: ns.addresses[1], netDevice: ns.devices[1] },
    };
    const over = { transport: "tcp" as const, hosts, pTp: 2, dTp: 4 };
    // (The router cannot reach the sidecars' gRPC in their namespaces: it hears from the engines.)
    await demo({ ...over, mode: "push" });
    await demo({ ...over, mode: "pull", dispatch: "sequential" });
  });
});

describe("push orderings, forced", () => {
  const sidecars: SidecarProcess[] = [];
  const engines: SimEngineProcess[] = [];
  let p: Node;
  let d: Node;
  let pApi: SidecarClient;
  let dApi: SidecarClient;
  const shape = { ...SMALL, mode: "push" as const, pTp: 2, dTp: 2 };

  beforeAll(async () => {
    p = await startNode(shape, "prefill", `order-p-${process.pid}`, {
      sidecars,
      engines,
      blocks: 64,
    });
    d = await startNode(shape, "decode", `order-d-${process.pid}`, {
      sidecars,
      engines,
      blocks: 64,
    });
    pApi = new SidecarClient(p.ready.grpc!);
    dApi = new SidecarClient(d.ready.grpc!);
  });
  afterAll(async () => {
    pApi?.close();
    dApi?.close();
    await Promise.all(engines.map((e) => e.close()));
    await Promise.all(sidecars.map((s) => s.close()));
  });

  /** Waits (bounded) until P's sidecar lists the transfer in `state`. */
  const pState = (id: string, state: TransferState) => awaitListed(pApi, id, state);

  it("D registers before P finishes prefill: P writes as soon as prefill is done", async () => {
    const id = `d-first-${process.pid}`;
    await d.engine.expect({ transferId: id, tokens: 150, source: p.ready.sideChannel });
    await pState(id, "WAITING"); // the registration is on P, prefill has not happened
    await p.engine.prefill(id, 150, 0);
    const ev = await dApi.awaitTransfer(id, 20_000);
    expect(ev.kind).toBe("KV_READY");
    expect(ev.mode).toBe("push");
    const v = await d.engine.waitTransfer(id, "verified", 20_000);
    expect(v.ok).toBe(true);
    expect((await pApi.awaitTransfer(id, 20_000, { side: "prefill" })).kind).toBe("RELEASED");
    checkTraces(
      (await pApi.listTransfers({})).transfers.find((t) => t.transferId === id)!,
      (await dApi.listTransfers({})).transfers.find((t) => t.transferId === id)!,
    );
    // The same hops through the CLI.
    const cli = await kvxfer(["status", d.ready.grpc!, "--trace", id]);
    expect(cli.stderr).toBe("");
    expect(cli.status).toBe(0);
    expect(cli.stdout).toMatch(/^decode d-first-\d+: KV_READY \(push\)$/m);
    expect(cli.stdout).toMatch(/^ {2}engine\.kvReady sent +\d+ +\d+$/m);
    const missing = await kvxfer(["status", d.ready.grpc!, "--trace", "no-such-transfer"]);
    expect(missing.status).toBe(1);
    expect(missing.stderr).toMatch(/no transfer 'no-such-transfer' on this sidecar/);
  });

  it("reports the UCX its agents run on: over gRPC, in `kvxfer status`, and in its ready line", async () => {
    const s = await dApi.getStatus();
    expect(s.ucx.version).toMatch(/^1\.(1[89]|[2-9]\d)\.\d+$/);
    // The registered agents' own transports: shared memory, zero-copy (cma) among them.
    expect(s.ucx.transports).toEqual(expect.arrayContaining(["cma/memory", "self/memory"]));
    expect(s.ucx.memoryTypes).toContain("host");
    const cli = await kvxfer(["status", d.ready.grpc!]);
    expect(cli.status).toBe(0);
    expect(cli.stdout).toContain(`ucx: ${s.ucx.version} (transports: `);
    expect(cli.stdout).toMatch(/^ucx: .*cma\/memory.*; memory: host/m);
    expect(d.ready.ucx?.version).toBe(s.ucx.version);
  });

  /**
   * Both sidecars' traces of one push, P TP 2 -> D TP 2: each chain of hops in order, and across
   * the two processes (one host, one monotonic clock) every XferDone reaches D after its pair's
   * data was flushed on P (it travels in the same native operation as the writes).
   */
  function checkTraces(p: TransferInfo, d: TransferInfo): void {
    const at = (t: TransferInfo, hop: string): number => {
      const h = t.trace.find((x) => x.hop === hop);
      if (h === undefined)
        throw new Error(`${t.side} has no hop '${hop}': ${JSON.stringify(t.trace)}`);
      return h.us;
    };
    const inOrder = (t: TransferInfo, hops: string[]): void => {
      const times = hops.map((h) => at(t, h));
      for (let i = 1; i < times.length; i++)
        expect(times[i], `${t.side}: '${hops[i]}' before '${hops[i - 1]}'`).toBeGreaterThanOrEqual(
          times[i - 1]!,
        );
    };
    inOrder(d, ["engine.expectKv", "peer.resolved", "peer.pushReg sent"]);
    inOrder(p, ["peer.pushReg", "engine.prefillDone", "planned"]);
    expect(at(p, "peer.pushReg")).toBeGreaterThanOrEqual(at(d, "peer.pushReg sent"));
    for (const pair of ["0>0", "1>1"]) {
      // The pair's writes and its XferDone are one operation: "notified" is the XferDone leaving.
      const steps = OP_STEPS.map((s) => `pair ${pair} ${s}`);
      steps.splice(OP_STEPS.indexOf("flushed") + 1, 0, `pair ${pair} notified`);
      inOrder(p, ["planned", ...steps]);
      inOrder(p, [`pair ${pair} delivered`, "engine.releaseBlocks sent", "event.appended"]);
      inOrder(d, [
        "peer.pushReg sent",
        `pair ${pair} xferDone received`,
        `pair ${pair} xferDone delivered`,
        "engine.kvReady sent",
        "event.appended",
        "event.answered",
      ]);
      expect(at(d, `pair ${pair} xferDone received`)).toBeGreaterThanOrEqual(
        at(p, `pair ${pair} flushed`),
      );
    }
  }

  it("P finishes prefill before D registers: P writes when the registration arrives", async () => {
    const id = `p-first-${process.pid}`;
    await p.engine.prefill(id, 150, 0);
    await pState(id, "HELD"); // blocks held under lease, nobody has asked yet
    await d.engine.expect({ transferId: id, tokens: 150, source: p.ready.sideChannel });
    const ev = await dApi.awaitTransfer(id, 20_000);
    expect(ev.kind).toBe("KV_READY");
    expect(ev.mode).toBe("push");
    const v = await d.engine.waitTransfer(id, "verified", 20_000);
    expect(v.ok).toBe(true);
    expect((await pApi.awaitTransfer(id, 20_000, { side: "prefill" })).kind).toBe("RELEASED");
    const stats = await p.engine.stats();
    expect(stats.freeBlocks).toBe(stats.totalBlocks);
  });
});
