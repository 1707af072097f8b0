/** Bad input: each gets its own error code, and nothing is posted. */
import { afterEach, beforeAll, beforeEach, describe, expect, it } from "vitest";

import { KvxferError, hasCode } from "../../src/errors.js";
import {
  Agent,
  KvxferError as AddonKvxferError,
  hasCode as addonHasCode,
  type Endpoint,
  type Region,
  type RemoteRegion,
} from "../../src/native/index.js";

let a: Agent;
let b: Agent;
let local: Region;
let remoteRegion: Region;
let ep: Endpoint;
let remote: RemoteRegion;
let dst: Uint8Array;

beforeAll(() => {
  // What this file makes the native layer print on purpose, so nobody reads it as a failure.
  console.log(
    "expected on stderr from this file: UCX's own WARN and ERROR for the unknown transport " +
      "'no-such-transport'",
  );
});

beforeEach(() => {
  a = new Agent({ name: "err-a", transports: "shm,self" });
  b = new Agent({ name: "err-b", transports: "shm,self" });
  local = a.registerMemory(new Uint8Array(4096).fill(0xaa));
  dst = new Uint8Array(8192);
  remoteRegion = b.registerMemory(dst);
  ep = a.connect(b.address);
  remote = ep.importRemote(remoteRegion.remoteKey());
});
afterEach(() => {
  a.close();
  b.close();
});

/** Twenty WRITEs of 20 000 descriptors of 256 bytes from `a` to `b`: far more than finish at once. */
function twentyBigWrites(): { big: Region; r: RemoteRegion; pending: Promise<unknown>[] } {
  const big = a.registerMemory(new Uint8Array(8 << 20));
  const bigDst = b.registerMemory(new Uint8Array(8 << 20));
  const r = ep.importRemote(bigDst.remoteKey());
  const descs = new Float64Array(3 * 20000);
  for (let i = 0; i < 20000; i++) descs.set([i * 256, i * 256, 256], 3 * i);
  return { big, r, pending: Array.from({ length: 20 }, () => a.write(ep, big, r, descs)) };
}

/** Each transfer's outcome: "done", or its error code. */
function outcomes(pending: Promise<unknown>[]): Promise<string[]> {
  return Promise.all(
    pending.map((p) =>
      p.then(
        () => "done",
        (e: unknown) => (e as KvxferError).code,
      ),
    ),
  );
}

/** Expects `fn` to throw (or reject with) a KvxferError with `code`. */
async function expectCode(fn: () => unknown, code: string): Promise<KvxferError> {
  let caught: unknown;
  try {
    await fn();
  } catch (err) {
    caught = err;
  }
  expect(caught, `expected ${code}`).toBeInstanceOf(KvxferError);
  expect((caught as KvxferError).code).toBe(code);
  return caught as KvxferError;
}

function untouched(): void {
  expect(dst.every((x) => x === 0)).toBe(true);
  expect(a.inflight).toBe(0);
}

describe("the addon's public face", () => {
  it("re-exports the one KvxferError and hasCode (src/errors.ts)", () => {
    expect(AddonKvxferError).toBe(KvxferError);
    expect(addonHasCode).toBe(hasCode);
  });
});

