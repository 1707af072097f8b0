/**
 * What the native tests that make agents in this process share: agents made through `agent()`
 * are closed after each test, `pattern()` fills a buffer with bytes that differ by seed, and
 * `traceSteps()` lists an operation's steps in the order they happen.
 */
import { afterEach, beforeEach } from "vitest";

import { Agent, type OpTrace } from "../../src/native/index.js";

type AgentOptions = ConstructorParameters<typeof Agent>[0];

/** Registers the hooks; returns the maker (over shared memory unless `opts` says otherwise). */
export function useAgents(): (opts?: AgentOptions) => Agent {
  let agents: Agent[] = [];
  beforeEach(() => {
    agents = [];
  });
  afterEach(() => {
    for (const a of agents) a.close();
  });
  return (opts = {}) => {
    const a = new Agent({ transports: "shm,self", ...opts });
    agents.push(a);
    return a;
  };
}

export function pattern(n: number, seed: number): Uint8Array {
  const b = new Uint8Array(n);
  for (let i = 0; i < n; i++) b[i] = (i * 31 + seed * 17 + (i >> 8)) & 0xff;
  return b;
}

/** An operation's steps in the order they happen; `notified` includes the notification's. */
export function traceSteps(t: OpTrace, notified: boolean): number[] {
  return [
    t.submittedUs,
    t.startedUs,
    t.firstPostUs,
    t.postedUs,
    t.flushedUs,
    ...(notified ? [t.notifiedUs] : []),
    t.completedUs,
    t.deliveredUs,
  ];
}
