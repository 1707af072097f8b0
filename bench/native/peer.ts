/**
 * A native agent in its own process, driven by JSON lines on stdin (one reply
 * per line on stdout, matched by `id`). The native tests and `bench/native`
 * use it to put the two ends of a transfer in different processes, and in
 * different network namespaces.
 */

import { KvxferError } from "../../src/errors.js";
import {
  Agent,
  type Endpoint,
  type Notification,
  type Region,
  type RemoteRegion,
} from "../../src/native/index.js";
import { fillPattern, prng, sha256 } from "./pattern.js";
import { serveJsonLines } from "./serve.js";

interface Request {
  id: number;
  op: string;
  [key: string]: unknown;
}

let agent: Agent | undefined;
let region: Region | undefined;
let ep: Endpoint | undefined;
let remote: RemoteRegion | undefined;
let guard: Buffer | undefined;
const watch = { ok: 0, bad: 0, firstBad: "" };
let ackWaiter: ((rep: number) => void) | undefined;

function need<T>(v: T | undefined, what: string): T {
  if (v === undefined) throw new KvxferError("ERR_INVALID_ARGUMENT", `peer: ${what} not set up`);
  return v;
}

function b64(buf: Uint8Array): string {
  return Buffer.from(buf.buffer, buf.byteOffset, buf.byteLength).toString("base64");
}

function descsFrom(s: unknown): Float64Array {
  const raw = Buffer.from(String(s), "base64");
  const copy = new Uint8Array(raw.length);
  copy.set(raw);
  return new Float64Array(copy.buffer, 0, Math.floor(copy.length / 8));
}

function onNotifications(batch: Notification[]): void {
  for (const n of batch) {
    const msg = JSON.parse(n.data.toString()) as {
      rep: number;
      off?: number;
      len?: number;
      seed?: number;
      ack?: boolean;
    };
    if (msg.ack === true) {
      ackWaiter?.(msg.rep);
      continue;
    }
    // The notification of a write: its data must already be complete here.
    const r = need(region, "region");
    const got = r.bytes().subarray(msg.off!, msg.off! + msg.len!);
    const want = new Uint8Array(msg.len!);
    fillPattern(want, msg.seed!, msg.off!);
    if (Buffer.compare(Buffer.from(got), Buffer.from(want)) === 0) {
      watch.ok++;
    } else {
      watch.bad++;
      watch.firstBad ||= `rep ${msg.rep}: ${msg.len} bytes at ${msg.off} incomplete at notification time`;
    }
    if (ep !== undefined)
      void need(agent, "agent").notify(
        ep,
        Buffer.from(JSON.stringify({ rep: msg.rep, ack: true })),
      );
  }
}

async function pingpong(reps: number, maxLen: number, seed: number): Promise<unknown> {
  const a = need(agent, "agent");
  const r = need(region, "region");
  const e = need(ep, "endpoint");
  const rem = need(remote, "remote region");
  const rand = prng(seed);
  const local = r.bytes();
  const size = Math.min(r.length, rem.length);
  const t0 = performance.now();
  for (let rep = 0; rep < reps; rep++) {
    const len = 1 + Math.floor(rand() * Math.min(maxLen, size));
    const off = Math.floor(rand() * (size - len + 1));
    fillPattern(local.subarray(off, off + len), seed + rep, off);
    // Split into up to 8 pieces so that several puts race the notification.
    const pieces = 1 + Math.floor(rand() * Math.min(8, len));
    const descs = new Float64Array(pieces * 3);
    const step = Math.floor(len / pieces);
    for (let i = 0; i < pieces; i++) {
      const start = off + i * step;
      const end = i === pieces - 1 ? off + len : start + step;
      descs.set([start, start, end - start], 3 * i);
    }
    const acked = new Promise<void>((resolve, reject) => {
      const timer = setTimeout(
        () => reject(new KvxferError("ERR_TIMEOUT", `no ack for rep ${rep} within 5 s`)),
        5000,
      );
      ackWaiter = (n) => {
        if (n === rep) {
          clearTimeout(timer);
          resolve();
        }
      };
    });
    await a.write(
      e,
      r,
      rem,
      descs,
      Buffer.from(JSON.stringify({ rep, off, len, seed: seed + rep })),
    );
    await acked;
  }
  return { reps, ms: performance.now() - t0 };
}

/** Bandwidth loop: `iters` descriptors of `size` bytes, `batch` per transfer, `window` transfers in flight. */
async function bandwidth(
  kind: "write" | "read",
  size: number,
  iters: number,
  batch: number,
  window: number,
): Promise<unknown> {
  const a = need(agent, "agent");
  const r = need(region, "region");
  const e = need(ep, "endpoint");
  const rem = need(remote, "remote region");
  const slots = Math.max(1, Math.floor(Math.min(r.length, rem.length) / size));
  const transfers = Math.ceil(iters / batch);
  const lists: Float64Array[] = [];
  for (let t = 0; t < Math.min(transfers, 16); t++) {
    const d = new Float64Array(batch * 3);
    for (let i = 0; i < batch; i++) {
      const slot = ((t * batch + i) % slots) * size;
      d.set([slot, slot, size], 3 * i);
    }
    lists.push(d);
  }
  let next = 0;
  let done = 0;
  const t0 = process.hrtime.bigint();
  await new Promise<void>((resolve, reject) => {
    const launch = (): void => {
      while (next < transfers && next - done < window) {
        const d = lists[next % lists.length]!;
        next++;
        const p = kind === "write" ? a.write(e, r, rem, d) : a.read(e, r, rem, d);
        p.then(() => {
          done++;
          if (done === transfers) resolve();
          else launch();
        }, reject);
      }
    };
    launch();
  });
  const seconds = Number(process.hrtime.bigint() - t0) / 1e9;
  const bytes = transfers * batch * size;
  return {
    seconds,
    bytes,
    messages: transfers * batch,
    gbps: bytes / seconds / 1e9,
    msgRate: (transfers * batch) / seconds,
  };
}

