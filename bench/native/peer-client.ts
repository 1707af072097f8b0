/**
 * Starts a peer process (bench/native/peer.ts, compiled) and calls it. Every
 * call has a deadline; close() ends the process and waits for it (bounded).
 */
import type { ChildProcess } from "node:child_process";
import { dirname, join } from "node:path";
import { fileURLToPath } from "node:url";
import { existsSync } from "node:fs";

import { JsonLinesChild } from "../../sim/json-lines-child.js";

export interface PeerError {
  code: string;
  message: string;
}

function peerScript(script: string): string {
  // Works from src (vitest) and from dist (compiled bench): the compiled peer lives in dist/.
  let dir = dirname(fileURLToPath(import.meta.url));
  for (let i = 0; i < 6; i++) {
    const candidate = join(dir, "dist", "bench", "native", script);
    if (existsSync(candidate)) return candidate;
    dir = dirname(dir);
  }
  throw new Error(`dist/bench/native/${script} not found: run 'npm run build' first`);
}

export class PeerProcess {
  private readonly proc: JsonLinesChild;

  /**
   * `prefix`: a command to run node under, e.g. ["ip", "netns", "exec", "ns1"]; `script`: the
   * peer to run (peer.js, or kv-side.js for bench e2e's reference).
   */
  constructor(prefix: string[] = [], env: NodeJS.ProcessEnv = {}, script = "peer.js") {
    this.proc = new JsonLinesChild([...prefix, process.execPath, peerScript(script)], {
      name: "peer",
      env,
      makeError: (code, message) => Object.assign(new Error(message), { code }),
    });
  }

  get child(): ChildProcess {
    return this.proc.child;
  }

  get stderr(): string {
    return this.proc.stderr;
  }

  call<T = Record<string, unknown>>(
    op: string,
    args: Record<string, unknown> = {},
    timeoutMs = 30_000,
  ): Promise<T> {
    return this.proc.call<T>(op, args, timeoutMs);
  }

  kill(signal: NodeJS.Signals = "SIGKILL"): void {
    this.proc.kill(signal);
  }

  /** Asks the peer to exit, then kills it if it has not within `timeoutMs`. Returns the exit code. */
  close(timeoutMs = 5000): Promise<number | null> {
    return this.proc.stop(timeoutMs);
  }
}

/** A peer's answer to write/read. */
export interface PeerXfer {
  ms: number;
  failed?: PeerError;
}

/**
 * Gives two started peers, P and D, an agent each (`init` plus their names) and a region of
 * `size` bytes (seeds 1 and 2), connects them both ways and hands each the other's remote key.
 * Returns their process ids. The caller owns (and closes) both peers.
 */
export async function connectPeers(
  p: PeerProcess,
  d: PeerProcess,
  names: [string, string],
  init: Record<string, unknown>,
  size: number,
): Promise<{ pids: [number, number] }> {
  const ip = await p.call<{ address: string; pid: number }>("init", { name: names[0], ...init });
  const id = await d.call<{ address: string; pid: number }>("init", { name: names[1], ...init });
  const kp = await p.call<{ key: string }>("alloc", { size, seed: 1 });
  const kd = await d.call<{ key: string }>("alloc", { size, seed: 2 });
  await p.call("connect", { address: id.address });
  await d.call("connect", { address: ip.address });
  await p.call("import", { key: kd.key });
  await d.call("import", { key: kp.key });
  return { pids: [ip.pid, id.pid] };
}
