// KV that the sidecars allocate (issue 14, item 4): AllocateKv, a SysV segment per region that
// UCX allocates and the engine attaches, registered by id. Against real sidecar and simulated
// engine processes (dist/): transfers byte-exact both ways, segments owner-only and gone with
// the processes, an engine that outlives its sidecar registering its segments again, and each
// bad allocation or segment refused with its code while the sidecar lives on. `npm run build`
// first.
import { create } from "@bufbuild/protobuf";
import { execFileSync } from "node:child_process";
import { pino } from "pino";
import { afterAll, beforeAll, describe, expect, it } from "vitest";

import { EngineLinkClient, engineMessage, kvCacheRegistration } from "../../../src/engine/link.js";
import {
  AllocateKvSchema,
  type Allocated,
  type Registered,
} from "../../../src/gen/kvxfer/v1/engine_pb.js";
import type { KvLayout } from "../../../src/plan/index.js";
import { HeldNode, KvNode, goodTransfer, oneLayerLayout, uniqueId } from "./fixtures.js";
import { until } from "../../until.js";

const WAIT = 10_000;
const log = pino({ level: "silent" });

/** `ipcs -m` facts about one segment, or undefined when it does not exist (any more). */
function segment(id: number): { perms: string; nattch: number } | undefined {
  const out = execFileSync("ipcs", ["-m"], { encoding: "utf8" });
  for (const line of out.split("\n")) {
    const f = line.trim().split(/\s+/);
    if (f.length >= 6 && f[1] === String(id)) return { perms: f[3]!, nattch: Number(f[5]) };
  }
  return undefined;
}

/** A segment of this user with `mode`, made outside kvxfer (removed by the caller: ipcrm). */
function foreignSegment(bytes: number, mode: number): number {
  const py =
    "import ctypes,sys; libc=ctypes.CDLL(None); " +
    `i=libc.shmget(0, ${bytes}, 0o1000 | ${mode}); print(i); sys.exit(0 if i >= 0 else 1)`;
  return Number(execFileSync("python3", ["-c", py], { encoding: "utf8" }).trim());
}

function removeSegment(id: number): void {
  try {
    execFileSync("ipcrm", ["-m", String(id)], { stdio: "ignore" });
  } catch {
    // already gone
  }
}

/** An engine link of its own: sends AllocateKv and RegisterKvCache, collects the answers. */
class RawEngine {
  readonly allocated: Allocated[] = [];
  readonly registered: Registered[] = [];
  readonly refused: string[] = [];
  private readonly client: EngineLinkClient;

  constructor(socket: string) {
    this.client = new EngineLinkClient({
      endpoint: socket,
      logger: log,
      onMessage: (m) => {
        if (m.msg.case === "allocated") this.allocated.push(m.msg.value);
        if (m.msg.case === "registered") this.registered.push(m.msg.value);
        if (m.msg.case === "refused")
          this.refused.push(`${m.msg.value.code}: ${m.msg.value.message}`);
      },
    });
  }

  /** The Allocated answer; a Refused from the link instead rejects with its text. */
  async allocate(rank: number, tpSize: number, lengths: readonly number[]): Promise<Allocated> {
    const n = this.allocated.length;
    const refusals = this.refused.length;
    await this.client.send(
      engineMessage(
        "allocate",
        create(AllocateKvSchema, { rank, tpSize, lengths: lengths.map((x) => BigInt(x)) }),
      ),
    );
    await until(
      () => this.allocated.length > n || this.refused.length > refusals,
      WAIT,
      "the answer to AllocateKv",
    );
    const a = this.allocated[n];
    if (a === undefined) throw new Error(this.refused[refusals]);
    return a;
  }

  /** Registers `layout` with region g of rank r in segment `segments[r][g]`. */
  async register(engineId: string, layout: KvLayout, segments: number[][]): Promise<Registered> {
    const n = this.registered.length;
    await this.client.send(
      engineMessage("register", kvCacheRegistration(engineId, layout, segments)),
    );
    await until(() => this.registered.length > n, WAIT, "the answer to RegisterKvCache");
    return this.registered[n]!;
  }

  close(): Promise<void> {
    return this.client.close();
  }
}

