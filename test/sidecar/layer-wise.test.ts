// Layer-wise push on P's side, every ordering forced in process: D's registration before P's
// first layer is saved, during P's forward, after its last layer; an abort mid-forward; a read
// before the last layer; an engine that stops sending layers; LayersSaved the sidecar refuses.
// Each layer's writes are posted once that layer is saved (one operation per batch of layers),
// and the XferDone only after every write landed. SMALL has 2 layers, one region each.
import { create } from "@bufbuild/protobuf";
import { describe, expect, it } from "vitest";

import {
  EngineToSidecarSchema,
  LayersSavedSchema,
  ReleaseReason,
} from "../../src/gen/kvxfer/v1/engine_pb.js";
import { checkEngineMessage } from "../../src/engine/validate.js";
import { kvLayout, layerSpans, singleGroup, splitByLayer } from "../../src/plan/index.js";
import { PrefillSide } from "../../src/sidecar/prefill.js";
import { FakeWorld, SMALL, prefillDone, pushReg, settle } from "./fakes.js";

const layerWise = (transferId: string, token = "") => ({
  ...prefillDone(transferId, token),
  layerWise: true,
});

const saved = (layers: number, ...transferIds: string[]) =>
  create(LayersSavedSchema, { transferIds, layers });

function world() {
  const w = new FakeWorld();
  const p = new PrefillSide(w.ctx);
  const d = w.peer("d0");
  const state = () => p.list()[0]!.state;
  return { w, p, d, state };
}

describe("layer-wise push: each layer leaves once it is saved", () => {
  it("D registered before P's first layer: one write per layer, XferDone after both landed", async () => {
    const { w, p, d, state } = world();
    p.pushReg(d, pushReg("t1"));
    p.prefillDone(layerWise("t1"));
    await settle();
    expect(state()).toBe("MOVING");
    expect(w.agent.ops, "nothing posted before a layer is saved").toHaveLength(0);
    p.layersSaved(saved(1, "t1"));
    await settle();
    expect(w.agent.partCounts, "layer 0's region pair alone").toEqual([1]);
    w.agent.landAll();
    await settle();
    expect(w.sealed, "no XferDone before the last layer").toEqual([]);
    p.layersSaved(saved(2, "t1"));
    await settle();
    expect(w.agent.partCounts).toEqual([1, 1]);
    expect(w.sealed).toEqual([]);
    w.agent.ops[1]!.op.resolve();
    await settle();
    // The XferDone's own operation (no parts), once every write landed.
    expect(w.agent.partCounts).toEqual([1, 1, 0]);
    w.agent.ops[2]!.op.resolve();
    await settle();
    expect(w.sealed.map((b) => b.case)).toEqual(["xferDone"]);
    expect(state()).toBe("RELEASED");
    expect(w.engineSaid("t1")).toEqual([`releaseBlocks:${ReleaseReason.TRANSFERRED}`]);
  });

  it("D registers during P's forward: the layers saved so far in one write, the rest after", async () => {
    const { w, p, d, state } = world();
    w.agent.autoLand = true;
    p.prefillDone(layerWise("t1"));
    p.layersSaved(saved(1, "t1"));
    expect(state()).toBe("HELD");
    p.pushReg(d, pushReg("t1"));
    await settle();
    expect(state()).toBe("MOVING");
    expect(w.agent.partCounts).toEqual([1]);
    p.layersSaved(saved(2, "t1"));
    await settle();
    expect(w.agent.partCounts).toEqual([1, 1, 0]);
    expect(w.sealed.map((b) => b.case)).toEqual(["xferDone"]);
    expect(state()).toBe("RELEASED");
  });

  it("D registers after P's last layer: every layer in one write with its XferDone", async () => {
    const { w, p, d, state } = world();
    w.agent.autoLand = true;
    p.prefillDone(layerWise("t1"));
    p.layersSaved(saved(1, "t1"));
    p.layersSaved(saved(2, "t1"));
    p.pushReg(d, pushReg("t1"));
    await settle();
    expect(w.agent.partCounts).toEqual([2]);
    expect(w.sealed.map((b) => b.case)).toEqual(["xferDone"]);
    expect(state()).toBe("RELEASED");
  });

  it("one LayersSaved names every transfer of the forward; a repeated or lower count changes nothing", async () => {
    const { w, p, d } = world();
    w.agent.autoLand = true;
    const d2 = w.peer("d1");
    p.pushReg(d, pushReg("a"));
    p.pushReg(d2, pushReg("b"));
    p.prefillDone(layerWise("a"));
    p.prefillDone({ ...layerWise("b"), blockIds: [2, 3] });
    p.layersSaved(saved(1, "a", "b"));
    await settle();
    expect(w.agent.partCounts).toEqual([1, 1]);
    p.layersSaved(saved(1, "a", "b"));
    await settle();
    expect(w.agent.partCounts, "layer 0 again: nothing more").toEqual([1, 1]);
    p.layersSaved(saved(2, "a", "b"));
    await settle();
    expect(p.list().map((t) => t.state)).toEqual(["RELEASED", "RELEASED"]);
    expect(w.sealed.map((b) => b.case)).toEqual(["xferDone", "xferDone"]);
    expect(w.refused).toEqual([]);
  });
});

