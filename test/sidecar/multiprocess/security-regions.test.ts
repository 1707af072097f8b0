// Security, issue 16 cases 2, 10, 11 and 12, against real sidecar processes (dist/): KV regions
// confined to --kv-dir (regular files owned by the sidecar's uid, no symbolic link at any step,
// size caps, no pre-fault unless asked), overlapping block claims of live transfers refused, and
// a malformed --tls-ca refused at start-up. Each refusal costs only that message: the same sidecar
// then registers a good engine and moves KV byte-exact. `npm run build` first.
import { execFileSync } from "node:child_process";
import {
  chownSync,
  mkdirSync,
  mkdtempSync,
  rmSync,
  symlinkSync,
  truncateSync,
  writeFileSync,
} from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { pino } from "pino";
import { afterAll, beforeAll, describe, expect, it } from "vitest";

import { EngineLinkClient, engineMessage, kvCacheRegistration } from "../../../src/engine/link.js";
import { type Registered } from "../../../src/gen/kvxfer/v1/engine_pb.js";
import type { KvLayout } from "../../../src/plan/index.js";
import { byteSize, kvDirectory } from "../../../src/cli/sidecar-options.js";
import { type PeerCredentialFiles, Pki } from "../../../sim/pki.js";
import { SidecarProcess } from "../../../sim/sidecar-process.js";
import {
  HeldNode,
  KvNode,
  goodTransfer,
  oneLayerLayout,
  rssKiB,
  sleep,
  uniqueId,
} from "./fixtures.js";
import { until } from "../../until.js";

const WAIT = 10_000;
const MiB = 1 << 20;
const log = pino({ level: "silent" });

/** Sends one RegisterKvCache (one rank, `paths[g]` for region g) and returns the answer. */
async function register(
  socket: string,
  engineId: string,
  layout: KvLayout,
  paths: readonly string[],
): Promise<Registered> {
  let answer: Registered | undefined;
  const client = new EngineLinkClient({
    endpoint: socket,
    logger: log,
    onMessage: (m) => {
      if (m.msg.case === "registered") answer = m.msg.value;
    },
  });
  try {
    await client.send(engineMessage("register", kvCacheRegistration(engineId, layout, [paths])));
    await until(() => answer !== undefined, WAIT, `the answer to a registration of ${paths[0]}`);
    return answer!;
  } finally {
    await client.close();
  }
}

/** A private folder under /dev/shm (the default --kv-dir's file system). */
function shmFolder(prefix: string): string {
  return mkdtempSync(join("/dev/shm", `${prefix}-`));
}

/** A sparse file of `bytes`. */
function sparseFile(path: string, bytes: number): string {
  writeFileSync(path, "");
  truncateSync(path, bytes);
  return path;
}

