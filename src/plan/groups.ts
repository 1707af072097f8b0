/**
 * KV cache groups (hybrid models): an engine's layers fall into groups, each with its own kind,
 * layout and block table per request (vLLM's KV cache groups). A transfer is one plan per group,
 * merged into one `TransferPlan`: every rank pair posts all groups' copies in one operation, and D
 * is ready only when every group's bytes have landed (the plan's pairs cover every group).
 *
 * - `full`: every token's KV (full attention; MLA is a full group whose layout has `mla`).
 * - `sliding`: attention over the last `slidingWindow` tokens. Blocks that left the window are not
 *   held (vLLM's null block); a block list says where its held tail starts (`BlockList.first`), and
 *   only tokens both sides hold move.
 * - `state`: recurrent state (Mamba, linear attention): one state slot per request. Its layout
 *   describes a slot as a block of one token holding one latent of the state's bytes; a transfer
 *   moves the one slot each side names. State is split over TP ranks in an engine's own way, so
 *   both sides must have one TP size.
 */
import { PlanError } from "./errors.js";
import { findIncompatibility } from "./compat.js";
import type { KvLayout } from "./layout.js";
import {
  type LayoutPairing,
  type RankPairPlan,
  type TransferPlan,
  pairLayouts,
  planPaired,
} from "./planner.js";
import type { RegionPairDescriptors } from "./descriptor-list.js";

export type KvGroupKind = "full" | "sliding" | "state";

/** One KV cache group of an engine. */
export interface KvGroup {
  readonly kind: KvGroupKind;
  /** Tokens in the window (`sliding` only). */
  readonly slidingWindow?: number;
  /** `state` only: the state's tensors as the engine names them; P and D must agree exactly. */
  readonly stateShape?: string;
  readonly layout: KvLayout;
}

/** One group's block table for a request: `ids[i]` is block index `first + i`. */
export interface BlockList {
  readonly first: number;
  readonly ids: readonly number[];
}

/** The one group of an engine that registered no groups: full attention (or MLA) with `layout`. */
export function singleGroup(layout: KvLayout): readonly KvGroup[] {
  return [{ kind: "full", layout }];
}

/** Most groups an engine may register (vLLM makes one per distinct layer spec, a few at most). */
export const MAX_KV_GROUPS = 256;

/** A short name of group `g` for messages: `group 1 (sliding)`. */
export function groupName(g: number, group: Pick<KvGroup, "kind">): string {
  return `group ${g} (${group.kind})`;
}

/** Why `group` is not a valid group of an engine, or undefined. */
export function groupProblem(group: KvGroup): string | undefined {
  if (group.kind === "sliding") {
    const w = group.slidingWindow;
    if (w === undefined || !Number.isSafeInteger(w) || w < 1)
      return `slidingWindow ${String(w)} must be an integer >= 1`;
  } else if (group.slidingWindow !== undefined && group.slidingWindow !== 0) {
    return `slidingWindow is set on a ${group.kind} group`;
  }
  if (group.kind === "state") {
    if (group.layout.blockSize !== 1)
      return `a state group's layout has blocks of one token (one state each), not ${group.layout.blockSize}`;
    if (!group.layout.mla)
      return "a state group's layout holds one latent per layer (mla), the state's bytes";
  }
  return undefined;
}

/** Groups P (`src`) and D (`dst`) paired once, at the handshake. */
export interface GroupsPairing {
  readonly src: readonly KvGroup[];
  readonly dst: readonly KvGroup[];
  readonly pairings: readonly LayoutPairing[];
  /** Every (P rank, D rank) pair some group moves bytes between, ordered by D rank then P rank. */
  readonly rankPairs: readonly { readonly srcRank: number; readonly dstRank: number }[];
}

function incompatible(field: string, message: string): PlanError {
  return new PlanError("ERR_LAYOUT_INCOMPATIBLE", field, message);
}

