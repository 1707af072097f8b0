/**
 * Blocks claimed by live transfers, block id -> transfer id, so that two live transfers never
 * claim one block (a refused message names the holder). Which blocks each side claims, and for
 * how long, is the side's rule (decode.ts, prefill.ts).
 */
export class BlockClaims {
  private readonly holders = new Map<number, string>();

  /** Why `ids` may not be claimed by `transferId` (the first block another transfer holds). */
  clash(ids: readonly number[], firstIndex: number, transferId: string): string | undefined {
    for (const [i, id] of ids.entries()) {
      const holder = this.holders.get(id);
      if (holder !== undefined && holder !== transferId) {
        return (
          `block_ids[${firstIndex + i}] = ${id} is held by live transfer '${holder}' ` +
          `(two live transfers may not claim one block; retry once it ends)`
        );
      }
    }
    return undefined;
  }

  claim(ids: readonly number[], transferId: string): void {
    for (const id of ids) this.holders.set(id, transferId);
  }

  /** Drops `transferId`'s claims among `ids` (unclaiming ids it never claimed is harmless). */
  release(ids: readonly number[], transferId: string): void {
    for (const id of ids) if (this.holders.get(id) === transferId) this.holders.delete(id);
  }
}
