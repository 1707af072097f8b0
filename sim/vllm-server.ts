/**
 * The simulated engine behind vLLM's command line and HTTP API: what the Helm chart's engine
 * container runs where no GPU runs vLLM (the local cluster, the pod test). It answers what a
 * router asks of a vLLM engine with kvxfer's connector, and moves the KV through the sidecar
 * beside it with a `SimEngine` (engine.ts), so every transfer is a real one between sidecars:
 *
 * - `POST /v1/completions` with `kv_transfer_params.do_remote_decode` (P): "prefills" (the
 *   transfer's KV pattern into fresh blocks, after a simulated compute), sends `PrefillDone`,
 *   answers one token and `kv_transfer_params` for D, as the connector does;
 * - with `do_remote_prefill` (D): sends `ExpectKv` (pull with P's block ids, push without), waits
 *   for the sidecar, checks every byte of the KV that landed (`verified`), then "decodes"; a
 *   transfer that failed is computed here instead (vLLM's `kv_load_failure_policy: recompute`);
 * - without either: computes alone.
 *
 * The output tokens are a function of the prompt alone, so one engine's answer is the reference
 * for any P/D pair. Each answer carries a `kvxfer` object saying what happened to the KV (sent,
 * received and verified with its byte count, recomputed and why). `/health` is 200 once the
 * sidecar accepted the KV cache, 503 while stopping; `/metrics` counts outcomes; `/kvxfer/stats`
 * is the engine's block pool.
 *
 * Prompts are token ids (a list of integers), or text, whose UTF-8 bytes are the token ids.
 */
import { createServer, type IncomingMessage, type Server, type ServerResponse } from "node:http";
import { createHash, randomUUID } from "node:crypto";
import { type AddressInfo } from "node:net";

import { type Logger } from "pino";

import { kvLayout } from "../src/plan/index.js";
import { SimEngine } from "./engine.js";
import { type SimEngineConfig } from "./engine-input.js";
import { type SimVllmConfig } from "./vllm-args.js";
import {
  BadParams,
  bindToken,
  type Params,
  parseRemoteDecode,
  parseRemotePrefill,
  prefillAnswer,
  promptDigest,
  wantsRemoteDecode,
  wantsRemotePrefill,
} from "./vllm-params.js";

const MAX_BODY_BYTES = 16 << 20;
const VOCAB = 32_000;
/** Between two registrations the sidecar refused (its old engine not yet provably gone). */
const REGISTER_RETRY_MS = 500;
/** One registration attempt waits at most this long for the sidecar's answer. */
const REGISTER_ATTEMPT_MS = 10_000;
const BOOTSTRAP_TTL_MS = 5_000;

type Outcome = "local" | "sent" | "received" | "recomputed";

/** What one completion did with its KV (the answer's `kvxfer` object). */
interface KvReport {
  role: "prefill" | "decode" | "local";
  kv: Outcome;
  transferId?: string;
  checkedBytes?: number;
  mismatches?: number;
  reason?: string;
}

class HttpError extends Error {
  constructor(
    readonly status: number,
    message: string,
  ) {
    super(message);
  }
}

const sleep = (ms: number): Promise<void> =>
  ms > 0 ? new Promise((r) => setTimeout(r, ms)) : Promise.resolve();

/** The output of a prompt: `n` token ids from its digest (every engine answers the same). */
export function outputTokens(prompt: readonly number[], n: number): number[] {
  const seed = promptDigest(prompt);
  const out: number[] = [];
  for (let i = 0; i < n; i++)
    out.push(createHash("sha256").update(`${seed}:${i}`).digest().readUInt32LE(0) % VOCAB);
  return out;
}

export function outputText(tokens: readonly number[]): string {
  return tokens.map((t) => ` t${t}`).join("");
}

/** The prompt's token ids: a list of integers as given, or the UTF-8 bytes of a text. */
export function promptTokens(prompt: unknown): number[] {
  if (typeof prompt === "string") {
    if (prompt === "") throw new HttpError(400, "prompt must not be empty");
    return [...Buffer.from(prompt, "utf8")];
  }
  if (Array.isArray(prompt) && prompt.length === 1 && Array.isArray(prompt[0])) prompt = prompt[0];
  if (Array.isArray(prompt) && prompt.length === 1 && typeof prompt[0] === "string")
    return promptTokens(prompt[0]);
  if (
    Array.isArray(prompt) &&
    prompt.length > 0 &&
    prompt.every((t) => Number.isSafeInteger(t) && (t as number) >= 0 && (t as number) < VOCAB)
  )
    return prompt as number[];
  throw new HttpError(400, `prompt must be a text or a list of token ids below ${VOCAB}`);
}

