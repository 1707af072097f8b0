/**
 * `kvxfer sidecar` with a port that is taken (--grpc, --listen, --metrics): one line naming the
 * flag, the address and what to do, exit 1 (failed; docs: 0 done, 1 failed, 2 usage), no stack
 * trace, and no engine socket or lock left behind.
 */
import { existsSync } from "node:fs";
import { createServer, type Server } from "node:net";
import { afterAll, beforeAll, describe, expect, it } from "vitest";

import { kvxfer } from "./run.js";

let taken: Server;
let address: string;

beforeAll(async () => {
  taken = createServer();
  await new Promise<void>((r) => taken.listen(0, "127.0.0.1", r));
  address = `127.0.0.1:${(taken.address() as { port: number }).port}`;
});

afterAll(async () => {
  await new Promise<void>((r) => taken.close(() => r()));
});

describe("kvxfer sidecar with a taken port", () => {
  it.each(["grpc", "listen", "metrics", "bootstrap"])(
    "--%s: one line naming the flag and the address, exit 1, nothing left behind",
    async (flag) => {
      const engineId = `ports-${flag}-${process.pid}`;
      const r = await kvxfer(["sidecar", `--engine-id=${engineId}`, `--${flag}=${address}`]);
      expect(r.status).toBe(1);
      expect(r.stdout).toBe(""); // never "ready"
      // stderr: the sidecar's JSON log lines, then one plain line, the error.
      const plain = r.stderr.split("\n").filter((l) => l.trim() !== "" && !l.startsWith("{"));
      expect(plain).toEqual([
        `kvxfer sidecar: --${flag} ${address}: the port is taken by another process (EADDRINUSE); choose another or stop that process`,
      ]);
      expect(r.stderr).not.toMatch(/\n\s+at /); // no stack trace
      expect(r.stderr).not.toContain("No address added"); // grpc-js's own line
      expect(existsSync(`/tmp/kvxfer-${engineId}.sock`)).toBe(false);
      expect(existsSync(`/tmp/kvxfer-${engineId}.sock.lock`)).toBe(false);
    },
    30_000,
  );
});