describe("bad input to transfers", () => {
  it("refuses a descriptor past the local region", async () => {
    const e = await expectCode(
      () => a.write(ep, local, remote, new Float64Array([0, 0, 64, 4000, 0, 200])),
      "ERR_OUT_OF_BOUNDS",
    );
    expect(e).toBeInstanceOf(KvxferError);
    expect(e.message).toMatch(/descriptor 1: local range/);
    expect(e.stack).toMatch(/native\/errors\.test\.ts/);
    untouched();
  });

  it("refuses a descriptor past the remote region", async () => {
    const e = await expectCode(
      () => a.write(ep, local, remote, new Float64Array([0, 8190, 4])),
      "ERR_OUT_OF_BOUNDS",
    );
    expect(e.message).toMatch(/remote range/);
    untouched();
  });

  it("refuses offsets that overflow when added to the length", async () => {
    await expectCode(
      () => a.write(ep, local, remote, new BigUint64Array([0n, 2n ** 64n - 1n, 16n])),
      "ERR_OUT_OF_BOUNDS",
    );
    untouched();
  });

  it("refuses zero and negative lengths, and non-integer or negative offsets", async () => {
    await expectCode(
      () => a.write(ep, local, remote, new Float64Array([0, 0, 0])),
      "ERR_INVALID_LENGTH",
    );
    await expectCode(
      () => a.write(ep, local, remote, new Float64Array([0, 0, -5])),
      "ERR_INVALID_LENGTH",
    );
    await expectCode(
      () => a.read(ep, local, remote, new Float64Array([0, 0, 1.5])),
      "ERR_INVALID_LENGTH",
    );
    await expectCode(
      () => a.write(ep, local, remote, new Float64Array([-1, 0, 8])),
      "ERR_INVALID_OFFSET",
    );
    await expectCode(
      () => a.write(ep, local, remote, new Float64Array([0, Number.NaN, 8])),
      "ERR_INVALID_OFFSET",
    );
    untouched();
  });

  it("refuses a truncated descriptor array", async () => {
    await expectCode(
      () => a.write(ep, local, remote, new Float64Array([0, 0, 8, 16])),
      "ERR_DESC_TRUNCATED",
    );
    const bytes = new Uint8Array(8 * 3 + 8).subarray(0, 20);
    await expectCode(() => a.write(ep, local, remote, bytes), "ERR_DESC_TRUNCATED");
    untouched();
  });

  it("refuses a misaligned descriptor byte view", async () => {
    const raw = new Uint8Array(8 * 3 + 1);
    new Float64Array(raw.buffer, 0, 3).set([0, 0, 8]);
    await expectCode(() => a.write(ep, local, remote, raw.subarray(1)), "ERR_DESC_MISALIGNED");
    untouched();
  });

  it("refuses descriptors of the wrong type", async () => {
    await expectCode(
      () => a.write(ep, local, remote, new Int32Array([0, 0, 8]) as unknown as Float64Array),
      "ERR_DESC_TYPE",
    );
    await expectCode(
      () => a.write(ep, local, remote, [0, 0, 8] as unknown as Float64Array),
      "ERR_DESC_TYPE",
    );
    untouched();
  });

  it("accepts a valid list after all that, on the same endpoint", async () => {
    await expectCode(
      () => a.write(ep, local, remote, new Float64Array([0, 0, 0])),
      "ERR_INVALID_LENGTH",
    );
    await a.write(ep, local, remote, new Float64Array([0, 100, 16]));
    expect(dst.subarray(100, 116).every((x) => x === 0xaa)).toBe(true);
    expect(dst[99]).toBe(0);
    expect(dst[116]).toBe(0);
  });

  it("refuses a notification larger than the limit", async () => {
    const small = new Agent({ name: "small", transports: "shm,self", maxNotificationBytes: 64 });
    try {
      const e2 = small.connect(b.address);
      await expectCode(() => small.notify(e2, Buffer.alloc(65)), "ERR_NOTIFICATION_TOO_LARGE");
    } finally {
      small.close();
    }
  });
});

describe("notifications above the receiver's cap", () => {
  it("are dropped unread and reported with the sender and size", async () => {
    const small = new Agent({
      name: "small-receiver",
      transports: "shm,self",
      maxNotificationBytes: 64,
    });
    try {
      const toSmall = a.connect(small.address);
      const dropped: [string, number][] = [];
      const got: number[] = [];
      small.on("notificationDropped", (peer, bytes) => dropped.push([peer, bytes]));
      small.on("notifications", (batch) => {
        for (const n of batch) got.push(n.data.length);
      });
      await a.notify(toSmall, Buffer.alloc(100));
      await a.notify(toSmall, Buffer.alloc(10));
      const end = Date.now() + 5000;
      while ((dropped.length < 1 || got.length < 1) && Date.now() < end)
        await new Promise((r) => setTimeout(r, 5));
      expect(dropped).toEqual([["err-a", 100]]);
      expect(got).toEqual([10]);
    } finally {
      small.close();
    }
  });
});