async function handle(req: Request): Promise<unknown> {
  switch (req.op) {
    case "init": {
      const opts: ConstructorParameters<typeof Agent>[0] = {
        name: String(req.name ?? `peer-${process.pid}`),
      };
      if (typeof req.transports === "string") opts.transports = req.transports;
      if (typeof req.netDevices === "string") opts.netDevices = req.netDevices;
      if (req.busyPoll === true) opts.busyPoll = true;
      if (typeof req.loopWake === "boolean") opts.loopWake = req.loopWake;
      agent = new Agent(opts);
      agent.on("notifications", onNotifications);
      return { address: b64(agent.address), pid: process.pid };
    }
    case "alloc": {
      const a = need(agent, "agent");
      region?.close();
      if (req.memory === "ucx") {
        region = a.allocate(Number(req.size));
        region.bytes().fill(0);
      } else if (typeof req.file === "string") {
        region = a.mapFile(req.file, { length: Number(req.size) });
      } else if (typeof req.guard === "number") {
        // Registers `size` bytes and keeps `guard` more right after them, unregistered: a
        // write there proves a remote key reached outside its region (test/security-rkey).
        const whole = Buffer.alloc(Number(req.size) + req.guard);
        guard = whole.subarray(Number(req.size));
        region = a.registerMemory(whole.subarray(0, Number(req.size)));
      } else {
        region = a.registerMemory(Buffer.alloc(Number(req.size)));
      }
      if (typeof req.seed === "number") fillPattern(region.bytes(), req.seed);
      return { key: b64(region.remoteKey()), length: region.length };
    }
    case "fill":
      fillPattern(need(region, "region").bytes(), Number(req.seed));
      return {};
    case "connect":
      ep = need(agent, "agent").connect(Buffer.from(String(req.address), "base64"), {
        errorMode: req.errorMode === "peer" ? "peer" : "none",
      });
      return { endpoint: ep.id };
    case "import":
      remote = need(ep, "endpoint").importRemote(Buffer.from(String(req.key), "base64"));
      return { length: remote.length };
    case "write":
    case "read": {
      const a = need(agent, "agent");
      const d = descsFrom(req.descs);
      const t0 = performance.now();
      try {
        if (req.op === "write") {
          const note =
            typeof req.notify === "string" ? Buffer.from(req.notify, "base64") : undefined;
          await a.write(
            need(ep, "endpoint"),
            need(region, "region"),
            need(remote, "remote region"),
            d,
            note,
          );
        } else {
          await a.read(
            need(ep, "endpoint"),
            need(region, "region"),
            need(remote, "remote region"),
            d,
          );
        }
        return { ms: performance.now() - t0 };
      } catch (err) {
        const e = KvxferError.from(err);
        return { ms: performance.now() - t0, failed: { code: e.code, message: e.message } };
      }
    }
    case "hash": {
      const bytes = need(region, "region").bytes();
      const off = Number(req.offset ?? 0);
      const len = Number(req.length ?? bytes.length - off);
      return { sha256: sha256(bytes.subarray(off, off + len)) };
    }
    case "guard": {
      const g = need(guard, "guard");
      let touched = 0;
      for (const b of g) if (b !== 0) touched++;
      return { touched };
    }
    case "watchStats":
      return { ...watch };
    case "pingpong":
      return pingpong(Number(req.reps), Number(req.maxLen), Number(req.seed ?? 1));
    case "bw":
      return bandwidth(
        req.kind === "read" ? "read" : "write",
        Number(req.size),
        Number(req.iters),
        Number(req.batch ?? 1),
        Number(req.window ?? 1),
      );
    case "block": {
      // Keeps the event loop busy (test/native/loop-wake: the progress thread still serves).
      const until = performance.now() + Number(req.ms);
      while (performance.now() < until) {
        // nothing: JavaScript is busy
      }
      return {};
    }
    case "loopTurns":
      return { loopTurns: need(agent, "agent").loopTurns };
    case "endpointState":
      return { state: need(ep, "endpoint").state };
    case "close":
      agent?.close();
      agent = undefined;
      return {};
    case "exit":
      agent?.close();
      setImmediate(() => process.exit(0));
      return {};
    default:
      throw new KvxferError("ERR_INVALID_ARGUMENT", `peer: unknown op '${req.op}'`);
  }
}

serveJsonLines<Request>(handle, () => agent?.close());
