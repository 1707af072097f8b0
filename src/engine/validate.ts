/**
 * Field checks for messages an engine sends its sidecar. The link itself only checks framing
 * (size, protobuf, a oneof set); the sidecar calls these before acting, and answers a problem
 * with `Refused { transfer_id, code, message }`. A problem costs only the message it names.
 */
import type {
  AllocateKv,
  EngineToSidecar,
  ExpectKv,
  LayersSaved,
  PrefillDone,
  RegisterKvCache,
} from "../gen/kvxfer/v1/engine_pb.js";
import { equals } from "@bufbuild/protobuf";
import { KvLayoutSchema } from "../gen/kvxfer/v1/layout_pb.js";
import type { KvBlockList } from "../gen/kvxfer/v1/layout_pb.js";
import {
  type BlockList,
  type KvGroup,
  type KvLayout,
  PlanError,
  groupName,
} from "../plan/index.js";
import { kvGroupsFromProto, kvLayoutFromProto } from "../plan/layout-proto.js";
import { MAX_TOKEN_BYTES, engineIdProblem, transferIdCharProblem } from "../peer/messages.js";

export { ENGINE_ID_RULE, engineIdProblem } from "../peer/messages.js";

export type EngineErrorCode =
  /** The frame is not one `EngineToSidecar` with its oneof set. */
  | "ERR_MALFORMED"
  /** The frame is larger than the link's cap. */
  | "ERR_TOO_LARGE"
  /** A transfer message arrived before the engine registered its KV cache. */
  | "ERR_NOT_REGISTERED"
  | "ERR_BAD_ENGINE_ID"
  | "ERR_BAD_TRANSFER_ID"
  | "ERR_BAD_LAYOUT"
  | "ERR_BAD_REGIONS"
  | "ERR_BAD_BLOCKS"
  | "ERR_BAD_TOKENS"
  | "ERR_BAD_TRANSFER_TOKEN"
  | "ERR_BAD_LAYERS"
  | "ERR_BAD_SOURCE";

/** Why a message was refused; `message` names the field at fault. */
export interface EngineProblem {
  readonly code: EngineErrorCode;
  /** The transfer the message named, or "" (registration, unreadable frames). */
  readonly transferId: string;
  readonly message: string;
}

/** Longest transfer id, engine id or source address accepted, in UTF-8 bytes. */
export const MAX_ID_BYTES = 256;
/** Most block ids one message may carry (a bound on work, far above any real request). */
export const MAX_BLOCK_IDS = 1 << 20;
/** A CUDA IPC memory handle (cudaIpcMemHandle_t) is 64 opaque bytes. */
export const CUDA_IPC_HANDLE_BYTES = 64;
/** Most ranks or regions per rank a registration may list. */
export const MAX_RANKS = 1024;
export const MAX_REGIONS_PER_RANK = 65536;

/**
 * One registered region: `length` bytes at `offset` of the file `path`, or of the SysV
 * segment `segment` the sidecar allocated (then `path` is "" and `offset` 0).
 */
export interface RegionSource {
  readonly path: string;
  readonly segment?: number;
  /** CUDA device memory the engine's process exported: its IPC handle and device (docs/gpu.md). */
  readonly cudaIpc?: { readonly handle: Uint8Array; readonly device: number };
  readonly offset: number;
  readonly length: number;
}

/** One rank's registered memory: `regions[g]` holds region `g` of the layout. */
export interface RankRegionFiles {
  readonly rank: number;
  readonly regions: readonly RegionSource[];
}

/** A checked `RegisterKvCache`: the layout and one entry per rank, indexed by rank. */
export interface EngineKvCache {
  readonly engineId: string;
  /** The template layout (tpRank 0); rank `r`'s layout is `{ ...layout, tpRank: r }`. */
  readonly layout: KvLayout;
  /** The engine's KV cache groups (one full group with `layout` when it registered none). */
  readonly groups: readonly KvGroup[];
  readonly ranks: readonly RankRegionFiles[];
}

export type RegisterCheck =
  | { readonly ok: true; readonly cache: EngineKvCache }
  | { readonly ok: false; readonly problem: EngineProblem };

function problem(code: EngineErrorCode, transferId: string, message: string): EngineProblem {
  return { code, transferId, message };
}

function checkId(value: string, field: string): string | undefined {
  if (value.length === 0) return `${field} is empty`;
  const n = Buffer.byteLength(value, "utf8");
  if (n > MAX_ID_BYTES) return `${field} is ${n} bytes, more than ${MAX_ID_BYTES}`;
  return undefined;
}