export class SimVllmServer {
  private engine: SimEngine | undefined;
  private server: Server | undefined;
  private sideChannel = "";
  private draining = false;
  private stopped: Promise<void> | undefined;
  private inFlight = 0;
  private lastRequestAt = 0;
  /** Waiters for the engine's per-transfer events (verified, failed). */
  private readonly waiters = new Map<string, (ev: Record<string, unknown>) => void>();
  private readonly bootstrapCache = new Map<string, { until: number; answer: unknown }>();
  private readonly counts = new Map<string, number>();

  constructor(
    private readonly cfg: SimVllmConfig,
    private readonly log: Logger,
  ) {}

  get address(): string {
    const a = this.server?.address() as AddressInfo | null | undefined;
    return a ? `${a.address}:${a.port}` : "";
  }

  private count(key: string): void {
    this.counts.set(key, (this.counts.get(key) ?? 0) + 1);
  }

  private engineConfig(registerTimeoutMs: number): SimEngineConfig {
    const c = this.cfg;
    return {
      engineId: c.engineId,
      // kv_both: the router decides per request whether this engine is P or D.
      role: "both",
      socket: c.socket,
      layout: kvLayout(
        {
          numLayers: c.layers,
          mla: false,
          totalKvHeads: c.kvHeads,
          headDim: c.headDim,
          dtype: "bfloat16",
          dtypeBytes: 2,
          blockSize: c.blockSize,
          numBlocks: c.numBlocks,
          order: "HND",
          tpSize: c.tp,
          tpRank: 0,
        },
        "region-per-layer",
      ),
      scheme: "region-per-layer",
      shmDir: c.shmDir,
      kvMemory: "file",
      seed: Math.floor(Math.random() * 2 ** 31),
      registerTimeoutMs,
      sidecarLostMs: c.sidecarLostMs,
      checkAfterMs: 0,
      blockWaitMs: 30_000,
      logLevel: c.logLevel,
      // PID 1 of a container after every restart: the files need another name than the last one's.
      fileTag: `${process.pid}-${randomUUID().slice(0, 8)}`,
    };
  }

  private onEngineEvent(ev: Record<string, unknown>): void {
    const tid = ev["transferId"];
    if (typeof tid !== "string" || tid === "") return;
    if (ev["event"] === "refused") {
      // The sidecar refused the transfer's message (e.g. ERR_DRAINING while its pod stops): it
      // started nothing, so the blocks come back here at once, as the connector frees them; D
      // computes the prompt itself.
      this.count("refused");
      void this.engine?.handle({ op: "drop", transferId: tid }).catch(() => undefined);
    }
    if (
      ev["event"] === "verified" ||
      ev["event"] === "refused" ||
      (ev["event"] === "failed" && ev["known"] !== false)
    ) {
      const w = this.waiters.get(tid);
      if (w) {
        this.waiters.delete(tid);
        w(ev);
      }
    }
    if (ev["event"] === "verified" && ev["ok"] !== true) this.count("mismatch");
  }

  /**
   * Registers with the sidecar, asking again while it refuses (a sidecar that still holds a
   * previous engine's registration stops for a new epoch once that engine is provably gone: the
   * chart's --engine-lease-ms), up to register_timeout_s in all, as the connector does.
   */
  private async startEngine(): Promise<void> {
    const deadline = Date.now() + this.cfg.registerTimeoutMs;
    for (let attempt = 1; ; attempt++) {
      const left = deadline - Date.now();
      const eng = new SimEngine(
        this.engineConfig(Math.max(1000, Math.min(REGISTER_ATTEMPT_MS, left))),
        this.log,
        (ev) => this.onEngineEvent(ev),
      );
      try {
        const ready = await eng.start();
        this.engine = eng;
        this.sideChannel = this.cfg.advertise || String(ready["sideChannel"]);
        this.log.info(
          { attempt, sideChannel: this.sideChannel, socket: this.cfg.socket },
          "registered with the sidecar",
        );
        return;
      } catch (err) {
        await eng.stop();
        const code = (err as { code?: string }).code;
        const retry = code === "ERR_REGISTER_REFUSED" || code === "ERR_REGISTER_TIMEOUT";
        if (!retry || Date.now() + REGISTER_RETRY_MS >= deadline || this.draining) throw err;
        this.log.warn({ attempt, err: (err as Error).message }, "not registered yet; asking again");
        await sleep(REGISTER_RETRY_MS);
      }
    }
  }

