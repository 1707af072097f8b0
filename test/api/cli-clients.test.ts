// kvxfer status | watch | await against a real server, in-process.
import { afterEach, beforeEach, describe, expect, it } from "vitest";
import { type ApiServer, startApiServer } from "../../src/api/server.js";
import { runAwait } from "../../src/cli/await.js";
import { runStatus } from "../../src/cli/status.js";
import { runWatch } from "../../src/cli/watch.js";
import { EventLog } from "../../src/sidecar/event-log.js";
import { FixtureSidecar } from "./fixtures.js";
import { until } from "../until.js";

let events: EventLog;
let fx: FixtureSidecar;
let server: ApiServer;

beforeEach(async () => {
  events = new EventLog();
  fx = new FixtureSidecar(events);
  server = await startApiServer({ view: fx, events });
});
afterEach(async () => {
  await server.close(1_000);
  events.close();
});

function capture() {
  const out: string[] = [];
  const err: string[] = [];
  return { out, err, io: { out: (l: string) => out.push(l), err: (l: string) => err.push(l) } };
}

describe("kvxfer status", () => {
  it("prints a table, or JSON", async () => {
    fx.start("a");
    fx.end("b", "KV_READY", 3 << 20);
    const c = capture();
    expect(await runStatus([server.address], c.io)).toBe(0);
    const text = c.out.join("\n");
    expect(text).toMatch(/^SIDECAR\s+EPOCH\s+ROLE/);
    expect(text).toMatch(/decode-0\s+0x123456789abcdef0\s+decode\s+auto\s+2/);
    expect(text).toContain("moved: 1 transfers, 3.0 MiB");
    expect(text).toContain("events: seq 1..1 retained");
    expect(text).toMatch(/prefill-0\s+0x7\s+connected/);
    expect(text).toMatch(/WAITING\s+1/);
    expect(text).toContain("peer prefill-1: connection reset");

    const j = capture();
    expect(await runStatus([server.address, "--json"], j.io)).toBe(0);
    const parsed = JSON.parse(j.out[0]!);
    expect(parsed).toMatchObject({
      engineId: "decode-0",
      epoch: "1311768467463790320",
      health: "SERVING",
    });
  });

  it("exits 2 on usage errors and 1 when the sidecar is unreachable, in one line", async () => {
    const c = capture();
    expect(await runStatus([], c.io)).toBe(2);
    expect(c.err).toEqual([
      expect.stringMatching(/^kvxfer status: missing the sidecar's gRPC address/),
    ]);
    const t = capture();
    expect(await runStatus(["127.0.0.1:1", "--timeout", "abc"], t.io)).toBe(2);
    expect(t.err).toEqual([expect.stringContaining("--timeout must be a number > 0, got 'abc'")]);
    const d = capture();
    expect(await runStatus(["127.0.0.1:1", "--timeout", "300"], d.io)).toBe(1);
    expect(d.err).toEqual([expect.stringContaining("nothing listening at 127.0.0.1:1")]);
  });
});

describe("kvxfer watch", () => {
  it("prints retained and live events from --from, filtered, and stops after --count", async () => {
    fx.end("t1", "KV_READY");
    fx.end("t2", "FAILED", 0, "PEER_FAILED");
    const c = capture();
    const run = runWatch(
      [server.address, "--from", "2", "--kind", "FAILED", "--kind", "KV_READY", "--count", "3"],
      c.io,
    );
    await until(() => c.out.length === 1, 5_000, "replayed event");
    fx.end("t3", "ABORTED");
    fx.end("t4", "KV_READY");
    fx.end("t5", "KV_READY");
    expect(await run).toBe(0);
    expect(c.out).toHaveLength(3);
    expect(c.out[0]).toMatch(
      /^\s+2 .* FAILED\s+ t2 {2}decode {2}peer=prefill-0 {2}pull .*reason=PEER_FAILED$/,
    );
    expect(c.out[1]).toMatch(/^\s+4 .*KV_READY\s+t4/);
    expect(c.out[2]).toMatch(/^\s+5 .*KV_READY\s+t5/);
  });

  it("without --from shows only new events; stops on its signal; --json prints objects", async () => {
    fx.end("old", "KV_READY");
    const ac = new AbortController();
    const c = capture();
    const run = runWatch([server.address, "--json"], { ...c.io, signal: ac.signal });
    await until(() => server.watchers === 1, 5_000, "watch open");
    await new Promise((r) => setTimeout(r, 50));
    fx.end("new", "KV_READY");
    await until(() => c.out.length === 1, 5_000, "live event");
    ac.abort();
    expect(await run).toBe(0);
    expect(JSON.parse(c.out[0]!)).toMatchObject({ seq: 2, transferId: "new", kind: "KV_READY" });
  });

  it("refuses unknown kinds before connecting", async () => {
    const c = capture();
    expect(await runWatch([server.address, "--kind", "NOPE"], c.io)).toBe(2);
    expect(c.err[0]).toMatch(/unknown kind 'NOPE'/);
  });
});

describe("kvxfer await", () => {
  it("exits 0 for KV_READY, 1 for FAILED, 3 when the timeout passes", async () => {
    fx.end("ok", "KV_READY");
    fx.end("bad", "FAILED", 0, "TIMEOUT");
    const a = capture();
    expect(await runAwait([server.address, "ok"], a.io)).toBe(0);
    expect(a.out[0]).toMatch(/KV_READY\s+ok/);
    expect(await runAwait([server.address, "bad"], capture().io)).toBe(1);
    const t = capture();
    expect(await runAwait([server.address, "never", "--timeout", "100"], t.io)).toBe(3);
    expect(t.err[0]).toMatch(/has not ended within 100 ms/);
    expect(await runAwait([server.address], capture().io)).toBe(2);
  });
});