/**
 * Why KV cannot move from P's groups to D's, or undefined: the same number of groups, each of one
 * kind on both sides (one window for sliding groups, one state shape and one TP size for state
 * groups), and each group's layouts compatible (`findIncompatibility`, field prefixed
 * `groups[g].`). The message names the group.
 */
export function findGroupsIncompatibility(
  src: readonly KvGroup[],
  dst: readonly KvGroup[],
): PlanError | undefined {
  // One full group each: the layouts' own words, as before groups existed.
  if (src.length === 1 && dst.length === 1 && src[0]!.kind === "full" && dst[0]!.kind === "full")
    return findIncompatibility(src[0]!.layout, dst[0]!.layout);
  if (src.length !== dst.length) {
    return incompatible(
      "groups",
      `P has ${src.length} KV cache groups (${kinds(src)}), D has ${dst.length} (${kinds(dst)})`,
    );
  }
  for (let g = 0; g < src.length; g++) {
    const p = src[g]!;
    const d = dst[g]!;
    const name = groupName(g, p);
    const field = `groups[${g}]`;
    if (p.kind !== d.kind)
      return incompatible(`${field}.kind`, `group ${g} is ${p.kind} on P, ${d.kind} on D`);
    if (p.kind === "sliding" && p.slidingWindow !== d.slidingWindow) {
      return incompatible(
        `${field}.slidingWindow`,
        `${name}: the window is ${String(p.slidingWindow)} tokens on P, ${String(d.slidingWindow)} on D`,
      );
    }
    if (p.kind === "state") {
      if (p.layout.tpSize !== d.layout.tpSize) {
        return incompatible(
          `${field}.tpSize`,
          `${name}: P has TP ${p.layout.tpSize}, D has TP ${d.layout.tpSize}; kvxfer moves recurrent state only between engines of one TP size (each rank's share of a state is the engine's own split)`,
        );
      }
      if ((p.stateShape ?? "") !== (d.stateShape ?? "")) {
        return incompatible(
          `${field}.stateShape`,
          `${name}: the state is ${p.stateShape ?? "?"} on P, ${d.stateShape ?? "?"} on D`,
        );
      }
    }
    const err = findIncompatibility(p.layout, d.layout);
    if (err !== undefined)
      return new PlanError(err.code, `${field}.${err.field}`, `${name}: ${err.message}`);
  }
  return undefined;
}

function kinds(groups: readonly KvGroup[]): string {
  return groups.map((g) => g.kind).join(", ");
}

/** Pairs P's groups with D's. Throws the `PlanError` `findGroupsIncompatibility` returns. */
export function pairGroups(src: readonly KvGroup[], dst: readonly KvGroup[]): GroupsPairing {
  const err = findGroupsIncompatibility(src, dst);
  if (err !== undefined) throw err;
  const pairings = src.map((p, g) => pairLayouts(p.layout, dst[g]!.layout));
  const keys = new Map<string, { srcRank: number; dstRank: number }>();
  for (const pairing of pairings) {
    for (const d of pairing.ranks)
      for (const s of d.sources)
        keys.set(`${s.srcRank}:${d.dstRank}`, { srcRank: s.srcRank, dstRank: d.dstRank });
  }
  const rankPairs = [...keys.values()].sort(
    (a, b) => a.dstRank - b.dstRank || a.srcRank - b.srcRank,
  );
  return { src, dst, pairings, rankPairs };
}

/** One request across groups: the tokens P holds, D's prefix, and each side's block lists. */
export interface GroupsPlanRequest {
  readonly numTokens: number;
  readonly prefixTokens: number;
  readonly src: readonly BlockList[];
  readonly dst: readonly BlockList[];
}

function requestError(field: string, message: string): PlanError {
  return new PlanError("ERR_PLAN_INVALID", field, message);
}

/** The block table from token 0 the planner reads: -1 before `first` (those entries are not read). */
function table(list: BlockList): number[] {
  const t = new Array<number>(list.first + list.ids.length);
  t.fill(-1, 0, list.first);
  for (let i = 0; i < list.ids.length; i++) t[list.first + i] = list.ids[i]!;
  return t;
}

