// The simulated engine as a separate process, against an EngineLinkServer in this test standing
// in for its sidecar. Runs the compiled engine (dist/): `npm run build` first.
import { existsSync, mkdtempSync, rmSync, statSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";

import { create } from "@bufbuild/protobuf";
import { pino } from "pino";
import { afterAll, afterEach, beforeAll, describe, expect, it } from "vitest";

import { type EnginePeer, EngineLinkServer, sidecarMessage } from "../../src/engine/link.js";
import {
  type EngineToSidecar,
  FailureReason,
  KvFailedSchema,
  KvReadySchema,
  RefusedSchema,
  RegisteredSchema,
  ReleaseBlocksSchema,
  ReleaseReason,
} from "../../src/gen/kvxfer/v1/engine_pb.js";
import { Agent, type Region } from "../../src/native/index.js";
import { type KvLayout, kvHeadsPerRank, planTransfer } from "../../src/plan/index.js";
import { kvLayoutFromProto } from "../../src/plan/layout-proto.js";
import {
  type SimEngineOptions,
  SimEngineProcess,
  type SimEngineStats,
} from "../../sim/engine-client.js";
import { fillKv, verifyKv } from "../../sim/kv-pattern.js";
import { until } from "../until.js";

const log = pino({ level: "silent" });
const SIDE_CHANNEL = "127.0.0.1:7000";
const WAIT = 10_000;

type MsgKind = NonNullable<EngineToSidecar["msg"]["case"]>;
type EngineMsg<K extends MsgKind> = Extract<EngineToSidecar["msg"], { case: K }>["value"];

/** A stand-in sidecar: records what its engine sends, answers RegisterKvCache. */
class FakeSidecar {
  readonly got: EngineToSidecar[] = [];
  engine: EnginePeer | undefined;
  readonly server: EngineLinkServer;
  registerAnswer: { ok: boolean; error: string } | "silent" = { ok: true, error: "" };

  constructor(readonly endpoint: string) {
    this.server = new EngineLinkServer({
      endpoint,
      logger: log,
      onMessage: (msg, from) => {
        this.got.push(msg);
        if (msg.msg.case === "register") {
          this.engine = from;
          // Like the sidecar: an accepted registration binds the link to its connection.
          if (this.registerAnswer !== "silent" && this.registerAnswer.ok) this.server.adopt(from);
          if (this.registerAnswer !== "silent") {
            void this.server.send(
              from,
              sidecarMessage(
                "registered",
                create(RegisteredSchema, { ...this.registerAnswer, sideChannel: SIDE_CHANNEL }),
              ),
            );
          }
        }
      },
    });
  }

  of<K extends MsgKind>(kind: K): EngineMsg<K>[] {
    const out: EngineMsg<K>[] = [];
    for (const m of this.got) if (m.msg.case === kind) out.push(m.msg.value as EngineMsg<K>);
    return out;
  }

  async waitFor<K extends MsgKind>(
    kind: K,
    pred: (v: EngineMsg<K>) => boolean,
  ): Promise<EngineMsg<K>> {
    await until(() => this.of(kind).some(pred), WAIT, `a ${kind} from the engine`);
    return this.of(kind).find(pred)!;
  }

  send(msg: Parameters<EngineLinkServer["send"]>[1]): Promise<boolean> {
    return this.server.sendToRegistered(msg);
  }

  /** ReleaseBlocks, as the sidecar sends when a transfer ends. */
  release(
    transferId: string,
    blockIds: number[],
    reason = ReleaseReason.TRANSFERRED,
  ): Promise<boolean> {
    return this.send(
      sidecarMessage(
        "releaseBlocks",
        create(ReleaseBlocksSchema, { transferId, blockIds, reason }),
      ),
    );
  }
}

describe("simulated engine", () => {
  let dir: string;
  let shmDir: string;
  let agent: Agent;
  const engines: SimEngineProcess[] = [];
  const sidecars: FakeSidecar[] = [];
  const regions: Region[] = [];

  beforeAll(() => {
    dir = mkdtempSync(join(tmpdir(), "kvxfer-sim-"));
    shmDir = mkdtempSync(join(existsSync("/dev/shm") ? "/dev/shm" : tmpdir(), "kvxfer-sim-test-"));
    agent = new Agent({ transports: "self" });
  });

  afterEach(async () => {
    for (const r of regions.splice(0)) r.close();
    await Promise.all(engines.splice(0).map((e) => e.close(5000)));
    await Promise.all(sidecars.splice(0).map((s) => s.server.close()));
  });

  afterAll(() => {
    agent.close();
    rmSync(dir, { recursive: true, force: true });
    rmSync(shmDir, { recursive: true, force: true });
  });

  async function sidecar(name: string): Promise<FakeSidecar> {
    const s = new FakeSidecar(`ipc://${join(dir, `${name}.sock`)}`);
    await s.server.start();
    sidecars.push(s);
    return s;
  }

  async function engine(s: FakeSidecar, o: Omit<SimEngineOptions, "socket" | "shmDir">) {
    const e = await SimEngineProcess.start({
      socket: s.endpoint,
      shmDir,
      layers: 2,
      kvHeads: 4,
      headDim: 16,
      seed: 7,
      logLevel: "error",
      ...o,
    });
    engines.push(e);
    return e;
  }

  /** Maps an engine's KV files into this process: memories[rank][region]. */
  function mapEngine(e: SimEngineProcess): Uint8Array[][] {
    const L = e.ready!.layout;
    return e.ready!.files.map((paths) =>
      paths.map((p, g) => {
        const r = agent.mapFile(p, { length: L.regionBytes[g]! });
        regions.push(r);
        return r.bytes();
      }),
    );
  }

  function expectAllFree(s: SimEngineStats): void {
    expect(s.freeBlocks).toBe(s.totalBlocks);
    expect(s.transfers).toBe(0);
  }

  it("registers its KV files, prefills, and frees blocks only on ReleaseBlocks", async () => {
    const side = await sidecar("p");
    const p = await engine(side, { engineId: "p1", role: "prefill", tp: 2, block: 16, blocks: 16 });
    expect(p.ready!.sideChannel).toBe(SIDE_CHANNEL);

    // RegisterKvCache: the layout and one file per (rank, region), each as long as its region.
    const [reg] = side.of("register");
    expect(reg!.engineId).toBe("p1");
    const layout = kvLayoutFromProto(reg!.layout!);
    expect(layout).toEqual(p.ready!.layout);
    expect(layout.tpSize).toBe(2);
    expect(layout.numLayers).toBe(2);
    expect(reg!.ranks.map((r) => r.rank)).toEqual([0, 1]);
    for (const rank of reg!.ranks) {
      expect(rank.regions).toHaveLength(layout.regionBytes.length);
      rank.regions.forEach((f, g) => {
        expect(f.path.startsWith(shmDir)).toBe(true);
        expect(f.path).toMatch(new RegExp(`kvxfer-p1-${p.pid}-r${rank.rank}-g${g}\\.kv$`));
        expect(Number(f.length)).toBe(layout.regionBytes[g]);
        expect(statSync(f.path).size).toBe(layout.regionBytes[g]);
      });
    }

    const t0 = Date.now();
    const { blockIds } = await p.prefill("t1", 40, 50);
    expect(Date.now() - t0).toBeGreaterThanOrEqual(45);
    expect(blockIds).toHaveLength(3);
    const done = await side.waitFor("prefillDone", (m) => m.transferId === "t1");
    expect(done.blockIds).toEqual(blockIds);
    expect(done.numTokens).toBe(40);

    // The KV is the transfer's pattern on every rank.
    const mem = mapEngine(p);
    for (let r = 0; r < 2; r++) {
      const c = verifyKv(layout, r, mem[r]!, "t1", blockIds, 0, 40);
      expect(c.mismatches).toBe(0);
      expect(c.checkedBytes).toBe(2 * 2 * 40 * kvHeadsPerRank(layout) * 16 * 2);
    }

    await expect(p.prefill("t1", 8)).rejects.toMatchObject({ code: "ERR_DUPLICATE" });
    await expect(p.expect({ transferId: "x", tokens: 8, source: "h:1" })).rejects.toMatchObject({
      code: "ERR_WRONG_ROLE",
    });
    // More blocks than the whole cache: refused at once, not after --block-wait-ms.
    await expect(p.prefill("huge", 17 * 16)).rejects.toMatchObject({
      code: "ERR_NO_BLOCKS",
      message: "need 17 blocks, the cache has 16 in all",
    });
    await expect(p.call("nope")).rejects.toMatchObject({ code: "ERR_UNKNOWN_OP" });

    let s = await p.stats();
    expect(s).toMatchObject({ freeBlocks: 13, totalBlocks: 16, transfers: 1 });

    // A release naming a block t1 does not hold frees the rest and reports the stranger.
    const release = (transferId: string, ids: number[]) => side.release(transferId, ids);
    const stranger = [...Array(16).keys()].find((b) => !blockIds.includes(b))!;
    await release("t1", [blockIds[0]!, stranger]);
    const bad = await p.waitEvent((e) => e.event === "bad-release" && e.transferId === "t1", WAIT);
    expect(bad.blockIds).toEqual([stranger]);
    s = await p.stats();
    expect(s).toMatchObject({ freeBlocks: 14, transfers: 1, badReleases: 1 });
    await release("t1", blockIds.slice(1));
    const rel = await p.waitTransfer("t1", "released", WAIT);
    expect(rel).toMatchObject({ side: "prefill", reason: "TRANSFERRED", blocks: 3 });
    expectAllFree(await p.stats());
    // Released twice: the transfer is gone.
    await release("t1", blockIds);
    await until(
      () => p.events.filter((e) => e.event === "bad-release").length === 2,
      WAIT,
      "2nd bad-release",
    );

    // Abort is passed on; an abort during compute returns the blocks without the sidecar.
    const slow = p.prefill("t2", 20, 300);
    await new Promise((r) => setTimeout(r, 50));
    await p.call("abort", { transferId: "t2" });
    await side.waitFor("abort", (m) => m.transferId === "t2");
    await expect(slow).rejects.toMatchObject({ code: "ERR_ABORTED" });
    expect(side.of("prefillDone").some((m) => m.transferId === "t2")).toBe(false);
    expectAllFree(await p.stats());

    // Hand-made messages reach the sidecar as given (for bad-input tests).
    await p.call("send", {
      message: { prefillDone: { transferId: "fake", blockIds: [99], numTokens: 1 } },
    });
    const fake = await side.waitFor("prefillDone", (m) => m.transferId === "fake");
    expect(fake.blockIds).toEqual([99]);

    // A clean exit removes the KV files.
    const files = p.ready!.files.flat();
    for (const r of regions.splice(0)) r.close();
    await p.call("exit");
    expect(await p.waitExit(WAIT)).toBe(0);
    for (const f of files) expect(existsSync(f)).toBe(false);
  });

  it("expects KV, verifies every byte on KvReady (planner-copied from P), and catches a bad byte", async () => {
    const sideP = await sidecar("p2");
    const sideD = await sidecar("d2");
    const p = await engine(sideP, {
      engineId: "p2",
      role: "prefill",
      tp: 2,
      block: 16,
      blocks: 12,
    });
    const d = await engine(sideD, {
      engineId: "d2",
      role: "decode",
      tp: 4,
      block: 32,
      blocks: 8,
      layout: "nhd",
      scheme: "region-per-layer-blocks-first",
    });
    const P: KvLayout = p.ready!.layout;
    const D: KvLayout = d.ready!.layout;
    const pMem = mapEngine(p);
    const dMem = mapEngine(d);

    // Transfer ok1: prefill on P, expect on D with a cached prefix, copy with the planner.
    const tokens = 70;
    const prefix = 5;
    const src = await p.prefill("ok1", tokens);
    const dst = await d.expect({
      transferId: "ok1",
      tokens,
      prefixTokens: prefix,
      source: p.ready!.sideChannel,
      sourceBlockIds: src.blockIds,
    });
    expect(dst.blockIds).toHaveLength(3);
    const ex = await sideD.waitFor("expectKv", (m) => m.transferId === "ok1");
    expect(ex).toMatchObject({
      source: SIDE_CHANNEL,
      blockIds: dst.blockIds,
      numTokens: tokens,
      prefixTokens: prefix,
      sourceBlockIds: src.blockIds,
      hasSourceBlockIds: true,
    });
    // The blocks are not contiguous runs handed out in order.
    expect(dst.blockIds).not.toEqual([0, 1, 2]);
    // D wrote the prefix itself; the rest is not there yet.
    expect(verifyKv(D, 0, dMem[0]!, "ok1", dst.blockIds, 0, prefix).mismatches).toBe(0);
    const plan = planTransfer(P, D, {
      numTokens: tokens,
      prefixTokens: prefix,
      srcBlockIds: src.blockIds,
      dstBlockIds: dst.blockIds,
    });
    for (const pair of plan.pairs) {
      for (const rp of pair.regionPairs) {
        const from = pMem[pair.srcRank]![rp.srcRegion]!;
        const to = dMem[pair.dstRank]![rp.dstRegion]!;
        const q = rp.descriptors;
        for (let i = 0; i < q.length; i += 3)
          to.set(from.subarray(q[i]!, q[i]! + q[i + 2]!), q[i + 1]!);
      }
    }
    await sideD.send(sidecarMessage("kvReady", create(KvReadySchema, { transferId: "ok1" })));
    const v = await d.waitTransfer("ok1", "verified", WAIT);
    const rowBytes = 16 * 2;
    expect(v).toMatchObject({ ok: true, mismatches: 0 });
    expect(v.checkedBytes).toBe(4 * 2 * 2 * tokens * kvHeadsPerRank(D) * rowBytes);
    expect(v.first).toBeUndefined();
    expectAllFree(await d.stats());

    // Transfer bad1: the right pattern, written directly, with one byte flipped.
    const b = await d.expect({ transferId: "bad1", tokens: 33, source: SIDE_CHANNEL });
    for (let r = 0; r < 4; r++) fillKv(D, r, dMem[r]!, "bad1", b.blockIds, 0, 33);
    const slot = D.slots[3]!; // layer 1, V
    const flipAt = slot.offset + b.blockIds[1]! * D.blockStride; // token 32, rank 2
    dMem[2]![slot.region]![flipAt]! ^= 0x01;
    expect(
      sideD.of("expectKv").find((m) => m.transferId === "bad1")?.hasSourceBlockIds ?? false,
    ).toBe(false);
    await sideD.send(sidecarMessage("kvReady", create(KvReadySchema, { transferId: "bad1" })));
    const bv = await d.waitTransfer("bad1", "verified", WAIT);
    expect(bv).toMatchObject({ ok: false, mismatches: 1 });
    expect(bv.first).toMatch(/rank 2 layer 1 V token 32 head 2 byte 0/);
    let s = await d.stats();
    expect(s).toMatchObject({ verified: 1, mismatches: 1 });
    expectAllFree(s);

    // Transfer f1 fails: KvFailed is reported, the blocks wait for ReleaseBlocks.
    await d.expect({ transferId: "f1", tokens: 64, source: SIDE_CHANNEL });
    await sideD.send(
      sidecarMessage(
        "kvFailed",
        create(KvFailedSchema, {
          transferId: "f1",
          reason: FailureReason.PEER_FAILED,
          message: "P went away",
        }),
      ),
    );
    const f = await d.waitTransfer("f1", "failed", WAIT);
    expect(f).toMatchObject({ reason: "PEER_FAILED", message: "P went away", known: true });
    s = await d.stats();
    expect(s).toMatchObject({ transfers: 1, freeBlocks: 6, failed: 1 });
    // A KvReady after the failure is not verified.
    await sideD.send(sidecarMessage("kvReady", create(KvReadySchema, { transferId: "f1" })));
    await d.waitEvent((e) => e.event === "unexpected" && e.transferId === "f1", WAIT);
    const fIds = sideD.of("expectKv").find((m) => m.transferId === "f1")!.blockIds;
    await sideD.release("f1", fIds, ReleaseReason.FAILED);
    expect(await d.waitTransfer("f1", "released", WAIT)).toMatchObject({
      side: "decode",
      reason: "FAILED",
    });
    s = await d.stats();
    expectAllFree(s);
    expect(s).toMatchObject({ verified: 1, mismatches: 1, failed: 1, released: 1 });

    // Refusals are reported.
    await sideD.send(
      sidecarMessage(
        "refused",
        create(RefusedSchema, { transferId: "zz", code: "ERR_BAD_BLOCKS", message: "m" }),
      ),
    );
    expect(await d.waitTransfer("zz", "refused", WAIT)).toMatchObject({ code: "ERR_BAD_BLOCKS" });

    // SIGTERM: a clean exit that removes the files.
    const files = d.ready!.files.flat();
    for (const r of regions.splice(0)) r.close();
    d.kill("SIGTERM");
    expect(await d.waitExit(WAIT)).toBe(143);
    for (const f of files) expect(existsSync(f)).toBe(false);
    // P still holds ok1's blocks: nobody released them.
    expect(await p.stats()).toMatchObject({ transfers: 1, freeBlocks: 12 - 5 });
  });

  it("a request short of free blocks waits for releases, first come first served, and is refused after --block-wait-ms", async () => {
    const side = await sidecar("pwait");
    const p = await engine(side, {
      engineId: "pwait",
      role: "prefill",
      block: 16,
      blocks: 4,
      blockWaitMs: 600,
    });
    const release = async (transferId: string, blockIds: number[]): Promise<void> => {
      await side.release(transferId, blockIds);
      await p.waitTransfer(transferId, "released", WAIT);
    };
    const a = await p.prefill("wa", 3 * 16);
    // b needs 2 of the 1 free block; c needs 1, but queues behind b.
    const settled: string[] = [];
    const b = p.prefill("wb", 2 * 16).then((r) => (settled.push("wb"), r));
    const c = p.prefill("wc", 16).then((r) => (settled.push("wc"), r));
    await new Promise((r) => setTimeout(r, 100));
    expect(settled).toEqual([]);
    expect(await p.stats()).toMatchObject({ freeBlocks: 1 });
    // A waiting transfer's id is taken.
    await expect(p.prefill("wb", 16)).rejects.toMatchObject({ code: "ERR_DUPLICATE" });
    await release("wa", a.blockIds);
    const [rb, rc] = await Promise.all([b, c]);
    expect(settled).toEqual(["wb", "wc"]);
    expect(rb.blockIds).toHaveLength(2);
    expect(rc.blockIds).toHaveLength(1);
    expect(new Set([...rb.blockIds, ...rc.blockIds]).size).toBe(3);
    expect(await p.stats()).toMatchObject({ freeBlocks: 1, transfers: 2 });
    // Nothing is released within the wait: refused, naming what it waited for.
    const t0 = Date.now();
    await expect(p.prefill("wd", 2 * 16)).rejects.toMatchObject({
      code: "ERR_NO_BLOCKS",
      message: "need 2 blocks, 1 were free after waiting 600 ms for releases",
    });
    expect(Date.now() - t0).toBeGreaterThanOrEqual(550);
    // The refused request holds nothing; the others release as usual.
    expect(await p.stats()).toMatchObject({ freeBlocks: 1, transfers: 2 });
    await release("wb", rb.blockIds);
    await release("wc", rc.blockIds);
    expectAllFree(await p.stats());
  });

  it("--check-after-ms: D checks the KV that long after KvReady, not at once; a stop with a check pending exits cleanly", async () => {
    const side = await sidecar("dlate");
    const d = await engine(side, {
      engineId: "dlate",
      role: "decode",
      block: 16,
      blocks: 8,
      checkAfterMs: 400,
    });
    const D: KvLayout = d.ready!.layout;
    const mem = mapEngine(d);
    // KvReady first, the KV written only then: a check at once would find none of it.
    const a = await d.expect({ transferId: "late1", tokens: 40, source: SIDE_CHANNEL });
    await side.send(sidecarMessage("kvReady", create(KvReadySchema, { transferId: "late1" })));
    fillKv(D, 0, mem[0]!, "late1", a.blockIds, 0, 40);
    expect(await d.waitTransfer("late1", "verified", WAIT)).toMatchObject({
      ok: true,
      mismatches: 0,
    });
    expectAllFree(await d.stats());
    // A check still waiting when the engine stops is dropped: no read of unmapped KV, exit 143.
    await d.expect({ transferId: "late2", tokens: 40, source: SIDE_CHANNEL });
    await side.send(sidecarMessage("kvReady", create(KvReadySchema, { transferId: "late2" })));
    const files = d.ready!.files.flat();
    for (const r of regions.splice(0)) r.close();
    d.kill("SIGTERM");
    expect(await d.waitExit(WAIT)).toBe(143);
    expect(d.events.some((e) => e.transferId === "late2" && e.event === "verified")).toBe(false);
    for (const f of files) expect(existsSync(f)).toBe(false);
  });

  it("registers again when a restarted sidecar answers ERR_NOT_REGISTERED", async () => {
    const side = await sidecar("p3");
    const p = await engine(side, { engineId: "p3", role: "both", blocks: 4 });
    expect(side.of("register")).toHaveLength(1);
    await side.send(
      sidecarMessage(
        "refused",
        create(RefusedSchema, { transferId: "", code: "ERR_NOT_REGISTERED", message: "who?" }),
      ),
    );
    await until(() => side.of("register").length === 2, WAIT, "a second RegisterKvCache");
    await p.waitEvent((e) => e.event === "registered" && e.ok === true, WAIT);
  });

  it("fails to start when the sidecar refuses or never answers, leaving no files", async () => {
    const side = await sidecar("p4");
    side.registerAnswer = { ok: false, error: "layout is odd" };
    await expect(
      engine(side, { engineId: "p4", role: "prefill", blocks: 4 }),
    ).rejects.toMatchObject({ code: "ERR_REGISTER_REFUSED" });
    side.registerAnswer = "silent";
    await expect(
      engine(side, { engineId: "p5", role: "prefill", blocks: 4, registerTimeoutMs: 300 }),
    ).rejects.toMatchObject({ code: "ERR_REGISTER_TIMEOUT" });
    await expect(
      SimEngineProcess.start({ engineId: "bad id!", role: "prefill", shmDir }),
    ).rejects.toMatchObject({ code: "ERR_USAGE" });
    const { readdirSync } = await import("node:fs");
    expect(readdirSync(shmDir)).toEqual([]);
  });

  it("leaves files only when SIGKILLed, and close() removes them", async () => {
    const side = await sidecar("p6");
    const p = await engine(side, { engineId: "p6", role: "prefill", blocks: 4 });
    const files = p.ready!.files.flat();
    p.kill("SIGKILL");
    await p.waitExit(WAIT);
    expect(files.every((f) => existsSync(f))).toBe(true);
    await p.close();
    expect(files.some((f) => existsSync(f))).toBe(false);
  });
});
