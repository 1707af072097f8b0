/** Two agents in two processes over shared memory; exit with handles open. */
import { spawnSync } from "node:child_process";
import { afterAll, beforeAll, describe, expect, it } from "vitest";

import {
  PeerProcess,
  type PeerXfer as Xfer,
  connectPeers,
} from "../../bench/native/peer-client.js";
import { prng, randomDescriptors } from "../../bench/native/pattern.js";

const b64 = (d: Float64Array): string =>
  Buffer.from(d.buffer, d.byteOffset, d.byteLength).toString("base64");

interface Hash {
  sha256: string;
}

describe("two processes over shared memory", () => {
  const SIZE = 256 << 20;
  let p: PeerProcess;
  let d: PeerProcess;

  beforeAll(async () => {
    p = new PeerProcess();
    d = new PeerProcess();
    await connectPeers(p, d, ["proc-p", "proc-d"], { transports: "shm,self" }, SIZE);
  });
  afterAll(async () => {
    expect(await p.close()).toBe(0);
    expect(await d.close()).toBe(0);
  });

  it("moves 256 MiB both ways by write and by read, hash-checked", async () => {
    const whole = b64(new Float64Array([0, 0, SIZE]));
    const hp = async (): Promise<string> => (await p.call<Hash>("hash")).sha256;
    const hd = async (): Promise<string> => (await d.call<Hash>("hash")).sha256;
    expect(await hp()).not.toBe(await hd());

    expect((await p.call<Xfer>("write", { descs: whole })).failed).toBeUndefined(); // P -> D by write
    expect(await hd()).toBe(await hp());

    await d.call("fill", { seed: 3 });
    expect((await p.call<Xfer>("read", { descs: whole })).failed).toBeUndefined(); // D -> P by read
    expect(await hp()).toBe(await hd());

    await p.call("fill", { seed: 4 });
    expect((await d.call<Xfer>("read", { descs: whole })).failed).toBeUndefined(); // P -> D by read
    expect(await hd()).toBe(await hp());

    await d.call("fill", { seed: 5 });
    expect((await d.call<Xfer>("write", { descs: whole })).failed).toBeUndefined(); // D -> P by write
    expect(await hp()).toBe(await hd());
  });

  it("moves random descriptor lists exactly (compared region by region)", async () => {
    const rand = prng(99);
    for (let round = 0; round < 20; round++) {
      await p.call("fill", { seed: 10 + round });
      await d.call("fill", { seed: 50 + round });
      // Non-overlapping destinations in the first 16 MiB; same offsets both sides keep the check simple.
      const descs = randomDescriptors(rand, 16 << 20, 1 + Math.floor(rand() * 2000), 4096);
      for (let i = 0; i < descs.length; i += 3) descs[i] = descs[i + 1]!;
      expect((await p.call<Xfer>("write", { descs: b64(descs) })).failed).toBeUndefined();
      for (let i = 0; i < descs.length; i += 3) {
        const off = descs[i + 1]!;
        const len = descs[i + 2]!;
        if (i % 60 !== 0) continue; // hash a sample of ranges: the IPC per range is the cost here
        const [a, b] = await Promise.all([
          p.call<Hash>("hash", { offset: off, length: len }),
          d.call<Hash>("hash", { offset: off, length: len }),
        ]);
        expect(b.sha256, `round ${round} range ${off}+${len}`).toBe(a.sha256);
      }
    }
  });

  it("never delivers a write's notification before its data (3000 round trips)", async () => {
    const r = await p.call<{ reps: number }>(
      "pingpong",
      { reps: 3000, maxLen: 128 << 10, seed: 7 },
      120_000,
    );
    expect(r.reps).toBe(3000);
    const stats = await d.call<{ ok: number; bad: number; firstBad: string }>("watchStats");
    expect(stats.firstBad).toBe("");
    expect(stats.bad).toBe(0);
    expect(stats.ok).toBe(3000);
  });
});

describe("process exit", () => {
  it("exits cleanly with agents, regions (with views), endpoints and transfers left open", () => {
    const script = `
      import { Agent } from ${JSON.stringify(new URL("../../src/native/index.ts", import.meta.url).pathname.replace("/src/", "/dist/src/").replace(/\.ts$/, ".js"))};
      const a = new Agent({ transports: "shm,self" });
      const b = new Agent({ transports: "shm,self" });
      const src = a.registerMemory(new Uint8Array(1 << 20));
      const dst = b.registerMemory(new Uint8Array(1 << 20));
      const ep = a.connect(b.address);
      const remote = ep.importRemote(dst.remoteKey());
      // A mapped file and UCX-allocated memory, each with a JavaScript view still reachable.
      const { writeFileSync, rmSync } = await import("node:fs");
      const file = "/tmp/kvxfer-exit-test-" + process.pid + ".kv";
      writeFileSync(file, Buffer.alloc(1 << 16));
      const mapped = b.mapFile(file, { length: 1 << 16 });
      globalThis.keep = [mapped.bytes(), a.allocate(1 << 16).bytes()];
      globalThis.keep[0][0] = 1;
      rmSync(file);
      a.write(ep, src, remote, new Float64Array([0, 0, 1 << 20])).then(() => console.log("written"));
      setTimeout(() => console.log("leaving"), 50);
    `;
    const res = spawnSync(process.execPath, ["--input-type=module", "-e", script], {
      encoding: "utf8",
      timeout: 20_000,
    });
    expect(res.error).toBeUndefined();
    expect(res.signal).toBeNull();
    expect(res.stderr).toBe("");
    expect(res.status).toBe(0);
    expect(res.stdout).toContain("written");
    expect(res.stdout).toContain("leaving");
  });
});
