/**
 * The workaround for UCX 1.22's software GET replies (native/src/ucx_fix.cc) is in place on the
 * pinned UCX and on the path every READ over TCP takes: the memory's owner primes one request per
 * GET it answers. (What it prevents, a P killed by D's death mid-pull, is shown across hosts in
 * test/sidecar/multiprocess/net-faults.test.ts.)
 */
import { afterEach, describe, expect, it } from "vitest";

import { Agent, ucxGetReplyFix } from "../../src/native/index.js";
import { fillPattern } from "../../bench/native/pattern.js";

const primed = (): number =>
  Number(/\((\d+) GET replies primed\)/.exec(ucxGetReplyFix())?.[1] ?? NaN);

describe("UCX 1.22's GET replies", () => {
  const agents: Agent[] = [];
  afterEach(() => {
    for (const a of agents.splice(0)) a.close();
  });

  it("are primed with a datatype on the pinned UCX, once per READ answered over TCP", async () => {
    const a = new Agent({ name: "fix-a", transports: "tcp", netDevices: "lo" });
    const b = new Agent({ name: "fix-b", transports: "tcp", netDevices: "lo" });
    agents.push(a, b);
    expect(ucxGetReplyFix()).toMatch(/^installed \(\d+ GET replies primed\)$/);
    const size = 1 << 20;
    const mine = new Uint8Array(size);
    const theirs = new Uint8Array(size);
    fillPattern(theirs, 3);
    const local = a.registerMemory(mine);
    const remoteRegion = b.registerMemory(theirs);
    const ep = a.connect(b.address);
    const remote = ep.importRemote(remoteRegion.remoteKey());
    const before = primed();
    const reads = 8;
    for (let i = 0; i < reads; i++) {
      mine.fill(0);
      await a.read(ep, local, remote, new Float64Array([0, 0, size]));
      expect(Buffer.compare(mine, theirs)).toBe(0);
    }
    expect(primed() - before).toBeGreaterThanOrEqual(reads);
    // A write is not a GET: nothing primed.
    const afterReads = primed();
    await a.write(ep, local, remote, new Float64Array([0, 0, size]));
    expect(primed()).toBe(afterReads);
  });
});