/** A transfer id: 1..MAX_ID_BYTES bytes of printable characters. */
function checkTransferId(value: string): string | undefined {
  return checkId(value, "transfer_id") ?? transferIdCharProblem(value, "transfer_id");
}

/** A transfer id as it may be echoed in a refusal: cut to the limit so a refusal stays small. */
function echoId(value: string): string {
  return Buffer.byteLength(value, "utf8") <= MAX_ID_BYTES ? value : value.slice(0, 64) + "...";
}

/**
 * Checks a registration and converts it: engine id, the layout (`validateKvLayout`), one entry
 * per rank `0 .. tpSize - 1` each once, one file per layout region, each file at least as long
 * as its region. Paths are not opened here.
 */
export function checkRegisterKvCache(msg: RegisterKvCache): RegisterCheck {
  const fail = (code: EngineErrorCode, message: string): RegisterCheck => ({
    ok: false,
    problem: problem(code, "", message),
  });
  const idProblem = engineIdProblem(msg.engineId, "engine_id");
  if (idProblem) return fail("ERR_BAD_ENGINE_ID", idProblem);
  if (msg.layout === undefined) return fail("ERR_BAD_LAYOUT", "layout is missing");
  let layout: KvLayout;
  try {
    layout = kvLayoutFromProto(msg.layout);
  } catch (err) {
    if (err instanceof PlanError)
      return fail("ERR_BAD_LAYOUT", `layout.${err.field}: ${err.message}`);
    throw err;
  }
  layout = { ...layout, tpRank: 0 };
  let groups: readonly KvGroup[];
  try {
    groups = kvGroupsFromProto(msg.groups, layout);
  } catch (err) {
    if (err instanceof PlanError) return fail("ERR_BAD_LAYOUT", `${err.field}: ${err.message}`);
    throw err;
  }
  if (msg.groups.length > 0 && !equals(KvLayoutSchema, msg.groups[0]!.layout!, msg.layout)) {
    return fail("ERR_BAD_LAYOUT", "layout must be groups[0].layout when groups are given");
  }
  if (msg.ranks.length !== layout.tpSize) {
    return fail(
      "ERR_BAD_REGIONS",
      `ranks lists ${msg.ranks.length} ranks, the layout has tpSize ${layout.tpSize}`,
    );
  }
  if (msg.ranks.length > MAX_RANKS)
    return fail("ERR_BAD_REGIONS", `ranks lists more than ${MAX_RANKS}`);
  const byRank: (RankRegionFiles | undefined)[] = new Array(layout.tpSize).fill(undefined);
  for (const [i, entry] of msg.ranks.entries()) {
    if (entry.rank >= layout.tpSize) {
      return fail(
        "ERR_BAD_REGIONS",
        `ranks[${i}].rank ${entry.rank} is not below tpSize ${layout.tpSize}`,
      );
    }
    if (byRank[entry.rank] !== undefined) {
      return fail("ERR_BAD_REGIONS", `ranks[${i}].rank ${entry.rank} is listed twice`);
    }
    const want = layout.regionBytes.length;
    if (entry.regions.length !== want) {
      return fail(
        "ERR_BAD_REGIONS",
        `ranks[${i}].regions lists ${entry.regions.length} files, the layout has ${want} regions`,
      );
    }
    const regions: RegionSource[] = [];
    for (const [g, file] of entry.regions.entries()) {
      const where = `ranks[${i}].regions[${g}]`;
      const cuda = file.cudaIpcHandle.length > 0;
      if (cuda) {
        if (file.cudaIpcHandle.length !== CUDA_IPC_HANDLE_BYTES) {
          return fail(
            "ERR_BAD_REGIONS",
            `${where}.cuda_ipc_handle has ${file.cudaIpcHandle.length} bytes, a CUDA IPC handle ${CUDA_IPC_HANDLE_BYTES}`,
          );
        }
        if (file.path.length !== 0 || file.segment !== undefined) {
          return fail(
            "ERR_BAD_REGIONS",
            `${where} names a CUDA IPC handle: path must be empty and no segment given`,
          );
        }
      } else if (file.segment !== undefined) {
        if (file.path.length !== 0 || file.offset !== 0n) {
          return fail(
            "ERR_BAD_REGIONS",
            `${where} names segment ${file.segment}: path must be empty and offset 0`,
          );
        }
      } else if (file.path.length === 0 || Buffer.byteLength(file.path) > 4096) {
        return fail(
          "ERR_BAD_REGIONS",
          `${where}.path must be 1..4096 bytes (or a segment or CUDA IPC handle given)`,
        );
      }
      if (
        file.offset > BigInt(Number.MAX_SAFE_INTEGER) ||
        file.length > BigInt(Number.MAX_SAFE_INTEGER)
      ) {
        return fail("ERR_BAD_REGIONS", `${where}: offset or length beyond 2^53`);
      }
      const length = Number(file.length);
      const need = layout.regionBytes[g]!;
      if (length < need) {
        return fail(
          "ERR_BAD_REGIONS",
          `${where}.length ${length} is below the region's ${need} bytes`,
        );
      }
      regions.push({
        path: file.path,
        ...(file.segment !== undefined ? { segment: file.segment } : {}),
        ...(cuda
          ? { cudaIpc: { handle: Uint8Array.from(file.cudaIpcHandle), device: file.cudaDevice } }
          : {}),
        offset: Number(file.offset),
        length,
      });
    }
    byRank[entry.rank] = { rank: entry.rank, regions };
  }
  return {
    ok: true,
    cache: { engineId: msg.engineId, layout, groups, ranks: byRank as RankRegionFiles[] },
  };
}

