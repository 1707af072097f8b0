/**
 * CUDA memory without a CUDA driver (issue 32): this machine has no GPU and no libcuda.so.1, so
 * openCudaIpc and allocateCuda must refuse with ERR_CUDA_UNAVAILABLE, naming the library the
 * addon tried and the loader's error, and leave the agent usable. The same calls against a
 * stand-in driver are in cuda-stub.test.ts; on a GPU, bench/gpu/run.sh.
 */
import { existsSync } from "node:fs";
import { afterEach, beforeEach, describe, expect, it } from "vitest";

import { Agent } from "../../src/native/index.js";

// A host with an NVIDIA driver loaded has this; there the refusal cannot be shown.
const HAS_DRIVER = existsSync("/proc/driver/nvidia/version");

let a: Agent;
beforeEach(() => {
  a = new Agent({ name: "cuda-none", transports: "shm,self" });
});
afterEach(() => a.close());

describe.skipIf(HAS_DRIVER)("CUDA memory on a host without a CUDA driver", () => {
  it("openCudaIpc refuses with ERR_CUDA_UNAVAILABLE naming libcuda.so.1 and dlerror", () => {
    let err: unknown;
    try {
      a.openCudaIpc(new Uint8Array(64), { device: 0, length: 1 << 20 });
    } catch (e) {
      err = e;
    }
    expect(err).toMatchObject({ code: "ERR_CUDA_UNAVAILABLE" });
    const msg = (err as Error).message;
    expect(msg).toContain("libcuda.so.1");
    // dlerror's own words for a missing file.
    expect(msg).toMatch(/cannot open shared object file|No such file/);
  });

  it("allocateCuda refuses the same way", () => {
    expect(() => a.allocateCuda(1 << 20, { device: 0 })).toThrow(
      expect.objectContaining({ code: "ERR_CUDA_UNAVAILABLE" }),
    );
  });

  it("refuses a malformed call before it looks for a driver", () => {
    expect(() => a.openCudaIpc(new Uint8Array(63), { device: 0, length: 4096 })).toThrow(
      expect.objectContaining({
        code: "ERR_INVALID_ARGUMENT",
        message: expect.stringMatching(/64 bytes, got 63/),
      }),
    );
    expect(() => a.openCudaIpc(new Uint8Array(64), { device: 0, length: 0 })).toThrow(
      expect.objectContaining({ code: "ERR_INVALID_LENGTH" }),
    );
    expect(() => a.openCudaIpc("x" as unknown as Uint8Array, { device: 0, length: 4096 })).toThrow(
      expect.objectContaining({ code: "ERR_INVALID_ARGUMENT" }),
    );
  });

  it("leaves the agent working: host regions still register", () => {
    expect(() => a.allocateCuda(4096, { device: 0 })).toThrow();
    const r = a.allocate(4096);
    expect(r.memoryType).toBe("host");
    r.close();
  });
});