describe("confined KV regions (--kv-dir, caps): each refusal costs only that registration", () => {
  const small = oneLayerLayout(16); // 1 MiB
  let kvDir: string;
  let outside: string;
  let good: string;
  let d: KvNode | undefined;
  /** P's sidecar: its engine starts once every refusal was tried on it. */
  let held: HeldNode;

  beforeAll(async () => {
    kvDir = shmFolder("kvxfer-regions");
    outside = mkdtempSync(join(tmpdir(), "kvxfer-regions-outside-"));
    good = sparseFile(join(kvDir, "good.kv"), small.regionBytes[0]!);
    held = await HeldNode.start({
      role: "prefill",
      engineId: uniqueId("p"),
      mode: "auto",
      sidecarArgs: ["--kv-dir", kvDir, "--max-registration-bytes", "8M", "--max-kv-bytes", "4MiB"],
      engine: { shmDir: kvDir },
    });
    d = await KvNode.start({ role: "decode", mode: "auto" });
  }, 60_000);

  afterAll(async () => {
    await held?.close();
    await d?.close();
    rmSync(kvDir, { recursive: true, force: true });
    rmSync(outside, { recursive: true, force: true });
  }, 30_000);

  /** Registers `path` as the one region; expects a refusal with `code`, naming the path. */
  async function refused(path: string, code: string, layout: KvLayout = small): Promise<string> {
    const ans = await register(held.socket, held.engineId, layout, [path]);
    expect(ans.ok, `registration of ${path}`).toBe(false);
    expect(ans.error.startsWith(`${code}:`), ans.error).toBe(true);
    // The sidecar lives on, and the operator sees the refusal.
    const status = await held.grpc.getStatus();
    expect(status.lastErrors.join("\n")).toContain(code);
    return ans.error;
  }

  it("/etc/passwd is refused (outside the KV directory)", async () => {
    const err = await refused("/etc/passwd", "ERR_REGION_OUTSIDE");
    expect(err).toContain("'/etc/passwd'");
    expect(err).toContain(kvDir);
  });

  it("a file outside the directory is refused, also when reached with '..'", async () => {
    const f = sparseFile(join(outside, "outside.kv"), small.regionBytes[0]!);
    expect(await refused(f, "ERR_REGION_OUTSIDE")).toContain(f);
    expect(await refused(`${kvDir}/../../etc/passwd`, "ERR_REGION_OUTSIDE")).toContain("'..'");
    // Even a '..' that would land back inside is refused: paths are taken as written.
    expect(await refused(`${kvDir}/sub/../good.kv`, "ERR_REGION_OUTSIDE")).toContain("'..'");
    expect(await refused("relative/good.kv", "ERR_REGION_OUTSIDE")).toContain("absolute");
  });

  it("a symbolic link under the KV directory is refused, even to a good file", async () => {
    const link = join(kvDir, "link.kv");
    symlinkSync(good, link);
    expect(await refused(link, "ERR_REGION_SYMLINK")).toContain(link);
    const toPasswd = join(kvDir, "passwd.kv");
    symlinkSync("/etc/passwd", toPasswd);
    await refused(toPasswd, "ERR_REGION_SYMLINK");
  });

  it("a symbolic link in a parent component is refused", async () => {
    mkdirSync(join(kvDir, "real"));
    sparseFile(join(kvDir, "real", "r.kv"), small.regionBytes[0]!);
    symlinkSync(join(kvDir, "real"), join(kvDir, "alias"));
    const err = await refused(join(kvDir, "alias", "r.kv"), "ERR_REGION_SYMLINK");
    expect(err).toContain(join(kvDir, "alias"));
    // A link to a folder outside: the same.
    symlinkSync(outside, join(kvDir, "out"));
    sparseFile(join(outside, "o.kv"), small.regionBytes[0]!);
    await refused(join(kvDir, "out", "o.kv"), "ERR_REGION_SYMLINK");
  });

  it("a file owned by another user is refused (and one in a folder of another user)", async () => {
    expect(process.getuid?.()).toBe(0); // this test runs as root: it can make nobody's files
    const theirs = sparseFile(join(kvDir, "nobody.kv"), small.regionBytes[0]!);
    chownSync(theirs, 65534, 65534);
    const err = await refused(theirs, "ERR_REGION_OWNER");
    expect(err).toContain("uid 65534");
    mkdirSync(join(kvDir, "nobody-dir"));
    sparseFile(join(kvDir, "nobody-dir", "mine.kv"), small.regionBytes[0]!);
    chownSync(join(kvDir, "nobody-dir"), 65534, 65534);
    await refused(join(kvDir, "nobody-dir", "mine.kv"), "ERR_REGION_OWNER");
  });

  it("a FIFO, a folder and a file with a second hard link are refused (not regular files)", async () => {
    const fifo = join(kvDir, "fifo.kv");
    execFileSync("mkfifo", [fifo]);
    expect(await refused(fifo, "ERR_REGION_NOT_REGULAR")).toContain("FIFO");
    mkdirSync(join(kvDir, "folder.kv"));
    expect(await refused(join(kvDir, "folder.kv"), "ERR_REGION_NOT_REGULAR")).toContain(
      "directory",
    );
    const twice = sparseFile(join(kvDir, "twice.kv"), small.regionBytes[0]!);
    execFileSync("ln", [twice, join(kvDir, "twice-again.kv")]);
    expect(await refused(twice, "ERR_REGION_NOT_REGULAR")).toContain("hard links");
  });

  it("a registration above --max-registration-bytes is refused before any file is opened", async () => {
    // 16 MiB of regions, over the 8 MiB cap; the path need not even exist.
    const err = await refused(
      join(kvDir, "never-made.kv"),
      "ERR_REGION_TOO_LARGE",
      oneLayerLayout(256),
    );
    expect(err).toContain("--max-registration-bytes");
  });

  it("a registration above the sidecar's --max-kv-bytes is refused", async () => {
    // 6 MiB: under the 8 MiB per-registration cap, over the 4 MiB per-sidecar one.
    const big = oneLayerLayout(96);
    const f = sparseFile(join(kvDir, "six.kv"), big.regionBytes[0]!);
    expect(await refused(f, "ERR_REGION_TOO_LARGE", big)).toContain("--max-kv-bytes");
  });

  it("after every refusal the same sidecar registers a good engine and moves KV byte-exact", async () => {
    const p = await held.start();
    expect(p.engine.ready!.files.flat().every((f) => f.startsWith(kvDir + "/"))).toBe(true);
    const v = await goodTransfer(p, d!, "regions-good");
    expect(v.ok).toBe(true);
    await goodTransfer(p, d!, "regions-good-pull", { pull: true });
    await p.allBlocksFree();
    await d!.allBlocksFree();
    // Registered now: a second registration, even a good one, changes nothing.
    const again = await register(held.socket, held.engineId, small, [good]);
    expect(again.error).toMatch(/^ERR_ENGINE_LINK_TAKEN/);
  }, 60_000);
});

