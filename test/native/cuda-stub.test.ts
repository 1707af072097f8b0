/**
 * openCudaIpc and allocateCuda against a stand-in CUDA driver (test/native/fake-libcuda.c, loaded
 * through KVXFER_LIBCUDA): everything on kvxfer's side of the CUDA boundary runs for real — the
 * driver loads by symbol, the handle's bytes reach cuIpcOpenMemHandle, what was opened is checked
 * (device memory, the device asked for, the range inside the allocation) — and nothing stays
 * open after any refusal. UCX on this machine has no CUDA transports, so the last refusal is
 * ERR_MEMORY_TYPE_UNSUPPORTED, after the handle opened; the mapping is closed again. A GPU runs
 * the rest (bench/gpu/run.sh).
 */
import { execFileSync } from "node:child_process";
import { mkdtempSync, readFileSync, rmSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { afterAll, afterEach, beforeAll, beforeEach, describe, expect, it } from "vitest";

import { Agent } from "../../src/native/index.js";

const dir = mkdtempSync(join(tmpdir(), "kvxfer-fakecuda-"));
const lib = join(dir, "libfakecuda.so");
const log = join(dir, "calls.log");
let compiled = true;
try {
  execFileSync("cc", [
    "-shared",
    "-fPIC",
    "-O1",
    "-o",
    lib,
    join(import.meta.dirname, "fake-libcuda.c"),
  ]);
} catch {
  compiled = false;
}
// Read once, on the first CUDA call of this process (this file runs in a process of its own).
process.env.KVXFER_LIBCUDA = lib;
process.env.FAKE_CUDA_LOG = log;

/** An IPC handle the stand-in opens: an allocation of `size` bytes on `device`. */
function handle(
  size: number,
  device = 0,
  opts: { fail?: boolean; host?: boolean } = {},
): Uint8Array {
  const h = new Uint8Array(64);
  new DataView(h.buffer).setBigUint64(0, BigInt(size), true);
  h[8] = device;
  h[9] = opts.fail ? 1 : 0;
  h[10] = opts.host ? 1 : 0;
  return h;
}

/** The stand-in's calls since the last look: ["open", "close", ...]. */
function calls(): string[] {
  let text = "";
  try {
    text = readFileSync(log, "utf8");
  } catch {
    return [];
  }
  writeFileSync(log, "");
  return text
    .split("\n")
    .filter(Boolean)
    .map((l) => l.split(" ")[0]!);
}

let a: Agent;
beforeAll(() => writeFileSync(log, ""));
afterAll(() => rmSync(dir, { recursive: true, force: true }));
beforeEach(() => {
  a = new Agent({ name: "cuda-stub", transports: "shm,self" });
  calls();
});
afterEach(() => a.close());

describe.skipIf(!compiled)("CUDA IPC through a stand-in driver (cc builds it)", () => {
  it("opens the handle, checks it, and closes it again when UCX cannot take CUDA memory", () => {
    expect(() =>
      a.openCudaIpc(handle(1 << 20), { device: 0, offset: 4096, length: 65536 }),
    ).toThrow(
      expect.objectContaining({
        code: "ERR_MEMORY_TYPE_UNSUPPORTED",
        message: expect.stringMatching(
          /^openCudaIpc: cannot register cuda memory: this UCX \(1\.\d+/,
        ),
      }),
    );
    expect(calls()).toEqual(["open", "close"]);
  });

  it("a handle the driver refuses is ERR_CUDA naming the call and the error", () => {
    expect(() =>
      a.openCudaIpc(handle(1 << 20, 0, { fail: true }), { device: 0, length: 4096 }),
    ).toThrow(
      expect.objectContaining({
        code: "ERR_CUDA",
        message: expect.stringContaining("cuIpcOpenMemHandle failed: CUDA_ERROR_INVALID_VALUE"),
      }),
    );
    expect(calls()).toEqual([]);
  });

  it("a range beyond the allocation is ERR_OUT_OF_BOUNDS, and the mapping is closed", () => {
    expect(() =>
      a.openCudaIpc(handle(1 << 20), { device: 0, offset: 1 << 19, length: (1 << 19) + 1 }),
    ).toThrow(
      expect.objectContaining({
        code: "ERR_OUT_OF_BOUNDS",
        message: expect.stringContaining("(1048576 bytes)"),
      }),
    );
    expect(calls()).toEqual(["open", "close"]);
  });

  it("memory on another device than the one named is refused (CUDA_VISIBLE_DEVICES differs)", () => {
    expect(() => a.openCudaIpc(handle(4096, 1), { device: 0, length: 4096 })).toThrow(
      expect.objectContaining({
        code: "ERR_CUDA",
        message: expect.stringContaining("CUDA device 1, not device 0"),
      }),
    );
    expect(calls()).toEqual(["open", "close"]);
  });

  it("host memory behind a handle is refused as not device memory", () => {
    expect(() =>
      a.openCudaIpc(handle(4096, 0, { host: true }), { device: 0, length: 4096 }),
    ).toThrow(
      expect.objectContaining({
        code: "ERR_CUDA",
        message: expect.stringContaining("not device memory"),
      }),
    );
    expect(calls()).toEqual(["open", "close"]);
  });

  it("a device the driver does not have is ERR_CUDA_UNAVAILABLE, before anything opens", () => {
    expect(() => a.openCudaIpc(handle(4096, 3), { device: 3, length: 4096 })).toThrow(
      expect.objectContaining({
        code: "ERR_CUDA_UNAVAILABLE",
        message: expect.stringContaining("CUDA device 3 does not exist (the driver sees 1)"),
      }),
    );
    expect(calls()).toEqual([]);
  });

  it("allocateCuda allocates, and frees when UCX refuses the memory type", () => {
    expect(() => a.allocateCuda(1 << 16, { device: 0 })).toThrow(
      expect.objectContaining({ code: "ERR_MEMORY_TYPE_UNSUPPORTED" }),
    );
    expect(calls()).toEqual(["alloc", "free"]);
  });
});
