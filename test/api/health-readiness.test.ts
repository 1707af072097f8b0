// Readiness through the real grpc.health.v1 service of a real sidecar process: NOT_SERVING until
// its engine has registered (handshakes would get ERR_NOT_READY), SERVING after, NOT_SERVING
// again while draining. Liveness (the gRPC server answering at all) does not wait for the engine.
import { existsSync, mkdtempSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";

import { afterAll, afterEach, beforeAll, describe, expect, it } from "vitest";

import { SidecarClient } from "../../src/api/client.js";
import { SimEngineProcess } from "../../sim/engine-client.js";
import { SidecarProcess } from "../../sim/sidecar-process.js";
import { SMALL_ENGINE, uniqueId } from "../sidecar/multiprocess/fixtures.js";
import { until } from "../until.js";

let shmDir: string;
const sidecars: SidecarProcess[] = [];
const engines: SimEngineProcess[] = [];
const clients: SidecarClient[] = [];
const paths: string[] = [];

beforeAll(() => {
  shmDir = mkdtempSync(join(existsSync("/dev/shm") ? "/dev/shm" : tmpdir(), "kvxfer-health-"));
});

afterEach(async () => {
  for (const c of clients.splice(0)) c.close();
  await Promise.all(engines.splice(0).map((e) => e.close(3000).catch(() => undefined)));
  await Promise.all(sidecars.splice(0).map((s) => s.close(5000).catch(() => undefined)));
  for (const p of paths.splice(0)) rmSync(p, { force: true });
});

afterAll(() => {
  rmSync(shmDir, { recursive: true, force: true });
});

function node(id: string): { socket: string; sidecar: SidecarProcess } {
  const path = `/tmp/kvxfer-test-health-${id}.sock`;
  paths.push(path, `${path}.lock`);
  const socket = `ipc://${path}`;
  const sidecar = new SidecarProcess(
    [
      "--engine-id",
      id,
      "--engine-socket",
      socket,
      "--transports",
      "shm,self",
      "--log-level",
      "warn",
    ],
    { pki: false },
  );
  sidecars.push(sidecar);
  return { socket, sidecar };
}

function engine(id: string, socket: string): Promise<SimEngineProcess> {
  return SimEngineProcess.start({ ...SMALL_ENGINE, engineId: id, role: "both", socket, shmDir });
}

describe("gRPC health is readiness", () => {
  it("NOT_SERVING before the engine registers, SERVING after, NOT_SERVING while draining", async () => {
    const id = uniqueId("health");
    const { socket, sidecar } = node(id);
    const ready = await sidecar.ready;
    const client = new SidecarClient(ready.grpc!, { timeoutMs: 5000 });
    clients.push(client);

    // Alive (the API answers) but not ready: no engine yet.
    expect(await client.health()).toBe("NOT_SERVING");
    expect(await client.health("kvxfer.v1.Sidecar")).toBe("NOT_SERVING");
    const status = await client.getStatus();
    expect(status.engineId).toBe(id);
    // A second look a moment later: it stays so while no engine comes.
    await new Promise((r) => setTimeout(r, 300));
    expect(await client.health()).toBe("NOT_SERVING");

    const e = await engine(id, socket);
    engines.push(e);
    // The engine's `ready` follows the sidecar's Registered answer: readiness is already set.
    expect(await client.health()).toBe("SERVING");
    expect(await client.health("kvxfer.v1.Sidecar")).toBe("SERVING");

    // SIGTERM: draining is NOT_SERVING again (the stop is bounded by --drain-ms).
    sidecar.kill("SIGTERM");
    let last = "SERVING";
    await until(
      async () => {
        last = await client.health().catch(() => "GONE");
        return last !== "SERVING";
      },
      10_000,
      "health to leave SERVING after SIGTERM",
    );
    expect(["NOT_SERVING", "GONE"]).toContain(last);
  });

  it("an engine that connected before its sidecar started: SERVING once the sidecar is up", async () => {
    const id = uniqueId("early");
    const path = `/tmp/kvxfer-test-health-${id}.sock`;
    paths.push(path, `${path}.lock`);
    const socket = `ipc://${path}`;
    // The engine waits (ZeroMQ reconnects) for a sidecar that is not there yet.
    const starting = engine(id, socket);
    await new Promise((r) => setTimeout(r, 300));
    const sidecar = new SidecarProcess(
      ["--engine-id", id, "--engine-socket", socket, "--transports", "shm,self"],
      { pki: false },
    );
    sidecars.push(sidecar);
    const ready = await sidecar.ready;
    const e = await starting;
    engines.push(e);
    const client = new SidecarClient(ready.grpc!, { timeoutMs: 5000 });
    clients.push(client);
    await until(async () => (await client.health()) === "SERVING", 5000, "SERVING");
  });
});