describe("KV regions are not pre-faulted unless --prefault true", () => {
  const dirs: string[] = [];
  const sidecars: SidecarProcess[] = [];
  afterAll(async () => {
    await Promise.all(sidecars.map((s) => s.close(5000)));
    for (const d of dirs) rmSync(d, { recursive: true, force: true });
  }, 30_000);

  /** Starts a sidecar, registers one sparse file of `blocks` x 64 KiB; returns VmRSS growth, KiB. */
  async function rssGrowth(blocks: number, extra: string[]): Promise<number> {
    const dir = shmFolder("kvxfer-rss");
    dirs.push(dir);
    const engineId = uniqueId("rss");
    const socket = `ipc:///tmp/kvxfer-test-${engineId}.sock`;
    const sc = new SidecarProcess([
      "--engine-id",
      engineId,
      "--engine-socket",
      socket,
      "--transports",
      "shm,self",
      "--kv-dir",
      dir,
      "--log-level",
      "warn",
      ...extra,
    ]);
    sidecars.push(sc);
    await sc.ready;
    const layout = oneLayerLayout(blocks);
    const file = sparseFile(join(dir, "big.kv"), layout.regionBytes[0]!);
    await sleep(300); // let start-up allocations settle
    const before = rssKiB(sc.child.pid!);
    const ans = await register(socket, engineId, layout, [file]);
    expect(ans.ok, ans.error).toBe(true);
    await sleep(300);
    const after = rssKiB(sc.child.pid!);
    await sc.close(5000);
    rmSync(socket.replace(/^ipc:\/\//, ""), { force: true });
    rmSync(file, { force: true });
    return after - before;
  }

  it("a 1 GiB registration leaves the sidecar's resident memory nearly unchanged", async () => {
    const grew = await rssGrowth(16384, []);
    // A UCX agent costs some MiB; a pre-faulted GiB would be 1,048,576 KiB.
    expect(grew, `VmRSS grew ${grew} KiB`).toBeLessThan(96 * 1024);
  }, 60_000);

  it("with --prefault true a 256 MiB registration is resident at once", async () => {
    const grew = await rssGrowth(4096, ["--prefault", "true"]);
    expect(grew, `VmRSS grew ${grew} KiB`).toBeGreaterThan(200 * 1024);
  }, 60_000);
});

describe("overlapping block claims of live transfers", () => {
  let p: KvNode | undefined;
  let d: KvNode | undefined;

  beforeAll(async () => {
    // Three blocks per engine: a 48-token transfer takes all of them, so the next one must
    // reuse the very same blocks.
    [p, d] = await Promise.all([
      KvNode.start({
        role: "prefill",
        mode: "auto",
        sidecarArgs: ["--exclusive-prefill-blocks", "true"],
        engine: { blocks: 3 },
      }),
      KvNode.start({ role: "decode", mode: "auto", engine: { blocks: 3 } }),
    ]);
  }, 60_000);

  afterAll(async () => {
    await Promise.all([p?.close(), d?.close()]);
  }, 30_000);

  it("P: a PrefillDone over a live transfer's blocks is refused, naming it; accepted once it ends", async () => {
    const P = p!;
    const D = d!;
    const { blockIds } = await P.engine.prefill("p-first", 48, 0);
    expect(blockIds).toHaveLength(3);
    const n = P.engine.events.length;
    await P.engine.call("send", {
      message: {
        prefillDone: { transferId: "p-intruder", blockIds: [blockIds[1]], numTokens: 16 },
      },
    });
    const r = await P.refusal("p-intruder", n);
    expect(r.code).toBe("ERR_BLOCKS_IN_USE");
    expect(String(r.message)).toContain("'p-first'");
    // No ReleaseBlocks for the refused message: the blocks are p-first's.
    await P.barrier("intruder");
    expect(P.engine.events.some((e) => e.event === "bad-release")).toBe(false);
    // The first transfer is unaffected: D gets its KV byte-exact (pull, with P's block ids).
    await D.engine.expect({
      transferId: "p-first",
      tokens: 48,
      source: P.sideChannel,
      sourceBlockIds: blockIds,
    });
    expect((await D.engineEvent("p-first", "verified", WAIT)).ok).toBe(true);
    expect((await P.engineEvent("p-first", "released", WAIT)).reason).toBe("TRANSFERRED");
    await D.allBlocksFree();
    // Once it ended, the same blocks go to the next transfer.
    const second = await P.engine.prefill("p-second", 48, 0);
    expect([...second.blockIds].sort()).toEqual([...blockIds].sort());
    await D.engine.expect({
      transferId: "p-second",
      tokens: 48,
      source: P.sideChannel,
      sourceBlockIds: second.blockIds,
    });
    expect((await D.engineEvent("p-second", "verified", WAIT)).ok).toBe(true);
    expect((await P.engineEvent("p-second", "released", WAIT)).reason).toBe("TRANSFERRED");
    const ps = await P.allBlocksFree();
    expect(ps.badReleases).toBe(0);
    expect(P.terminal("p-first")).toHaveLength(1);
    expect(P.terminal("p-intruder")).toHaveLength(0);
  }, 60_000);

  it("D: an ExpectKv writing into a live transfer's blocks is refused, naming it; accepted once it ends", async () => {
    const P = p!;
    const D = d!;
    // Push: D registers with P first, then P prefills; meanwhile D holds its three blocks.
    const { blockIds } = await D.engine.expect({
      transferId: "d-first",
      tokens: 48,
      source: P.sideChannel,
    });
    const n = D.engine.events.length;
    await D.engine.call("send", {
      message: {
        expectKv: {
          transferId: "d-intruder",
          source: P.sideChannel,
          blockIds: [blockIds[2]],
          numTokens: 16,
        },
      },
    });
    const r = await D.refusal("d-intruder", n);
    expect(r.code).toBe("ERR_BLOCKS_IN_USE");
    expect(String(r.message)).toContain("'d-first'");
    await P.engine.prefill("d-first", 48, 0);
    expect((await D.engineEvent("d-first", "verified", WAIT)).ok).toBe(true);
    expect((await P.engineEvent("d-first", "released", WAIT)).reason).toBe("TRANSFERRED");
    await D.allBlocksFree();
    // The same blocks, now free, serve the next transfer.
    const v = await goodTransfer(P, D, "d-second", { tokens: 48 });
    expect(v.ok).toBe(true);
    expect(D.terminal("d-first")).toHaveLength(1);
    expect(D.terminal("d-intruder")).toHaveLength(0);
    const ds = await D.allBlocksFree();
    expect(ds.badReleases).toBe(0);
    expect(ds.mismatches).toBe(0);
  }, 60_000);
});

describe("P's blocks may be shared by default (--exclusive-prefill-blocks false)", () => {
  let p: KvNode | undefined;
  afterAll(async () => {
    await p?.close();
  }, 30_000);

  it("a PrefillDone listing a live transfer's blocks is accepted: vLLM's prefix cache shares read-only blocks", async () => {
    p = await KvNode.start({ role: "prefill", mode: "auto" });
    const { blockIds } = await p.engine.prefill("shared-first", 32, 0);
    const n = p.engine.events.length;
    // Another request whose cached prefix is the same first block (as vLLM would list it).
    await p.engine.call("send", {
      message: {
        prefillDone: { transferId: "shared-second", blockIds: [blockIds[0]], numTokens: 16 },
      },
    });
    await until(
      async () => (await p!.client.listTransfers({ states: ["HELD"] })).total === 2,
      WAIT,
      "both transfers held on P",
    );
    expect(p.engine.events.slice(n).filter((e) => e.event === "refused")).toEqual([]);
    // Both end on their own (aborted by the engine); each releases its own blocks once.
    await p.engine.call("abort", { transferId: "shared-first" });
    await p.engine.call("send", { message: { abort: { transferId: "shared-second" } } });
    await p.waitEvent((e) => e.transferId === "shared-first" && e.kind === "ABORTED", WAIT);
    await p.waitEvent((e) => e.transferId === "shared-second" && e.kind === "ABORTED", WAIT);
    expect((await p.engineEvent("shared-first", "released", WAIT)).reason).toBe("ABORTED");
    await p.allBlocksFree();
  }, 60_000);
});

describe("a malformed --tls-ca", () => {
  let dir = "";
  let ca: Pki | undefined;
  let serverFiles: PeerCredentialFiles;
  beforeAll(() => {
    dir = mkdtempSync(join(tmpdir(), "kvxfer-bad-ca-"));
    ca = new Pki("kvxfer test CA");
    serverFiles = ca.issue("localhost", "server");
    writeFileSync(join(dir, "garbage.pem"), "this is not a certificate\n");
    writeFileSync(
      join(dir, "broken.pem"),
      "-----BEGIN CERTIFICATE-----\nbm90IGEgY2VydGlmaWNhdGU=\n-----END CERTIFICATE-----\n",
    );
  });
  afterAll(() => {
    if (dir) rmSync(dir, { recursive: true, force: true });
    ca?.close();
  });

  for (const [name, why] of [
    ["garbage.pem", "holds no PEM certificate"],
    ["broken.pem", "does not parse"],
  ] as const) {
    it(`stops the sidecar at start-up with ERR_CONFIG naming the flag and file (${name})`, async () => {
      const ca = join(dir, name);
      const sc = new SidecarProcess([
        "--engine-id",
        uniqueId("ca"),
        "--engine-socket",
        `ipc:///tmp/kvxfer-test-${uniqueId("ca")}.sock`,
        "--tls-cert",
        serverFiles.cert,
        "--tls-key",
        serverFiles.key,
        "--tls-ca",
        ca,
      ]);
      await expect(sc.ready).rejects.toThrow(/before ready/);
      const end = await sc.close(5000);
      expect(end.code).not.toBe(0);
      expect(end.code).not.toBeNull();
      expect(sc.stderrTail).toContain("ERR_CONFIG");
      expect(sc.stderrTail).toContain(`--tls-ca '${ca}'`);
      expect(sc.stderrTail).toContain(why);
    }, 30_000);
  }
});

describe("region settings", () => {
  it("byte counts take binary suffixes; empty means the default; anything else is ERR_CONFIG", () => {
    expect(byteSize("max-kv-bytes", "64G", 1)).toBe(64 * 2 ** 30);
    expect(byteSize("max-kv-bytes", "512MiB", 1)).toBe(512 * MiB);
    expect(byteSize("max-kv-bytes", "4096", 1)).toBe(4096);
    expect(byteSize("max-kv-bytes", "", 7)).toBe(7);
    for (const bad of ["0", "-1", "1.5G", "lots", "1P"])
      expect(() => byteSize("max-kv-bytes", bad, 1), bad).toThrow(/--max-kv-bytes/);
  });

  it("--kv-dir must be an existing directory", () => {
    expect(kvDirectory("/dev/shm/")).toBe("/dev/shm");
    expect(() => kvDirectory("/etc/passwd")).toThrow(/--kv-dir '\/etc\/passwd' is not a directory/);
    expect(() => kvDirectory("/no/such/kv/dir")).toThrow(/--kv-dir/);
    expect(() => kvDirectory("")).toThrow(/--kv-dir/);
  });
});
