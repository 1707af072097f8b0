// WatchEvents over loopback: resuming without loss or duplicates across
// 10 000 transfers, and bounded memory with a watcher that never reads.
import * as grpc from "@grpc/grpc-js";
import { create, fromBinary, toBinary } from "@bufbuild/protobuf";
import * as http2 from "node:http2";
import { setFlagsFromString } from "node:v8";
import { runInNewContext } from "node:vm";
import { afterEach, describe, expect, it } from "vitest";
import { SidecarClient } from "../../src/api/client.js";
import { type ApiServer, startApiServer } from "../../src/api/server.js";
import { method, sidecarService } from "../../src/api/service.js";
import {
  WatchEventsRequestSchema,
  WatchEventsResponseSchema,
} from "../../src/gen/kvxfer/v1/sidecar_pb.js";
import { EventLog } from "../../src/sidecar/event-log.js";
import type { SidecarEvent, TerminalKind } from "../../src/sidecar/view.js";
import { FixtureSidecar, rejection } from "./fixtures.js";
import { until } from "../until.js";

const cleanup: (() => Promise<void> | void)[] = [];
afterEach(async () => {
  for (const f of cleanup.splice(0).reverse()) await f();
});

async function serve(
  events: EventLog,
  view: FixtureSidecar,
  extra: Partial<Parameters<typeof startApiServer>[0]> = {},
): Promise<ApiServer> {
  const s = await startApiServer({ view, events, address: "127.0.0.1:0", ...extra });
  cleanup.push(() => s.close(1_000));
  return s;
}

function newClient(address: string): SidecarClient {
  const c = new SidecarClient(address, { timeoutMs: 5_000 });
  cleanup.push(() => c.close());
  return c;
}

const KINDS: TerminalKind[] = ["KV_READY", "KV_READY", "KV_READY", "FAILED", "EXPIRED", "ABORTED"];
const tick = () => new Promise<void>((r) => setImmediate(r));

