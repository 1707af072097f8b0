// --notify-zmq: real ZeroMQ sockets. The bytes are production-stack's (msgpack {"req_id": id},
// decoded by the real msgspec in connectors/vllm/tests/test_notify_zmq.py); here: one message per
// decode-side KV_READY and nothing else, and a router that is down costs a counted drop, no wait.
import { Pull } from "zeromq";
import { afterEach, describe, expect, it } from "vitest";

import { MetricsRegistry } from "../../src/api/metrics.js";
import { ZmqNotifier, encodeReqId } from "../../src/api/zmq-notify.js";
import { EventLog } from "../../src/sidecar/event-log.js";
import { logEvent } from "../sidecar/fakes.js";
import { until } from "../until.js";

const open: { close(): void }[] = [];
afterEach(() => {
  for (const o of open.splice(0)) o.close();
});

describe("--notify-zmq", () => {
  it("encodes MessagePack {req_id: id} with the string length forms msgpack defines", () => {
    expect([...encodeReqId("t1")]).toEqual([
      0x81,
      0xa6,
      ...Buffer.from("req_id"),
      0xa2,
      ...Buffer.from("t1"),
    ]);
    const mid = "x".repeat(40);
    expect([...encodeReqId(mid).subarray(8, 10)]).toEqual([0xd9, 40]);
    const long = "y".repeat(300);
    expect([...encodeReqId(long).subarray(8, 11)]).toEqual([0xda, 300 >> 8, 300 & 0xff]);
    expect(encodeReqId(long).length).toBe(8 + 3 + 300);
  });

  it("one message per decode-side KV_READY, in order; nothing for other events", async () => {
    const pull = new Pull();
    open.push(pull);
    await pull.bind("tcp://127.0.0.1:*");
    const registry = new MetricsRegistry();
    const n = new ZmqNotifier(pull.lastEndpoint!, registry);
    open.push(n);
    const log = new EventLog({ capacity: 100 });
    n.start(log);
    // The PUSH side connects in the background: wait until a message goes through.
    const got: string[] = [];
    const reader = (async () => {
      for await (const [msg] of pull) got.push(msg!.toString("latin1"));
    })();
    for (let i = 0; i < 200 && got.length === 0; i++) {
      log.append(logEvent(`warm-${i}`, "KV_READY"));
      await new Promise((r) => setTimeout(r, 10));
    }
    await until(() => got.length > 0);
    await new Promise((r) => setTimeout(r, 50));
    const warm = got.length;
    log.append(logEvent("a", "KV_READY"));
    log.append(logEvent("b", "FAILED"));
    log.append(logEvent("c", "RELEASED", "prefill"));
    log.append(logEvent("d", "KV_READY"));
    await until(() => got.length === warm + 2);
    expect(got.slice(warm)).toEqual([
      encodeReqId("a").toString("latin1"),
      encodeReqId("d").toString("latin1"),
    ]);
    expect(n.counts.sent).toBe(got.length);
    expect(await registry.expose()).toContain(
      `kvxfer_notify_zmq_total{result="sent"} ${got.length}`,
    );
    n.close();
    pull.close();
    await reader.catch(() => undefined);
  });

  it("a router that is down: every message dropped and counted at once, nothing waits", async () => {
    // A port nobody listens on: bind a socket for a free port, then close it.
    const probe = new Pull();
    await probe.bind("tcp://127.0.0.1:*");
    const endpoint = probe.lastEndpoint!;
    probe.close();
    const n = new ZmqNotifier(endpoint);
    open.push(n);
    const log = new EventLog({ capacity: 100 });
    n.start(log);
    const t0 = Date.now();
    for (let i = 0; i < 5; i++) log.append(logEvent(`t${i}`, "KV_READY"));
    await until(() => n.counts.dropped_no_router === 5, 2000);
    expect(Date.now() - t0).toBeLessThan(2000);
    expect(n.counts.sent).toBe(0);
  });

  it("refuses an endpoint that is not one, naming the flag", () => {
    expect(() => new ZmqNotifier("router:7500")).toThrow(
      "--notify-zmq must be a ZeroMQ endpoint such as tcp://127.0.0.1:7500, got 'router:7500'",
    );
  });
});
