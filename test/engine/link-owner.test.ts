// The engine link belongs to its engine (issue 16, cases 7 and 9, and the ipc socket's mode), with
// real sidecar processes (dist/), simulated engines and ZeroMQ connections made here as the
// "second engine": a refused registration changes nothing, another connection's messages are
// refused (ERR_NOT_OWNER) and never acted on, the engine's own reconnection takes its link back
// (with what was held for it) while other files cannot, the socket file is owner-only whatever the
// umask, and a frame far over the cap is dropped by ZeroMQ before it is buffered.
// `npm run build` first.
import { closeSync, ftruncateSync, mkdtempSync, openSync, rmSync, statSync } from "node:fs";
import { type AddressInfo, type Socket, createServer } from "node:net";
import { join } from "node:path";

import { create } from "@bufbuild/protobuf";
import { pino } from "pino";
import { afterEach, describe, expect, it } from "vitest";
import { Dealer } from "zeromq";

import { EngineLinkClient, engineMessage, kvCacheRegistration } from "../../src/engine/link.js";
import {
  AbortSchema,
  ExpectKvSchema,
  PrefillDoneSchema,
  type RegisterKvCache,
  type SidecarToEngine,
} from "../../src/gen/kvxfer/v1/engine_pb.js";
import { SMALL } from "../sidecar/fakes.js";
import { SidecarProcess } from "../../sim/sidecar-process.js";
import {
  KvNode,
  type Pair,
  goodTransfer,
  rssKiB,
  sleep,
  startPair,
  uniqueId,
} from "../sidecar/multiprocess/fixtures.js";
import { until } from "../until.js";

const WAIT = 10_000;
const log = pino({ level: "silent" });

type Kind = NonNullable<SidecarToEngine["msg"]["case"]>;
type ValueOf<K extends Kind> = Extract<SidecarToEngine["msg"], { case: K }>["value"];

/** A connection to an engine link made by this test: an engine, or someone posing as one. */
class RawEngine {
  readonly got: SidecarToEngine[] = [];
  readonly link: EngineLinkClient;
  constructor(endpoint: string) {
    this.link = new EngineLinkClient({ endpoint, logger: log, onMessage: (m) => this.got.push(m) });
  }
  kinds(): string[] {
    return this.got.map((m) => m.msg.case ?? "");
  }
  async next<K extends Kind>(
    kind: K,
    since: number,
    pred: (v: ValueOf<K>) => boolean = () => true,
  ): Promise<ValueOf<K>> {
    let found: unknown;
    await until(
      () => {
        for (const m of this.got.slice(since)) {
          if (m.msg.case !== kind) continue;
          const v = m.msg.value as ValueOf<K>;
          if (pred(v)) {
            found = v;
            return true;
          }
        }
        return false;
      },
      WAIT,
      () => `a ${kind} on the test's connection; got ${JSON.stringify(this.kinds())}`,
    );
    return found as ValueOf<K>;
  }
  async register(reg: RegisterKvCache): Promise<{ ok: boolean; error: string; epoch: bigint }> {
    const n = this.got.length;
    await this.link.send(engineMessage("register", reg));
    return this.next("registered", n);
  }
  /** Sends `abort` and returns the refusal it gets. */
  async abort(transferId: string): Promise<{ code: string; message: string; transferId: string }> {
    const n = this.got.length;
    await this.link.send(engineMessage("abort", create(AbortSchema, { transferId })));
    return this.next("refused", n, (r) => r.transferId === transferId);
  }
  close(): Promise<void> {
    return this.link.close(1000);
  }
}

/** The registration a sim engine sent, rebuilt from its ready event (same files, same layout). */
function registrationOf(node: KvNode): RegisterKvCache {
  const r = node.engine.ready!;
  return kvCacheRegistration(node.engineId, r.layout, r.files);
}

/** KV files for SMALL under `dir` (one set per call, named by `tag`). */
function kvFiles(dir: string, tag: string): string[][] {
  return [
    SMALL.regionBytes.map((n, g) => {
      const path = join(dir, `${tag}-g${g}.kv`);
      const fd = openSync(path, "wx", 0o600);
      ftruncateSync(fd, n);
      closeSync(fd);
      return path;
    }),
  ];
}

function shmDir(): string {
  return mkdtempSync(join("/dev/shm", "kvxfer-owner-test-"));
}

