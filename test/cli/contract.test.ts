/**
 * One command-line contract for every `kvxfer` subcommand, run as a user runs
 * it (the built CLI): --help does no work and exits 0; an unknown flag or a
 * bad value is refused with one line naming the flag, exit 2; --version is one
 * line; the client commands say "nothing listening" and "TLS" in one line.
 */
import { spawnSync } from "node:child_process";
import { readFileSync } from "node:fs";
import { createServer } from "node:net";
import { join } from "node:path";
import { fileURLToPath } from "node:url";
import { afterAll, beforeAll, describe, expect, it } from "vitest";

import { type ApiServer, startApiServer } from "../../src/api/server.js";
import { commands as BENCH_COMMANDS } from "../../bench/commands.js";
import { COMMANDS as PRODUCT_COMMANDS } from "../../src/cli/commands.js";
import { commands as SIM_COMMANDS } from "../../sim/commands.js";
import { EventLog } from "../../src/sidecar/event-log.js";
import { type PeerCredentialFiles, Pki } from "../../sim/pki.js";
import { cliScript } from "../../sim/sidecar-process.js";
import { kvxfer } from "./run.js";
import { FixtureSidecar } from "../api/fixtures.js";

const ROOT = fileURLToPath(new URL("../..", import.meta.url));

/** The product's commands and those of the packages it loads them from (src/cli/optional.ts). */
const COMMANDS = [...PRODUCT_COMMANDS, ...SIM_COMMANDS, ...BENCH_COMMANDS];

const lines = (s: string): string[] => s.split("\n").filter((l) => l.trim() !== "");

/** For each command: an unknown flag and a bad value (a flag and its value), with the flag to name. */
const BAD: Record<string, { args: string[]; names: string }> = {
  sidecar: { args: ["--lease-ms", "abc"], names: "--lease-ms" },
  "sim-engine": { args: ["--engine-id", "e", "--role", "prefill", "--tp", "-1"], names: "--tp" },
  demo: { args: ["--requests", "-1"], names: "--requests" },
  status: { args: ["127.0.0.1:1", "--timeout", "abc"], names: "--timeout" },
  watch: { args: ["127.0.0.1:1", "--count", "-1"], names: "--count" },
  await: { args: ["127.0.0.1:1", "t1", "--timeout", "abc"], names: "--timeout" },
  "native-demo": { args: ["--size", "-5"], names: "--size" },
  "bench native": { args: ["--sizes", "lots"], names: "--sizes" },
  "bench plan": { args: ["--runs", "0"], names: "--runs" },
  "bench events": { args: ["--events", "-1"], names: "--events" },
  "bench e2e": { args: ["--tokens", "128,x"], names: "--tokens" },
  "bench modes": { args: ["--requests", "abc"], names: "--requests" },
  "bench control": { args: ["--concurrency", "-2"], names: "--concurrency" },
  "bench vllm": { args: ["--requests", "abc"], names: "--requests" },
  "bench peers": { args: ["--systems", "kvxfer,foo"], names: "--systems" },
  "bench all": { args: ["--quick=yes"], names: "--quick" },
  "bench plot": { args: ["--json"], names: "--json" },
};

