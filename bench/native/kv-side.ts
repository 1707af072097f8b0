/**
 * The passive side of `bench e2e`'s native reference in its own process, as a sidecar's is: one
 * agent per rank, a region per KV region over shared-memory files of the engine's sizes. For a
 * push it is D (it reports when each notification reached JavaScript, in monoUs, the clock the
 * bench process shares on this host); for a pull it is P, whose progress threads serve D's reads.
 * Driven by JSON lines (serve.ts); closing stdin closes the agents and removes the files.
 */
import { closeSync, ftruncateSync, openSync, unlinkSync } from "node:fs";

import { KvxferError } from "../../src/errors.js";
import { Agent, type Endpoint, type Region } from "../../src/native/index.js";
import { serveJsonLines } from "./serve.js";

interface Request {
  id: number;
  op: string;
  [key: string]: unknown;
}

const agents: Agent[] = [];
const regions: Region[][] = [];
const files: string[] = [];
const backs: Endpoint[] = [];
/** Notification text -> when it reached JavaScript (monoUs). */
const arrived = new Map<string, number>();
const waiters = new Map<string, (us: number) => void>();

function b64(buf: Uint8Array): string {
  return Buffer.from(buf.buffer, buf.byteOffset, buf.byteLength).toString("base64");
}

function mapRegion(agent: Agent, rank: number, g: number, bytes: number, fill: number): Region {
  // Named after the bench process too (its parent), so a check for its leftovers finds them.
  const path = `/dev/shm/kvxfer-bench-e2e-ref-${process.ppid}-${process.pid}-r${rank}-g${g}.kv`;
  const fd = openSync(path, "w+");
  files.push(path);
  try {
    ftruncateSync(fd, bytes);
  } finally {
    closeSync(fd);
  }
  const region = agent.mapFile(path, { length: bytes, populate: true });
  if (fill !== 0) region.bytes().fill(fill);
  return region;
}

async function handle(req: Request): Promise<unknown> {
  switch (req.op) {
    case "init": {
      const ranks = Number(req.ranks);
      const regionBytes = req.regionBytes as number[];
      const out: { address: string; keys: string[] }[] = [];
      for (let r = 0; r < ranks; r++) {
        const ucx = req.memory === "ucx";
        const agent = new Agent({
          name: `${String(req.name)}${r}`,
          transports: String(req.transports ?? "shm,self"),
        });
        agent.on("notifications", (batch) => {
          for (const n of batch) {
            const key = n.data.toString();
            arrived.set(key, n.deliveredUs);
            waiters.get(key)?.(n.deliveredUs);
          }
        });
        agents.push(agent);
        const fill = Number(req.fill ?? 0);
        regions.push(
          regionBytes.map((b, g) => {
            if (!ucx) return mapRegion(agent, r, g, b, fill);
            const region = agent.allocate(b);
            region.bytes().fill(fill);
            return region;
          }),
        );
        out.push({ address: b64(agent.address), keys: regions[r]!.map((x) => b64(x.remoteKey())) });
      }
      return { ranks: out };
    }
    case "connect": {
      // The way back to the moving side's agent (UCX's own replies use it).
      const agent = agents[Number(req.rank)];
      if (agent === undefined) throw new KvxferError("ERR_INVALID_ARGUMENT", "no such rank");
      backs.push(agent.connect(Buffer.from(String(req.address), "base64")));
      return {};
    }
    case "waitNote": {
      const key = String(req.key);
      const seen = arrived.get(key);
      if (seen !== undefined) {
        arrived.delete(key);
        return { deliveredUs: seen };
      }
      const timeoutMs = Number(req.timeoutMs ?? 10_000);
      const us = await new Promise<number>((resolve, reject) => {
        const timer = setTimeout(() => {
          waiters.delete(key);
          reject(new KvxferError("ERR_TIMEOUT", `no notification '${key}' within ${timeoutMs} ms`));
        }, timeoutMs);
        waiters.set(key, (at) => {
          clearTimeout(timer);
          waiters.delete(key);
          resolve(at);
        });
      });
      arrived.delete(key);
      return { deliveredUs: us };
    }
    default:
      throw new KvxferError("ERR_INVALID_ARGUMENT", `unknown op '${req.op}'`);
  }
}

serveJsonLines(handle, () => {
  for (const a of agents) a.close();
  for (const f of files) {
    try {
      unlinkSync(f);
    } catch {
      // already gone
    }
  }
});
