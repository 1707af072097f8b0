/**
 * Case 3 of docs/security.md: does a remote key reach outside its region when the sender lies
 * about the region's length? The target registers 16 KiB and keeps 64 KiB of unregistered memory
 * right after it; the sender imports the key with its length forged (and the wrapper's checksum,
 * which is no MAC, recomputed) and writes 4 KiB into that unregistered memory. The addon checks
 * bounds on the sender's side only, against the length it was given, so the write is posted;
 * what stops it, if anything, is the target's transport. Measured over shared memory (one
 * namespace) and over TCP across two network namespaces made by this test. What this finds is
 * why a remote key is a capability handed only to authenticated peers (DESIGN.md invariant 7).
 */
import { afterAll, describe, expect, it } from "vitest";

import { canCreateNetns, createNetnsPair, type NetnsPair } from "../../bench/native/netns.js";
import { PeerProcess } from "../../bench/native/peer-client.js";

const REGION = 16 << 10;
const GUARD = 64 << 10;
const b64 = (d: Float64Array): string =>
  Buffer.from(d.buffer, d.byteOffset, d.byteLength).toString("base64");

/** The wrapped remote key with its region length replaced (magic, size, address, length, checksum). */
function forgeLength(keyB64: string, length: number): string {
  const k = Buffer.from(keyB64, "base64");
  k.writeBigUInt64LE(BigInt(length), 16);
  k.writeBigUInt64LE(0n, 32);
  let h = 1469598103934665603n; // the addon's FNV-1a basis (native/src/wire.cc)
  for (const byte of k) {
    h ^= BigInt(byte);
    h = (h * 0x100000001b3n) & 0xffffffffffffffffn;
  }
  k.writeBigUInt64LE(h, 32);
  return k.toString("base64");
}

interface Outcome {
  posted: boolean;
  failed?: string;
  /** Non-zero bytes in the target's unregistered memory after the write (the sender's pattern
   * has about one zero byte in 256, so a landed 4 KiB write shows about 4080). */
  touched: number;
}

async function attempt(
  sender: PeerProcess,
  target: PeerProcess,
  init: { transports: string; netDevices?: [string, string] },
): Promise<Outcome> {
  const sa = await sender.call<{ address: string }>("init", {
    name: "forger",
    transports: init.transports,
    ...(init.netDevices ? { netDevices: init.netDevices[0] } : {}),
  });
  const ta = await target.call<{ address: string }>("init", {
    name: "target",
    transports: init.transports,
    ...(init.netDevices ? { netDevices: init.netDevices[1] } : {}),
  });
  await sender.call("alloc", { size: GUARD, seed: 7 });
  const key = await target.call<{ key: string }>("alloc", { size: REGION, guard: GUARD });
  await sender.call("connect", { address: ta.address });
  await target.call("connect", { address: sa.address });
  // An honest key is refused past its region by the sender's own addon.
  await sender.call("import", { key: key.key });
  const honest = await sender.call<{ failed?: { code: string } }>("write", {
    descs: b64(new Float64Array([0, REGION + 4096, 4096])),
  });
  expect(honest.failed?.code).toBe("ERR_OUT_OF_BOUNDS");
  // The same key with its length forged.
  await sender.call("import", { key: forgeLength(key.key, REGION + GUARD) });
  const w = await sender.call<{ failed?: { code: string; message: string } }>("write", {
    descs: b64(new Float64Array([0, REGION + 4096, 4096])),
  });
  const { touched } = await target.call<{ touched: number }>("guard");
  return {
    posted: w.failed === undefined,
    ...(w.failed ? { failed: `${w.failed.code}: ${w.failed.message}` } : {}),
    touched,
  };
}

describe("a forged remote key (docs/security.md case 3)", () => {
  const peers: PeerProcess[] = [];
  let ns: NetnsPair | undefined;
  afterAll(async () => {
    for (const p of peers) await p.close();
    ns?.destroy();
  });

  it("over shared memory: the target does not bound it (the write lands outside the region)", async () => {
    const s = new PeerProcess();
    const t = new PeerProcess();
    peers.push(s, t);
    const o = await attempt(s, t, { transports: "shm,self" });
    console.log(`[rkey] shm: ${JSON.stringify(o)}`);
    expect(o.posted).toBe(true);
    expect(o.touched).toBeGreaterThan(3900);
  }, 60_000);

  it.skipIf(!canCreateNetns())(
    "over TCP across two namespaces: the target does not bound it either",
    async () => {
      ns = createNetnsPair("rk");
      const s = new PeerProcess(ns.prefix(0));
      const t = new PeerProcess(ns.prefix(1));
      peers.push(s, t);
      const o = await attempt(s, t, { transports: "tcp", netDevices: ns.devices });
      console.log(`[rkey] tcp: ${JSON.stringify(o)}`);
      expect(o.posted).toBe(true);
      expect(o.touched).toBeGreaterThan(3900);
    },
    60_000,
  );
});