describe("layer-wise push: aborts, reads and an engine that stops", () => {
  it("the engine aborts mid-forward: what was posted settles, no XferDone, blocks back ABORTED, D told", async () => {
    const { w, p, d, state } = world();
    p.pushReg(d, pushReg("t1"));
    p.prefillDone(layerWise("t1"));
    p.layersSaved(saved(1, "t1"));
    await settle();
    expect(w.agent.partCounts).toEqual([1]);
    p.abort("t1");
    await settle();
    expect(state()).toBe("ABORTING");
    expect(w.engineSaid("t1"), "layer 0's write is still in flight").toEqual([]);
    w.agent.landAll();
    await settle();
    expect(state()).toBe("ABORTED");
    expect(w.agent.partCounts, "layer 1 never posted").toEqual([1]);
    expect(w.sealed).toEqual([]);
    expect(w.peerSaid("t1")).toEqual(["failed:ERR_ABORTED"]);
    expect(w.engineSaid("t1")).toEqual([`releaseBlocks:${ReleaseReason.ABORTED}`]);
    // The forward goes on: its later LayersSaved is nothing to do.
    p.layersSaved(saved(2, "t1"));
    expect(w.refused).toEqual([]);
  });

  it("D aborts mid-forward: writes settle, AbortAck, blocks back", async () => {
    const { w, p, d, state } = world();
    w.agent.autoLand = true;
    p.pushReg(d, pushReg("t1", "tok"));
    p.prefillDone(layerWise("t1", "tok"));
    p.layersSaved(saved(1, "t1"));
    await settle();
    p.peerAbort(d, "t1", "tok");
    await settle();
    expect(state()).toBe("ABORTED");
    expect(w.agent.partCounts).toEqual([1]);
    expect(w.peerSaid("t1")).toEqual(["abortAck"]);
    expect(w.engineSaid("t1")).toEqual([`releaseBlocks:${ReleaseReason.ABORTED}`]);
  });

  it("a read (pull) before the last layer is not held; after it, it is", () => {
    const { w, p, d, state } = world();
    p.prefillDone(layerWise("t1", "tok"));
    p.layersSaved(saved(1, "t1"));
    p.readDone(d, "t1", 100, "tok");
    expect(state()).toBe("HELD");
    p.layersSaved(saved(2, "t1"));
    p.readDone(d, "t1", 100, "tok");
    expect(state()).toBe("RELEASED");
    const acks = w.toPeer
      .filter((m) => m.body.case === "readAck")
      .map((m) => (m.body.value as { held: boolean }).held);
    expect(acks).toEqual([false, true]);
  });

  it("an engine that stops sending layers: the write gives up after the block lease, D told", async () => {
    const { w, p, d, state } = world(); // leaseMs 1000
    w.agent.autoLand = true;
    p.pushReg(d, pushReg("t1"));
    p.prefillDone(layerWise("t1"));
    p.layersSaved(saved(1, "t1"));
    await settle();
    expect(state()).toBe("MOVING");
    await new Promise((r) => setTimeout(r, 1200));
    await settle();
    expect(state()).toBe("FAILED");
    expect(w.peerSaid("t1")).toEqual(["failed:ERR_TIMEOUT"]);
    expect(w.sealed).toEqual([]);
    expect(w.engineSaid("t1")).toEqual([`releaseBlocks:${ReleaseReason.FAILED}`]);
  });
});