  /** Listens at once (health 503 until registered), then registers. */
  async start(): Promise<void> {
    this.server = createServer((req, res) => void this.serve(req, res));
    this.server.keepAliveTimeout = 30_000;
    await new Promise<void>((resolve, reject) => {
      this.server!.once("error", reject);
      this.server!.listen(this.cfg.port, this.cfg.host, () => resolve());
    });
    this.log.info({ address: this.address }, "HTTP listening");
    await this.startEngine();
  }

  /**
   * SIGTERM: health goes 503 at once, requests are still answered while they come (a router
   * takes a moment to see the health), then the listener closes, the requests in flight end
   * (bounded), and the engine removes its KV files.
   */
  stop(deadlineMs = 25_000): Promise<void> {
    this.stopped ??= (async () => {
      this.draining = true;
      const end = Date.now() + deadlineMs;
      this.lastRequestAt = Date.now();
      while (Date.now() < end && Date.now() - this.lastRequestAt < this.cfg.drainMs)
        await sleep(100);
      const closed = new Promise<void>((r) => (this.server ? this.server.close(() => r()) : r()));
      this.server?.closeIdleConnections();
      while (this.inFlight > 0 && Date.now() < end) await sleep(50);
      this.server?.closeAllConnections();
      await closed;
      for (const [tid, w] of this.waiters)
        w({ event: "failed", transferId: tid, reason: "ENGINE_STOPPING" });
      this.waiters.clear();
      await this.engine?.stop();
      this.log.info({ left: this.inFlight }, "stopped");
    })();
    return this.stopped;
  }

  private async serve(req: IncomingMessage, res: ServerResponse): Promise<void> {
    const path = (req.url ?? "/").split("?")[0];
    const send = (status: number, body: unknown, type = "application/json"): void => {
      const text = typeof body === "string" ? body : JSON.stringify(body);
      res.writeHead(status, { "content-type": type, "content-length": Buffer.byteLength(text) });
      res.end(text);
    };
    try {
      if (req.method === "GET" && path === "/health") {
        send(this.engine !== undefined && !this.draining ? 200 : 503, "", "text/plain");
      } else if (req.method === "GET" && path === "/v1/models") {
        send(200, {
          object: "list",
          data: [
            {
              id: this.cfg.servedModelName,
              object: "model",
              owned_by: "kvxfer-sim",
              root: this.cfg.model,
              max_model_len: this.cfg.maxModelLen,
            },
          ],
        });
      } else if (req.method === "GET" && path === "/metrics") {
        send(200, this.metrics(), "text/plain; version=0.0.4");
      } else if (req.method === "GET" && path === "/kvxfer/stats") {
        const stats = this.engine ? await this.engine.handle({ op: "stats" }) : {};
        send(200, { ...stats, outcomes: Object.fromEntries(this.counts), draining: this.draining });
      } else if (req.method === "POST" && path === "/v1/completions") {
        this.inFlight++;
        this.lastRequestAt = Date.now();
        try {
          send(200, await this.complete(await readJson(req)));
        } finally {
          this.inFlight--;
          this.lastRequestAt = Date.now();
        }
      } else {
        send(404, {
          error: { message: `no route ${req.method} ${path}`, type: "NotFoundError", code: 404 },
        });
      }
    } catch (err) {
      const status = err instanceof HttpError ? err.status : err instanceof BadParams ? 400 : 500;
      if (status === 500) this.log.error({ err }, "request failed");
      this.count(`error_${status}`);
      if (!res.headersSent)
        send(status, {
          error: {
            message: (err as Error).message,
            type: status === 400 ? "BadRequestError" : "InternalServerError",
            code: status,
          },
        });
    }
  }

