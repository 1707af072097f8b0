// The simulated engine behind vLLM's command line (dist/sim/vllm-main.js, the chart's engine where
// no GPU runs vLLM) as two processes next to two real sidecars on loopback: what a router asks of
// a vLLM engine with kvxfer's connector, in pull (P's answer relayed to D) and in push (both at
// once, D finding P's sidecar through P's bootstrap URL), every byte checked on D; a D whose
// prompt is not P's computes it itself; SIGTERM drains and removes the KV files; a bad command
// line is refused by name. Runs the compiled code: `npm run build` first.
import { type ChildProcess, spawn } from "node:child_process";
import { mkdtempSync, readdirSync, rmSync } from "node:fs";
import { resolve } from "node:path";

import { afterAll, beforeAll, describe, expect, it } from "vitest";

import { SidecarProcess, type SidecarReady } from "../../sim/sidecar-process.js";
import { runNode } from "../run-node.js";
import { until } from "../until.js";

const MAIN = resolve(import.meta.dirname, "../../dist/sim/vllm-main.js");
/** 4 layers x K,V x 8 heads x 128 x 2 bytes: the simulated engine's default shape. */
const BYTES_PER_TOKEN = 4 * 2 * 8 * 128 * 2;

interface Engine {
  child: ChildProcess;
  url: string;
  stderr: string[];
}

const shm = mkdtempSync("/dev/shm/kvxfer-vllm-sim-");
const sidecars: SidecarProcess[] = [];
const engines: Engine[] = [];
const ready: Record<"p" | "d", SidecarReady> = {} as never;
const url: Record<"p" | "d", string> = {} as never;
const id = (role: string): string => `vsim-${role}-${process.pid}`;

async function startEngine(engineId: string, extra: Record<string, unknown> = {}): Promise<Engine> {
  const cfg = {
    kv_connector: "KvxferConnector",
    engine_id: engineId,
    kv_connector_extra_config: {
      engine_socket: `ipc:///tmp/kvxfer-${engineId}.sock`,
      shm_dir: shm,
      register_timeout_s: 20,
      ...extra,
    },
  };
  const child = spawn(
    process.execPath,
    [
      MAIN,
      "--model",
      "sim",
      "--host",
      "127.0.0.1",
      "--port",
      "0",
      "--kv-transfer-config",
      JSON.stringify(cfg),
    ],
    { stdio: ["ignore", "ignore", "pipe"] },
  );
  const e: Engine = { child, url: "", stderr: [] };
  engines.push(e);
  child.stderr!.setEncoding("utf8").on("data", (s: string) => e.stderr.push(s));
  await until(
    () => {
      const m = /"address":"(127\.0\.0\.1:\d+)"/.exec(e.stderr.join(""));
      if (m) e.url = `http://${m[1]}`;
      return e.url !== "" && /registered with the sidecar/.test(e.stderr.join(""));
    },
    20_000,
    () => `${engineId} registered (stderr: ${e.stderr.join("").slice(-500)})`,
    50,
  );
  return e;
}

async function complete(
  base: string,
  prompt: number[],
  maxTokens: number,
  params?: Record<string, unknown>,
): Promise<Record<string, any>> {
  const res = await fetch(`${base}/v1/completions`, {
    method: "POST",
    headers: { "content-type": "application/json" },
    body: JSON.stringify({
      model: "sim",
      prompt,
      max_tokens: maxTokens,
      kv_transfer_params: params,
    }),
    signal: AbortSignal.timeout(20_000),
  });
  const body = (await res.json()) as Record<string, any>;
  expect(res.status, JSON.stringify(body)).toBe(200);
  return body;
}

const tokens = (n: number, seed: number): number[] =>
  Array.from({ length: n }, (_, i) => 1 + ((i * 7919 + seed * 104729) % 31_000));

beforeAll(async () => {
  await Promise.all(
    (["p", "d"] as const).map(async (role) => {
      const sc = new SidecarProcess([
        "--engine-id",
        id(role),
        "--role",
        role === "p" ? "prefill" : "decode",
        "--engine-socket",
        `ipc:///tmp/kvxfer-${id(role)}.sock`,
        "--listen",
        "127.0.0.1:0",
        "--kv-dir",
        shm,
        "--transports",
        "tcp,self",
        ...(role === "p" ? ["--bootstrap", "127.0.0.1:0"] : []),
      ]);
      sidecars.push(sc);
      ready[role] = await sc.ready;
      url[role] = (await startEngine(id(role))).url;
    }),
  );
}, 60_000);

afterAll(async () => {
  for (const e of engines) if (e.child.exitCode === null) e.child.kill("SIGTERM");
  await Promise.all(
    engines.map((e) =>
      e.child.exitCode !== null ? undefined : new Promise((r) => e.child.once("exit", r)),
    ),
  );
  await Promise.all(sidecars.map((s) => s.close()));
  rmSync(shm, { recursive: true, force: true });
}, 60_000);

