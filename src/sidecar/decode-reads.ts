/**
 * D's reads of a pull, the I/O behind the START_READS effect: the plan of the rank pairs (at
 * CONNECT_PULL), then every pair's reads from P's blocks posted and awaited. The result is the
 * event DecodeSide feeds D's machine next.
 */
import type { Endpoint, OpTrace } from "../native/index.js";
import { KvxferError } from "../errors.js";
import type { PeerState } from "../peer/peer-state.js";
import { descriptorsForSide, planGroups, type KvGroup, type TransferPlan } from "../plan/index.js";
import { transferError, type SideContext } from "./context.js";
import { settleAbandoned } from "./settle.js";
import type { DecodeTransfer } from "./decode-transfer.js";
import { markPairSteps } from "./trace.js";

/** The pairs D reads for `t` from `peer` into `groups` (this engine's), or why there is no plan. */
export function planPull(
  peer: PeerState,
  groups: readonly KvGroup[],
  t: DecodeTransfer,
): TransferPlan | KvxferError {
  try {
    return planGroups(peer.pairing(peer.groups, groups), {
      numTokens: t.numTokens,
      prefixTokens: t.prefixTokens,
      src: t.srcLists!,
      dst: t.dstLists,
    });
  } catch (err) {
    return transferError(err);
  }
}

/**
 * D reads every rank pair's KV from P's blocks and waits for all to settle: undefined when all
 * landed, else the first read's error. Stamps the transfer's bytes, data time and pair steps.
 * A read given up on (its endpoint abandoned: P went silent) is not cancelled in UCX: over TCP
 * its request waits in the old connection and P's answer may still land in D's blocks after the
 * link heals. So on failure this returns only once every abandoned endpoint it read on has
 * settled (UCX holds none of its operations), or after `settleBoundMs`: until then D's blocks
 * stay held (READS_DRAINING).
 */
export async function postReads(
  ctx: SideContext,
  t: DecodeTransfer,
  peer: PeerState,
  plan: TransferPlan,
): Promise<KvxferError | undefined> {
  const kv = ctx.kvs.kv!;
  t.bytes = plan.bytes;
  t.descriptors = plan.descriptorCount;
  const reads: Promise<OpTrace>[] = [];
  const pairOf: string[] = [];
  const used = new Set<Endpoint>();
  try {
    for (const pair of plan.pairs) {
      const agent = kv.agents[pair.dstRank]!;
      const ep = peer.endpoint(pair.dstRank, pair.srcRank);
      used.add(ep);
      for (const rp of pair.regionPairs) {
        if (rp.count === 0) continue;
        const remote = peer.remote(pair.dstRank, pair.srcRank, rp.srcRegion);
        pairOf.push(`${pair.srcRank}>${pair.dstRank}`);
        reads.push(
          agent.read(
            ep,
            kv.regions[pair.dstRank]![rp.dstRegion]!,
            remote,
            descriptorsForSide(rp.descriptors, "dst"),
          ),
        );
      }
    }
  } catch (err) {
    reads.push(Promise.reject(err));
  }
  const settled = await Promise.allSettled(reads);
  t.t.dataDoneMs = ctx.clock.now();
  for (const name of new Set(pairOf)) {
    const ops: OpTrace[] = [];
    settled.forEach((r, i) => {
      if (r.status === "fulfilled" && pairOf[i] === name) ops.push(r.value);
    });
    markPairSteps(t.trace, name, ops);
  }
  const bad = settled.find((s) => s.status === "rejected");
  if (bad === undefined) return undefined;
  await settleAbandoned(ctx, t.id, peer.engineId, [...used]);
  return KvxferError.from((bad as PromiseRejectedResult).reason);
}
