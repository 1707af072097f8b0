/**
 * A child process driven by JSON lines: one request per line on its stdin
 * (`{...args, id, op}`), one reply per request on its stdout (`{id, result}`
 * or `{id, error: {code, message}}`), and any other line handed to
 * `onMessage` (events). Every call has a deadline; a call to a process that
 * exited fails at once; stop() is bounded.
 */
import { spawn, type ChildProcess } from "node:child_process";
import { createInterface } from "node:readline";

export interface JsonLinesChildOptions {
  /** What the process is, for messages ("sim engine", "peer"). */
  name: string;
  env?: NodeJS.ProcessEnv;
  /** Builds the error a failed, timed-out or orphaned call rejects with. */
  makeError: (code: string, message: string) => Error;
  /** Lines that are not replies (events). */
  onMessage?: (msg: Record<string, unknown>) => void;
  /** After the process exited and every pending call was rejected. */
  onExit?: (code: number | null, signal: NodeJS.Signals | null) => void;
}

interface Reply {
  id?: unknown;
  result?: unknown;
  error?: { code: string; message: string };
}

const STDERR_KEPT = 65_536;

export class JsonLinesChild {
  readonly child: ChildProcess;
  /** The first 64 KiB of stderr, for error messages. */
  stderr = "";
  /** Set once the process has exited: why, with the end of its stderr. */
  exitReason: string | undefined;
  readonly exited: Promise<number | null>;
  private nextId = 1;
  private readonly waiting = new Map<
    number,
    { resolve: (v: unknown) => void; reject: (e: Error) => void }
  >();

  /** `argv`: the whole command, e.g. [...prefix, process.execPath, script, ...args]. */
  constructor(
    argv: readonly string[],
    private readonly opts: JsonLinesChildOptions,
  ) {
    this.child = spawn(argv[0]!, argv.slice(1), {
      stdio: ["pipe", "pipe", "pipe"],
      env: { ...process.env, ...opts.env },
    });
    this.child.stdin!.on("error", () => undefined); // writes after exit are reported by the exit
    this.child.stderr!.on("data", (d: Buffer) => {
      if (this.stderr.length < STDERR_KEPT) this.stderr += d.toString();
    });
    createInterface({ input: this.child.stdout! }).on("line", (line) => this.onLine(line));
    this.exited = new Promise((resolve) => this.child.on("exit", (code) => resolve(code)));
    this.child.on("exit", (code, signal) => {
      this.exitReason = `${opts.name} exited (code ${code}, signal ${signal}); stderr: ${this.stderr.slice(-2000)}`;
      for (const w of this.waiting.values())
        w.reject(opts.makeError("ERR_EXITED", this.exitReason));
      this.waiting.clear();
      opts.onExit?.(code, signal);
    });
  }

  private onLine(line: string): void {
    let msg: Reply & Record<string, unknown>;
    try {
      msg = JSON.parse(line) as typeof msg;
    } catch {
      return;
    }
    if (typeof msg.id === "number" && ("result" in msg || "error" in msg)) {
      const w = this.waiting.get(msg.id);
      if (w === undefined) return;
      this.waiting.delete(msg.id);
      if (msg.error !== undefined) w.reject(this.opts.makeError(msg.error.code, msg.error.message));
      else w.resolve(msg.result);
      return;
    }
    this.opts.onMessage?.(msg);
  }

  /** One request; rejects with the child's code, or ERR_TIMEOUT / ERR_EXITED. */
  call<T = Record<string, unknown>>(
    op: string,
    args: Record<string, unknown> = {},
    timeoutMs = 30_000,
  ): Promise<T> {
    if (this.exitReason !== undefined)
      return Promise.reject(this.opts.makeError("ERR_EXITED", this.exitReason));
    const id = this.nextId++;
    return new Promise<T>((resolve, reject) => {
      const timer = setTimeout(() => {
        this.waiting.delete(id);
        reject(
          this.opts.makeError(
            "ERR_TIMEOUT",
            `${this.opts.name} call '${op}' timed out after ${timeoutMs} ms; stderr: ${this.stderr.slice(-2000)}`,
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
      this.child.stdin!.write(JSON.stringify({ ...args, id, op }) + "\n");
    });
  }

  get running(): boolean {
    return this.child.exitCode === null && this.child.signalCode === null;
  }

  kill(signal: NodeJS.Signals = "SIGKILL"): void {
    this.child.kill(signal);
  }

  /** Ends stdin (the child exits by itself), SIGKILLs it after `timeoutMs`; returns the exit code. */
  async stop(timeoutMs = 5000): Promise<number | null> {
    if (this.running) {
      this.child.stdin!.end();
      const timer = setTimeout(() => this.child.kill("SIGKILL"), timeoutMs);
      await this.exited;
      clearTimeout(timer);
    }
    return this.child.exitCode;
  }
}