describe("KV in segments the sidecars allocate (--kv-memory segment)", () => {
  let p: KvNode;
  let d: KvNode;

  beforeAll(async () => {
    p = await KvNode.start({ role: "prefill", engine: { kvMemory: "segment" } });
    d = await KvNode.start({ role: "decode", engine: { kvMemory: "segment" } });
  }, 60_000);

  afterAll(async () => {
    await p?.close();
    await d?.close();
  }, 30_000);

  it("push and pull are byte-exact; the engines' regions are owner-only segments, no files", async () => {
    for (const node of [p, d]) {
      const ready = node.engine.ready!;
      expect(ready.files).toEqual([]);
      expect(ready.segments.flat().length).toBeGreaterThan(0);
      for (const id of ready.segments.flat()) {
        // Owner-only, attached by the sidecar and by its engine.
        expect(segment(id)).toEqual({ perms: "600", nattch: 2 });
      }
    }
    expect((await goodTransfer(p, d, uniqueId("seg-push"))).ok).toBe(true);
    expect((await goodTransfer(p, d, uniqueId("seg-pull"), { pull: true })).ok).toBe(true);
    await p.allBlocksFree();
    await d.allBlocksFree();
  }, 60_000);

  it("an engine that outlives its sidecar registers its segments with the new one, and KV moves", async () => {
    const ids = p.engine.ready!.segments.flat();
    await p.restartSidecar();
    await p.engine.waitEvent((e) => e.event === "registered" && e.ok === true, WAIT);
    // The same memory: the new sidecar attached the segments the engine still has.
    expect(p.engine.ready!.segments.flat()).toEqual(ids);
    // Attached by the engine and the new sidecar (and by D's sidecar, which read from them).
    for (const id of ids) expect(segment(id)!.perms).toBe("600");
    expect((await goodTransfer(p, d, uniqueId("seg-after-restart"))).ok).toBe(true);
    expect((await goodTransfer(p, d, uniqueId("seg-after-restart-pull"), { pull: true })).ok).toBe(
      true,
    );
  }, 60_000);

  it("once both processes are gone, so are the segments", async () => {
    const ids = [...p.engine.ready!.segments.flat(), ...d.engine.ready!.segments.flat()];
    await p.close();
    await d.close();
    for (const id of ids) expect(segment(id), `segment ${id}`).toBeUndefined();
  }, 30_000);
});