describe("every subcommand", () => {
  it("is covered here", () => {
    expect(Object.keys(BAD).sort()).toEqual(COMMANDS.map((c) => c.path.join(" ")).sort());
  });

  for (const spec of COMMANDS) {
    const name = spec.path.join(" ");
    it(`${name}: --help and -h print its usage and nothing runs; an unknown flag and a bad value exit 2 naming the flag`, async () => {
      const [help, short, unknown, bad] = await Promise.all([
        kvxfer([...spec.path, "--help"]),
        kvxfer([...spec.path, "-h"]),
        kvxfer([...spec.path, "--bogus-flag"]),
        kvxfer([...spec.path, ...BAD[name]!.args]),
      ]);
      for (const h of [help, short]) {
        expect(h.status, h.stderr).toBe(0);
        expect(h.stdout).toContain(`usage: kvxfer ${name}`);
        expect(h.stdout).toContain("exit codes: 0 done, 1 failed, 2 usage");
        // Nothing ran: no log lines, no ready line, no bench table, and quickly.
        expect(h.stderr).toBe("");
        expect(h.stdout).not.toMatch(/^\{"event":"ready"|GB\/s|^=== /m);
        expect(h.ms).toBeLessThan(10_000);
      }
      for (const spec2 of spec.options) expect(help.stdout).toContain(`--${spec2.name}`);

      expect(unknown.status, unknown.stderr).toBe(2);
      expect(lines(unknown.stderr)).toHaveLength(1);
      expect(unknown.stderr).toContain("unknown option '--bogus-flag'");
      expect(unknown.stderr).toMatch(new RegExp(`^kvxfer ${name}: `));
      expect(unknown.stdout).toBe("");

      expect(bad.status, bad.stderr).toBe(2);
      const badLines = lines(bad.stderr);
      expect(badLines, bad.stderr).toHaveLength(1);
      expect(badLines[0]).toContain(BAD[name]!.names);
      expect(badLines[0]).not.toMatch(/ambiguous/);
    }, 60_000);
  }
});

describe("kvxfer itself", () => {
  it("--version prints the version only; --help the main usage, generated from every command", async () => {
    const pkg = JSON.parse(readFileSync(join(ROOT, "package.json"), "utf8")) as {
      version: string;
    };
    const [v, help, none, unknown] = await Promise.all([
      kvxfer(["--version"]),
      kvxfer(["--help"]),
      kvxfer([]),
      kvxfer(["frobnicate"]),
    ]);
    expect(v.status).toBe(0);
    expect(v.stdout).toBe(`${pkg.version}\n`);
    expect(help.status).toBe(0);
    for (const spec of COMMANDS) expect(help.stdout).toContain(`kvxfer ${spec.path.join(" ")}`);
    expect(help.stdout).toContain("exit codes: 0 done, 1 failed, 2 usage");
    expect(none.status).toBe(2);
    expect(none.stderr).toContain("usage: kvxfer");
    expect(unknown.status).toBe(2);
    expect(lines(unknown.stderr)).toEqual([
      expect.stringContaining("unknown command 'frobnicate'"),
    ]);
  });
});

/** A port nothing listens on (bound, then released). */
async function deadPort(): Promise<number> {
  const srv = createServer();
  await new Promise<void>((r) => srv.listen(0, "127.0.0.1", r));
  const port = (srv.address() as { port: number }).port;
  await new Promise<void>((r) => srv.close(() => r()));
  return port;
}

describe("client commands", () => {
  it("say 'nothing listening at ADDRESS' in one line (status, await: exit 1 and 4; watch gives up after --retries)", async () => {
    const address = `127.0.0.1:${await deadPort()}`;
    const [status, watch, wait] = await Promise.all([
      kvxfer(["status", address]),
      kvxfer(["watch", address, "--retries", "2"]),
      kvxfer(["await", address, "t1"]),
    ]);
    expect(status.status).toBe(1);
    expect(lines(status.stderr)).toEqual([
      expect.stringContaining(`nothing listening at ${address}`),
    ]);
    expect(status.stderr).not.toMatch(/\n\s+at /); // no stack trace
    expect(wait.status).toBe(4); // await's own code for "any other error" (1 is: the transfer failed)
    expect(lines(wait.stderr)).toEqual([
      expect.stringContaining(`nothing listening at ${address}`),
    ]);
    expect(watch.status).toBe(1);
    const w = lines(watch.stderr);
    expect(w).toHaveLength(3); // two reconnects, then it gives up
    expect(w[2]).toContain(`nothing listening at ${address}`);
    expect(w[2]).toContain("gave up after 2 retries");
  });

  it("refuse HOST without a port in one line (there is no fixed gRPC port)", async () => {
    const r = await kvxfer(["status", "localhost"]);
    expect(r.status).toBe(2);
    expect(lines(r.stderr)).toEqual([expect.stringContaining("'localhost' has no port")]);
  });

  describe("against a TLS sidecar", () => {
    let ca: Pki | undefined;
    let serverFiles: PeerCredentialFiles;
    let server: ApiServer;
    let events: EventLog;
    beforeAll(async () => {
      ca = new Pki("kvxfer-test CA");
      serverFiles = ca.issue("kvxfer-test", "server");
      events = new EventLog();
      const fx = new FixtureSidecar(events);
      fx.end("t1", "KV_READY");
      server = await startApiServer({
        view: fx,
        events,
        tls: {
          cert: readFileSync(serverFiles.cert),
          key: readFileSync(serverFiles.key),
        },
      });
    });
    afterAll(async () => {
      await server?.close(1_000);
      events?.close();
      ca?.close();
    });

    it("without --ca: one line naming TLS, the address and the flag to pass", async () => {
      const a = server.address;
      const [status, watch, wait] = await Promise.all([
        kvxfer(["status", a]),
        kvxfer(["watch", a, "--retries", "0"]),
        kvxfer(["await", a, "t1"]),
      ]);
      for (const r of [status, watch, wait]) {
        expect(r.status).not.toBe(0);
        const l = lines(r.stderr);
        expect(l, r.stderr).toHaveLength(1);
        expect(l[0]).toMatch(/TLS/);
        expect(l[0]).toContain(a);
        expect(l[0]).toContain("--ca");
      }
      expect(status.status).toBe(1);
    });

    it("with --ca: works, and no Node deprecation warning for the IP address (DEP0123)", async () => {
      const r = await kvxfer(["status", server.address, "--ca", ca!.caCert]);
      expect(r.status, r.stderr).toBe(0);
      expect(r.stdout).toMatch(/^SIDECAR/);
      expect(r.stderr).not.toMatch(/DEP0123|DeprecationWarning/);
    });
  });
});

it("kvxfer is a package bin with a shebang", () => {
  const pkg = JSON.parse(readFileSync(join(ROOT, "package.json"), "utf8")) as {
    bin: Record<string, string>;
  };
  expect(pkg.bin.kvxfer).toBe("dist/src/cli/main.js");
  expect(readFileSync(cliScript(), "utf8").startsWith("#!/usr/bin/env node\n")).toBe(true);
  // Runs by itself (executable), as the PATH link does.
  const r = spawnSync(cliScript(), ["--version"], { encoding: "utf8" });
  expect(r.status, r.stderr).toBe(0);
});