/** Checks a block table: size bounds, each id below `numBlocks`, no id twice. */
function checkBlockIds(
  ids: readonly number[],
  field: string,
  minCount: number,
  numBlocks: number,
): string | undefined {
  if (ids.length > MAX_BLOCK_IDS)
    return `${field} lists ${ids.length} ids, more than ${MAX_BLOCK_IDS}`;
  if (ids.length < minCount) return `${field} lists ${ids.length} ids, the tokens need ${minCount}`;
  if (ids.length > numBlocks)
    return `${field} lists ${ids.length} ids, the cache has ${numBlocks} blocks`;
  const seen = new Set<number>();
  for (const [i, id] of ids.entries()) {
    if (id >= numBlocks) return `${field}[${i}] = ${id} is not below numBlocks ${numBlocks}`;
    if (seen.has(id)) return `${field}[${i}] = ${id} is listed twice`;
    seen.add(id);
  }
  return undefined;
}

/**
 * A transfer's block lists, one per group: `groups` (the message's per-group lists) or, from an
 * engine of one group, `blockIds`. Each list within the cache, covering the tokens from where it
 * starts (a state group: one slot), and no block id twice in the transfer, whatever its group
 * (one block pool). Returns the lists or a problem naming the field.
 */
export function checkBlockLists(
  lists: readonly KvBlockList[],
  blockIds: readonly number[],
  field: string,
  numTokens: number,
  groups: readonly KvGroup[],
): BlockList[] | string {
  if (lists.length === 0) {
    if (groups.length !== 1)
      return `${field} is empty: the engine registered ${groups.length} KV cache groups, name one list per group (groups)`;
    const layout = groups[0]!.layout;
    const err = checkBlockIds(
      blockIds,
      field,
      Math.ceil(numTokens / layout.blockSize),
      layout.numBlocks,
    );
    return err ?? [{ first: 0, ids: blockIds }];
  }
  const listsField = field === "block_ids" ? "groups" : "source_groups";
  if (blockIds.length > 0) return `${field} and ${listsField} are both given`;
  if (lists.length !== groups.length)
    return `${listsField} lists ${lists.length} block lists, the engine registered ${groups.length} groups`;
  const out: BlockList[] = [];
  const seen = new Set<number>();
  let total = 0;
  for (const [g, l] of lists.entries()) {
    const group = groups[g]!;
    const where = `${listsField}[${g}].block_ids`;
    const layout = group.layout;
    total += l.blockIds.length;
    if (total > MAX_BLOCK_IDS) return `${listsField} list more than ${MAX_BLOCK_IDS} ids`;
    if (group.kind === "state") {
      if (l.blockIds.length !== 1 || l.firstBlock !== 0)
        return `${where}: ${groupName(g, group)} names its one state slot, got ${l.blockIds.length} ids from block ${l.firstBlock}`;
    } else {
      const need = Math.ceil(numTokens / layout.blockSize);
      if (l.firstBlock >= need)
        return `${listsField}[${g}].first_block ${l.firstBlock}: ${numTokens} tokens fill ${need} blocks of ${layout.blockSize}`;
      if (group.kind === "full" && l.firstBlock !== 0)
        return `${listsField}[${g}].first_block ${l.firstBlock}: ${groupName(g, group)} holds every block from 0`;
      const err = checkBlockIds(l.blockIds, where, need - l.firstBlock, layout.numBlocks);
      if (err) return err;
    }
    for (const [i, id] of l.blockIds.entries()) {
      if (id >= layout.numBlocks)
        return `${where}[${i}] = ${id} is not below numBlocks ${layout.numBlocks}`;
      if (seen.has(id)) return `${where}[${i}] = ${id} is listed twice in the transfer`;
      seen.add(id);
    }
    out.push({ first: l.firstBlock, ids: l.blockIds });
  }
  return out;
}