describe("LayersSaved the sidecar refuses", () => {
  it("an unknown id, or a transfer that is not layer-wise: ERR_BAD_LAYERS, the others still count", async () => {
    const { w, p, d, state } = world();
    w.agent.autoLand = true;
    p.prefillDone(prefillDone("whole", "", [2, 3]));
    p.pushReg(d, pushReg("t1"));
    p.prefillDone(layerWise("t1"));
    p.layersSaved(saved(2, "nope", "whole", "t1"));
    await settle();
    expect(w.refused).toEqual([
      { transferId: "nope", code: "ERR_BAD_LAYERS" },
      { transferId: "whole", code: "ERR_BAD_LAYERS" },
    ]);
    expect(p.list().find((t) => t.transferId === "t1")!.state).toBe("RELEASED");
    expect(state()).toBe("HELD"); // "whole", untouched
  });

  it("fields: no ids, layers 0 or above num_layers, a bad id; layer_wise with several groups", () => {
    const groups = singleGroup(SMALL);
    const check = (layers: number, ids: string[]) =>
      checkEngineMessage(
        create(EngineToSidecarSchema, {
          msg: { case: "layersSaved", value: saved(layers, ...ids) },
        }),
        groups,
      );
    expect(check(1, [])?.code).toBe("ERR_BAD_LAYERS");
    expect(check(0, ["t"])?.message).toMatch(/layers 0 is not 1\.\.2/);
    expect(check(3, ["t"])?.code).toBe("ERR_BAD_LAYERS");
    expect(check(1, ["t", ""])?.code).toBe("ERR_BAD_TRANSFER_ID");
    expect(check(2, ["t", "u"])).toBeUndefined();
    const two = [...groups, { ...groups[0]!, kind: "sliding" as const, slidingWindow: 16 }];
    const lw = checkEngineMessage(
      create(EngineToSidecarSchema, { msg: { case: "prefillDone", value: layerWise("t") } }),
      two,
    );
    expect(lw?.code).toBe("ERR_BAD_LAYERS");
  });
});

describe("layerSpans and splitByLayer: P's copies told apart by layer", () => {
  it("a region per layer: one span each; one region, layers first: a span per layer; blocks first: none", () => {
    const perLayer = layerSpans(SMALL);
    expect(perLayer.map((s) => [...s!.layers])).toEqual([[0], [1]]);
    const layersFirst = layerSpans(kvLayout({ ...SMALL, numLayers: 3 }, "one-region-layers-first"));
    expect(layersFirst).toHaveLength(1);
    expect([...layersFirst[0]!.layers]).toEqual([0, 1, 2]);
    const blocksFirst = layerSpans(kvLayout({ ...SMALL, numLayers: 3 }, "one-region-blocks-first"));
    expect(blocksFirst).toEqual([undefined]);
  });

  it("each copy goes with the layer it reads; one that runs into the next layer, with that one", () => {
    const spans = {
      starts: Float64Array.from([0, 100, 200]),
      ends: Float64Array.from([100, 200, 300]),
      layers: Int32Array.from([0, 1, 2]),
    };
    // (src, dst, length): layer 2, layer 0, layers 0-1 (goes with 1), layer 1.
    const d = Float64Array.from([250, 0, 10, 10, 10, 10, 90, 20, 20, 150, 40, 5]);
    const out = splitByLayer(d, 4, spans)!;
    expect(out.map((o) => [o.layer, [...o.descriptors]])).toEqual([
      [0, [10, 10, 10]],
      [1, [90, 20, 20, 150, 40, 5]],
      [2, [250, 0, 10]],
    ]);
    expect(splitByLayer(Float64Array.from([290, 0, 20]), 1, spans)).toBeUndefined();
  });
});