  private async complete(body: Record<string, unknown>): Promise<Record<string, unknown>> {
    if (this.engine === undefined)
      throw new HttpError(503, "the engine has not registered with its sidecar yet");
    if (body["stream"] === true)
      throw new HttpError(400, "stream is not supported by the simulated engine");
    const model = body["model"];
    if (model !== undefined && model !== this.cfg.servedModelName && model !== this.cfg.model)
      throw new HttpError(404, `the model '${String(model)}' does not exist`);
    const prompt = promptTokens(body["prompt"]);
    const maxTokens = body["max_tokens"] ?? 16;
    if (typeof maxTokens !== "number" || !Number.isInteger(maxTokens) || maxTokens < 1)
      throw new HttpError(400, "max_tokens must be a positive integer");
    if (prompt.length + maxTokens > this.cfg.maxModelLen)
      throw new HttpError(
        400,
        `the prompt (${prompt.length} tokens) and max_tokens (${maxTokens}) exceed max_model_len ${this.cfg.maxModelLen}`,
      );
    const params = body["kv_transfer_params"] as Params | undefined;
    if (
      params !== undefined &&
      (typeof params !== "object" || params === null || Array.isArray(params))
    )
      throw new HttpError(400, "kv_transfer_params must be an object");
    const requestId = `cmpl-${randomUUID()}`;
    let report: KvReport;
    let answerParams: Params | undefined;
    let n = maxTokens;
    if (wantsRemoteDecode(params)) {
      ({ report, answerParams } = await this.prefillForRemote(params!, requestId, prompt));
      n = 1;
    } else if (wantsRemotePrefill(params)) {
      report = await this.decodeFromRemote(params!, requestId, prompt);
      await sleep(this.cfg.decodeMsPerToken * maxTokens);
    } else {
      await sleep(
        (this.cfg.prefillUsPerToken * prompt.length) / 1000 + this.cfg.decodeMsPerToken * maxTokens,
      );
      report = { role: "local", kv: "local" };
    }
    this.count(report.kv);
    const tokens = outputTokens(prompt, n);
    return {
      id: requestId,
      object: "text_completion",
      created: Math.floor(Date.now() / 1000),
      model: this.cfg.servedModelName,
      choices: [
        {
          index: 0,
          text: outputText(tokens),
          token_ids: tokens,
          logprobs: null,
          finish_reason: "length",
          stop_reason: null,
        },
      ],
      usage: {
        prompt_tokens: prompt.length,
        completion_tokens: n,
        total_tokens: prompt.length + n,
      },
      ...(answerParams !== undefined ? { kv_transfer_params: answerParams } : {}),
      kvxfer: { engineId: this.cfg.engineId, ...report },
    };
  }

  private async prefillForRemote(
    params: Params,
    requestId: string,
    prompt: number[],
  ): Promise<{ report: KvReport; answerParams: Params }> {
    const p = parseRemoteDecode(params, requestId);
    const digest = promptDigest(prompt);
    const computeMs = Math.round((this.cfg.prefillUsPerToken * prompt.length) / 1000);
    const { blockIds } = (await this.engine!.handle({
      op: "prefill",
      transferId: p.transferId,
      tokens: prompt.length,
      computeMs,
      token: bindToken(p.token, digest),
    })) as { blockIds: number[] };
    return {
      report: { role: "prefill", kv: "sent", transferId: p.transferId },
      answerParams: prefillAnswer({
        transferId: p.transferId,
        engineId: this.cfg.engineId,
        requestId,
        sideChannel: this.sideChannel,
        blockIds,
        numTokens: prompt.length,
        tpSize: this.cfg.tp,
        token: p.token,
        digest,
      }),
    };
  }