function checkPrefillDone(msg: PrefillDone, groups: readonly KvGroup[]): EngineProblem | undefined {
  const tid = echoId(msg.transferId);
  const idProblem = checkTransferId(msg.transferId);
  if (idProblem) return problem("ERR_BAD_TRANSFER_ID", tid, idProblem);
  if (msg.numTokens === 0) return problem("ERR_BAD_TOKENS", tid, "num_tokens must be > 0");
  if (msg.layerWise && groups.length !== 1)
    return problem(
      "ERR_BAD_LAYERS",
      tid,
      `layer_wise: the engine registered ${groups.length} KV cache groups; layer-wise push needs one`,
    );
  const blocks = checkBlockLists(msg.groups, msg.blockIds, "block_ids", msg.numTokens, groups);
  if (typeof blocks === "string") return problem("ERR_BAD_BLOCKS", tid, blocks);
  return checkToken(msg.token, tid);
}

/** Most transfers one LayersSaved may name. */
export const MAX_LAYERS_SAVED_IDS = 65536;

/**
 * A LayersSaved's own fields: 1..MAX_LAYERS_SAVED_IDS well-formed ids, `layers` 1..num_layers of
 * the one group's layout. Whether each id is a live layer-wise transfer is P's side to say.
 */
function checkLayersSaved(msg: LayersSaved, groups: readonly KvGroup[]): EngineProblem | undefined {
  const first = echoId(msg.transferIds[0] ?? "");
  const n = msg.transferIds.length;
  if (n === 0 || n > MAX_LAYERS_SAVED_IDS)
    return problem(
      "ERR_BAD_LAYERS",
      first,
      `LayersSaved names ${n} transfers, expected 1..${MAX_LAYERS_SAVED_IDS}`,
    );
  for (const [i, id] of msg.transferIds.entries()) {
    const idProblem = checkTransferId(id);
    if (idProblem)
      return problem("ERR_BAD_TRANSFER_ID", echoId(id), `transfer_ids[${i}]: ${idProblem}`);
  }
  const layers = groups.length === 1 ? groups[0]!.layout.numLayers : 0;
  if (msg.layers === 0 || msg.layers > layers)
    return problem(
      "ERR_BAD_LAYERS",
      first,
      groups.length === 1
        ? `LayersSaved.layers ${msg.layers} is not 1..${layers} (the layout's num_layers)`
        : `LayersSaved from an engine with ${groups.length} KV cache groups; layer-wise push needs one`,
    );
  return undefined;
}

/** A transfer token: at most MAX_TOKEN_BYTES (empty: the transfer is not bound to a decode engine). */
function checkToken(token: string, tid: string): EngineProblem | undefined {
  if (Buffer.byteLength(token) > MAX_TOKEN_BYTES)
    return problem(
      "ERR_BAD_TRANSFER_TOKEN",
      tid,
      `token is ${Buffer.byteLength(token)} bytes, at most ${MAX_TOKEN_BYTES}`,
    );
  return undefined;
}

