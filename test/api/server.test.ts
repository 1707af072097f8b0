// The gRPC API over loopback: status, transfers, AwaitTransfer, health, status codes.
import * as grpc from "@grpc/grpc-js";
import { create } from "@bufbuild/protobuf";
import { afterEach, beforeEach, describe, expect, it } from "vitest";
import {
  type SidecarClient as Client,
  SidecarClient,
  type HealthStatus,
} from "../../src/api/client.js";
import { type ApiServer, startApiServer } from "../../src/api/server.js";
import { WatchEventsRequestSchema, EventKind } from "../../src/gen/kvxfer/v1/sidecar_pb.js";
import { EventLog } from "../../src/sidecar/event-log.js";
import type { TransferState } from "../../src/sidecar/view.js";
import { FixtureSidecar, rejection } from "./fixtures.js";
import { until } from "../until.js";

let events: EventLog;
let sidecar: FixtureSidecar;
let server: ApiServer;
let client: Client;

beforeEach(async () => {
  events = new EventLog({ capacity: 1000 });
  sidecar = new FixtureSidecar(events);
  server = await startApiServer({ view: sidecar, events, address: "127.0.0.1:0" });
  client = new SidecarClient(server.address, { timeoutMs: 5_000 });
});

afterEach(async () => {
  client.close();
  await server.close(1_000);
  events.close();
});

describe("GetStatus and ListTransfers", () => {
  it("reports identity, counts and the event log's position", async () => {
    sidecar.start("a");
    sidecar.start("b");
    sidecar.moving("b");
    sidecar.end("c", "KV_READY", 1 << 20);
    const s = await client.getStatus();
    expect(s).toMatchObject({
      engineId: "decode-0",
      epoch: sidecar.epoch,
      role: "decode",
      mode: "auto",
      tpSize: 2,
      draining: false,
      transfersByState: { WAITING: 1, MOVING: 1, KV_READY: 1 },
      bytesMoved: 1 << 20,
      transfersMoved: 1,
      firstSeq: 1,
      lastSeq: 1,
      watchers: 0,
    });
    expect(s.peers[0]).toMatchObject({ engineId: "prefill-0", epoch: 7n, state: "connected" });
    expect(s.uptimeMs).toBeGreaterThanOrEqual(0);
    expect(s.lastErrors).toEqual(["peer prefill-1: connection reset"]);
    expect(s.ucx).toEqual({
      version: "1.22.0",
      transports: ["cma/memory", "tcp/lo"],
      memoryTypes: ["host"],
    });
  });

  it("lists transfers by state and peer, with timings", async () => {
    sidecar.start("a", "prefill-0");
    sidecar.start("b", "prefill-1");
    sidecar.end("c", "KV_READY");
    const waiting = await client.listTransfers({ states: ["WAITING"] });
    expect(waiting.transfers.map((t) => t.transferId).sort()).toEqual(["a", "b"]);
    const p1 = await client.listTransfers({ peer: "prefill-1" });
    expect(p1.transfers.map((t) => t.transferId)).toEqual(["b"]);
    const ready = await client.listTransfers({ states: ["KV_READY"] });
    expect(ready.transfers[0]).toMatchObject({ transferId: "c", state: "KV_READY", bytes: 4096 });
    expect(ready.transfers[0]!.timings.readyMs).toBeGreaterThan(0);
    const limited = await client.listTransfers({ limit: 1 });
    expect(limited).toMatchObject({ total: 3 });
    expect(limited.transfers).toHaveLength(1);
  });

  it("refuses unknown states with INVALID_ARGUMENT", async () => {
    const err = await rejection(client.listTransfers({ states: ["BOGUS" as TransferState] }));
    expect(err.code).toBe(grpc.status.INVALID_ARGUMENT);
    expect(err.details).toMatch(/unknown transfer state/);
  });
});

