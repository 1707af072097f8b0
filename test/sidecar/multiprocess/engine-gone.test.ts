// The engine dies under a running sidecar (issue 35, case 2). Readiness follows the engine
// (NOT_SERVING while its connection is down); with --engine-lease-ms, once the engine is provably
// gone (its KV files removed, or away that long) the sidecar ends everything it held, telling its
// peers (D recomputes at once instead of after its transfer timeout), and exits 75 so that its
// supervisor restarts it: the new sidecar (a new epoch) takes the next engine's registration.
// Real processes; `npm run build` first.
import { mkdtempSync, rmSync } from "node:fs";
import { join } from "node:path";

import { afterEach, describe, expect, it } from "vitest";

import { SidecarClient } from "../../../src/api/client.js";
import { SimEngineProcess } from "../../../sim/engine-client.js";
import { SidecarProcess } from "../../../sim/sidecar-process.js";
import { KvNode, SMALL_ENGINE, uniqueId } from "./fixtures.js";
import { until } from "../../until.js";

const ENGINE_GONE_EXIT = 75;
const nodes: KvNode[] = [];
const cleanups: (() => Promise<unknown>)[] = [];

afterEach(async () => {
  for (const c of cleanups.splice(0).reverse()) await c().catch(() => undefined);
  await Promise.all(nodes.splice(0).map((n) => n.close()));
});

function exitOf(p: SidecarProcess): Promise<number | null> {
  const c = p.child;
  if (c.exitCode !== null || c.signalCode !== null) return Promise.resolve(c.exitCode);
  return new Promise((resolve) => c.once("exit", (code) => resolve(code)));
}

describe("an engine gone under its sidecar", () => {
  it("push: P's engine SIGKILLed; D recomputes at once, P's sidecar exits 75", async () => {
    const p = await KvNode.start({
      role: "prefill",
      mode: "push",
      sidecarArgs: ["--engine-lease-ms", "1500", "--metrics", "127.0.0.1:0"],
    });
    nodes.push(p);
    const d = await KvNode.start({
      role: "decode",
      mode: "push",
      sidecarArgs: ["--transfer-timeout-ms", "60000"],
    });
    nodes.push(d);
    expect(await p.client.health()).toBe("SERVING");
    await d.engine.expect({ transferId: "g1", tokens: 40, source: p.sideChannel });
    await p.waitTransfer("g1", "prefill", (t) => t.state === "WAITING", "D's registration");
    // The live-transfers gauge counts it (the listing would also count ended ones).
    const scrape = await (await fetch(`http://${p.ready.metrics!}/metrics`)).text();
    expect(scrape).toContain('kvxfer_live_transfers{side="prefill"} 1');
    expect(scrape).toContain('kvxfer_live_transfers{side="decode"} 0');
    const exited = exitOf(p.sidecar);
    const t0 = Date.now();
    p.engine.kill("SIGKILL");
    // Readiness follows the engine at once; the sidecar waits out the lease (the SIGKILLed
    // engine left its files), then fails D's registration and stops.
    await until(
      async () => (await p.client.health().catch(() => "GONE")) !== "SERVING",
      3000,
      "P's readiness to follow its engine",
    );
    const notReadyMs = Date.now() - t0;
    const failed = await d.engineEvent("g1", "failed", 10_000);
    const failedMs = Date.now() - t0;
    expect(failed.reason).not.toBe("TIMEOUT");
    await d.engineEvent("g1", "released", 10_000);
    expect(await exited).toBe(ENGINE_GONE_EXIT);
    const stats = await d.engine.stats();
    expect(stats.freeBlocks).toBe(stats.totalBlocks);
    expect(failedMs).toBeLessThan(10_000); // D's transfer timeout is 60 s
    console.log(
      `P engine SIGKILLed: P NOT_SERVING after ${notReadyMs} ms, D recomputes after ${failedMs} ms ` +
        `(engine lease 1500 ms, transfer timeout 60000 ms); D holds ${stats.totalBlocks - stats.freeBlocks} blocks`,
    );
  });

  it("an engine that removed its files: the sidecar stops at once; the restarted one takes the next engine", async () => {
    const shmDir = mkdtempSync(join("/dev/shm", "kvxfer-gone-"));
    cleanups.push(async () => rmSync(shmDir, { recursive: true, force: true }));
    const id = uniqueId("gone");
    const socket = `ipc:///tmp/kvxfer-test-${id}.sock`;
    const args = [
      ...["--engine-id", id, "--role", "prefill", "--engine-socket", socket],
      ...["--transports", "shm,self", "--kv-dir", shmDir, "--engine-lease-ms", "60000"],
    ];
    const start = async (): Promise<{ sc: SidecarProcess; client: SidecarClient }> => {
      const sc = new SidecarProcess(args, { pki: false });
      cleanups.push(() => sc.close(5000));
      const ready = await sc.ready;
      const client = new SidecarClient(ready.grpc!, { timeoutMs: 3000 });
      cleanups.push(async () => client.close());
      return { sc, client };
    };
    const engine = (): Promise<SimEngineProcess> =>
      SimEngineProcess.start({ ...SMALL_ENGINE, engineId: id, role: "prefill", socket, shmDir });
    const first = await start();
    const e1 = await engine();
    cleanups.push(() => e1.close(3000));
    expect(await first.client.health()).toBe("SERVING");
    const epoch1 = (await first.client.getStatus()).epoch;
    const exited = exitOf(first.sc);
    const t0 = Date.now();
    await e1.call("exit", {}); // a clean exit removes its KV files: provably gone
    expect(await exited).toBe(ENGINE_GONE_EXIT);
    const goneMs = Date.now() - t0;
    expect(goneMs).toBeLessThan(5000); // not the 60 s lease
    // What a supervisor does: start the sidecar again. The next engine registers with it.
    const second = await start();
    const e2 = await engine();
    cleanups.push(() => e2.close(3000));
    expect(await second.client.health()).toBe("SERVING");
    expect((await second.client.getStatus()).epoch).not.toBe(epoch1);
    console.log(
      `engine exited: its sidecar stopped (75) after ${goneMs} ms; the next one took the next engine`,
    );
  });
});