function checkExpectKv(msg: ExpectKv, groups: readonly KvGroup[]): EngineProblem | undefined {
  const tid = echoId(msg.transferId);
  const idProblem = checkTransferId(msg.transferId);
  if (idProblem) return problem("ERR_BAD_TRANSFER_ID", tid, idProblem);
  const srcProblem = checkId(msg.source, "source");
  if (srcProblem) return problem("ERR_BAD_SOURCE", tid, srcProblem);
  if (msg.numTokens === 0) return problem("ERR_BAD_TOKENS", tid, "num_tokens must be > 0");
  if (msg.prefixTokens > msg.numTokens) {
    return problem(
      "ERR_BAD_TOKENS",
      tid,
      `prefix_tokens ${msg.prefixTokens} is above num_tokens ${msg.numTokens}`,
    );
  }
  const blocks = checkBlockLists(msg.groups, msg.blockIds, "block_ids", msg.numTokens, groups);
  if (typeof blocks === "string") return problem("ERR_BAD_BLOCKS", tid, blocks);
  if (!msg.hasSourceBlockIds && (msg.sourceBlockIds.length > 0 || msg.sourceGroups.length > 0)) {
    return problem(
      "ERR_BAD_BLOCKS",
      tid,
      "source_block_ids is set but has_source_block_ids is false",
    );
  }
  if (msg.hasSourceBlockIds) {
    // P's layout is not known here: the sidecar checks the ids against it once it has it.
    if (msg.sourceGroups.length === 0) {
      const src = checkBlockIds(msg.sourceBlockIds, "source_block_ids", 1, MAX_BLOCK_IDS);
      if (src) return problem("ERR_BAD_BLOCKS", tid, src);
    } else {
      if (msg.sourceBlockIds.length > 0)
        return problem("ERR_BAD_BLOCKS", tid, "source_block_ids and source_groups are both given");
      if (msg.sourceGroups.length !== groups.length)
        return problem(
          "ERR_BAD_BLOCKS",
          tid,
          `source_groups lists ${msg.sourceGroups.length} block lists, the engine registered ${groups.length} groups`,
        );
      for (const [g, l] of msg.sourceGroups.entries()) {
        const src = checkBlockIds(l.blockIds, `source_groups[${g}].block_ids`, 1, MAX_BLOCK_IDS);
        if (src) return problem("ERR_BAD_BLOCKS", tid, src);
      }
    }
  }
  return checkToken(msg.token, tid);
}

/**
 * Checks one engine message's fields. `groups` are the engine's registered KV cache groups
 * (undefined before `RegisterKvCache` was accepted): transfer messages need them. A registration is checked
 * with `checkRegisterKvCache`, which also converts it.
 */
export function checkEngineMessage(
  msg: EngineToSidecar,
  groups: readonly KvGroup[] | undefined,
): EngineProblem | undefined {
  const m = msg.msg;
  switch (m.case) {
    case "register": {
      const r = checkRegisterKvCache(m.value);
      return r.ok ? undefined : r.problem;
    }
    case "prefillDone":
      if (!groups) return notRegistered(m.value.transferId);
      return checkPrefillDone(m.value, groups);
    case "expectKv":
      if (!groups) return notRegistered(m.value.transferId);
      return checkExpectKv(m.value, groups);
    case "allocate":
      return checkAllocateKv(m.value);
    case "layersSaved":
      if (!groups) return notRegistered(m.value.transferIds[0] ?? "");
      return checkLayersSaved(m.value, groups);
    case "abort": {
      const tid = echoId(m.value.transferId);
      const idProblem = checkTransferId(m.value.transferId);
      if (idProblem) return problem("ERR_BAD_TRANSFER_ID", tid, idProblem);
      if (!groups) return notRegistered(m.value.transferId);
      return undefined;
    }
    case undefined:
      return problem("ERR_MALFORMED", "", "EngineToSidecar has no message set");
  }
}

/**
 * Checks an allocation request: 1 <= tp_size <= MAX_RANKS, rank below tp_size,
 * 1..MAX_REGIONS_PER_RANK lengths, each above 0.
 */
export function checkAllocateKv(msg: AllocateKv): EngineProblem | undefined {
  if (msg.tpSize === 0 || msg.tpSize > MAX_RANKS)
    return problem("ERR_BAD_REGIONS", "", `allocate: tp_size ${msg.tpSize} is not 1..${MAX_RANKS}`);
  if (msg.rank >= msg.tpSize)
    return problem(
      "ERR_BAD_REGIONS",
      "",
      `allocate: rank ${msg.rank} is not below tp_size ${msg.tpSize}`,
    );
  const n = msg.lengths.length;
  if (n === 0 || n > MAX_REGIONS_PER_RANK) {
    return problem(
      "ERR_BAD_REGIONS",
      "",
      `allocate: lengths lists ${n} regions, expected 1..${MAX_REGIONS_PER_RANK}`,
    );
  }
  for (const [g, len] of msg.lengths.entries()) {
    if (len === 0n || len > BigInt(Number.MAX_SAFE_INTEGER)) {
      return problem(
        "ERR_BAD_REGIONS",
        "",
        `allocate: lengths[${g}] ${len} must be above 0 and at most 2^53`,
      );
    }
  }
  return undefined;
}

function notRegistered(transferId: string): EngineProblem {
  return problem(
    "ERR_NOT_REGISTERED",
    echoId(transferId),
    "the engine has not registered its KV cache (send RegisterKvCache first)",
  );
}
