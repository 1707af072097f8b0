// --bootstrap: a real sidecar process answers GET /query with what vllm-router's mooncake mode
// reads (vLLM's bootstrap form: data-parallel rank → engine id and workers), naming its own side
// channel; other paths and methods get 404; a decode-only sidecar refuses the flag.
import { existsSync } from "node:fs";

import { afterEach, describe, expect, it } from "vitest";

import { bootstrapAnswer } from "../../src/api/bootstrap.js";
import { SidecarProcess } from "../../sim/sidecar-process.js";
import { kvxfer } from "../cli/run.js";

const started: SidecarProcess[] = [];
afterEach(async () => {
  await Promise.all(started.splice(0).map((s) => s.close()));
});

describe("--bootstrap", () => {
  it("answers GET /query with this engine's id and side channel, in vLLM's bootstrap form", async () => {
    const engineId = `boot-${process.pid}`;
    const sc = new SidecarProcess([
      "--engine-id",
      engineId,
      "--role",
      "prefill",
      "--engine-socket",
      `ipc:///tmp/kvxfer-${engineId}.sock`,
      "--listen",
      "127.0.0.1:0",
      "--bootstrap",
      "127.0.0.1:0",
    ]);
    started.push(sc);
    const ready = await sc.ready;
    expect(ready.bootstrap).toMatch(/^127\.0\.0\.1:\d+$/);
    const res = await fetch(`http://${ready.bootstrap}/query`, {
      signal: AbortSignal.timeout(5000),
    });
    expect(res.status).toBe(200);
    expect(res.headers.get("content-type")).toBe("application/json");
    expect(await res.json()).toEqual({
      "0": { engine_id: engineId, worker_addr: { "0": { "0": ready.sideChannel } } },
    });
    const other = await fetch(`http://${ready.bootstrap}/register`, {
      method: "POST",
      body: "{}",
      signal: AbortSignal.timeout(5000),
    });
    expect(other.status).toBe(404);
    expect(await other.text()).toBe("not found: try GET /query\n");
    expect(
      (await fetch(`http://${ready.bootstrap}/`, { signal: AbortSignal.timeout(5000) })).status,
    ).toBe(404);
  }, 30_000);

  it("the answer is JSON of the engine id and side channel, whatever characters they hold", () => {
    const body = JSON.parse(bootstrapAnswer('e"1\\x', "[::1]:7000")) as Record<string, unknown>;
    expect(body).toEqual({
      "0": { engine_id: 'e"1\\x', worker_addr: { "0": { "0": "[::1]:7000" } } },
    });
  });

  it("answers --advertise when the side channel listens on every address", async () => {
    const engineId = `boot-adv-${process.pid}`;
    const sc = new SidecarProcess([
      "--engine-id",
      engineId,
      "--role",
      "both",
      "--engine-socket",
      `ipc:///tmp/kvxfer-${engineId}.sock`,
      "--listen",
      "0.0.0.0:0",
      "--advertise",
      "10.1.2.3:7600",
      "--bootstrap",
      "127.0.0.1:0",
    ]);
    started.push(sc);
    const ready = await sc.ready;
    // The ready line names what peers dial, and what was bound.
    expect(ready.sideChannel).toBe("10.1.2.3:7600");
    expect(ready.listen).toMatch(/^0\.0\.0\.0:[1-9][0-9]*$/);
    const res = await fetch(`http://${ready.bootstrap}/query`, {
      signal: AbortSignal.timeout(5000),
    });
    expect(await res.json()).toEqual({
      "0": { engine_id: engineId, worker_addr: { "0": { "0": "10.1.2.3:7600" } } },
    });
  }, 30_000);

  it.each([
    [["--listen=0.0.0.0:0"], "ERR_CONFIG: --bootstrap would tell routers and D to dial 0.0.0.0:"],
    [
      ["--listen=0.0.0.0:0", "--advertise=0.0.0.0:7600"],
      "ERR_CONFIG: --advertise must be the host:port peers dial, got '0.0.0.0:7600'",
    ],
    [
      ["--advertise=pod-ip"],
      "ERR_CONFIG: --advertise must be the host:port peers dial, got 'pod-ip'",
    ],
  ])(
    "refuses to answer an address nobody can dial: %j",
    async (flags, message) => {
      const engineId = `boot-bad-${process.pid}`;
      const r = await kvxfer([
        "sidecar",
        `--engine-id=${engineId}`,
        "--role=prefill",
        "--bootstrap=127.0.0.1:0",
        "--insecure-peers=true",
        ...flags,
      ]);
      expect(r.status).toBe(2);
      expect(r.stdout).toBe("");
      expect(r.stderr).toContain(message);
      expect(existsSync(`/tmp/kvxfer-${engineId}.sock`)).toBe(false);
    },
    30_000,
  );

  it("a decode-only sidecar refuses it: it has no prefill coordinates to give", async () => {
    const r = await kvxfer([
      "sidecar",
      `--engine-id=boot-d-${process.pid}`,
      "--role=decode",
      "--bootstrap=127.0.0.1:0",
      "--insecure-peers=true",
    ]);
    expect(r.status).toBe(2); // a usage error
    expect(r.stdout).toBe("");
    expect(r.stderr).toContain(
      "ERR_CONFIG: --bootstrap serves a prefill engine's coordinates: --role prefill or both",
    );
  }, 30_000);
});