describe("AwaitTransfer", () => {
  it("returns the terminal event appended before the call", async () => {
    sidecar.end("before", "KV_READY", 123);
    const ev = await client.awaitTransfer("before", 2_000);
    expect(ev).toMatchObject({
      seq: 1,
      kind: "KV_READY",
      transferId: "before",
      bytes: 123,
      side: "decode",
    });
  });

  it("waits for a transfer that ends during the call", async () => {
    sidecar.start("during");
    const pending = client.awaitTransfer("during", 5_000);
    await new Promise((r) => setTimeout(r, 100));
    sidecar.end("during", "FAILED", 0, "PEER_FAILED");
    const ev = await pending;
    expect(ev).toMatchObject({ kind: "FAILED", transferId: "during", reason: "PEER_FAILED" });
    expect(events.waiterTotal).toBe(0);
  });

  it("fails with DEADLINE_EXCEEDED when the deadline passes first, and leaves no waiter behind", async () => {
    sidecar.start("slow");
    const t0 = Date.now();
    const err = await rejection(client.awaitTransfer("slow", 200));
    expect(err.code).toBe(grpc.status.DEADLINE_EXCEEDED);
    expect(Date.now() - t0).toBeLessThan(3_000);
    await until(() => events.waiterTotal === 0, 2_000, "waiter removed");
    // A transfer never seen also waits until the deadline (it may not have started yet).
    const never = await rejection(client.awaitTransfer("never-seen", 100));
    expect(never.code).toBe(grpc.status.DEADLINE_EXCEEDED);
  });

  it("stops at the server's longest wait when the call has a later deadline", async () => {
    const s2 = await startApiServer({ view: sidecar, events, maxAwaitMs: 100 });
    const c2 = new SidecarClient(s2.address);
    try {
      const err = await rejection(c2.awaitTransfer("x", 5_000));
      expect(err.code).toBe(grpc.status.DEADLINE_EXCEEDED);
      expect(err.details).toMatch(/longest wait/);
    } finally {
      c2.close();
      await s2.close(1_000);
    }
  });

  it("answers NOT_FOUND when the terminal event is no longer retained", async () => {
    const small = new EventLog({ capacity: 10 });
    const fx = new FixtureSidecar(small);
    const s2 = await startApiServer({ view: fx, events: small });
    const c2 = new SidecarClient(s2.address);
    try {
      fx.end("old", "KV_READY");
      for (let i = 0; i < 15; i++) fx.end(`t${i}`, "KV_READY");
      const err = await rejection(c2.awaitTransfer("old", 1_000));
      expect(err.code).toBe(grpc.status.NOT_FOUND);
      expect(err.details).toMatch(/ended at seq 1, no longer retained \(oldest retained seq 7\)/);
      expect((await c2.awaitTransfer("t14", 1_000)).seq).toBe(16);
    } finally {
      c2.close();
      await s2.close(1_000);
      small.close();
    }
  });

  it("refuses an empty or oversized transfer id with INVALID_ARGUMENT", async () => {
    expect((await rejection(client.awaitTransfer("", 1_000))).code).toBe(
      grpc.status.INVALID_ARGUMENT,
    );
    expect((await rejection(client.awaitTransfer("x".repeat(600), 1_000))).code).toBe(
      grpc.status.INVALID_ARGUMENT,
    );
    // Printable characters only (issue 31): a NUL or a newline is refused by name.
    const nul = await rejection(client.awaitTransfer("a\u0000b", 1_000));
    expect(nul.code).toBe(grpc.status.INVALID_ARGUMENT);
    expect(nul.details).toMatch(/U\+0000 at index 1: only printable characters/);
    expect((await rejection(client.awaitTransfer("a\nb", 1_000))).details).toMatch(/U\+000A/);
  });
});

