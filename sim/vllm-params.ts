/**
 * `kv_transfer_params` as kvxfer's vLLM connector reads and writes them
 * (connectors/vllm/kvxfer_vllm/params.py), for the simulated engine behind vLLM's command line:
 * what a router sends P and D, what P answers for D, the prompt digest and the transfer token
 * bound to it. The field names and the two hashes are the connector's, so a router (and a D or
 * P of either kind) sees the same answers.
 */
import { createHash, randomBytes } from "node:crypto";

/** Hex digits of `kvxfer_prompt_digest` (128 bits of SHA-256). */
const DIGEST_HEX = 32;
const MAX_TOKEN_BYTES = 128;
const MAX_ID_BYTES = 256;

/** A request's `kv_transfer_params` that cannot be used; `field` names the culprit. */
export class BadParams extends Error {
  readonly code = "ERR_BAD_PARAMS";
  constructor(
    readonly field: string,
    message: string,
  ) {
    super(`kv_transfer_params.${field}: ${message}`);
  }
}

/** SHA-256 of the prompt's token ids as little-endian int64s, 128 bits in hex. */
export function promptDigest(tokens: readonly number[]): string {
  if (tokens.length === 0) return "";
  const buf = Buffer.alloc(tokens.length * 8);
  tokens.forEach((t, i) => buf.writeBigInt64LE(BigInt(t), i * 8));
  return createHash("sha256").update(buf).digest("hex").slice(0, DIGEST_HEX);
}

/** The token a sidecar sees: the router's (or P's) token bound to this side's prompt digest. */
export function bindToken(token: string, digest: string): string {
  if (digest === "") return token;
  return "kvxfer-p1." + createHash("sha256").update(`${token}\0${digest}`).digest("hex");
}

export function newToken(): string {
  return randomBytes(16).toString("hex");
}

export type Params = Record<string, unknown>;

export function wantsRemoteDecode(p: Params | undefined): boolean {
  return p !== undefined && p["do_remote_decode"] === true;
}

export function wantsRemotePrefill(p: Params | undefined): boolean {
  return p !== undefined && p["do_remote_prefill"] === true;
}

function tokenOf(p: Params): string {
  const t = p["kvxfer_token"] ?? "";
  if (typeof t !== "string" || Buffer.byteLength(t) > MAX_TOKEN_BYTES)
    throw new BadParams("kvxfer_token", `must be a string of at most ${MAX_TOKEN_BYTES} bytes`);
  return t;
}

/** The transfer id the router named, else the request's own id. */
export function transferIdOf(p: Params, requestId: string): string {
  const tid = p["transfer_id"];
  const id = typeof tid === "string" && tid !== "" ? tid : requestId;
  if (Buffer.byteLength(id) > MAX_ID_BYTES)
    throw new BadParams("transfer_id", `is longer than ${MAX_ID_BYTES} bytes`);
  return id;
}

/** P's view of a request it prefills for another engine. */
export interface RemoteDecode {
  readonly transferId: string;
  /** The router's token, or one P made (returned in the answer), or "" (below). */
  readonly token: string;
}

/**
 * As the connector does: the router's token when it gave one; none when the router named the
 * transfer itself (vllm-router's mooncake mode tells D at the same time, so D cannot learn a token
 * P makes: the transfer binds to the first authenticated D that registers); else a fresh one,
 * which reaches D in P's answer.
 */
export function parseRemoteDecode(p: Params, requestId: string): RemoteDecode {
  const given = tokenOf(p);
  const named = typeof p["transfer_id"] === "string" && p["transfer_id"] !== "";
  return {
    transferId: transferIdOf(p, requestId),
    token: given !== "" ? given : named ? "" : newToken(),
  };
}

/** D's view of where its KV comes from. */
export interface RemotePrefill {
  readonly transferId: string;
  /** P's sidecar side channel (`remote_host:remote_port`), or "" when only a bootstrap URL names P. */
  readonly source: string;
  /** vllm-router's mooncake mode: P's bootstrap URL and engine id (D asks it for the side channel). */
  readonly bootstrap?: { readonly url: string; readonly engineId: string };
  /** P's block table (pull), or undefined (push: P writes into D's blocks). */
  readonly sourceBlockIds: number[] | undefined;
  readonly numTokens: number | undefined;
  readonly token: string;
  readonly promptDigest: string;
}