describe("bad handles and addresses", () => {
  it("refuses a garbage remote key", async () => {
    await expectCode(() => ep.importRemote(Buffer.from("not a key at all")), "ERR_BAD_REMOTE_KEY");
    const key = remoteRegion.remoteKey();
    key[key.length - 1]! ^= 0xff;
    await expectCode(() => ep.importRemote(key), "ERR_BAD_REMOTE_KEY");
    await expectCode(() => ep.importRemote(key.subarray(0, 20)), "ERR_BAD_REMOTE_KEY");
  });

  it("refuses a garbage worker address", async () => {
    await expectCode(() => a.connect(Buffer.alloc(64, 7)), "ERR_BAD_ADDRESS");
    const addr = b.address;
    addr[addr.length - 3]! ^= 0x55;
    await expectCode(() => a.connect(addr), "ERR_BAD_ADDRESS");
    await expectCode(() => a.connect(Buffer.alloc(0)), "ERR_BAD_ADDRESS");
  });

  it("refuses a shared-memory path that does not exist", async () => {
    await expectCode(
      () => a.mapFile("/dev/shm/kvxfer-does-not-exist", { length: 4096 }),
      "ERR_NO_SUCH_FILE",
    );
  });

  it("refuses a remote region used on another endpoint", async () => {
    const ep2 = a.connect(b.address);
    await expectCode(
      () => a.write(ep2, local, remote, new Float64Array([0, 0, 8])),
      "ERR_ENDPOINT_MISMATCH",
    );
    untouched();
  });

  it("refuses handles of another agent", async () => {
    const other = b.registerMemory(new Uint8Array(64));
    await expectCode(
      () => a.write(ep, other, remote, new Float64Array([0, 0, 8])),
      "ERR_WRONG_AGENT",
    );
    untouched();
  });

  it("refuses use after close, and close is idempotent", async () => {
    local.close();
    local.close();
    await expectCode(() => a.write(ep, local, remote, new Float64Array([0, 0, 8])), "ERR_CLOSED");
    await expectCode(() => local.remoteKey(), "ERR_CLOSED");
    remote.close();
    remote.close();
    const l2 = a.registerMemory(new Uint8Array(64));
    await expectCode(() => a.write(ep, l2, remote, new Float64Array([0, 0, 8])), "ERR_CLOSED");
    ep.close();
    ep.close();
    await expectCode(() => ep.importRemote(remoteRegion.remoteKey()), "ERR_CLOSED");
    await expectCode(() => a.notify(ep, Buffer.from("x")), "ERR_CLOSED");
    a.close();
    a.close();
    await expectCode(() => a.registerMemory(new Uint8Array(8)), "ERR_CLOSED");
    await expectCode(() => a.connect(b.address), "ERR_CLOSED");
    await expectCode(() => a.address, "ERR_CLOSED");
    expect(l2.closed).toBe(true);
    untouched();
  });

  it("rejects transfers in flight when the agent closes", async () => {
    const { pending } = twentyBigWrites();
    a.close();
    const results = await outcomes(pending);
    // Every write settles; those the close caught are cancelled with ERR_CLOSED. Twenty
    // writes of 20 000 descriptors are far more than can finish before the close is seen.
    for (const r of results) expect(["done", "ERR_CLOSED"]).toContain(r);
    expect(results).toContain("ERR_CLOSED");
    expect(a.inflight).toBe(0);
  });

  it("beginClose() refuses new work at once and cancels what is queued; close() settles the rest", async () => {
    const { big, r, pending } = twentyBigWrites();
    a.beginClose();
    a.beginClose(); // idempotent
    const refused = await expectCode(
      () => a.write(ep, big, r, new Float64Array([0, 0, 8])),
      "ERR_CLOSED",
    );
    expect(refused.message).toBe("write: the agent is closing");
    await expectCode(() => a.notify(ep, Buffer.from("x")), "ERR_CLOSED");
    expect(a.closed).toBe(false);
    a.close();
    const results = await outcomes(pending);
    for (const x of results) expect(["done", "ERR_CLOSED"]).toContain(x);
    expect(results).toContain("ERR_CLOSED");
    expect(a.inflight).toBe(0);
    expect(a.closed).toBe(true);
    a.beginClose(); // after close: nothing
  });

  it("a transfer that fails after it started rejects with a stack through the function awaiting it", async () => {
    const big = a.registerMemory(new Uint8Array(8 << 20));
    const bigDst = b.registerMemory(new Uint8Array(8 << 20));
    const r = ep.importRemote(bigDst.remoteKey());
    const descs = new Float64Array(3 * 20000);
    for (let i = 0; i < 20000; i++) descs.set([i * 256, i * 256, 256], 3 * i);
    async function awaitedHere(): Promise<KvxferError | "done"> {
      try {
        await a.write(ep, big, r, descs);
        return "done";
      } catch (err) {
        return err as KvxferError;
      }
    }
    const pending = Array.from({ length: 20 }, () => awaitedHere());
    ep.abandon();
    const failed = (await Promise.all(pending)).filter((x) => x !== "done");
    expect(failed.length).toBeGreaterThan(0);
    for (const e of failed) {
      expect(e).toBeInstanceOf(KvxferError);
      expect(e.code).toBe("UCS_ERR_CONNECTION_RESET");
      expect(e.stack).toMatch(/at (async )?awaitedHere \(.*native\/errors\.test\.ts:\d+/);
    }
  });

  it("abandon() settles every transfer on an endpoint now and fails the endpoint", async () => {
    const { big, r, pending } = twentyBigWrites();
    ep.abandon();
    const results = await outcomes(pending);
    for (const x of results) expect(["done", "UCS_ERR_CONNECTION_RESET"]).toContain(x);
    expect(results).toContain("UCS_ERR_CONNECTION_RESET");
    expect(ep.state).toBe("failed");
    await expectCode(
      () => a.write(ep, big, r, new Float64Array([0, 0, 8])),
      "UCS_ERR_CONNECTION_RESET",
    );
    expect(a.inflight).toBe(0);
  });

  it("after abandon(), settled() resolves once UCX holds none of the abandoned writes: no byte lands after it", async () => {
    const big = a.registerMemory(new Uint8Array(8 << 20).fill(0x5c));
    const bigDstBytes = new Uint8Array(8 << 20);
    const bigDst = b.registerMemory(bigDstBytes);
    const r = ep.importRemote(bigDst.remoteKey());
    const descs = new Float64Array(3 * 20000);
    for (let i = 0; i < 20000; i++) descs.set([i * 256, i * 256, 256], 3 * i);
    const pending = Array.from({ length: 20 }, () => a.write(ep, big, r, descs));
    ep.abandon();
    const results = await outcomes(pending);
    expect(results).toContain("UCS_ERR_CONNECTION_RESET");
    expect(ep.abandoned).toBe(true);
    const code = await ep.settled();
    expect(typeof code).toBe("string");
    expect(ep.settled()).toBe(ep.settled()); // the abandon's settle, not a new one each time
    // From here nothing may change in the destination: let both workers run, compare.
    const snapshot = Buffer.from(bigDstBytes);
    const live = b.connect(a.address);
    await a.notify(a.connect(b.address), Buffer.from("tick"));
    await new Promise((r2) => setTimeout(r2, 200));
    expect(Buffer.compare(Buffer.from(bigDstBytes), snapshot)).toBe(0);
    live.close();
  });

  it("settled() on a live endpoint resolves UCS_OK once what was posted on it is over; ERR_CLOSED at once after its agent closed", async () => {
    await a.write(ep, local, remote, new Float64Array([0, 0, 4096]));
    expect(ep.abandoned).toBe(false);
    expect(await ep.settled()).toBe("UCS_OK");
    expect(ep.state).toBe("connected");
    const late = b.connect(a.address);
    b.close();
    expect(await late.settled()).toBe("ERR_CLOSED");
  });

  it("names a bad transport list", async () => {
    await expectCode(() => new Agent({ transports: "no-such-transport" }), "UCS_ERR_NO_DEVICE");
  });
});
