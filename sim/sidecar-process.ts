/**
 * A `kvxfer sidecar` child process, as the demo, tests and benchmarks start
 * it: waits (bounded) for its ready line, stops it (bounded) on close().
 */
import { spawn, type ChildProcess } from "node:child_process";
import { appendFileSync, existsSync, lstatSync, rmSync } from "node:fs";
import { dirname, join } from "node:path";
import { createInterface } from "node:readline";
import { fileURLToPath } from "node:url";

import { sharedPki, type Pki } from "./pki.js";

/** The compiled CLI (dist/src/cli/main.js), found from src or dist. */
export function cliScript(): string {
  let dir = dirname(fileURLToPath(import.meta.url));
  for (let i = 0; i < 6; i++) {
    const candidate = join(dir, "dist", "src", "cli", "main.js");
    if (existsSync(candidate)) return candidate;
    dir = dirname(dir);
  }
  throw new Error("dist/src/cli/main.js not found: run 'npm run build' first");
}

export interface SidecarReady {
  engineId: string;
  epoch: string;
  /** What peers dial: --advertise when given, else the bound address. */
  sideChannel: string;
  /** The bound side channel, when --advertise names another address. */
  listen?: string;
  engineSocket: string;
  grpc?: string;
  metrics?: string;
  bootstrap?: string;
  /** The UCX the sidecar's agents run on (version, transport resources, memory types). */
  ucx?: { version: string; transports: string[]; memoryTypes: string[] };
}

/**
 * Sidecars still running, stopped if this process exits first (a second
 * Ctrl-C, an uncaught error): a sidecar does not watch its parent, so it would
 * otherwise run on. SIGKILL of this process is the one case not covered.
 */
const running = new Set<ChildProcess>();
let exitHook = false;

function track(child: ChildProcess): void {
  running.add(child);
  child.on("exit", () => running.delete(child));
  if (!exitHook) {
    exitHook = true;
    process.on("exit", () => {
      for (const c of running) c.kill("SIGTERM");
    });
  }
}

export class SidecarProcess {
  readonly child: ChildProcess;
  readonly ready: Promise<SidecarReady>;
  stderrTail = "";
  private readonly exited: Promise<{ code: number | null; signal: NodeJS.Signals | null }>;

  /**
   * `args`: sidecar flags; `prefix`: a command to run node under (e.g. ip netns exec);
   * `pki`: where its peer certificate comes from (default: one CA per process), or false to
   * run it without peer credentials. Flags that already name credentials are kept.
   */
  constructor(
    args: string[],
    options: {
      prefix?: string[];
      env?: NodeJS.ProcessEnv;
      readyTimeoutMs?: number;
      pki?: Pki | false;
    } = {},
  ) {
    const idAt = args.indexOf("--engine-id");
    const engineId = idAt >= 0 ? args[idAt + 1] : undefined;
    const auth =
      options.pki === false ||
      engineId === undefined ||
      args.includes("--peer-cert") ||
      args.includes("--insecure-peers")
        ? []
        : (options.pki ?? sharedPki()).sidecarFlags(engineId);
    // KVXFER_SIDECAR_NODE_ARGS: flags for node itself (e.g. "--cpu-prof --cpu-prof-dir=/tmp/p"),
    // which NODE_OPTIONS does not take; for profiling the sidecars of a demo or benchmark.
    const nodeArgs = (process.env.KVXFER_SIDECAR_NODE_ARGS ?? "")
      .split(/\s+/)
      .filter((a) => a !== "");
    const argv = [
      ...(options.prefix ?? []),
      process.execPath,
      ...nodeArgs,
      cliScript(),
      "sidecar",
      ...args,
      ...auth,
    ];
    this.child = spawn(argv[0]!, argv.slice(1), {
      stdio: ["ignore", "pipe", "pipe"],
      env: { ...process.env, ...options.env },
    });
    track(this.child);
    // KVXFER_LOG_DIR keeps every sidecar's log (one file per process) for a look afterwards.
    const logDir = process.env.KVXFER_LOG_DIR;
    this.child.stderr!.on("data", (d: Buffer) => {
      this.stderrTail = (this.stderrTail + d.toString()).slice(-20_000);
      if (logDir !== undefined && logDir !== "")
        appendFileSync(join(logDir, `sidecar-${this.child.pid}.log`), d);
    });
    this.exited = new Promise((resolve) =>
      this.child.on("exit", (code, signal) => resolve({ code, signal })),
    );
    const timeoutMs = options.readyTimeoutMs ?? 20_000;
    this.ready = new Promise<SidecarReady>((resolve, reject) => {
      const timer = setTimeout(
        () =>
          reject(
            new Error(`sidecar not ready within ${timeoutMs} ms: ${this.stderrTail.slice(-2000)}`),
          ),
        timeoutMs,
      );
      createInterface({ input: this.child.stdout! }).on("line", (line) => {
        try {
          const msg = JSON.parse(line) as { event?: string } & SidecarReady;
          if (msg.event === "ready") {
            clearTimeout(timer);
            resolve(msg);
          }
        } catch {
          // not a control line
        }
      });
      void this.exited.then(({ code, signal }) => {
        clearTimeout(timer);
        reject(
          new Error(
            `sidecar exited (code ${code}, signal ${signal}) before ready: ${this.stderrTail.slice(-2000)}`,
          ),
        );
      });
    });
    this.ready.then(
      (r) => this.noteSocketFiles(r),
      () => undefined,
    );
  }

  kill(signal: NodeJS.Signals = "SIGKILL"): void {
    this.child.kill(signal);
  }

  /**
   * SIGTERM, then SIGKILL after `timeoutMs`. Resolves with how it ended. Whatever files of its
   * engine socket the sidecar could not remove (it was SIGKILLed, or hung and was) are removed
   * here, if they are still the ones it made (same inode: not a later sidecar's).
   */
  async close(timeoutMs = 10_000): Promise<{ code: number | null; signal: NodeJS.Signals | null }> {
    if (this.child.exitCode === null && this.child.signalCode === null) this.child.kill("SIGTERM");
    const timer = setTimeout(() => this.child.kill("SIGKILL"), timeoutMs);
    const res = await this.exited;
    clearTimeout(timer);
    for (const [path, ino] of this.socketFiles) {
      try {
        if (lstatSync(path, { bigint: true }).ino === ino) rmSync(path, { force: true });
      } catch {
        // gone already
      }
    }
    this.socketFiles.clear();
    return res;
  }

  /** The engine socket file and its lock, by inode, once ready (ipc endpoints only). */
  private readonly socketFiles = new Map<string, bigint>();

  private noteSocketFiles(ready: SidecarReady): void {
    const endpoint = ready.engineSocket ?? "";
    if (!endpoint.startsWith("ipc://")) return;
    const path = endpoint.slice("ipc://".length);
    if (path === "" || path.startsWith("@")) return;
    for (const p of [path, `${path}.lock`]) {
      try {
        this.socketFiles.set(p, lstatSync(p, { bigint: true }).ino);
      } catch {
        // not there (another transport, or already gone)
      }
    }
  }
}