describe("engine link ownership (multi-process)", () => {
  const cleanup: (() => Promise<unknown> | void)[] = [];
  afterEach(async () => {
    for (const f of cleanup.splice(0).reverse()) await f();
  }, 30_000);

  it("takeover refused: a second engine's registration changes nothing, its messages get ERR_NOT_OWNER, the real engines still get KvReady and ReleaseBlocks", async () => {
    const pair: Pair = await startPair({ mode: "push" });
    cleanup.push(() => pair.close());
    const { p, d } = pair;
    await goodTransfer(p, d, "before");

    // A second engine on each link, first with exactly the owner's registration (its files are
    // there to read in /dev/shm), then with its own engine id.
    const evilP = new RawEngine(p.socket);
    const evilD = new RawEngine(d.socket);
    cleanup.push(
      () => evilP.close(),
      () => evilD.close(),
    );
    for (const [evil, node] of [
      [evilP, p],
      [evilD, d],
    ] as const) {
      const same = await evil.register(registrationOf(node));
      expect(same.ok).toBe(false);
      expect(same.error).toMatch(/^ERR_ENGINE_LINK_TAKEN: another live connection owns/);
      expect(same.epoch).toBe(BigInt(node.ready.epoch));
      const other = await evil.register({ ...registrationOf(node), engineId: "someone-else" });
      expect(other.ok).toBe(false);
    }

    // A transfer in flight while the second engines try to abort it, finish it, expect it.
    const id = "owned";
    const pre = p.engine.prefill(id, 40, 600, WAIT);
    const exp = d.engine.expect({ transferId: id, tokens: 40, source: p.sideChannel }, WAIT);
    await sleep(100);
    for (const evil of [evilP, evilD]) {
      const r = await evil.abort(id);
      expect(r.code).toBe("ERR_NOT_OWNER");
      expect(r.message).toMatch(/belongs to another connection/);
    }
    let n = evilP.got.length;
    await evilP.link.send(
      engineMessage(
        "prefillDone",
        create(PrefillDoneSchema, { transferId: "forged", blockIds: [1, 2, 3], numTokens: 40 }),
      ),
    );
    expect((await evilP.next("refused", n, (r) => r.transferId === "forged")).code).toBe(
      "ERR_NOT_OWNER",
    );
    n = evilD.got.length;
    await evilD.link.send(
      engineMessage(
        "expectKv",
        create(ExpectKvSchema, {
          transferId: "forged-d",
          source: p.sideChannel,
          blockIds: [1, 2, 3],
          numTokens: 40,
        }),
      ),
    );
    expect((await evilD.next("refused", n, (r) => r.transferId === "forged-d")).code).toBe(
      "ERR_NOT_OWNER",
    );
    await Promise.all([pre, exp]);
    const verified = await d.engineEvent(id, "verified", WAIT);
    expect(verified.ok).toBe(true);
    expect((await p.engineEvent(id, "released", WAIT)).reason).toBe("TRANSFERRED");
    await goodTransfer(p, d, "after", { pull: true });

    // The second engines heard only their refusals; the real ones lost nothing.
    for (const evil of [evilP, evilD])
      expect(new Set(evil.kinds())).toEqual(new Set(["registered", "refused"]));
    for (const node of [p, d]) {
      expect(node.terminal(id)).toHaveLength(1);
      expect(node.terminal("forged")).toHaveLength(0);
      expect(node.terminal("forged-d")).toHaveLength(0);
      const s = await node.allBlocksFree(WAIT);
      expect(s.badReleases).toBe(0);
      expect(node.engine.events.filter((e) => e.event === "unexpected")).toEqual([]);
      expect((await node.client.getStatus()).lastErrors.join("\n")).toMatch(/ERR_NOT_OWNER/);
    }
  }, 90_000);

  it("a refused registration changes nothing; the engine's own reconnection takes the link back with what was held, other files cannot", async () => {
    const dir = shmDir();
    cleanup.push(() => rmSync(dir, { recursive: true, force: true }));
    const engineId = uniqueId("own");
    const socket = `ipc://${join(dir, "engine.sock")}`;
    const sidecar = new SidecarProcess([
      "--engine-id",
      engineId,
      "--role",
      "decode",
      "--engine-socket",
      socket,
      "--transports",
      "shm,self",
      "--transfer-timeout-ms",
      "1500",
      "--log-level",
      "warn",
    ]);
    cleanup.push(() => sidecar.close(5000));
    const ready = await sidecar.ready;
    const mine = kvCacheRegistration(engineId, SMALL, kvFiles(dir, "mine"));
    const theirs = kvCacheRegistration(engineId, SMALL, kvFiles(dir, "theirs"));

    const a = new RawEngine(socket);
    cleanup.push(() => a.close());
    const first = await a.register(mine);
    expect(first).toMatchObject({ ok: true, epoch: BigInt(ready.epoch) });

    // B, while A is connected: refused, whatever it names, and nothing changed: A's messages are
    // still acted on (ERR_UNKNOWN_TRANSFER is the sidecar's answer), B's are not.
    const b = new RawEngine(socket);
    cleanup.push(() => b.close());
    for (const reg of [theirs, mine]) {
      const r = await b.register(reg);
      expect(r.ok).toBe(false);
      expect(r.error).toMatch(/^ERR_ENGINE_LINK_TAKEN: another live connection/);
    }
    expect((await b.abort("x")).code).toBe("ERR_NOT_OWNER");
    expect((await a.abort("x")).code).toBe("ERR_UNKNOWN_TRANSFER");

    // A asks for KV from a "P" that accepts connections and never answers, and goes away: the
    // KvFailed (D's watchdog) and ReleaseBlocks of that transfer come while no connection of the
    // engine is up, and are held for it.
    const held: Socket[] = [];
    const silent = createServer((sock) => held.push(sock));
    await new Promise<void>((r) => silent.listen(0, "127.0.0.1", r));
    cleanup.push(() => {
      for (const sock of held) sock.destroy();
      silent.close();
    });
    const silentPort = (silent.address() as AddressInfo).port;
    await a.link.send(
      engineMessage(
        "expectKv",
        create(ExpectKvSchema, {
          transferId: "held",
          source: `127.0.0.1:${silentPort}`,
          blockIds: [0, 1, 2],
          numTokens: 40,
        }),
      ),
    );
    await sleep(100);
    await a.close();

    // Other files cannot take the link of an engine that is gone.
    let last = { ok: true, error: "" };
    await until(
      async () => {
        last = await b.register(theirs);
        return /is gone/.test(last.error);
      },
      WAIT,
      () => `the sidecar to see A's connection end; last answer ${JSON.stringify(last)}`,
      100,
    );
    expect(last.ok).toBe(false);
    expect((await b.abort("y")).code).toBe("ERR_NOT_OWNER");
    await sleep(2500); // past --transfer-timeout-ms: the transfer failed while A was away

    // The same engine (same files) on a new connection: the link is its again, same epoch, and
    // what was held comes.
    const c = new RawEngine(socket);
    cleanup.push(() => c.close());
    const back = await c.register(mine);
    expect(back).toMatchObject({ ok: true, epoch: BigInt(ready.epoch) });
    expect((await c.next("kvFailed", 0, (f) => f.transferId === "held")).transferId).toBe("held");
    expect(c.kinds()[0]).toBe("registered"); // the answer first, then what was held
    expect((await c.next("releaseBlocks", 0, (r) => r.transferId === "held")).blockIds).toEqual([
      0, 1, 2,
    ]);
    expect((await c.abort("z")).code).toBe("ERR_UNKNOWN_TRANSFER");
    expect((await b.abort("z")).code).toBe("ERR_NOT_OWNER");
    expect(b.kinds().filter((k) => k !== "registered" && k !== "refused")).toEqual([]);
  }, 60_000);

  it("a simulated engine whose connection drops (sidecar alive) reconnects, takes its link back at the same epoch, and gets the KvReady sent meanwhile", async () => {
    // A 64 KiB cap: a 300 KiB frame from the engine makes ZeroMQ drop its connection.
    const pair = await startPair({
      mode: "push",
      sidecarArgs: ["--engine-max-frame-bytes", String(64 << 10)],
    });
    cleanup.push(() => pair.close());
    const { p, d } = pair;
    await goodTransfer(p, d, "before-drop");
    const epoch = d.ready.epoch;
    const id = "across-the-drop";
    const pre = p.engine.prefill(id, 40, 1500, WAIT);
    await d.engine.expect({ transferId: id, tokens: 40, source: p.sideChannel }, WAIT);
    await d.engine.call("send-raw", { hex: Buffer.alloc(300 << 10, 1).toString("hex") });
    await d.engine.waitEvent((e) => e.event === "link" && e.state === "disconnected", WAIT);
    const back = await d.engine.waitEvent((e) => e.event === "registered" && e.ok === true, WAIT);
    expect(back).toMatchObject({ restarted: false, epoch });
    await pre;
    expect((await d.engineEvent(id, "verified", WAIT)).ok).toBe(true);
    expect((await p.engineEvent(id, "released", WAIT)).reason).toBe("TRANSFERRED");
    const s = await d.allBlocksFree(WAIT);
    expect(s).toMatchObject({ restarts: 0, recovered: 0, epoch, badReleases: 0 });
    await goodTransfer(p, d, "after-drop");
    expect(d.engine.events.filter((e) => e.event === "unexpected")).toEqual([]);
  }, 60_000);

  it("the ipc socket file is created owner-only (0600), even under umask 000", async () => {
    const dir = shmDir();
    cleanup.push(() => rmSync(dir, { recursive: true, force: true }));
    const path = join(dir, "open.sock");
    const sidecar = new SidecarProcess(
      [
        "--engine-id",
        uniqueId("mode"),
        "--role",
        "prefill",
        "--engine-socket",
        `ipc://${path}`,
        "--log-level",
        "warn",
      ],
      // sh runs node with umask 000: without the sidecar's care the socket would be 0777.
      { prefix: ["sh", "-c", 'umask 000 && exec "$0" "$@"'] },
    );
    cleanup.push(() => sidecar.close(5000));
    await sidecar.ready;
    const st = statSync(path);
    expect(st.isSocket()).toBe(true);
    expect((st.mode & 0o777).toString(8)).toBe("600");
    expect(st.uid).toBe(process.getuid!());

    // The same for a sidecar started the usual way (the fixture's default umask).
    const pair = await startPair();
    cleanup.push(() => pair.close());
    for (const node of [pair.p, pair.d]) {
      const m = statSync(node.socket.replace(/^ipc:\/\//, "")).mode & 0o777;
      expect(m.toString(8)).toBe("600");
    }
  }, 60_000);

  it("an oversized frame is dropped by ZeroMQ before it is buffered; the sidecar's memory stays flat and it still serves its engine", async () => {
    const cap = 2 << 20; // 2 MiB: answered up to 8 MiB, dropped by libzmq above
    const pair = await startPair({ sidecarArgs: ["--engine-max-frame-bytes", String(cap)] });
    cleanup.push(() => pair.close());
    const { p, d } = pair;
    await goodTransfer(p, d, "before-big");

    // Just over the cap (below 4x): read, answered ERR_TOO_LARGE to the sender.
    const near = new RawEngine(p.socket);
    cleanup.push(() => near.close());
    await near.link.sendRaw(Buffer.alloc(cap + 1024, 1));
    const tooLarge = await near.next("refused", 0);
    expect(tooLarge.code).toBe("ERR_TOO_LARGE");

    // Far over: four 64 MiB frames from a plain ZeroMQ socket with no cap of its own.
    const pid = p.sidecarPid;
    const before = rssKiB(pid);
    const big = new Dealer({ linger: 0, sendTimeout: 2000 });
    cleanup.push(() => big.close());
    big.connect(p.socket);
    const frame = Buffer.alloc(64 << 20, 7);
    let peak = before;
    for (let i = 0; i < 4; i++) {
      await big.send(frame).catch(() => undefined);
      for (let j = 0; j < 5; j++) {
        await sleep(100);
        peak = Math.max(peak, rssKiB(pid));
      }
    }
    const grewMiB = (peak - before) / 1024;
    console.log(
      `[oversized] sidecar VmRSS ${Math.round(before / 1024)} MiB before, peak ${Math.round(peak / 1024)} MiB while 4 x 64 MiB frames came (cap ${cap >> 20} MiB)`,
    );
    expect(grewMiB).toBeLessThan(32);

    await goodTransfer(p, d, "after-big");
    await goodTransfer(p, d, "after-big-pull", { pull: true });
    for (const node of [p, d]) await node.allBlocksFree(WAIT);
  }, 90_000);
});
