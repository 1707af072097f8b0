/** The `kvxfer` command as a user runs it. */
import { AUTO_SPIN_US, spinFor } from "../../src/sidecar/kv-registration.js";
import { spawnSync } from "node:child_process";
import { mkdtempSync, rmSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { describe, expect, it } from "vitest";

import { resolveSettings } from "../../src/cli/sidecar-settings.js";
import { cliScript } from "../../sim/sidecar-process.js";

function kvxfer(
  args: string[],
  timeoutMs = 120_000,
): { status: number | null; stdout: string; stderr: string } {
  const r = spawnSync(process.execPath, [cliScript(), ...args], {
    encoding: "utf8",
    timeout: timeoutMs,
  });
  return { status: r.status, stdout: r.stdout, stderr: r.stderr };
}

describe("--spin-us auto", () => {
  it("polls 200 µs after activity when each rank's agent has two cores, else sleeps at once", () => {
    expect(spinFor("auto", 1, 2)).toBe(AUTO_SPIN_US);
    expect(spinFor("auto", 2, 2)).toBe(0);
    expect(spinFor("auto", 4, 8)).toBe(AUTO_SPIN_US);
    expect(spinFor("auto", 5, 8)).toBe(0);
    expect(spinFor(0, 1, 64)).toBe(0);
    expect(spinFor(750, 8, 2)).toBe(750);
  });
});

describe("kvxfer demo --json", () => {
  it("reports every byte verified for a non-default shape (MLA, P TP 2 -> D TP 4, pull)", () => {
    const r = kvxfer([
      "demo",
      "--json",
      "--model",
      "deepseek-mla",
      "--layers",
      "2",
      "--prefill",
      "1",
      "--decode",
      "1",
      "--p-tp",
      "2",
      "--d-tp",
      "4",
      "--p-block",
      "32",
      "--d-block",
      "16",
      "--mode",
      "pull",
      "--requests",
      "3",
      "--prompt-tokens",
      "100,300",
      "--kv-memory",
      "file",
    ]);
    expect(r.status, r.stderr.slice(-2000)).toBe(0);
    const s = JSON.parse(r.stdout.trim().split("\n").pop()!) as Record<string, unknown>;
    expect(s.verified).toBe(true);
    expect(s.transfers).toBe(3);
    expect(s.failed).toBe(0);
    expect(s.mode).toBe("pull");
    expect(s.byMode).toEqual({ pull: 3 });
    expect(s.kvMemory).toBe("file");
    expect(Number(s.bytes)).toBeGreaterThan(0);
    const sidecars = s.sidecars as { grpc: string; sideChannel: string }[];
    expect(sidecars).toHaveLength(2);
    for (const sc of sidecars) {
      expect(sc.grpc).toMatch(/^127\.0\.0\.1:\d+$/);
      expect(sc.sideChannel).toMatch(/^127\.0\.0\.1:\d+$/);
    }
  });

  it("refuses a bad flag with a message naming it (exit 2, usage)", () => {
    const r = kvxfer(["demo", "--mode", "sideways"]);
    expect(r.status).toBe(2);
    expect(r.stderr).toMatch(/--mode must be one of push, pull, auto, got 'sideways'/);
    const u = kvxfer(["demo", "--mode", "pull", "--dispatch", "concurrent"]);
    expect(u.status).toBe(2);
    expect(u.stderr).toMatch(/--mode pull needs --dispatch sequential/);
    const m = kvxfer(["demo", "--kv-memory", "disk"]);
    expect(m.status).toBe(2);
    expect(m.stderr).toMatch(/--kv-memory must be one of segment, file, got 'disk'/);
  });

  it("prints usage for help and for an unknown command", () => {
    expect(kvxfer(["--help"]).status).toBe(0);
    const r = kvxfer(["frobnicate"]);
    expect(r.status).toBe(2);
    expect(r.stderr).toMatch(/unknown command 'frobnicate'/);
  });
});

describe("sidecar settings", () => {
  it("take a flag over the environment over the config file over the default", () => {
    const dir = mkdtempSync(join(tmpdir(), "kvxfer-cfg-"));
    try {
      const file = join(dir, "sidecar.json");
      writeFileSync(
        file,
        JSON.stringify({ "lease-ms": 111, "heartbeat-ms": 222, "peer-timeout-ms": 333 }),
      );
      const s = resolveSettings(["--config", file, "--lease-ms", "999"], {
        KVXFER_HEARTBEAT_MS: "444",
        KVXFER_ENGINE_ID: "from-env",
      });
      expect(s["lease-ms"]).toBe("999"); // flag
      expect(s["heartbeat-ms"]).toBe("444"); // environment
      expect(s["peer-timeout-ms"]).toBe("333"); // file
      expect(s["abort-grace-ms"]).toBe("2000"); // default
      expect(s["engine-id"]).toBe("from-env");
    } finally {
      rmSync(dir, { recursive: true, force: true });
    }
  });

  it("name an unknown config key and a bad value", () => {
    const dir = mkdtempSync(join(tmpdir(), "kvxfer-cfg-"));
    try {
      const file = join(dir, "bad.json");
      writeFileSync(file, JSON.stringify({ "lease-msec": 5 }));
      expect(() => resolveSettings(["--config", file], {})).toThrow(/unknown setting 'lease-msec'/);
      const r = kvxfer(["sidecar", "--engine-id", "x", "--lease-ms", "soon"], 20_000);
      expect(r.status).toBe(2);
      expect(r.stderr).toMatch(/--lease-ms must be a positive integer, got 'soon'/);
      const m = kvxfer(["sidecar", "--role", "prefill"], 20_000);
      expect(m.status).toBe(2);
      expect(m.stderr).toMatch(/--engine-id is required/);
      // The same check for a value from the environment (ERR_CONFIG: a usage error too).
      const e = spawnSync(process.execPath, [cliScript(), "sidecar", "--engine-id", "x"], {
        encoding: "utf8",
        timeout: 20_000,
        env: { ...process.env, KVXFER_LEASE_MS: "soon" },
      });
      expect(e.status).toBe(2);
      expect(e.stderr).toMatch(/ERR_CONFIG: --lease-ms must be a positive integer, got 'soon'/);
      // --spin-us takes auto or a number of microseconds.
      const sp = kvxfer(["sidecar", "--engine-id", "x", "--spin-us", "fast"], 20_000);
      expect(sp.status).toBe(2);
      expect(sp.stderr).toMatch(
        /--spin-us must be auto or a non-negative integer \(µs\), got 'fast'/,
      );
      expect(resolveSettings(["--engine-id", "x"], {})["spin-us"]).toBe("auto");
    } finally {
      rmSync(dir, { recursive: true, force: true });
    }
  });
});