/**
 * The tokens of a group that move: from the prefix, or from where the later side's held tail
 * starts (sliding windows), to the end. A full group must hold every token D needs on P.
 */
function groupStart(
  g: number,
  group: KvGroup,
  pairing: LayoutPairing,
  req: GroupsPlanRequest,
): number {
  const src = req.src[g]!;
  const dst = req.dst[g]!;
  const pStart = src.first * pairing.src.blockSize;
  const dStart = Math.max(req.prefixTokens, dst.first * pairing.dst.blockSize);
  if (group.kind === "full" && pStart > dStart) {
    throw requestError(
      `src[${g}].first`,
      `${groupName(g, group)}: P holds tokens from ${pStart}, D needs them from ${dStart}`,
    );
  }
  // Sliding windows: what only one side holds is outside the window of D's next token (both
  // sides keep at least the window; a larger block size only starts its tail earlier).
  return Math.min(req.numTokens, Math.max(pStart, dStart));
}

/**
 * Plans one request over every group and merges the plans: per (P rank, D rank) pair, the region
 * pairs of all groups (one descriptor list per region pair). Throws `PlanError`
 * (`ERR_PLAN_INVALID`: a list count that is not one per group, a state group without exactly one
 * slot on each side, or what the group's own plan refuses, field prefixed `groups[g].`).
 */
export function planGroups(pairing: GroupsPairing, req: GroupsPlanRequest): TransferPlan {
  const n = pairing.src.length;
  if (req.src.length !== n || req.dst.length !== n) {
    throw requestError(
      "groups",
      `the request names ${req.src.length} block lists on P and ${req.dst.length} on D for ${n} groups`,
    );
  }
  if (n > 1) checkDistinctDst(req.dst);
  const plans: TransferPlan[] = [];
  for (let g = 0; g < n; g++) {
    const group = pairing.src[g]!;
    const gp = pairing.pairings[g]!;
    const src = req.src[g]!;
    const dst = req.dst[g]!;
    try {
      if (group.kind === "state") {
        if (src.ids.length !== 1 || dst.ids.length !== 1) {
          throw requestError(
            "blockIds",
            `a state group names one slot per side, got ${src.ids.length} on P and ${dst.ids.length} on D`,
          );
        }
        // The state after numTokens tokens, unless D already has all of them.
        const prefixTokens = req.prefixTokens >= req.numTokens ? 1 : 0;
        plans.push(
          planPaired(gp, {
            numTokens: 1,
            prefixTokens,
            srcBlockIds: src.ids,
            dstBlockIds: dst.ids,
          }),
        );
        continue;
      }
      const start = groupStart(g, group, gp, req);
      plans.push(
        planPaired(gp, {
          numTokens: req.numTokens,
          prefixTokens: start,
          srcBlockIds: table(src),
          dstBlockIds: table(dst),
        }),
      );
    } catch (err) {
      if (!(err instanceof PlanError) || n === 1) throw err;
      throw new PlanError(
        err.code,
        `groups[${g}].${err.field}`,
        `${groupName(g, group)}: ${err.message}`,
      );
    }
  }
  return n === 1 ? plans[0]! : mergePlans(plans, req, pairing);
}

/**
 * Groups of one engine share its block ids (one block pool; vLLM's groups overlay one
 * allocation), so a D block named by two groups would take two groups' bytes.
 */
function checkDistinctDst(lists: readonly BlockList[]): void {
  const seen = new Set<number>();
  for (const [g, l] of lists.entries()) {
    for (const id of l.ids) {
      if (seen.has(id))
        throw requestError(`groups[${g}].dstBlockIds`, `D block ${id} is named by two groups`);
      seen.add(id);
    }
  }
}