describe("WatchEvents requests", () => {
  it("refuses unknown kinds, huge and stale sequence numbers, a foreign epoch", async () => {
    for (let i = 0; i < 5; i++) sidecar.end(`t${i}`, "KV_READY");
    const codeOf = (req: Parameters<SidecarClient["watchRequest"]>[0]) =>
      rejection(client.watchRequest(req, () => {}).done);

    const unknownKind = await codeOf(
      create(WatchEventsRequestSchema, { kinds: [99 as EventKind] }),
    );
    expect(unknownKind.code).toBe(grpc.status.INVALID_ARGUMENT);
    expect(unknownKind.details).toMatch(/unknown event kind 99/);
    // The client sends a name it does not know as kind 0, which the server refuses too.
    const byName = await rejection(client.watch({ kinds: ["BOGUS"] }, () => {}).done);
    expect(byName.code).toBe(grpc.status.INVALID_ARGUMENT);

    const huge = await codeOf(create(WatchEventsRequestSchema, { afterSeq: 1n << 62n }));
    expect(huge.code).toBe(grpc.status.OUT_OF_RANGE);
    const ahead = await codeOf(create(WatchEventsRequestSchema, { afterSeq: 6n }));
    expect(ahead.code).toBe(grpc.status.OUT_OF_RANGE);
    expect(ahead.details).toMatch(/beyond the newest seq 5/);

    const epoch = await codeOf(create(WatchEventsRequestSchema, { afterSeq: 2n, epoch: 42n }));
    expect(epoch.code).toBe(grpc.status.FAILED_PRECONDITION);

    const emptyId = await codeOf(create(WatchEventsRequestSchema, { transferIds: [""] }));
    expect(emptyId.code).toBe(grpc.status.INVALID_ARGUMENT);
  });

  it("answers OUT_OF_RANGE, naming the oldest retained seq, when resuming from a dropped seq", async () => {
    for (let i = 0; i < 1500; i++) sidecar.end(`t${i}`, "KV_READY");
    expect(events.firstSeq).toBe(501);
    const err = await rejection(client.watch({ afterSeq: 100 }, () => {}).done);
    expect(err.code).toBe(grpc.status.OUT_OF_RANGE);
    expect(err.details).toMatch(/oldest retained seq is 501/);
    // Resuming right at the edge works: nothing it needs is gone.
    const got: number[] = [];
    const w = client.watch({ afterSeq: 500 }, (ev) => got.push(ev.seq));
    await until(() => got.length === 1000, 5_000, "replay");
    expect(got[0]).toBe(501);
    w.cancel();
    await w.done;
  });
});

describe("health", () => {
  it("flips to NOT_SERVING on setServing(false), for Check and Watch", async () => {
    expect(await client.health()).toBe("SERVING");
    expect(await client.health("kvxfer.v1.Sidecar")).toBe("SERVING");
    expect((await rejection(client.health("nope"))).code).toBe(grpc.status.NOT_FOUND);

    const seen: HealthStatus[] = [];
    const hw = client.watchHealth("", (s) => seen.push(s));
    await until(() => seen.length === 1, 5_000, "first health status");
    server.setServing(false);
    await until(() => seen.length === 2, 5_000, "health change");
    expect(seen).toEqual(["SERVING", "NOT_SERVING"]);
    expect(await client.health()).toBe("NOT_SERVING");
    // Draining keeps the Sidecar service answering: routers still learn how transfers end.
    sidecar.end("late", "KV_READY");
    expect((await client.awaitTransfer("late", 1_000)).kind).toBe("KV_READY");
    server.setServing(true);
    await until(() => seen.length === 3, 5_000, "health back");
    expect(seen[2]).toBe("SERVING");
    hw.cancel();
    await hw.done;

    const unknown: HealthStatus[] = [];
    const uw = client.watchHealth("other.Service", (s) => unknown.push(s));
    await until(() => unknown.length === 1, 5_000, "unknown service status");
    expect(unknown).toEqual(["SERVICE_UNKNOWN"]);
    uw.cancel();
    await uw.done;
  });

  it("close() ends open watches with UNAVAILABLE and pending awaits", async () => {
    const w = client.watch({}, () => {});
    const a = client.awaitTransfer("pending", 10_000);
    await until(
      () => server.watchers === 1 && events.waiterTotal === 1,
      5_000,
      "watch and await open",
    );
    const watchEnd = rejection(w.done);
    const awaitEnd = rejection(a);
    await server.close(1_000);
    expect((await watchEnd).code).toBe(grpc.status.UNAVAILABLE);
    expect((await awaitEnd).code).toBe(grpc.status.UNAVAILABLE);
  });
});
