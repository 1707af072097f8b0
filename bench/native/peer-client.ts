/**
 * Starts a peer process (bench/native/peer.ts, compiled) and calls it. Every
 * call has a deadline; close() ends the process and waits for it (bounded).
 */
import { spawn, type ChildProcess } from "node:child_process";
import { dirname, join } from "node:path";
import { fileURLToPath } from "node:url";
import { existsSync } from "node:fs";
import { createInterface } from "node:readline";

export interface PeerError {
  code: string;
  message: string;
}

function peerScript(): string {
  // Works from src (vitest) and from dist (compiled bench): the compiled peer lives in dist/.
  let dir = dirname(fileURLToPath(import.meta.url));
  for (let i = 0; i < 6; i++) {
    const candidate = join(dir, "dist", "bench", "native", "peer.js");
    if (existsSync(candidate)) return candidate;
    dir = dirname(dir);
  }
  throw new Error("dist/bench/native/peer.js not found: run 'npm run build' first");
}

export class PeerProcess {
  readonly child: ChildProcess;
  private nextId = 1;
  private readonly waiting = new Map<
    number,
    { resolve: (v: unknown) => void; reject: (e: Error) => void }
  >();
  private exited: Promise<number | null>;
  stderr = "";

  /** `prefix`: a command to run node under, e.g. ["ip", "netns", "exec", "ns1"]. */
  constructor(prefix: string[] = [], env: NodeJS.ProcessEnv = {}) {
    const argv = [...prefix, process.execPath, peerScript()];
    this.child = spawn(argv[0]!, argv.slice(1), {
      stdio: ["pipe", "pipe", "pipe"],
      env: { ...process.env, ...env },
    });
    this.child.stderr!.on("data", (d: Buffer) => {
      if (this.stderr.length < 65536) this.stderr += d.toString();
    });
    createInterface({ input: this.child.stdout! }).on("line", (line) => {
      let msg: { id: number; result?: unknown; error?: PeerError };
      try {
        msg = JSON.parse(line) as typeof msg;
      } catch {
        return;
      }
      const w = this.waiting.get(msg.id);
      if (w === undefined) return;
      this.waiting.delete(msg.id);
      if (msg.error !== undefined) {
        w.reject(Object.assign(new Error(msg.error.message), { code: msg.error.code }));
      } else {
        w.resolve(msg.result);
      }
    });
    this.exited = new Promise((resolve) => this.child.on("exit", (code) => resolve(code)));
    this.child.on("exit", (code, signal) => {
      const why = `peer exited (code ${code}, signal ${signal}); stderr: ${this.stderr.slice(-2000)}`;
      for (const w of this.waiting.values()) w.reject(new Error(why));
      this.waiting.clear();
    });
  }

  call<T = Record<string, unknown>>(
    op: string,
    args: Record<string, unknown> = {},
    timeoutMs = 30_000,
  ): Promise<T> {
    const id = this.nextId++;
    return new Promise<T>((resolve, reject) => {
      const timer = setTimeout(() => {
        this.waiting.delete(id);
        reject(
          new Error(
            `peer call '${op}' timed out after ${timeoutMs} ms; stderr: ${this.stderr.slice(-2000)}`,
          ),
        );
      }, timeoutMs);
      this.waiting.set(id, {
        resolve: (v) => {
          clearTimeout(timer);
          resolve(v as T);
        },
        reject: (e) => {
          clearTimeout(timer);
          reject(e);
        },
      });
      this.child.stdin!.write(JSON.stringify({ id, op, ...args }) + "\n");
    });
  }

  kill(signal: NodeJS.Signals = "SIGKILL"): void {
    this.child.kill(signal);
  }

  /** Asks the peer to exit, then kills it if it has not within `timeoutMs`. Returns the exit code. */
  async close(timeoutMs = 5000): Promise<number | null> {
    if (this.child.exitCode !== null || this.child.signalCode !== null) return this.child.exitCode;
    this.child.stdin!.end();
    const timer = setTimeout(() => this.child.kill("SIGKILL"), timeoutMs);
    const code = await this.exited;
    clearTimeout(timer);
    return code;
  }
}
