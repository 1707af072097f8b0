// Engine socket ownership and clean-up, with real processes: a second sidecar on a held engine
// socket is refused by name, an engine with another id is refused at once, `sim-engine` exits
// non-zero on a failed start with one line, and no socket, lock or shared-memory file of a run
// remains after a normal stop, SIGTERM, SIGINT, a failed start, a demo and a bench run.
// Every path checked is one this test made (other tests make their own files concurrently).
import { spawn } from "node:child_process";
import { existsSync, lstatSync, mkdtempSync, readdirSync, readFileSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";

import { afterAll, afterEach, beforeAll, describe, expect, it } from "vitest";

import { runDemo } from "../../../sim/demo.js";
import { DEFAULT_DEMO, type SidecarSummary } from "../../../sim/demo-types.js";
import { SimEngineProcess, simEngineScript } from "../../../sim/engine-client.js";
import { cliScript, SidecarProcess } from "../../../sim/sidecar-process.js";
import { SMALL_ENGINE, uniqueId } from "./fixtures.js";
import { until } from "../../until.js";

const SHM_ROOT = existsSync("/dev/shm") ? "/dev/shm" : tmpdir();

let shmDir: string;
const started: SidecarProcess[] = [];
const engines: SimEngineProcess[] = [];
const paths: string[] = [];

beforeAll(() => {
  shmDir = mkdtempSync(join(SHM_ROOT, "kvxfer-own-test-"));
});

afterEach(async () => {
  await Promise.all(engines.splice(0).map((e) => e.close(3000).catch(() => undefined)));
  await Promise.all(started.splice(0).map((s) => s.close(5000).catch(() => undefined)));
  for (const p of paths.splice(0)) rmSync(p, { force: true });
});

afterAll(() => {
  rmSync(shmDir, { recursive: true, force: true });
});

/** A unique engine socket path (and its lock), removed after the test whatever happens. */
function socketPath(id: string): string {
  const path = `/tmp/kvxfer-test-own-${id}.sock`;
  paths.push(path, `${path}.lock`);
  return path;
}

function sidecar(id: string, path: string, extra: string[] = []): SidecarProcess {
  const s = new SidecarProcess(
    [
      "--engine-id",
      id,
      "--engine-socket",
      `ipc://${path}`,
      "--transports",
      "shm,self",
      "--log-level",
      "warn",
      ...extra,
    ],
    { pki: false, readyTimeoutMs: 15_000 },
  );
  started.push(s);
  return s;
}

interface Ran {
  code: number | null;
  signal: NodeJS.Signals | null;
  stdout: string;
  stderr: string;
}

/** Runs a node script to its end (bounded: SIGKILL after `timeoutMs`), stdin closed. */
function run(
  script: string,
  args: string[],
  timeoutMs = 20_000,
  env: NodeJS.ProcessEnv = {},
): Promise<Ran & { pid: number }> {
  return new Promise((resolve) => {
    const child = spawn(process.execPath, [script, ...args], {
      stdio: ["ignore", "pipe", "pipe"],
      env: { ...process.env, ...env },
    });
    let stdout = "";
    let stderr = "";
    child.stdout.on("data", (d: Buffer) => (stdout += d.toString()));
    child.stderr.on("data", (d: Buffer) => (stderr += d.toString()));
    const timer = setTimeout(() => child.kill("SIGKILL"), timeoutMs);
    child.on("close", (code, signal) => {
      clearTimeout(timer);
      resolve({ code, signal, stdout, stderr, pid: child.pid ?? 0 });
    });
  });
}

function inode(path: string): bigint {
  return lstatSync(path, { bigint: true }).ino;
}

/** The SysV segments (ids) whose creator is one of `pids` (/proc/sysvipc/shm: cpid). */
function segmentsCreatedBy(pids: ReadonlySet<number | undefined>): number[] {
  const [header, ...rows] = readFileSync("/proc/sysvipc/shm", "utf8").trim().split("\n");
  const cols = header!.trim().split(/\s+/);
  const id = cols.indexOf("shmid");
  const cpid = cols.indexOf("cpid");
  return rows
    .map((r) => r.trim().split(/\s+/))
    .filter((f) => pids.has(Number(f[cpid])))
    .map((f) => Number(f[id]));
}

/** Files of `dir` whose names contain `part`. */
function filesWith(dir: string, part: string): string[] {
  return readdirSync(dir).filter((f) => f.includes(part));
}

/** sim-engine flags for a tiny engine on the ipc socket at `path`, its files in `shmDir`. */
function smallEngine(id: string, role: string, path: string, registerTimeoutMs: number): string[] {
  return [
    "--engine-id",
    id,
    "--role",
    role,
    "--socket",
    `ipc://${path}`,
    "--layers",
    "2",
    "--kv-heads",
    "2",
    "--head-dim",
    "16",
    "--blocks",
    "8",
    "--shm-dir",
    shmDir,
    "--register-timeout-ms",
    String(registerTimeoutMs),
  ];
}
describe("engine socket ownership", () => {
  it("refuses a second sidecar on a held engine socket, by name; the first keeps it", async () => {
    const id = uniqueId("own");
    const path = socketPath(id);
    const first = sidecar(id, path);
    await first.ready;
    const ino = inode(path);
    expect(existsSync(`${path}.lock`)).toBe(true);

    const second = await run(cliScript(), [
      "sidecar",
      "--engine-id",
      id,
      "--engine-socket",
      `ipc://${path}`,
      "--log-level",
      "error",
    ]);
    expect(second.code).toBe(1);
    expect(second.stdout).not.toContain('"ready"');
    const lines = second.stderr.trim().split("\n");
    expect(lines).toHaveLength(1);
    expect(lines[0]).toMatch(/ERR_ENGINE_SOCKET_IN_USE/);
    expect(lines[0]).toContain(`ipc://${path}`);
    // The first sidecar's socket was not unlinked and rebound.
    expect(inode(path)).toBe(ino);

    // And it still serves its engine.
    const engine = await SimEngineProcess.start({
      ...SMALL_ENGINE,
      engineId: id,
      role: "both",
      socket: `ipc://${path}`,
      shmDir,
    });
    engines.push(engine);
    expect(engine.ready?.engineId).toBe(id);
  });

  it("takes over the socket and lock a SIGKILLed sidecar left behind", async () => {
    const id = uniqueId("own");
    const path = socketPath(id);
    const dead = sidecar(id, path);
    await dead.ready;
    dead.kill("SIGKILL");
    // Its own exit, not dead.close() (which removes what a killed sidecar left, as the demo does).
    await until(() => dead.child.signalCode !== null, 5000, "the sidecar to die");
    // SIGKILL is the one stop nothing can clean up after.
    expect(existsSync(path)).toBe(true);
    expect(existsSync(`${path}.lock`)).toBe(true);

    const next = sidecar(id, path);
    await next.ready;
    expect((await next.close()).code).toBe(0);
    expect(existsSync(path)).toBe(false);
    expect(existsSync(`${path}.lock`)).toBe(false);
  });

  it("refuses an engine with another id at once, by name; sim-engine exits 1 with one line", async () => {
    const id = uniqueId("own");
    const path = socketPath(id);
    const s = sidecar(id, path);
    await s.ready;
    const wrong = uniqueId("wrong");
    const t0 = Date.now();
    // stdin closed, as when run from a script: the refusal still comes, and exit code 1.
    const r = await run(simEngineScript(), smallEngine(wrong, "both", path, 10000));
    expect(Date.now() - t0).toBeLessThan(8000); // not a timeout
    expect(r.code).toBe(1);
    const lines = r.stderr.trim().split("\n");
    expect(lines).toHaveLength(1);
    expect(lines[0]).toMatch(/^kvxfer sim-engine: ERR_REGISTER_REFUSED: .*ERR_BAD_ENGINE_ID/);
    expect(lines[0]).toContain(`'${wrong}'`);
    expect(lines[0]).toContain(`'${id}'`);
    expect(r.stderr).not.toMatch(/\n\s+at /); // no stack trace
    expect(filesWith(shmDir, wrong)).toEqual([]);
    // The sidecar logged the refusal by name too.
    await until(
      () => s.stderrTail.includes("engine registration refused"),
      5000,
      "the sidecar's refusal log line",
    );
    expect(s.stderrTail).toContain(`engine id '${wrong}' is not this sidecar's '${id}'`);
  });

  it("sim-engine with no sidecar: exit 1, one line naming the socket", async () => {
    const id = uniqueId("alone");
    const path = socketPath(id);
    const r = await run(simEngineScript(), smallEngine(id, "decode", path, 500));
    expect(r.code).toBe(1);
    const lines = r.stderr.trim().split("\n");
    expect(lines).toHaveLength(1);
    expect(lines[0]).toMatch(/ERR_REGISTER_TIMEOUT: no sidecar answered at ipc:\/\//);
    expect(lines[0]).toContain(path);
    expect(filesWith(shmDir, id)).toEqual([]);
  });
});

describe("quiet", () => {
  it("many concurrent waits on one sim engine: no MaxListenersExceededWarning", async () => {
    const id = uniqueId("quiet");
    const path = socketPath(id);
    const s = sidecar(id, path);
    await s.ready;
    const engine = await SimEngineProcess.start({
      ...SMALL_ENGINE,
      engineId: id,
      role: "both",
      socket: `ipc://${path}`,
      shmDir,
    });
    engines.push(engine);
    const warnings: string[] = [];
    const onWarning = (w: Error): void => void warnings.push(`${w.name}: ${w.message}`);
    process.on("warning", onWarning);
    try {
      // 50 waiters at once (a router with 50 transfers in flight), all ended by their timeout.
      const waits = Array.from({ length: 50 }, (_, i) =>
        engine.waitTransfer(`never-${i}`, "verified", 200).catch((e: Error) => e),
      );
      expect((await Promise.all(waits)).every((e) => e instanceof Error)).toBe(true);
      // Warnings are emitted on the next tick.
      await new Promise((r) => setImmediate(r));
      expect(warnings.filter((w) => w.includes("MaxListeners"))).toEqual([]);
      expect(engine.listenerCount("event")).toBe(0);
    } finally {
      process.off("warning", onWarning);
    }
  });
});

describe("nothing left behind", () => {
  for (const sig of ["SIGTERM", "SIGINT"] as const) {
    it(`${sig}: the sidecar removes its socket and lock, the engine its KV files`, async () => {
      const id = uniqueId("stop");
      const path = socketPath(id);
      const s = sidecar(id, path);
      await s.ready;
      const engine = await SimEngineProcess.start({
        ...SMALL_ENGINE,
        engineId: id,
        role: "both",
        socket: `ipc://${path}`,
        shmDir,
      });
      engines.push(engine);
      const files = engine.ready!.files.flat();
      expect(files.length).toBeGreaterThan(0);
      expect(files.every((f) => existsSync(f))).toBe(true);
      expect(existsSync(path)).toBe(true);
      expect(existsSync(`${path}.lock`)).toBe(true);

      engine.child.kill(sig);
      s.kill(sig);
      // The engine's own exit, not engine.close() (which would remove its files for it).
      await until(() => engine.child.exitCode !== null, 10_000, "the sim engine to exit");
      expect(engine.child.exitCode).toBe(sig === "SIGTERM" ? 143 : 130);
      expect(files.filter((f) => existsSync(f))).toEqual([]);
      await until(() => s.child.exitCode !== null, 15_000, "the sidecar to exit");
      expect(s.child.exitCode).toBe(0);
      expect(existsSync(path)).toBe(false);
      expect(existsSync(`${path}.lock`)).toBe(false);
    });
  }

  it("a second signal (exit at once, code 1) still removes the socket and lock", async () => {
    const id = uniqueId("twice");
    const path = socketPath(id);
    const s = sidecar(id, path, ["--drain-ms", "5000"]);
    await s.ready;
    s.kill("SIGTERM");
    s.kill("SIGTERM");
    await until(() => s.child.exitCode !== null, 15_000, "the sidecar to exit");
    expect([0, 1]).toContain(s.child.exitCode); // 1 if the second signal came mid-stop
    expect(existsSync(path)).toBe(false);
    expect(existsSync(`${path}.lock`)).toBe(false);
  });

  it("a failed start (--listen nohost) leaves no socket or lock", async () => {
    const id = uniqueId("fail");
    const path = socketPath(id);
    const r = await run(cliScript(), [
      "sidecar",
      "--engine-id",
      id,
      "--engine-socket",
      `ipc://${path}`,
      "--listen",
      "nohost:0",
      "--insecure-peers",
      "true",
      "--log-level",
      "error",
    ]);
    expect(r.code).toBe(1);
    expect(r.stderr).toMatch(/nohost/);
    expect(existsSync(path)).toBe(false);
    expect(existsSync(`${path}.lock`)).toBe(false);
  });

  it.each(["segment", "file"] as const)(
    "a demo (KV in %s) leaves no socket, lock, shared-memory file or segment",
    async (kvMemory) => {
      let sidecars: SidecarSummary[] = [];
      const summary = await runDemo({
        ...DEFAULT_DEMO,
        kvMemory,
        prefill: 1,
        decode: 1,
        pTp: 1,
        dTp: 1,
        layers: 1,
        kvHeads: 2,
        headDim: 16,
        requests: 3,
        promptTokens: [32],
        computeMs: 0,
        peerAuth: false,
        onStarted: (s) => {
          sidecars = s;
        },
        beforeStop: () => {
          // While they run they have segments (the KV's in segment mode, UCX's shared-memory
          // transport's in both), so the check below can fail.
          expect(segmentsCreatedBy(new Set(sidecars.map((sc) => sc.pid))).length).toBeGreaterThan(
            0,
          );
        },
      });
      expect(summary.verified).toBe(true);
      expect(sidecars).toHaveLength(2);
      for (const sc of sidecars) {
        const path = sc.engineSocket.replace(/^ipc:\/\//, "");
        paths.push(path, `${path}.lock`);
        expect(existsSync(path)).toBe(false);
        expect(existsSync(`${path}.lock`)).toBe(false);
        expect(filesWith(SHM_ROOT, `kvxfer-${sc.engineId}-`)).toEqual([]);
      }
      // Segments the sidecars created (their pid is the creator's) are gone with them.
      const pids = new Set(sidecars.map((sc) => sc.pid));
      expect(pids.has(undefined)).toBe(false);
      expect(segmentsCreatedBy(pids)).toEqual([]);
    },
  );

  it("a bench run (bench control, small) leaves no socket, lock or shared-memory file", async () => {
    const results = mkdtempSync(join(tmpdir(), "kvxfer-own-bench-"));
    try {
      const r = await run(
        cliScript(),
        [
          "bench",
          "control",
          "--quick",
          "--requests",
          "40",
          "--warmup",
          "10",
          "--concurrency",
          "8",
          "--reps",
          "100",
        ],
        120_000,
        { KVXFER_BENCH_RESULTS: results },
      );
      expect(r.code, r.stderr.slice(-2000)).toBe(0);
      // The demo's engine ids (and so its socket and KV file names) carry the bench's pid.
      const mark = `-${r.pid}-`;
      expect(r.pid).toBeGreaterThan(0);
      expect(filesWith("/tmp", "kvxfer-").filter((f) => f.includes(mark))).toEqual([]);
      expect(filesWith(SHM_ROOT, "kvxfer-").filter((f) => f.includes(mark))).toEqual([]);
      expect(existsSync(join(results, "control.json"))).toBe(true);
    } finally {
      rmSync(results, { recursive: true, force: true });
    }
  }, 150_000);

  it("bench e2e (small) moves every plan again in two processes, traces each hop, leaves nothing", async () => {
    const results = mkdtempSync(join(tmpdir(), "kvxfer-own-e2e-"));
    try {
      const r = await run(
        cliScript(),
        ["bench", "e2e", "--tokens", "16,64", "--rounds", "2", "--reps", "1", "--layers", "1"],
        150_000,
        { KVXFER_BENCH_RESULTS: results },
      );
      expect(r.code, r.stderr.slice(-2000)).toBe(0);
      const mark = `-${r.pid}-`;
      expect(filesWith("/tmp", "kvxfer-").filter((f) => f.includes(mark))).toEqual([]);
      expect(filesWith(SHM_ROOT, "kvxfer-").filter((f) => f.includes(mark))).toEqual([]);
      const out = JSON.parse(readFileSync(join(results, "e2e.json"), "utf8")) as {
        rows: {
          mode: string;
          failed: number;
          nativeMs: { n: number; p50: number };
          nativeHotMs: { n: number; p50: number };
          grpcHopMs: { n: number; p50: number };
          ratio: number;
          ratioWithGrpc: number;
          hops: { hop: string }[];
        }[];
      };
      expect(out.rows.map((x) => x.mode)).toEqual(["push", "push", "pull", "pull"]);
      for (const row of out.rows) {
        expect(row.failed).toBe(0);
        // The reference (the other side in its own process) moved every measured plan.
        expect(row.nativeMs.n).toBe(2);
        expect(row.nativeMs.p50).toBeGreaterThan(0);
        // ... and again back to back, without the prefill's idle time before each move.
        expect(row.nativeHotMs.n).toBe(2);
        expect(row.nativeHotMs.p50).toBeGreaterThan(0);
        // The gRPC hop alone (its server in a third process): at least 20 events, the warm-up
        // left out, and a reference that adds it can only bring the ratio down.
        expect(row.grpcHopMs.n).toBe(20);
        expect(row.grpcHopMs.p50).toBeGreaterThan(0);
        expect(row.ratioWithGrpc).toBeLessThan(row.ratio);
        const hops = row.hops.map((h) => h.hop);
        expect(hops).toContain("router heard KV_READY");
        expect(hops).toContain(row.mode === "push" ? "P pair 0>0 flushed" : "D pair 0>0 flushed");
      }
    } finally {
      rmSync(results, { recursive: true, force: true });
    }
  }, 180_000);
});