describe("sim-vllm", () => {
  it("pull: P answers kv_transfer_params, D reads P's blocks and checks every byte", async () => {
    for (const n of [5, 16, 70]) {
      const prompt = tokens(n, n);
      const alone = await complete(url.p, prompt, 6);
      expect(alone["kvxfer"]).toMatchObject({ role: "local", kv: "local" });
      const p = await complete(url.p, prompt, 1, { do_remote_decode: true });
      expect(p["kvxfer"]).toMatchObject({ role: "prefill", kv: "sent" });
      const params = p["kv_transfer_params"] as Record<string, unknown>;
      expect(params).toMatchObject({
        do_remote_prefill: true,
        remote_engine_id: id("p"),
        remote_host: "127.0.0.1",
        remote_num_tokens: n,
        transfer_mode: "pull",
      });
      expect(`${String(params["remote_host"])}:${String(params["remote_port"])}`).toBe(
        ready.p.sideChannel,
      );
      const d = await complete(url.d, prompt, 6, params);
      expect(d["kvxfer"]).toMatchObject({
        role: "decode",
        kv: "received",
        checkedBytes: n * BYTES_PER_TOKEN,
        mismatches: 0,
      });
      expect(d["choices"][0]["token_ids"]).toEqual(alone["choices"][0]["token_ids"]);
    }
  }, 60_000);

  it("push through P's bootstrap URL: both at once, P writes into D's blocks", async () => {
    const prompt = tokens(100, 3);
    const tid = `xfer-${process.pid}`;
    const [d, p] = await Promise.all([
      complete(url.d, prompt, 4, {
        do_remote_prefill: true,
        transfer_id: tid,
        remote_bootstrap_addr: `http://${ready.p.bootstrap}`,
        remote_engine_id: id("p"),
      }),
      complete(url.p, prompt, 1, { do_remote_decode: true, transfer_id: tid }),
    ]);
    expect(p["kvxfer"]).toMatchObject({ kv: "sent", transferId: tid });
    expect(d["kvxfer"]).toMatchObject({
      kv: "received",
      transferId: tid,
      checkedBytes: 100 * BYTES_PER_TOKEN,
    });
    expect(d["choices"][0]["token_ids"]).toEqual(
      (await complete(url.d, prompt, 4))["choices"][0]["token_ids"],
    );
  }, 60_000);

  it("a D whose prompt is not P's computes it itself, and answers right", async () => {
    const p = await complete(url.p, tokens(40, 1), 1, { do_remote_decode: true });
    const other = tokens(40, 2);
    const d = await complete(url.d, other, 3, p["kv_transfer_params"] as Record<string, unknown>);
    expect(d["kvxfer"]).toMatchObject({ kv: "recomputed" });
    expect(String(d["kvxfer"]["reason"])).toMatch(/^ERR_PROMPT_MISMATCH/);
    expect(d["choices"][0]["token_ids"]).toEqual(
      (await complete(url.p, other, 3))["choices"][0]["token_ids"],
    );
    // P's blocks for the transfer nobody read come back when the sidecar's lease ends; D's at once.
    const stats = (await (await fetch(`${url.d}/kvxfer/stats`)).json()) as Record<string, number>;
    expect(stats["freeBlocks"]).toBe(stats["totalBlocks"]);
  }, 60_000);

  it("refuses a command line it cannot serve, naming what is wrong", async () => {
    const bad = await runNode(
      [MAIN, "--model", "m", "--kv-transfer-config", '{"kv_connector":"NixlConnector"}'],
      process.env,
      10_000,
    );
    expect(bad.status).toBe(2);
    expect(bad.stderr).toContain('kv_connector must be KvxferConnector, got "NixlConnector"');
    const unknown = await runNode(
      [MAIN, "--model", "m", "--gpu-memory-utilization", "0.9"],
      process.env,
      10_000,
    );
    expect(unknown.status).toBe(2);
    expect(unknown.stderr).toContain("--gpu-memory-utilization");
  }, 30_000);

  it("SIGTERM: health 503 at once, then it exits 0 and its KV files are gone", async () => {
    const e = engines.find((x) => x.url === url.d)!;
    const mine = (): string[] => readdirSync(shm).filter((f) => f.startsWith(`kvxfer-${id("d")}-`));
    expect(mine().length).toBeGreaterThan(0);
    e.child.kill("SIGTERM");
    await until(
      async () => (await fetch(`${url.d}/health`)).status === 503,
      5000,
      "health 503",
      20,
    );
    const code = await new Promise<number | null>((r) => e.child.once("exit", (c) => r(c)));
    expect(code).toBe(0);
    expect(mine()).toEqual([]);
  }, 30_000);
});