  private async decodeFromRemote(
    params: Params,
    requestId: string,
    prompt: number[],
  ): Promise<KvReport> {
    const r = parseRemotePrefill(params, requestId);
    const digest = promptDigest(prompt);
    const recompute = async (reason: string): Promise<KvReport> => {
      this.log.warn({ transferId: r.transferId, reason }, "computing the prompt here");
      await sleep((this.cfg.prefillUsPerToken * prompt.length) / 1000);
      return { role: "decode", kv: "recomputed", transferId: r.transferId, reason };
    };
    if (r.promptDigest !== "" && r.promptDigest !== digest)
      return recompute("ERR_PROMPT_MISMATCH: P's KV is for another prompt");
    let source = r.source;
    if (source === "" && r.bootstrap !== undefined) {
      try {
        source = await this.bootstrapSideChannel(r.bootstrap.url, r.bootstrap.engineId);
      } catch (err) {
        return recompute(`ERR_BOOTSTRAP: ${(err as Error).message}`);
      }
    }
    const verdict = new Promise<Record<string, unknown>>((resolve) => {
      const timer = setTimeout(() => {
        this.waiters.delete(r.transferId);
        resolve({ event: "timeout" });
      }, this.cfg.kvWaitMs);
      this.waiters.set(r.transferId, (ev) => {
        clearTimeout(timer);
        resolve(ev);
      });
    });
    try {
      await this.engine!.handle({
        op: "expect",
        transferId: r.transferId,
        tokens: prompt.length,
        source,
        ...(r.sourceBlockIds !== undefined ? { sourceBlockIds: r.sourceBlockIds } : {}),
        token: bindToken(r.token, digest),
      });
    } catch (err) {
      this.waiters.delete(r.transferId);
      return recompute(`${(err as { code?: string }).code ?? "ERR"}: ${(err as Error).message}`);
    }
    const ev = await verdict;
    if (ev["event"] === "verified") {
      const report: KvReport = {
        role: "decode",
        kv: "received",
        transferId: r.transferId,
        checkedBytes: Number(ev["checkedBytes"]),
        mismatches: Number(ev["mismatches"]),
      };
      // Wrong bytes would be a wrong answer from a real engine: say so, loudly.
      if (ev["ok"] !== true)
        throw new HttpError(
          500,
          `KV of ${r.transferId} failed verification: ${JSON.stringify(ev)}`,
        );
      return report;
    }
    if (ev["event"] === "timeout") {
      await this.engine!.handle({ op: "abort", transferId: r.transferId }).catch(() => undefined);
      return recompute(`ERR_KV_TIMEOUT: no KvReady within ${this.cfg.kvWaitMs} ms`);
    }
    if (ev["event"] === "refused")
      return recompute(`${String(ev["code"])}: ${String(ev["message"] ?? "")}`);
    return recompute(`${String(ev["reason"])}: ${String(ev["message"] ?? "")}`.trim());
  }

  /** P's side channel from its bootstrap URL (`GET /query`, the P sidecar's --bootstrap). */
  private async bootstrapSideChannel(url: string, engineId: string): Promise<string> {
    const base = url.replace(/\/+$/, "");
    if (!/^https?:\/\/[^/]+$/.test(base))
      throw new Error(`remote_bootstrap_addr must be http(s)://host:port, got '${url}'`);
    let hit = this.bootstrapCache.get(base);
    if (hit === undefined || hit.until < Date.now()) {
      const res = await fetch(`${base}/query`, { signal: AbortSignal.timeout(2000) });
      if (!res.ok) throw new Error(`${base}/query answered ${res.status}`);
      hit = { until: Date.now() + BOOTSTRAP_TTL_MS, answer: await res.json() };
      this.bootstrapCache.set(base, hit);
    }
    for (const entry of Object.values(hit.answer as Record<string, unknown>)) {
      const e = entry as {
        engine_id?: unknown;
        worker_addr?: Record<string, Record<string, unknown>>;
      };
      if (e?.engine_id !== engineId) continue;
      const address = e.worker_addr?.["0"]?.["0"];
      if (typeof address === "string" && address.includes(":")) return address;
      throw new Error(`${base}/query names ${engineId} without a side channel`);
    }
    this.bootstrapCache.delete(base);
    throw new Error(`${base}/query does not serve engine ${engineId}`);
  }

  private metrics(): string {
    const lines = [
      "# HELP kvxfer_sim_completions_total Completions answered, by what happened to their KV.",
      "# TYPE kvxfer_sim_completions_total counter",
    ];
    for (const kv of ["local", "sent", "received", "recomputed"])
      lines.push(`kvxfer_sim_completions_total{kv="${kv}"} ${this.counts.get(kv) ?? 0}`);
    lines.push(
      "# HELP kvxfer_sim_kv_mismatches_total Transfers whose KV failed the byte check.",
      "# TYPE kvxfer_sim_kv_mismatches_total counter",
      `kvxfer_sim_kv_mismatches_total ${this.counts.get("mismatch") ?? 0}`,
    );
    return lines.join("\n") + "\n";
  }
}

async function readJson(req: IncomingMessage): Promise<Record<string, unknown>> {
  const chunks: Buffer[] = [];
  let size = 0;
  for await (const chunk of req) {
    size += (chunk as Buffer).length;
    if (size > MAX_BODY_BYTES)
      throw new HttpError(413, `request body above ${MAX_BODY_BYTES} bytes`);
    chunks.push(chunk as Buffer);
  }
  let body: unknown;
  try {
    body = JSON.parse(Buffer.concat(chunks).toString("utf8"));
  } catch (err) {
    throw new HttpError(400, `the body is not JSON: ${(err as Error).message}`);
  }
  if (typeof body !== "object" || body === null || Array.isArray(body))
    throw new HttpError(400, "the body must be a JSON object");
  return body as Record<string, unknown>;
}
