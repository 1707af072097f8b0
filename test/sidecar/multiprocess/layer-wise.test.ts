/**
 * Layer-wise push across processes: simulated engines and sidecars as separate processes, UCX
 * between them, every byte checked by D's engine. P's engine sends PrefillDone (layer_wise)
 * before its "forward", then one LayersSaved per layer; every layer holds a stale pattern until
 * it is saved, so a write posted before its layer was saved lands the wrong bytes at D. D
 * registers before P's first layer, during P's forward and after its last; P's TP 2 writes into
 * D's TP 1 with other block sizes, from one region holding every layer; an abort mid-forward gives every block back on both sides.
 */
import { afterAll, beforeAll, describe, expect, it } from "vitest";

import { SidecarClient } from "../../../src/api/client.js";
import { DEFAULT_DEMO, type DemoOptions } from "../../../sim/demo-types.js";
import { startNode, type Node } from "../../../sim/demo-node.js";
import type { SimEngineProcess } from "../../../sim/engine-client.js";
import type { SidecarProcess } from "../../../sim/sidecar-process.js";
import type { TransferState } from "../../../src/sidecar/view.js";
import { until } from "../../until.js";
import { awaitListed } from "./fixtures.js";

const SHAPE: DemoOptions = {
  ...DEFAULT_DEMO,
  kvMemory: "file",
  mode: "push",
  prefill: 1,
  decode: 1,
  pTp: 2,
  dTp: 1,
  pBlock: 16,
  dBlock: 32,
  layers: 4,
  // Every layer in one region on P, layers first (as vLLM's CPU engine places them in one file):
  // P's copies are told apart by the bytes they read, not by region.
  pScheme: "one-region-layers-first",
  requestTimeoutMs: 30_000,
};
const BLOCKS = 64;
const TOKENS = 150;
const LAYER_MS = 60;

describe("layer-wise push across processes, byte-verified", () => {
  const sidecars: SidecarProcess[] = [];
  const engines: SimEngineProcess[] = [];
  let p: Node;
  let d: Node;
  let pApi: SidecarClient;
  let dApi: SidecarClient;

  beforeAll(async () => {
    const tag = `${process.pid}-${Date.now() % 100_000}`;
    p = await startNode(SHAPE, "prefill", `lw-p-${tag}`, { sidecars, engines, blocks: BLOCKS });
    d = await startNode(SHAPE, "decode", `lw-d-${tag}`, { sidecars, engines, blocks: BLOCKS });
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

  /** D's bytes are P's pattern, D ready by push, P released; nothing held after. */
  async function landed(id: string): Promise<void> {
    const ev = await dApi.awaitTransfer(id, 20_000);
    expect(ev.kind).toBe("KV_READY");
    expect(ev.mode).toBe("push");
    const v = await d.engine.waitTransfer(id, "verified", 20_000);
    expect(v.ok, JSON.stringify(v)).toBe(true);
    expect((await pApi.awaitTransfer(id, 20_000, { side: "prefill" })).kind).toBe("RELEASED");
    await noneHeld();
  }

  function noneHeld(): Promise<void> {
    let last = "";
    return until(
      async () => {
        const [ps, ds] = [await p.engine.stats(), await d.engine.stats()];
        last = `P ${JSON.stringify(ps)}, D ${JSON.stringify(ds)}`;
        return ps.freeBlocks === ps.totalBlocks && ds.freeBlocks === ds.totalBlocks;
      },
      10_000,
      () => `every block back (${last})`,
      20,
    );
  }

  it("D registers before P's first layer: each layer leaves as it is saved", async () => {
    const id = `lw-before-${process.pid}`;
    await d.engine.expect({ transferId: id, tokens: TOKENS, source: p.ready.sideChannel });
    await pState(id, "WAITING");
    const r = await p.engine.prefillByLayer(id, TOKENS, LAYER_MS);
    expect(r.layersSaved).toBe(4);
    await landed(id);
    // The first writes went out while P was still computing: 3 layers (180 ms) before the last
    // was saved, not after it.
    const pT = (await pApi.listTransfers({})).transfers.find((t) => t.transferId === id)!;
    const at = (re: RegExp) => pT.trace.find((h) => re.test(h.hop))?.us;
    const allSaved = at(/^engine\.layersSaved all$/);
    const firstPost = at(/^pair \S+ submitted$/);
    expect(allSaved).toBeDefined();
    expect(firstPost).toBeDefined();
    expect(allSaved! - firstPost!).toBeGreaterThan(2 * LAYER_MS * 1000);
  });

  it("D registers during P's forward: what is saved goes at once, the rest layer by layer", async () => {
    const id = `lw-during-${process.pid}`;
    const prefill = p.engine.prefillByLayer(id, TOKENS, LAYER_MS);
    await pState(id, "HELD");
    await new Promise((r) => setTimeout(r, LAYER_MS * 1.5));
    await d.engine.expect({ transferId: id, tokens: TOKENS, source: p.ready.sideChannel });
    expect((await prefill).layersSaved).toBe(4);
    await landed(id);
  });

  it("D registers after P's last layer: everything in one batch", async () => {
    const id = `lw-after-${process.pid}`;
    await p.engine.prefillByLayer(id, TOKENS, 0);
    await pState(id, "HELD");
    await d.engine.expect({ transferId: id, tokens: TOKENS, source: p.ready.sideChannel });
    await landed(id);
  });

  it("P's engine aborts mid-forward: D is told, nothing is ready, every block back on both sides", async () => {
    const id = `lw-abort-${process.pid}`;
    await d.engine.expect({ transferId: id, tokens: TOKENS, source: p.ready.sideChannel });
    await pState(id, "WAITING");
    const prefill = p.engine.prefillByLayer(id, TOKENS, 150);
    await pState(id, "MOVING");
    await new Promise((r) => setTimeout(r, 200));
    await p.engine.call("abort", { transferId: id });
    expect((await prefill).layersSaved).toBeLessThan(4);
    const ev = await dApi.awaitTransfer(id, 20_000);
    expect(ev.kind).not.toBe("KV_READY");
    expect((await pApi.awaitTransfer(id, 20_000, { side: "prefill" })).kind).toBe("ABORTED");
    await noneHeld();
    // The next transfer moves as before.
    const next = `lw-next-${process.pid}`;
    await d.engine.expect({ transferId: next, tokens: TOKENS, source: p.ready.sideChannel });
    await pState(next, "WAITING");
    await p.engine.prefillByLayer(next, TOKENS, 10);
    await landed(next);
  });
});
