/** The copies between one P region and one D region of one rank pair. */
export interface RegionPairDescriptors {
  readonly srcRegion: number;
  readonly dstRegion: number;
  /**
   * `(srcOffset, dstOffset, length)` triples, byte offsets relative to the start of each region;
   * `descriptors.length === 3 * count`. Push posts them as (local, remote, length) as they are;
   * pull swaps the first two (see `descriptorsForSide`).
   */
  readonly descriptors: Float64Array;
  readonly count: number;
  readonly bytes: number;
}

/**
 * A growable list of `(src, dst, len)` triples that merges a copy into the previous one when it
 * continues it on both sides. Sized up front from an upper bound, so it rarely grows.
 */
export class DescriptorList {
  data: Float64Array;
  count = 0;
  bytes = 0;
  private srcEnd = -1;
  private dstEnd = -1;

  constructor(
    readonly srcRegion: number,
    readonly dstRegion: number,
    capacity: number,
    private readonly coalesce: boolean,
  ) {
    this.data = new Float64Array(3 * Math.max(capacity, 1));
  }

  /**
   * Appends pieces `from .. to - 1` of `ps`/`pd`/`pl` shifted by `srcBase`/`dstBase`. One call
   * per run of pieces keeps the hot loop on locals.
   */
  append(
    srcBase: number,
    dstBase: number,
    ps: Float64Array,
    pd: Float64Array,
    pl: Float64Array,
    from: number,
    to: number,
  ): void {
    this.reserve(to - from);
    const d = this.data;
    const merge = this.coalesce;
    let j = 3 * this.count;
    let srcEnd = this.srcEnd;
    let dstEnd = this.dstEnd;
    let bytes = 0;
    for (let i = from; i < to; i++) {
      const src = srcBase + ps[i]!;
      const dst = dstBase + pd[i]!;
      const len = pl[i]!;
      bytes += len;
      if (merge && src === srcEnd && dst === dstEnd) {
        d[j - 1]! += len;
      } else {
        d[j] = src;
        d[j + 1] = dst;
        d[j + 2] = len;
        j += 3;
      }
      srcEnd = src + len;
      dstEnd = dst + len;
    }
    this.count = j / 3;
    this.srcEnd = srcEnd;
    this.dstEnd = dstEnd;
    this.bytes += bytes;
  }

  /**
   * Appends pieces `0 .. n - 1` for two slots at once, piece by piece: `a`'s piece `i`, then
   * `b`'s, then `a`'s piece `i + 1`. For K and V whose rows interleave inside a block (vLLM's CPU
   * layout: a head's K rows, then its V rows; fused cells: a row of K, then its row of V), that
   * is address order, so a whole block of both becomes one copy instead of one per head or row.
   */
  appendPaired(
    aSrc: number,
    aDst: number,
    bSrc: number,
    bDst: number,
    ps: Float64Array,
    pd: Float64Array,
    pl: Float64Array,
    n: number,
  ): void {
    this.reserve(2 * n);
    const d = this.data;
    const merge = this.coalesce;
    let j = 3 * this.count;
    let srcEnd = this.srcEnd;
    let dstEnd = this.dstEnd;
    let bytes = 0;
    for (let i = 0; i < n; i++) {
      const len = pl[i]!;
      bytes += 2 * len;
      for (let k = 0; k < 2; k++) {
        const src = (k === 0 ? aSrc : bSrc) + ps[i]!;
        const dst = (k === 0 ? aDst : bDst) + pd[i]!;
        if (merge && src === srcEnd && dst === dstEnd) {
          d[j - 1]! += len;
        } else {
          d[j] = src;
          d[j + 1] = dst;
          d[j + 2] = len;
          j += 3;
        }
        srcEnd = src + len;
        dstEnd = dst + len;
      }
    }
    this.count = j / 3;
    this.srcEnd = srcEnd;
    this.dstEnd = dstEnd;
    this.bytes += bytes;
  }

  /**
   * Appends every chunk's pieces for every slot, chunk by chunk (`[block][slot]` order), for
   * layouts whose blocks hold all slots back to back: the one list of such a pair.
   */
  appendInterleaved(
    srcOff: Float64Array,
    dstOff: Float64Array,
    ps: Float64Array,
    pd: Float64Array,
    pl: Float64Array,
    chunkStart: Int32Array,
    chunks: number,
  ): void {
    const nSlots = srcOff.length;
    // The merge loop of `append`, inlined on purpose: calling `append` per (chunk, slot) made the
    // 128k-token cross-layer plan about 40% slower (51 -> 70-84 ms in bench/plan).
    const merge = this.coalesce;
    let srcEnd = this.srcEnd;
    let dstEnd = this.dstEnd;
    let bytes = 0;
    for (let c = 0; c < chunks; c++) {
      const from = chunkStart[c]!;
      const to = chunkStart[c + 1]!;
      this.reserve((to - from) * nSlots);
      const d = this.data;
      let j = 3 * this.count;
      for (let s = 0; s < nSlots; s++) {
        const so = srcOff[s]!;
        const dOff = dstOff[s]!;
        for (let i = from; i < to; i++) {
          const src = so + ps[i]!;
          const dst = dOff + pd[i]!;
          const len = pl[i]!;
          bytes += len;
          if (merge && src === srcEnd && dst === dstEnd) {
            d[j - 1]! += len;
          } else {
            d[j] = src;
            d[j + 1] = dst;
            d[j + 2] = len;
            j += 3;
          }
          srcEnd = src + len;
          dstEnd = dst + len;
        }
      }
      this.count = j / 3;
    }
    this.srcEnd = srcEnd;
    this.dstEnd = dstEnd;
    this.bytes += bytes;
  }

  /** Makes room for `extra` more triples. */
  private reserve(extra: number): void {
    const need = 3 * (this.count + extra);
    if (need > this.data.length) {
      const grown = new Float64Array(Math.max(2 * this.data.length, need));
      grown.set(this.data.subarray(0, 3 * this.count));
      this.data = grown;
    }
  }

  finish(): RegionPairDescriptors {
    const n = 3 * this.count;
    return {
      srcRegion: this.srcRegion,
      dstRegion: this.dstRegion,
      descriptors: n === this.data.length ? this.data : this.data.slice(0, n),
      count: this.count,
      bytes: this.bytes,
    };
  }
}
