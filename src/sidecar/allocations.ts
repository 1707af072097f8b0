/**
 * KV regions the sidecar allocates for its engine (`AllocateKv`), before the engine registers
 * them. UCX allocates each from its sysv memory domain: a SysV shared-memory segment that the
 * engine attaches by id and computes into, and that UCX's shared-memory transports move with
 * plain copies between the two sidecars of one host (registered file memory goes through a
 * system call per operation, several times slower: docs/benchmarks.md).
 *
 * The regions of one rank come from that rank's agent, made here; the registration that names
 * them takes the agent and its regions over (`take`). What no registration took is freed when
 * the connection that asked for it ends, when it asks again for the same rank, or when another
 * connection's registration is accepted. Segments are owner-only (mode 0600) and marked for
 * removal: the memory goes away once the sidecar and the engine have both let go of it.
 */
import { KvxferError } from "../errors.js";
import type { Agent, Region } from "../native/index.js";

/** One rank's allocation: its agent, and its regions in the layout's order. */
export interface RankAllocation {
  readonly rank: number;
  readonly tpSize: number;
  readonly agent: Agent;
  readonly regions: readonly Region[];
  /** The engine link connection that asked for it. */
  readonly connection: string;
  readonly bytes: number;
}

export class KvAllocations {
  private readonly byRank = new Map<number, RankAllocation>();

  /** Bytes allocated and not yet registered (counted against --max-kv-bytes). */
  get bytes(): number {
    let n = 0;
    for (const a of this.byRank.values()) n += a.bytes;
    return n;
  }

  /**
   * Allocates one rank's regions with a new agent (`makeAgent`), every page faulted in when
   * `populate` (--prefault); replaces (and frees) an earlier
   * allocation for the same rank. Throws ERR_NO_SEGMENT when UCX did not allocate from SysV
   * shared memory (nothing is kept then).
   */
  allocate(
    rank: number,
    tpSize: number,
    lengths: readonly number[],
    connection: string,
    makeAgent: () => Agent,
    populate = false,
  ): RankAllocation {
    this.free(rank);
    const agent = makeAgent();
    const regions: Region[] = [];
    try {
      for (const [g, length] of lengths.entries()) {
        const region = agent.allocate(length, { populate });
        regions.push(region);
        if (region.segment === null) {
          throw new KvxferError(
            "ERR_NO_SEGMENT",
            `region ${g}: UCX allocated it outside SysV shared memory, which an engine cannot ` +
              "attach (is UCX_ALLOC_PRIO set without md:sysv?)",
          );
        }
      }
    } catch (err) {
      agent.close();
      throw err;
    }
    const a: RankAllocation = {
      rank,
      tpSize,
      agent,
      regions,
      connection,
      bytes: lengths.reduce((s, n) => s + n, 0),
    };
    this.byRank.set(rank, a);
    return a;
  }

  /** The allocation of `rank`, if any (still owned here). */
  get(rank: number): RankAllocation | undefined {
    return this.byRank.get(rank);
  }

  /** Hands `rank`'s allocation over to a registration: it is no longer freed here. */
  take(rank: number): RankAllocation | undefined {
    const a = this.byRank.get(rank);
    this.byRank.delete(rank);
    return a;
  }

  /** Frees `rank`'s allocation (its agent and regions), if any. */
  free(rank: number): void {
    const a = this.byRank.get(rank);
    if (a === undefined) return;
    this.byRank.delete(rank);
    a.agent.close();
  }

  /** Frees what `connection` asked for (its connection ended); how many ranks. */
  freeConnection(connection: string): number {
    let n = 0;
    for (const a of [...this.byRank.values()]) {
      if (a.connection !== connection) continue;
      this.free(a.rank);
      n++;
    }
    return n;
  }

  /** Frees everything. */
  freeAll(): void {
    for (const rank of [...this.byRank.keys()]) this.free(rank);
  }
}