describe("bad allocations and segments: each refusal costs only its message", () => {
  /** The sidecar under test: its engine starts once every refusal was tried on it. */
  let held: HeldNode;
  let socket = "";
  let engineId = "";
  let d: KvNode | undefined;
  const foreign: number[] = [];

  beforeAll(async () => {
    held = await HeldNode.start({
      role: "prefill",
      engineId: uniqueId("p"),
      sidecarArgs: ["--max-registration-bytes", "8M"],
      engine: { kvMemory: "segment" },
    });
    ({ socket, engineId } = held);
  }, 60_000);

  afterAll(async () => {
    await held?.close();
    await d?.close();
    for (const id of foreign) removeSegment(id);
  }, 30_000);

  async function lastErrors(): Promise<string> {
    return (await held.grpc.getStatus()).lastErrors.join("\n");
  }

  it("AllocateKv with a bad rank, TP size or lengths is refused, naming the field", async () => {
    const e = new RawEngine(socket);
    try {
      const cases: [number, number, number[], RegExp][] = [
        [0, 0, [4096], /^ERR_BAD_REGIONS: allocate: tp_size 0 is not 1\.\.1024$/],
        [2, 2, [4096], /^ERR_BAD_REGIONS: allocate: rank 2 is not below tp_size 2$/],
        [0, 1, [], /^ERR_BAD_REGIONS: allocate: lengths lists 0 regions, expected 1\.\.65536$/],
        [0, 1, [4096, 0], /^ERR_BAD_REGIONS: allocate: lengths\[1\] 0 must be above 0/],
        [0, 1, [16 << 20], /^ERR_REGION_TOO_LARGE: allocating 16777216 bytes for rank 0/],
      ];
      for (const [rank, tp, lengths, want] of cases) {
        const a = await e.allocate(rank, tp, lengths);
        expect(a.ok).toBe(false);
        expect(a.rank).toBe(rank);
        expect(a.segments).toEqual([]);
        expect(a.error).toMatch(want);
      }
      expect(await lastErrors()).toContain("allocate: ERR_REGION_TOO_LARGE");
    } finally {
      await e.close();
    }
  });

  it("a registration naming a missing segment, or one not owner-only, is refused", async () => {
    const e = new RawEngine(socket);
    const layout = oneLayerLayout(16);
    const bytes = layout.regionBytes[0]!;
    try {
      const missing = foreignSegment(4096, 0o600);
      removeSegment(missing); // nobody attached: gone at once
      let r = await e.register(engineId, layout, [[missing]]);
      expect(r.ok).toBe(false);
      expect(r.error).toMatch(
        new RegExp(`^ERR_NO_SUCH_SEGMENT: rank 0 region 0: attachSegment: segment ${missing}: `),
      );

      const shared = foreignSegment(bytes, 0o660);
      foreign.push(shared);
      r = await e.register(engineId, layout, [[shared]]);
      expect(r.error).toBe(
        `ERR_SEGMENT_PERMISSIONS: rank 0 region 0: attachSegment: segment ${shared} has mode 0660; ` +
          "only an owner-only segment (0600) is accepted",
      );

      const short = foreignSegment(4096, 0o600);
      foreign.push(short);
      r = await e.register(engineId, layout, [[short]]);
      expect(r.error).toBe(
        `ERR_OUT_OF_BOUNDS: rank 0 region 0: attachSegment: length ${bytes} exceeds segment ${short} (4096 bytes)`,
      );
      // Nothing was kept attached.
      expect(segment(shared)!.nattch).toBe(0);
      expect(segment(short)!.nattch).toBe(0);
    } finally {
      await e.close();
    }
  });

  it("allocated segments are owner-only, and freed when their connection ends unregistered", async () => {
    const e = new RawEngine(socket);
    let ids: number[] = [];
    try {
      const a = await e.allocate(0, 1, [1 << 20, 1 << 19]);
      expect(a.ok, a.error).toBe(true);
      ids = [...a.segments];
      expect(ids).toHaveLength(2);
      for (const id of ids) expect(segment(id)).toEqual({ perms: "600", nattch: 1 });
      // Asking again for the same rank replaces the first allocation.
      const again = await e.allocate(0, 1, [1 << 20]);
      expect(again.ok, again.error).toBe(true);
      for (const id of ids) expect(segment(id), `replaced segment ${id}`).toBeUndefined();
      ids = [...again.segments];
    } finally {
      await e.close();
    }
    await until(
      () => ids.every((id) => segment(id) === undefined),
      WAIT,
      `segments ${ids.join(", ")} freed after their connection ended`,
    );
  });

  it("a registration naming its rank's allocation wrongly is refused; the engine then registers", async () => {
    const e = new RawEngine(socket);
    const layout = oneLayerLayout(16, 2);
    try {
      const r0 = await e.allocate(0, 1, layout.regionBytes);
      const r1 = await e.allocate(1, 2, layout.regionBytes);
      expect(r0.ok && r1.ok).toBe(true);
      // Rank 0 was allocated for TP 1; this registration is TP 2.
      const r = await e.register(engineId, layout, [[...r0.segments], [...r1.segments]]);
      expect(r.error).toBe(
        "ERR_BAD_REGIONS: rank 0: its regions were allocated for tp_size 1, the layout has 2",
      );
    } finally {
      await e.close();
    }
    // The sidecar lives on: the real engine allocates, registers and moves KV.
    const probe = await held.start();
    const ids = probe.engine.ready!.segments.flat();
    expect(ids.length).toBeGreaterThan(0);
    // Another connection cannot allocate once an engine owns the link.
    const after = new RawEngine(socket);
    try {
      await expect(after.allocate(0, 1, [4096])).rejects.toThrow(/^ERR_NOT_OWNER: /);
    } finally {
      await after.close();
    }
    d = await KvNode.start({ role: "decode", engine: { kvMemory: "segment" } });
    expect((await goodTransfer(probe, d, uniqueId("seg-probe"))).ok).toBe(true);
  }, 60_000);
});
