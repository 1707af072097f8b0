import { PlanError } from "./errors.js";
import type { KvLayout } from "./layout.js";

/** One request: which tokens move and where they live on each side. */
export interface PlanRequest {
  /** Tokens of the request held by P (prompt length). */
  readonly numTokens: number;
  /** Tokens `0 .. prefixTokens - 1` are already on D and do not move; need not be block-aligned. */
  readonly prefixTokens?: number;
  /**
   * P's block table for the request: entry `i` holds tokens `i * P.blockSize ..`. Entries for
   * blocks wholly inside the prefix are not read; entries past the last token are ignored.
   */
  readonly srcBlockIds: ArrayLike<number>;
  /** D's block table, the same way round with D's block size. */
  readonly dstBlockIds: ArrayLike<number>;
}

export interface PlanOptions {
  /** Plan only these P ranks (default: all). */
  readonly srcRanks?: readonly number[];
  /** Plan only these D ranks (default: all). */
  readonly dstRanks?: readonly number[];
  /** Merge adjacent copies (default true). Off only to inspect the raw pieces. */
  readonly coalesce?: boolean;
}

export function requestError(field: string, message: string): PlanError {
  return new PlanError("ERR_PLAN_INVALID", field, message);
}

/**
 * Token ranges `[t, t + len)` that stay inside one P block and one D block, from the first token
 * that moves to the last: the unit every copy is cut from.
 */
export interface Chunks {
  readonly n: number;
  readonly srcBlock: Float64Array;
  readonly srcPos: Int32Array;
  readonly dstBlock: Float64Array;
  readonly dstPos: Int32Array;
  readonly len: Int32Array;
}

function readBlockId(ids: ArrayLike<number>, i: number, layout: KvLayout, field: string): number {
  const id = ids[i];
  if (typeof id !== "number" || !Number.isInteger(id) || id < 0 || id >= layout.numBlocks) {
    throw requestError(
      field,
      `${field}[${i}] = ${String(id)} is not a block id below numBlocks ${layout.numBlocks}`,
    );
  }
  return id;
}

export function buildChunks(
  src: KvLayout,
  dst: KvLayout,
  req: PlanRequest,
  first: number,
  unit: number,
): Chunks {
  // Tokens move in units (whole opaque blocks, whole tiles): the last unit's tail past the last
  // token goes with it. A unit divides both block sizes, so the tail stays in the last blocks.
  const last =
    unit > 1 && first < req.numTokens ? Math.ceil(req.numTokens / unit) * unit : req.numTokens;
  const bp = src.blockSize;
  const bd = dst.blockSize;
  // A chunk ends at a P or D block boundary or the last token, so there are at most this many.
  const max =
    Math.ceil(last / bp) - Math.floor(first / bp) + Math.ceil(last / bd) - Math.floor(first / bd);
  const c: Chunks = {
    n: 0,
    srcBlock: new Float64Array(max),
    srcPos: new Int32Array(max),
    dstBlock: new Float64Array(max),
    dstPos: new Int32Array(max),
    len: new Int32Array(max),
  };
  // D blocks written twice would mix two token ranges; reading a P block twice is harmless.
  const seen = new Uint8Array(dst.numBlocks);
  let n = 0;
  let t = first;
  let lastDstIndex = -1;
  let srcId = 0;
  let dstId = 0;
  let lastSrcIndex = -1;
  while (t < last) {
    const pi = Math.floor(t / bp);
    const pp = t - pi * bp;
    const di = Math.floor(t / bd);
    const dp = t - di * bd;
    if (pi !== lastSrcIndex) {
      srcId = readBlockId(req.srcBlockIds, pi, src, "srcBlockIds");
      lastSrcIndex = pi;
    }
    if (di !== lastDstIndex) {
      dstId = readBlockId(req.dstBlockIds, di, dst, "dstBlockIds");
      if (seen[dstId]) {
        throw requestError("dstBlockIds", `dstBlockIds lists block ${dstId} twice`);
      }
      seen[dstId] = 1;
      lastDstIndex = di;
    }
    const len = Math.min(last - t, bp - pp, bd - dp);
    c.srcBlock[n] = srcId;
    c.srcPos[n] = pp;
    c.dstBlock[n] = dstId;
    c.dstPos[n] = dp;
    c.len[n] = len;
    n++;
    t += len;
  }
  return { ...c, n };
}

/**
 * The prefix a request keeps on D, after checking the request; `unit`: tokens that move only
 * together from a block's start (`LayoutPairing.tokenUnit`), which the prefix must respect.
 */
export function checkRequest(src: KvLayout, dst: KvLayout, req: PlanRequest, unit: number): number {
  const n = req.numTokens;
  if (!Number.isSafeInteger(n) || n < 0) {
    throw requestError("numTokens", `numTokens must be an integer >= 0, got ${String(n)}`);
  }
  const k = req.prefixTokens ?? 0;
  if (!Number.isSafeInteger(k) || k < 0 || k > n) {
    throw requestError("prefixTokens", `prefixTokens ${String(k)} is not within 0..${n}`);
  }
  if (k % unit !== 0 && k !== n) {
    throw requestError(
      "prefixTokens",
      unit === src.blockSize
        ? `prefixTokens ${k} is not a multiple of the block size ${src.blockSize}: opaque blocks move whole`
        : `prefixTokens ${k} is not a multiple of ${unit} tokens: the run order moves whole tiles of ${unit}`,
    );
  }
  for (const [field, ids, layout] of [
    ["srcBlockIds", req.srcBlockIds, src],
    ["dstBlockIds", req.dstBlockIds, dst],
  ] as const) {
    const need = Math.ceil(n / layout.blockSize);
    if (ids == null || typeof ids.length !== "number" || ids.length < need) {
      throw requestError(
        field,
        `${field} has ${String(ids?.length)} blocks; ${n} tokens in blocks of ${layout.blockSize} need ${need}`,
      );
    }
  }
  return k;
}

export function checkRanks(
  field: string,
  ranks: readonly number[] | undefined,
  tpSize: number,
): void {
  for (const r of ranks ?? []) {
    if (!Number.isInteger(r) || r < 0 || r >= tpSize) {
      throw requestError(field, `${field} lists rank ${String(r)}, not within 0..${tpSize - 1}`);
    }
  }
}
