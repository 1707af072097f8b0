import { type KvLayout, firstKvHeadOfRank, kvHeadsPerRank } from "./layout.js";

/** A run of consecutive KV heads one D rank takes from one P rank. */
export interface HeadSource {
  readonly srcRank: number;
  /** First head of the run, counted within the P rank's heads. */
  readonly srcHeadOffset: number;
  /** First head of the run, counted within the D rank's heads. */
  readonly dstHeadOffset: number;
  readonly numHeads: number;
}

/** Where one D rank's heads come from, in D head order. */
export interface DstRankSources {
  readonly dstRank: number;
  readonly sources: readonly HeadSource[];
}

/**
 * For each D rank, the P ranks that hold its heads and at which head offsets. The layouts must be
 * compatible (`assertCompatible`). Each D head has one source: when P replicates heads (more P
 * ranks than KV heads, or MLA, where every rank holds the latent) D rank `r` takes replica
 * `r % replicas`, so D ranks that want the same head read from different P ranks.
 */
export function mapRanks(src: KvLayout, dst: KvLayout): DstRankSources[] {
  const heads = src.mla ? 1 : src.totalKvHeads;
  const srcPerRank = kvHeadsPerRank(src);
  const replicas = src.tpSize >= heads ? src.tpSize / heads : 1;
  const dstPerRank = kvHeadsPerRank(dst);
  const out: DstRankSources[] = [];
  for (let r = 0; r < dst.tpSize; r++) {
    const first = firstKvHeadOfRank(dst, r);
    const sources: HeadSource[] = [];
    for (let i = 0; i < dstPerRank; i++) {
      const head = first + i;
      const srcRank = Math.floor(head / srcPerRank) * replicas + (r % replicas);
      const srcHeadOffset = head - firstKvHeadOfRank(src, srcRank);
      const last = sources[sources.length - 1];
      if (
        last &&
        last.srcRank === srcRank &&
        last.srcHeadOffset + last.numHeads === srcHeadOffset &&
        last.dstHeadOffset + last.numHeads === i
      ) {
        sources[sources.length - 1] = { ...last, numHeads: last.numHeads + 1 };
      } else {
        sources.push({ srcRank, srcHeadOffset, dstHeadOffset: i, numHeads: 1 });
      }
    }
    out.push({ dstRank: r, sources });
  }
  return out;
}