/** Several groups' plans as one: pairs by (P rank, D rank), region pairs by (P region, D region). */
function mergePlans(
  plans: readonly TransferPlan[],
  req: GroupsPlanRequest,
  pairing: GroupsPairing,
): TransferPlan {
  const byPair = new Map<string, RankPairPlan[]>();
  for (const plan of plans) {
    for (const pair of plan.pairs) {
      const key = `${pair.srcRank}:${pair.dstRank}`;
      const list = byPair.get(key);
      if (list) list.push(pair);
      else byPair.set(key, [pair]);
    }
  }
  const pairs: RankPairPlan[] = [];
  let bytes = 0;
  let descriptorCount = 0;
  let rawDescriptorCount = 0;
  for (const { srcRank, dstRank } of pairing.rankPairs) {
    const parts = byPair.get(`${srcRank}:${dstRank}`) ?? [];
    const regions = new Map<string, RegionPairDescriptors[]>();
    let pairBytes = 0;
    let raw = 0;
    for (const part of parts) {
      pairBytes += part.bytes;
      raw += part.rawDescriptorCount;
      for (const rp of part.regionPairs) {
        const key = `${rp.srcRegion}:${rp.dstRegion}`;
        const list = regions.get(key);
        if (list) list.push(rp);
        else regions.set(key, [rp]);
      }
    }
    const regionPairs: RegionPairDescriptors[] = [];
    let count = 0;
    for (const list of regions.values()) {
      const merged = concatRegionPairs(list);
      count += merged.count;
      regionPairs.push(merged);
    }
    pairs.push({
      srcRank,
      dstRank,
      bytes: pairBytes,
      descriptorCount: count,
      rawDescriptorCount: raw,
      regionPairs,
    });
    bytes += pairBytes;
    descriptorCount += count;
    rawDescriptorCount += raw;
  }
  return {
    numTokens: req.numTokens,
    prefixTokens: req.prefixTokens,
    pairs,
    bytes,
    descriptorCount,
    rawDescriptorCount,
  };
}

function concatRegionPairs(list: readonly RegionPairDescriptors[]): RegionPairDescriptors {
  if (list.length === 1) return list[0]!;
  let count = 0;
  let bytes = 0;
  for (const rp of list) {
    count += rp.count;
    bytes += rp.bytes;
  }
  const descriptors = new Float64Array(3 * count);
  let at = 0;
  for (const rp of list) {
    descriptors.set(rp.descriptors.subarray(0, 3 * rp.count), at);
    at += 3 * rp.count;
  }
  return {
    srcRegion: list[0]!.srcRegion,
    dstRegion: list[0]!.dstRegion,
    descriptors,
    count,
    bytes,
  };
}

/** Every block id of a transfer's lists, in group order (what its engine holds for it). */
export function allBlockIds(lists: readonly BlockList[]): number[] {
  const out: number[] = [];
  for (const l of lists) for (const id of l.ids) out.push(id);
  return out;
}

/**
 * A message's block lists (`groups`, in the wire's shape), or its one list (`blockIds`) from an
 * engine of one group.
 */
export function blockLists(
  groups: readonly { readonly firstBlock: number; readonly blockIds: readonly number[] }[],
  blockIds: readonly number[],
): BlockList[] {
  if (groups.length === 0) return [{ first: 0, ids: [...blockIds] }];
  return groups.map((g) => ({ first: g.firstBlock, ids: [...g.blockIds] }));
}

/**
 * The blocks of D's lists a transfer may write: per group, those holding tokens from the prefix
 * (or the list's first block) on; a state group's one slot unless D has every token.
 */
export function writtenBlocks(
  groups: readonly KvGroup[],
  lists: readonly BlockList[],
  prefixTokens: number,
  numTokens: number,
): number[] {
  const out: number[] = [];
  if (prefixTokens >= numTokens) return out;
  for (const [g, list] of lists.entries()) {
    const group = groups[g];
    if (group === undefined) continue;
    if (group.kind === "state") {
      if (prefixTokens < numTokens) out.push(...list.ids);
      continue;
    }
    const bs = group.layout.blockSize;
    const from = Math.max(list.first, Math.floor(prefixTokens / bs));
    const to = Math.ceil(numTokens / bs);
    for (let i = from; i < to; i++) {
      const id = list.ids[i - list.first];
      if (id !== undefined) out.push(id);
    }
  }
  return out;
}
