/**
 * Memory types (issue 30): every region knows what its memory is and registers with UCX as that
 * type; a type the running UCX cannot serve is refused by name, with what it found. This machine
 * has no GPU, so `cuda` memory must be refused here, and the refusal is the test; host memory
 * registered by address moves byte for byte like any other region.
 */
import { afterEach, beforeEach, describe, expect, it } from "vitest";

import { Agent, describeUcx, ucxInfo, ucxVersion } from "../../src/native/index.js";

let a: Agent;
let b: Agent;

beforeEach(() => {
  a = new Agent({ name: "mt-a", transports: "shm,self" });
  b = new Agent({ name: "mt-b", transports: "shm,self" });
});
afterEach(() => {
  a.close();
  b.close();
});

describe("the UCX this process runs on", () => {
  it("is the pinned modern UCX, with zero-copy shared memory (cma) and TCP", () => {
    const info = ucxInfo();
    expect(info.version).toBe(ucxVersion);
    const [major, minor] = info.version.split(".").map(Number);
    expect(major! > 1 || (major === 1 && minor! >= 18)).toBe(true);
    const tls = info.transports.map((t) => t.split("/")[0]);
    for (const t of ["self", "tcp", "cma", "sysv", "posix"]) expect(tls).toContain(t);
    expect(info.memoryTypes).toContain("host");
    expect(describeUcx(info)).toMatch(/^UCX 1\.\d+\.\d+ \(self, tcp, .*cma.*; memory: host/);
  });

  it("each agent reports the transports its own context opened", () => {
    const tls = a.transports.map((t) => t.split("/")[0]);
    expect(new Set(tls)).toEqual(new Set(["self", "sysv", "posix", "cma"]));
    expect(a.memoryTypes).toContain("host");
  });
});

describe("regions by memory type", () => {
  it("every kind of host region says host and has no device", () => {
    const buf = a.registerMemory(new Uint8Array(4096));
    const alloc = a.allocate(1 << 16);
    for (const r of [buf, alloc]) {
      expect(r.memoryType).toBe("host");
      expect(r.device).toBeNull();
    }
  });

  it("host memory registered by address moves byte for byte both ways", async () => {
    const srcBuf = new Uint8Array(1 << 16).map((_, i) => (i * 7) & 0xff);
    const dstBuf = new Uint8Array(1 << 16);
    // Registered by address (the memory stays alive through srcBuf/dstBuf in this test).
    const src = a.registerAddress(a.registerMemory(srcBuf).address, srcBuf.length, {
      memoryType: "host",
    });
    const dst = b.registerAddress(b.registerMemory(dstBuf).address, dstBuf.length, {
      memoryType: "host",
    });
    expect(src.memoryType).toBe("host");
    const ep = a.connect(b.address);
    const remote = ep.importRemote(dst.remoteKey());
    await a.write(ep, src, remote, new Float64Array([0, 4096, 8192, 100, 200, 300]));
    expect(Buffer.compare(dstBuf.subarray(4096, 12288), srcBuf.subarray(0, 8192))).toBe(0);
    expect(Buffer.compare(dstBuf.subarray(200, 500), srcBuf.subarray(100, 400))).toBe(0);
    expect(dstBuf.subarray(0, 200).every((x) => x === 0)).toBe(true);
    const back = new Uint8Array(8192);
    const backRegion = a.registerMemory(back);
    await a.read(ep, backRegion, remote, new Float64Array([0, 4096, 8192]));
    expect(Buffer.compare(back, srcBuf.subarray(0, 8192))).toBe(0);
  });

  it("CUDA device memory is refused without CUDA transports, naming the type, the UCX and its transports", () => {
    // No GPU and no CUDA driver here: UCX's cuda module does not load.
    expect(a.memoryTypes).not.toContain("cuda");
    let err: unknown;
    try {
      a.registerAddress(0x7f0000000000n, 1 << 20, { memoryType: "cuda", device: 0 });
    } catch (e) {
      err = e;
    }
    expect(err).toMatchObject({ code: "ERR_MEMORY_TYPE_UNSUPPORTED" });
    const message = (err as Error).message;
    expect(message).toContain("cuda memory");
    expect(message).toContain(`UCX (${ucxVersion})`);
    expect(message).toContain("serves host memory only");
    expect(message).toMatch(/transports self, sysv, posix, cma/);
    expect(message).toContain("cuda_copy, cuda_ipc");
    expect(message).toContain("CUDA driver");
  });

  it("refuses an unknown memory type, a GPU type without its device, and bad addresses by name", () => {
    const cases: [() => unknown, string, RegExp][] = [
      [
        () => a.registerAddress(0x1000n, 4096, { memoryType: "vram" as "cuda", device: 0 }),
        "ERR_INVALID_ARGUMENT",
        /memoryType must be 'host', 'cuda' or 'cuda-host', got 'vram'/,
      ],
      [
        () => a.registerAddress(0x1000n, 4096, { memoryType: "cuda" }),
        "ERR_INVALID_ARGUMENT",
        /a cuda region needs its CUDA device index/,
      ],
      [
        () => a.registerAddress(0x1000n, 4096, { memoryType: "cuda-host" }),
        "ERR_INVALID_ARGUMENT",
        /a cuda-host region needs its CUDA device index/,
      ],
      [
        () => a.registerAddress(0n, 4096, { memoryType: "host" }),
        "ERR_INVALID_ARGUMENT",
        /non-zero 64-bit/,
      ],
      [
        () => a.registerAddress(2n ** 64n - 10n, 4096, { memoryType: "host" }),
        "ERR_INVALID_LENGTH",
        /does not wrap/,
      ],
      [
        () => a.registerAddress(0x1000n, 0, { memoryType: "host" }),
        "ERR_INVALID_LENGTH",
        /positive integer/,
      ],
      [
        () => a.registerAddress(4096 as unknown as bigint, 4096, { memoryType: "host" }),
        "ERR_INVALID_ARGUMENT",
        /address must be a bigint/,
      ],
    ];
    for (const [f, code, message] of cases) {
      let err: unknown;
      try {
        f();
      } catch (e) {
        err = e;
      }
      expect(err, String(message)).toMatchObject({ code });
      expect((err as Error).message).toMatch(message);
    }
  });

  it("cuda-host memory is host memory to UCX: registered and moved like it", async () => {
    // Page-locked host memory from cudaHostAlloc is ordinary host memory to the CPU; with no GPU
    // here a plain buffer stands in for it (the type changes only what kvxfer records).
    const srcBuf = new Uint8Array(8192).fill(0x5a);
    const dstBuf = new Uint8Array(8192);
    const src = a.registerAddress(a.registerMemory(srcBuf).address, srcBuf.length, {
      memoryType: "cuda-host",
      device: 0,
    });
    expect(src.memoryType).toBe("cuda-host");
    expect(src.device).toBe(0);
    expect(src.bytes()[0]).toBe(0x5a);
    const dst = b.registerMemory(dstBuf);
    const ep = a.connect(b.address);
    await a.write(ep, src, ep.importRemote(dst.remoteKey()), new Float64Array([0, 0, 8192]));
    expect(dstBuf.every((x) => x === 0x5a)).toBe(true);
  });
});