function blockIds(v: unknown): number[] {
  // vLLM's per-group form [[1, 2]] with one group, or [1, 2].
  if (Array.isArray(v) && v.length === 1 && Array.isArray(v[0])) v = v[0];
  if (!Array.isArray(v))
    throw new BadParams("remote_block_ids", `must be a list of block ids, got ${typeof v}`);
  return v.map((b, i) => {
    if (typeof b !== "number" || !Number.isSafeInteger(b) || b < 0 || b >= 2 ** 32)
      throw new BadParams("remote_block_ids", `[${i}] = ${JSON.stringify(b)} is not a block id`);
    return b;
  });
}

export function parseRemotePrefill(p: Params, requestId: string): RemotePrefill {
  const transferId = transferIdOf(p, requestId);
  const host = p["remote_host"];
  const port = p["remote_port"];
  let source = "";
  let bootstrap: RemotePrefill["bootstrap"];
  if (typeof host === "string" && host !== "") {
    if (typeof port !== "number" || !Number.isInteger(port) || port < 1 || port > 65535)
      throw new BadParams(
        "remote_port",
        `must be P's sidecar side channel port, got ${JSON.stringify(port)}`,
      );
    source = host.includes(":") ? `[${host}]:${port}` : `${host}:${port}`;
  } else {
    const url = p["remote_bootstrap_addr"];
    const engineId = p["remote_engine_id"];
    if (typeof url !== "string" || url === "")
      throw new BadParams("remote_host", "names neither P's sidecar nor P's bootstrap URL");
    if (typeof engineId !== "string" || engineId === "")
      throw new BadParams("remote_engine_id", "must name P's engine (with remote_bootstrap_addr)");
    bootstrap = { url, engineId };
  }
  const raw = p["remote_block_ids"];
  let sourceBlockIds =
    raw === undefined || raw === null || (Array.isArray(raw) && raw.length === 0)
      ? undefined
      : blockIds(raw);
  const split = p["kvxfer_blocks_per_block"] ?? 1;
  if (typeof split !== "number" || !Number.isInteger(split) || split < 1 || split > 1024)
    throw new BadParams(
      "kvxfer_blocks_per_block",
      `must be an integer 1..1024, got ${JSON.stringify(split)}`,
    );
  if (sourceBlockIds !== undefined && split > 1)
    sourceBlockIds = sourceBlockIds.flatMap((b) =>
      Array.from({ length: split }, (_, j) => b * split + j),
    );
  const n = p["remote_num_tokens"];
  if (n !== undefined && n !== null && (typeof n !== "number" || !Number.isInteger(n) || n < 0))
    throw new BadParams("remote_num_tokens", `must be a token count, got ${JSON.stringify(n)}`);
  const digest = p["kvxfer_prompt_digest"] ?? "";
  if (typeof digest !== "string" || (digest !== "" && !/^[0-9a-f]{32}$/.test(digest)))
    throw new BadParams(
      "kvxfer_prompt_digest",
      `must be ${DIGEST_HEX} hex digits, got ${JSON.stringify(digest)}`,
    );
  return {
    transferId,
    source,
    ...(bootstrap !== undefined ? { bootstrap } : {}),
    sourceBlockIds,
    numTokens: typeof n === "number" && n > 0 ? n : undefined,
    token: tokenOf(p),
    promptDigest: digest,
  };
}

/** What P returns for D (the response's `kv_transfer_params`), as the connector does. */
export function prefillAnswer(a: {
  transferId: string;
  engineId: string;
  requestId: string;
  sideChannel: string;
  blockIds: readonly number[];
  numTokens: number;
  tpSize: number;
  token: string;
  digest: string;
}): Params {
  const at = a.sideChannel.lastIndexOf(":");
  return {
    do_remote_prefill: true,
    do_remote_decode: false,
    transfer_id: a.transferId,
    remote_engine_id: a.engineId,
    remote_request_id: a.requestId,
    remote_host: a.sideChannel.slice(0, at).replace(/^\[|\]$/g, ""),
    remote_port: Number(a.sideChannel.slice(at + 1)),
    remote_block_ids: [...a.blockIds],
    remote_num_tokens: a.numTokens,
    tp_size: a.tpSize,
    transfer_mode: "pull",
    kvxfer_blocks_per_block: 1,
    kvxfer_token: a.token,
    kvxfer_prompt_digest: a.digest,
  };
}