describe("resuming", () => {
  it("delivers every terminal event exactly once across 10 000 transfers, disconnecting mid-run", async () => {
    const events = new EventLog({ capacity: 100_000 });
    cleanup.push(() => events.close());
    const fx = new FixtureSidecar(events);
    const server = await serve(events, fx);
    const client = newClient(server.address);

    const N = 10_000;
    const got = new Map<string, number>();
    const seqs: number[] = [];
    const onEvent = (ev: SidecarEvent) => {
      got.set(ev.transferId, (got.get(ev.transferId) ?? 0) + 1);
      seqs.push(ev.seq);
    };
    let lastSeq = 0;
    let epoch: bigint | undefined;
    let disconnects = 0;
    let appendedWhileAway = 0;
    let next = 0;
    const appendBatch = (n: number) => {
      for (let i = 0; i < n && next < N; i++, next++) {
        // Interleave peer events, which the router filters out.
        if (next % 1000 === 0)
          events.append({
            kind: "PEER_UP",
            timeMs: Date.now(),
            transferId: "",
            peer: "prefill-0",
            side: "",
            reason: "",
            bytes: 0,
            mode: "",
          });
        fx.end(`req-${next}`, KINDS[next % KINDS.length]!);
      }
    };
    while (next < N) {
      // Connected: a router-side client watching terminal kinds from its last seq.
      const w = client.watch(
        {
          afterSeq: lastSeq,
          kinds: ["KV_READY", "FAILED", "EXPIRED", "ABORTED", "RELEASED"],
          ...(epoch !== undefined ? { epoch } : {}),
        },
        onEvent,
      );
      for (let b = 0; b < 5 && next < N; b++) {
        appendBatch(137);
        await tick();
      }
      // Let some of it arrive, not necessarily all, then drop the connection mid-stream.
      await new Promise((r) => setTimeout(r, 2));
      w.cancel();
      await w.done;
      lastSeq = w.lastSeq;
      epoch = w.epoch ?? epoch;
      disconnects++;
      // Disconnected: transfers keep ending.
      const before = next;
      appendBatch(251);
      appendedWhileAway += next - before;
    }
    const w = client.watch(
      {
        afterSeq: lastSeq,
        kinds: ["KV_READY", "FAILED", "EXPIRED", "ABORTED", "RELEASED"],
        ...(epoch !== undefined ? { epoch } : {}),
      },
      onEvent,
    );
    await until(() => got.size === N, 20_000, "every transfer's event");
    await new Promise((r) => setTimeout(r, 50)); // room for a duplicate to show up
    w.cancel();
    await w.done;

    expect(disconnects).toBeGreaterThan(5);
    expect(appendedWhileAway).toBeGreaterThan(1000);
    expect(got.size).toBe(N);
    expect([...got.values()].every((c) => c === 1)).toBe(true);
    for (let i = 1; i < seqs.length; i++) expect(seqs[i]! > seqs[i - 1]!).toBe(true);
  });

  it("watchResumable reconnects by itself through a server restart and delivers each event once", async () => {
    const events = new EventLog({ capacity: 100_000 });
    cleanup.push(() => events.close());
    const fx = new FixtureSidecar(events);
    let server = await startApiServer({ view: fx, events, address: "127.0.0.1:0" });
    const port = server.port;
    const client = newClient(`127.0.0.1:${port}`);
    const seqs: number[] = [];
    const w = client.watchResumable({ minBackoffMs: 10, maxBackoffMs: 100 }, (ev) =>
      seqs.push(ev.seq),
    );
    cleanup.push(() => w.cancel());
    let n = 0;
    for (let round = 0; round < 4; round++) {
      for (let i = 0; i < 500; i++) fx.end(`r${round}-${n++}`, "KV_READY");
      // Everything so far delivered: the client is connected to this incarnation.
      await until(() => seqs.length === n, 10_000, "this round's events");
      // The server goes away mid-stream (the log survives, as in the sidecar) and comes back.
      await server.close(200);
      for (let i = 0; i < 300; i++) fx.end(`r${round}-${n++}`, "KV_READY");
      server = await startApiServer({ view: fx, events, address: `127.0.0.1:${port}` });
    }
    cleanup.push(() => server.close(1_000));
    await until(() => seqs.length === n, 20_000, "all events after reconnects");
    expect(w.reconnects).toBeGreaterThanOrEqual(4);
    expect(seqs).toEqual(Array.from({ length: n }, (_, i) => i + 1));
  });

  it("a filtered watcher's resume point moves with progress messages, so it stays retained", async () => {
    const events = new EventLog({ capacity: 100 });
    cleanup.push(() => events.close());
    const fx = new FixtureSidecar(events);
    const server = await serve(events, fx, { progressIntervalMs: 20 });
    const client = newClient(server.address);
    const got: SidecarEvent[] = [];
    let caughtUp = false;
    const w = client.watch(
      { transferIds: ["mine"], onProgress: (p) => (caughtUp ||= p.caughtUp) },
      (ev) => got.push(ev),
    );
    await until(() => caughtUp, 5_000, "caught up");
    // Now only the periodic progress message can move its resume point.
    for (let i = 0; i < 90; i++) fx.end(`other-${i}`, "KV_READY");
    await until(() => w.lastSeq === 90, 5_000, "progress to seq 90");
    w.cancel();
    await w.done;
    // 150 more: seq 90 is still inside the ring's last 100 only because progress moved it.
    for (let i = 0; i < 60; i++) fx.end(`more-${i}`, "KV_READY");
    fx.end("mine", "KV_READY");
    const again = client.watch({ afterSeq: w.lastSeq, transferIds: ["mine"] }, (ev) =>
      got.push(ev),
    );
    await until(() => got.length === 1, 5_000, "my event");
    expect(got[0]).toMatchObject({ transferId: "mine", seq: 151 });
    again.cancel();
    await again.done;
    expect(got).toHaveLength(1);
  });

  it("watchResumable gives up with OUT_OF_RANGE instead of skipping events that are gone", async () => {
    const events = new EventLog({ capacity: 50 });
    cleanup.push(() => events.close());
    const fx = new FixtureSidecar(events);
    const server = await serve(events, fx);
    const client = newClient(server.address);
    for (let i = 0; i < 200; i++) fx.end(`t${i}`, "KV_READY");
    const w = client.watchResumable({ afterSeq: 10 }, () => {});
    const err = await rejection(w.done);
    expect(err.code).toBe(grpc.status.OUT_OF_RANGE);
  });
});

function gc(): void {
  setFlagsFromString("--expose-gc");
  (runInNewContext("gc") as () => void)();
}

