/**
 * Inline posting (issue 51, item 5): with the progress thread, a small write, read or notification
 * is posted by the JavaScript thread itself when the worker's lock is free and nothing is queued
 * before it; what completes at once never crosses threads. These cases check that it happens, that
 * it can be switched off, and that mixing inline and thread-posted operations loses no byte and
 * sends no notification before its bytes.
 */
import { describe, expect, it } from "vitest";

import { type Notification, monoUs } from "../../src/native/index.js";
import { pattern, useAgents } from "./agents.js";

const agent = useAgents();

/**
 * `n` 4 KiB writes one after another: how many the JavaScript thread posted itself, how many had
 * their completion queued before write() returned (the trace's completedUs at or before the
 * return), and whether the bytes moved.
 */
async function sequentialWrites(name: string, inlinePost: boolean, n: number) {
  const a = agent({ name: `${name}-a`, inlinePost });
  const b = agent({ name: `${name}-b` });
  const srcBuf = pattern(n * 4096, 3);
  const dstBuf = new Uint8Array(n * 4096);
  const src = a.registerMemory(srcBuf);
  const ep = a.connect(b.address);
  const remote = ep.importRemote(b.registerMemory(dstBuf).remoteKey());
  let insideCall = 0;
  for (let i = 0; i < n; i++) {
    const p = a.write(ep, src, remote, new Float64Array([i * 4096, i * 4096, 4096]));
    const returned = monoUs();
    const t = await p;
    if (t.completedUs <= returned) insideCall++;
  }
  return { inline: a.inlinePosts, insideCall, same: Buffer.compare(dstBuf, srcBuf) === 0 };
}

describe("inline posting", () => {
  it("completes a small write inside the call that posts it; inlinePost false hands it to the thread", async () => {
    const on = await sequentialWrites("inline-on", true, 200);
    expect(on.same).toBe(true);
    // The progress thread may hold the worker for a turn now and then (its sleep bound wakes it):
    // those few go the usual way.
    expect(on.inline).toBeGreaterThanOrEqual(180);
    // Posted inline and complete at once (shared memory): settled before the call returned.
    expect(on.insideCall).toBeGreaterThanOrEqual(on.inline);
    const off = await sequentialWrites("inline-off", false, 200);
    expect(off.same).toBe(true);
    expect(off.inline).toBe(0);
  });

  it("mixes inline and thread-posted writes, reads and notifications without losing a byte or notifying early", async () => {
    const SLOT = 1 << 20;
    const SLOTS = 16;
    const a = agent({ name: "mix-a" });
    const b = agent({ name: "mix-b" });
    const srcBuf = pattern(SLOT * SLOTS, 7);
    const dstBuf = new Uint8Array(SLOT * SLOTS);
    const backBuf = new Uint8Array(SLOT * SLOTS);
    const src = a.registerMemory(srcBuf);
    const back = a.registerMemory(backBuf);
    const ep = a.connect(b.address);
    const remote = ep.importRemote(b.registerMemory(dstBuf).remoteKey());
    // Sizes on both sides of the inline bound (64 descriptors, 256 KiB).
    const sizes = [1, 64, 4096, 65536, 256 << 10, (256 << 10) + 1, SLOT];
    const early: string[] = [];
    const seen = new Set<string>();
    const expected = new Map<string, { off: number; len: number }>();
    b.on("notifications", (batch: Notification[]) => {
      for (const n of batch) {
        const tag = n.data.toString();
        seen.add(tag);
        const want = expected.get(tag);
        if (want === undefined) continue;
        const { off, len } = want;
        // The notification follows the flush: every byte of its write is there already.
        if (Buffer.compare(dstBuf.subarray(off, off + len), srcBuf.subarray(off, off + len)) !== 0)
          early.push(tag);
      }
    });
    for (let wave = 0; wave < 12; wave++) {
      dstBuf.fill(0);
      backBuf.fill(0);
      const ops: Promise<unknown>[] = [];
      for (let s = 0; s < SLOTS; s++) {
        const len = sizes[(wave + s) % sizes.length]!;
        const off = s * SLOT + ((wave * 4096) % (SLOT - len + 1));
        const tag = `w${wave}s${s}`;
        expected.set(tag, { off, len });
        // Half as one descriptor, half cut in 32 (more descriptors, same bytes).
        const pieces = s % 2 === 0 ? 1 : Math.min(32, len);
        const desc = new Float64Array(pieces * 3);
        const step = Math.floor(len / pieces);
        for (let k = 0; k < pieces; k++) {
          const start = k * step;
          const end = k === pieces - 1 ? len : start + step;
          desc.set([off + start, off + start, end - start], k * 3);
        }
        ops.push(
          a
            .write(ep, src, remote, desc, Buffer.from(tag))
            .then(() => a.read(ep, back, remote, new Float64Array([off, off, len])))
            .then(() => {
              const got = backBuf.subarray(off, off + len);
              expect(Buffer.compare(got, srcBuf.subarray(off, off + len)), tag).toBe(0);
            }),
        );
        if (s % 4 === 0) ops.push(a.notify(ep, Buffer.from(`n${wave}s${s}`)));
      }
      await Promise.all(ops);
      // Every notification of this wave in before the next wave clears the buffers.
      const want = (wave + 1) * (SLOTS + SLOTS / 4);
      const deadline = Date.now() + 10_000;
      while (seen.size < want && Date.now() < deadline) await new Promise((r) => setTimeout(r, 2));
      expect(seen.size, `notifications after wave ${wave}`).toBe(want);
    }
    expect(early).toEqual([]);
    // Both ways were taken: the small ones inline, the large ones (and a few small) by the thread.
    expect(a.inlinePosts).toBeGreaterThan(0);
    expect(a.inlinePosts).toBeLessThan(12 * (16 * 2 + 4));
  });

  it("keeps working while the progress thread spins after activity (spinUs)", async () => {
    const a = agent({ name: "spin-a", spinUs: 200 });
    const b = agent({ name: "spin-b", spinUs: 200 });
    const srcBuf = pattern(1 << 20, 9);
    const dstBuf = new Uint8Array(1 << 20);
    const src = a.registerMemory(srcBuf);
    const ep = a.connect(b.address);
    const remote = ep.importRemote(b.registerMemory(dstBuf).remoteKey());
    const chunk = 4096;
    for (let round = 0; round < 4; round++) {
      await Promise.all(
        a.transferMany(
          Array.from({ length: 256 }, (_, i) => ({
            kind: "write" as const,
            endpoint: ep,
            local: src,
            remote,
            descriptors: new Float64Array([i * chunk, i * chunk, chunk]),
          })),
        ),
      );
    }
    expect(Buffer.compare(dstBuf, srcBuf)).toBe(0);
    expect(a.inlinePosts).toBeGreaterThan(0);
  });
});