describe("bounds", () => {
  it("a watcher that never reads is ended (RESOURCE_EXHAUSTED) and memory stays bounded", async () => {
    const capacity = 20_000;
    const bufferLimit = 2_000;
    const events = new EventLog({ capacity });
    cleanup.push(() => events.close());
    const fx = new FixtureSidecar(events);
    const server = await serve(events, fx, { watchBufferLimit: bufferLimit });
    // A raw HTTP/2 client whose stream is paused: it never reads, so HTTP/2
    // flow control pushes back on the server as it would for a stuck router.
    const session = http2.connect(`http://${server.address}`);
    cleanup.push(() => void session.destroy());
    const body = toBinary(WatchEventsRequestSchema, create(WatchEventsRequestSchema, {}));
    const frame = Buffer.alloc(5 + body.length);
    frame.writeUInt32BE(body.length, 1);
    frame.set(body, 5);
    const stream = session.request({
      ":method": "POST",
      ":path": method(sidecarService, "WatchEvents").path,
      "content-type": "application/grpc",
      te: "trailers",
    });
    stream.end(frame);
    stream.pause();
    let grpcStatus: string | undefined;
    let grpcMessage = "";
    stream.on("trailers", (t) => {
      grpcStatus = String(t["grpc-status"]);
      grpcMessage = decodeURIComponent(String(t["grpc-message"] ?? ""));
    });
    await until(() => server.watchers === 1, 5_000, "watcher open");

    const append = (n: number, from: number) => {
      for (let i = 0; i < n; i++)
        events.append({
          kind: "KV_READY",
          timeMs: Date.now(),
          transferId: `req-${from + i}-${"x".repeat(64)}`,
          peer: "prefill-0",
          side: "decode",
          reason: "r".repeat(200),
          bytes: 4096,
          mode: "pull",
        });
    };
    // Fill the log once so its own size is part of the baseline.
    append(capacity, 0);
    await until(() => server.watchers === 0, 10_000, "never-reading watcher ended");
    gc();
    const base = process.memoryUsage().heapUsed;
    let maxBuffered = 0;
    for (let round = 0; round < 20; round++) {
      append(10_000, capacity + round * 10_000);
      maxBuffered = Math.max(maxBuffered, ...events.subscriberBuffers(), 0);
      await tick();
    }
    gc();
    const growth = process.memoryUsage().heapUsed - base;
    expect(events.size).toBe(capacity);
    expect(events.subscriberCount).toBe(0);
    expect(maxBuffered).toBeLessThanOrEqual(bufferLimit);
    // 200 000 events of ~300 bytes appended after the baseline: unbounded buffering would be ~60 MB.
    expect(growth).toBeLessThan(15 << 20);

    // When it reads at last, it gets a gap-free prefix, then RESOURCE_EXHAUSTED.
    const chunks: Buffer[] = [];
    stream.on("data", (c: Buffer) => chunks.push(c));
    let streamEnded = false;
    stream.on("end", () => (streamEnded = true));
    stream.resume();
    // Trailers can come before the buffered data is read; 'end' comes after it.
    await until(() => grpcStatus !== undefined && streamEnded, 10_000, "stream end");
    expect(grpcStatus).toBe(String(grpc.status.RESOURCE_EXHAUSTED));
    expect(grpcMessage).toMatch(/fell behind/);
    const all = Buffer.concat(chunks);
    const seqs: number[] = [];
    for (let off = 0; off < all.length;) {
      const len = all.readUInt32BE(off + 1);
      const res = fromBinary(WatchEventsResponseSchema, all.subarray(off + 5, off + 5 + len));
      if (res.msg.case === "event") seqs.push(Number(res.msg.value.seq));
      off += 5 + len;
    }
    expect(seqs.length).toBeGreaterThan(0);
    expect(seqs.length).toBeLessThan(capacity);
    expect(seqs).toEqual(Array.from({ length: seqs.length }, (_, i) => i + 1));
  });
  it("a watcher that reads keeps up with a fast producer (no false 'fell behind')", async () => {
    const events = new EventLog({ capacity: 100_000 });
    cleanup.push(() => events.close());
    const fx = new FixtureSidecar(events);
    const server = await serve(events, fx, { watchBufferLimit: 5_000 });
    const client = newClient(server.address);
    let count = 0;
    const w = client.watch({}, () => count++);
    await until(() => server.watchers === 1, 5_000, "watcher open");
    for (let round = 0; round < 50; round++) {
      for (let i = 0; i < 1000; i++) fx.end(`t${round}-${i}`, "KV_READY");
      await until(() => count >= (round + 1) * 1000 - 4000, 10_000, "watcher keeping up");
    }
    await until(() => count === 50_000, 20_000, "all delivered");
    w.cancel();
    await w.done;
  });
});
