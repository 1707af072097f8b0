/**
 * The network fault harness (issue 52), used by the tests (test/net/, the sidecars' net-faults
 * cases) and by `kvxfer bench peers --faults` (NIXL's and Mooncake's agents on the same link): two "hosts" (network namespaces P and D) joined by one
 * data veth, each also joined to this (the test's) namespace by a management veth that carries
 * only gRPC and metrics and is never impaired. Faults act on the data link alone:
 *
 * - bandwidth caps: `tbf` on each end's egress;
 * - loss and one-way drops (partitions in one direction or both): iptables rules in a chain of
 *   our own on the receiving end's INPUT (`-m statistic --mode random --probability p`, DROP),
 *   so what is lost is lost on the wire, and the sender's sockets see nothing locally;
 * - link down: `ip link set … down` on one end;
 * - delay and jitter (and so reordering): `nfq-delay.c`, a delay line of our own that an
 *   iptables NFQUEUE rule on the receiving end feeds (for kernels without netem; needs
 *   libnetfilter-queue-dev and cc, else skipped by name: `delayMissing`);
 * - delay, jitter, duplication, reordering, corruption: `netem` where the kernel has it; a
 *   kernel without it (these machines: "Specified qdisc kind is unknown") skips those cases by
 *   name (`netemMissing`), never counts them as passing.
 *
 * The veths run with `gso_max_segs 1` and TSO/GSO/GRO off: otherwise one "packet" iptables or
 * tbf sees is up to 64 KiB of wire packets, and a 1% loss would be a 1% loss of 64 KiB bursts.
 *
 * Every name made here starts with `kx52` (namespaces, veths, chains); addresses are inside
 * 198.18.0.0/15 (RFC 2544). `destroy()` removes everything (deleting a namespace removes its
 * veth ends, qdiscs and iptables rules with it) and is safe to call twice; a harness left by a
 * killed run of the same tag is removed before a new one is made.
 */
import { execFileSync, spawn, type ChildProcess } from "node:child_process";
import { createHash } from "node:crypto";
import { existsSync, readFileSync, renameSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";

import { packageRoot } from "../report.js";

export type Side = "p" | "d";

/** What one call of the harness runs (for the tests' logs). */
function run(cmd: string, args: string[], timeoutMs = 10_000): string {
  return execFileSync(cmd, args, { stdio: "pipe", timeout: timeoutMs, encoding: "utf8" });
}

function has(cmd: string, args: string[]): boolean {
  try {
    run(cmd, args, 5_000);
    return true;
  } catch {
    return false;
  }
}

export interface FaultSupport {
  /** Why no fault net can be made here (not root, no ip/tc/iptables), or undefined. */
  missing: string | undefined;
  /** Why netem cases are skipped here, or undefined when the kernel has netem. */
  netemMissing: string | undefined;
  /** Why the NFQUEUE delay line cannot run here (no compiler or libnetfilter_queue), or undefined. */
  delayMissing: string | undefined;
}

let delayBinary: string | undefined;

/**
 * The delay line, compiled into the temp directory under the hash of its source (one small
 * file, reused by every later run of the same source); throws why it cannot be.
 */
export function nfqDelayBinary(): string {
  if (delayBinary !== undefined) return delayBinary;
  const source = join(packageRoot(), "bench", "net", "nfq-delay.c");
  const hash = createHash("sha256").update(readFileSync(source)).digest("hex").slice(0, 16);
  const out = join(tmpdir(), `kx52-nfq-delay-${hash}`);
  if (!existsSync(out)) {
    if (!existsSync("/usr/include/libnetfilter_queue/libnetfilter_queue.h"))
      throw new Error("no libnetfilter_queue headers (apt-get install libnetfilter-queue-dev)");
    // Built beside it and renamed: a run at the same time never sees half a binary.
    const partial = `${out}.${process.pid}`;
    run("cc", ["-O2", "-o", partial, source, "-lnetfilter_queue", "-lnfnetlink"], 60_000);
    renameSync(partial, out);
  }
  delayBinary = out;
  return out;
}

let support: FaultSupport | undefined;

/** What this machine can do, probed once (a scratch namespace, removed at once). */
export function faultSupport(): FaultSupport {
  if (support !== undefined) return support;
  let missing: string | undefined;
  if (process.getuid?.() !== 0) missing = "not root (ip netns needs it)";
  else if (!has("ip", ["-V"])) missing = "no iproute2 (ip)";
  else if (!has("tc", ["-V"])) missing = "no tc";
  else if (!has("iptables", ["--version"])) missing = "no iptables (apt-get install iptables)";
  let netemMissing: string | undefined = missing;
  if (missing === undefined) {
    const ns = `kx52-probe-${process.pid % 100000}`;
    try {
      run("ip", ["netns", "add", ns]);
      run("ip", ["-n", ns, "link", "set", "lo", "up"]);
      try {
        run("tc", ["-n", ns, "qdisc", "add", "dev", "lo", "root", "tbf", ...tbfArgs(100)]);
      } catch (err) {
        missing = `no tbf qdisc: ${(err as Error).message.split("\n")[0]}`;
      }
      try {
        run("tc", ["-n", ns, "qdisc", "replace", "dev", "lo", "root", "netem", "delay", "1ms"]);
        netemMissing = undefined;
      } catch (err) {
        const stderr = String((err as { stderr?: unknown }).stderr ?? "").trim();
        netemMissing = `no netem qdisc in this kernel (tc: ${stderr || "failed"})`;
      }
      try {
        run("ip", ["netns", "exec", ns, "iptables", "-w", "5", "-N", "kx52-probe"]);
        run("ip", [
          "netns",
          "exec",
          ns,
          "iptables",
          "-w",
          "5",
          "-A",
          "kx52-probe",
          "-m",
          "statistic",
          "--mode",
          "random",
          "--probability",
          "0.5",
          "-j",
          "DROP",
        ]);
      } catch (err) {
        missing = `iptables cannot drop at random: ${(err as Error).message.split("\n")[0]}`;
      }
    } finally {
      try {
        run("ip", ["netns", "del", ns]);
      } catch {
        // not made
      }
    }
  }
  let delayMissing: string | undefined = missing;
  if (missing === undefined) {
    try {
      nfqDelayBinary();
    } catch (err) {
      delayMissing = `no NFQUEUE delay line: ${(err as Error).message.split("\n")[0]}`;
    }
  }
  support = { missing, netemMissing, delayMissing };
  return support;
}

/** tbf at `mbit`: a burst of a few packets, and a queue of at most 50 ms of the rate. */
function tbfArgs(mbit: number): string[] {
  const burst = Math.max(16_000, Math.round((mbit * 1e6) / 8 / 250));
  return ["rate", `${mbit}mbit`, "burst", String(burst), "latency", "50ms"];
}

export interface HostEnd {
  /** The namespace's name. */
  ns: string;
  /** Its end of the data veth, and that end's address (side channel and UCX go here). */
  dev: string;
  address: string;
  /** Its end of its management veth, reachable from this namespace (gRPC, metrics). */
  mgmtAddress: string;
  /** The command prefix that runs a program in this namespace. */
  prefix: string[];
}

export interface NetemSpec {
  delayMs?: number;
  jitterMs?: number;
  lossPct?: number;
  duplicatePct?: number;
  corruptPct?: number;
  reorderPct?: number;
}

/** The other side. */
export function other(side: Side): Side {
  return side === "p" ? "d" : "p";
}

export class FaultNet {
  readonly hosts: Record<Side, HostEnd>;
  private readonly mgmtDevs: string[];
  private destroyed = false;
  /** Faults applied now, by name (for logs and for `heal`). */
  private readonly applied = new Set<string>();
  /** The delay lines running, by the side whose arriving packets they hold. */
  private readonly delayLines = new Map<Side, ChildProcess>();

  /**
   * `tag`: a few letters naming the test file; `octet` (1-250): the /24s this harness uses
   * (198.18.<octet>.0 data, 198.19.<octet>.0 management). Files running at once pass different
   * tags and octets.
   */
  constructor(
    readonly tag: string,
    readonly octet: number,
  ) {
    if (!/^[a-z0-9]{1,4}$/.test(tag)) throw new Error(`tag '${tag}': 1-4 of [a-z0-9]`);
    if (!(octet >= 1 && octet <= 250)) throw new Error(`octet ${octet}`);
    // Interface names are at most 15 characters: kx52<tag>p / kx52<tag>pm.
    const dev = (s: Side): string => `kx52${tag}${s}`;
    this.hosts = {
      p: {
        ns: `kx52-${tag}-p`,
        dev: dev("p"),
        address: `198.18.${octet}.1`,
        mgmtAddress: `198.19.${octet}.2`,
        prefix: ["ip", "netns", "exec", `kx52-${tag}-p`],
      },
      d: {
        ns: `kx52-${tag}-d`,
        dev: dev("d"),
        address: `198.18.${octet}.2`,
        mgmtAddress: `198.19.${octet}.6`,
        prefix: ["ip", "netns", "exec", `kx52-${tag}-d`],
      },
    };
    this.mgmtDevs = [`kx52${tag}pm`, `kx52${tag}dm`];
    this.remove();
    try {
      this.make();
    } catch (err) {
      this.remove();
      throw err;
    }
  }

  private make(): void {
    run("ip", ["netns", "add", this.hosts.p.ns]);
    run("ip", ["netns", "add", this.hosts.d.ns]);
    run("ip", ["link", "add", this.hosts.p.dev, "type", "veth", "peer", "name", this.hosts.d.dev]);
    for (const side of ["p", "d"] as const) {
      this.moveDataEnd(side);
      this.hookChains(side);
      this.makeMgmt(side);
    }
  }

  /** `side`'s end of the data veth into its namespace: address, one packet per skb, up. */
  private moveDataEnd(side: Side): void {
    const h = this.hosts[side];
    run("ip", ["link", "set", h.dev, "netns", h.ns]);
    run("ip", ["-n", h.ns, "addr", "add", `${h.address}/24`, "dev", h.dev]);
    // One wire packet per skb: per-packet loss and rate are then per wire packet.
    run("ip", ["-n", h.ns, "link", "set", h.dev, "gso_max_segs", "1"]);
    run("ip", ["-n", h.ns, "link", "set", h.dev, "up"]);
    run("ip", ["-n", h.ns, "link", "set", "lo", "up"]);
    if (has("ethtool", ["--version"]))
      run("ip", [
        "netns",
        "exec",
        h.ns,
        "ethtool",
        "-K",
        h.dev,
        "tso",
        "off",
        "gso",
        "off",
        "gro",
        "off",
      ]);
  }

  /** Our chains, hooked first in `side`'s INPUT for the data device only: drops, then the delay line. */
  private hookChains(side: Side): void {
    const h = this.hosts[side];
    this.ipt(side, ["-N", "kx52-in"]);
    this.ipt(side, ["-N", "kx52-dl"]);
    this.ipt(side, ["-I", "INPUT", "1", "-i", h.dev, "-j", "kx52-dl"]);
    this.ipt(side, ["-I", "INPUT", "1", "-i", h.dev, "-j", "kx52-in"]);
  }

  /** The management link: this namespace <-> `side`'s host, a /30. */
  private makeMgmt(side: Side): void {
    const h = this.hosts[side];
    const devHere = this.mgmtDevs[side === "p" ? 0 : 1]!;
    const addrHere = `198.19.${this.octet}.${side === "p" ? 1 : 5}`;
    const devThere = `${devHere}x`;
    // After a host vanished, the root end of its old link lives until the kernel has freed the
    // old namespace (asynchronously): a rebuild right after deletes it first.
    try {
      run("ip", ["link", "del", devHere]);
    } catch {
      // not there
    }
    run("ip", ["link", "add", devHere, "type", "veth", "peer", "name", devThere]);
    run("ip", ["link", "set", devThere, "netns", h.ns]);
    run("ip", ["addr", "add", `${addrHere}/30`, "dev", devHere]);
    run("ip", ["link", "set", devHere, "up"]);
    run("ip", ["-n", h.ns, "addr", "add", `${h.mgmtAddress}/30`, "dev", devThere]);
    run("ip", ["-n", h.ns, "link", "set", devThere, "up"]);
  }

  /** iptables in one host's namespace (waits for the xtables lock, bounded). */
  private ipt(side: Side, args: string[]): void {
    run("ip", ["netns", "exec", this.hosts[side].ns, "iptables", "-w", "5", ...args]);
  }

  /** Caps what `side` sends on the data link at `mbit` (both sides when side is omitted). */
  cap(mbit: number, side?: Side): void {
    for (const s of side === undefined ? (["p", "d"] as const) : [side]) {
      const h = this.hosts[s];
      run("tc", ["-n", h.ns, "qdisc", "replace", "dev", h.dev, "root", "tbf", ...tbfArgs(mbit)]);
      this.applied.add(`cap:${s}`);
    }
  }

  /** Removes the caps (and any netem) on the data link. */
  uncap(): void {
    for (const s of ["p", "d"] as const) {
      const h = this.hosts[s];
      try {
        run("tc", ["-n", h.ns, "qdisc", "del", "dev", h.dev, "root"]);
      } catch {
        // none there
      }
      this.applied.delete(`cap:${s}`);
      this.applied.delete(`netem:${s}`);
    }
  }

  /**
   * Drops packets `from` one side to the other: every one (probability 1, a one-way partition)
   * or each with `probability` (loss). A second call replaces the first for that direction.
   */
  drop(from: Side, probability = 1): void {
    const to = other(from);
    this.ipt(to, ["-F", "kx52-in"]);
    const stat =
      probability >= 1
        ? []
        : ["-m", "statistic", "--mode", "random", "--probability", String(probability)];
    this.ipt(to, ["-A", "kx52-in", ...stat, "-j", "DROP"]);
    this.applied.add(`drop:${from}`);
  }

  /** Cuts the data link both ways (every packet dropped at both receivers). */
  partition(): void {
    this.drop("p");
    this.drop("d");
  }

  /** Ends every drop and loss rule (the link itself stays as it is). */
  heal(): void {
    for (const s of ["p", "d"] as const) this.ipt(s, ["-F", "kx52-in"]);
    this.applied.delete("drop:p");
    this.applied.delete("drop:d");
  }

  /** Takes `side`'s end of the data link down (or up again). */
  link(side: Side, up: boolean): void {
    const h = this.hosts[side];
    run("ip", ["-n", h.ns, "link", "set", h.dev, up ? "up" : "down"]);
    if (up) this.applied.delete(`down:${side}`);
    else this.applied.add(`down:${side}`);
  }

  /**
   * Holds every packet arriving at `side` on the data link `delayMs` ± up to `jitterMs` (so one
   * way: call it for both sides for a round trip's worth), with the NFQUEUE delay line. Packets
   * leave in the order they came unless `reorder` (then jitter wider than the gap between two
   * packets swaps them, as netem's jitter does). Resolves once the line is running and the rule
   * in place. Throws when `faultSupport().delayMissing`.
   */
  async delay(side: Side, delayMs: number, jitterMs = 0, reorder = false): Promise<void> {
    const why = faultSupport().delayMissing;
    if (why !== undefined) throw new Error(`delay: ${why}`);
    this.undelay(side);
    const h = this.hosts[side];
    const queue = String(52);
    const child = spawn(
      h.prefix[0]!,
      [
        ...h.prefix.slice(1),
        nfqDelayBinary(),
        queue,
        String(delayMs),
        String(jitterMs),
        reorder ? "reorder" : "order",
      ],
      { stdio: ["ignore", "pipe", "pipe"] },
    );
    this.delayLines.set(side, child);
    let err = "";
    child.stderr!.on("data", (d: Buffer) => (err += d.toString()));
    await new Promise<void>((resolve, reject) => {
      const t = setTimeout(
        () => reject(new Error(`delay line in ${side} not ready: ${err}`)),
        10_000,
      );
      child.stdout!.once("data", () => {
        clearTimeout(t);
        resolve();
      });
      child.once("exit", (code) => {
        clearTimeout(t);
        reject(new Error(`delay line in ${side} exited ${code}: ${err}`));
      });
    });
    // --queue-bypass: were the line gone, packets pass instead of being dropped.
    this.ipt(side, ["-A", "kx52-dl", "-j", "NFQUEUE", "--queue-num", queue, "--queue-bypass"]);
    this.applied.add(`delay:${side}`);
  }

  /** Ends the delay line at `side` (both when omitted): the rule first, then the process. */
  undelay(side?: Side): void {
    for (const s of side === undefined ? (["p", "d"] as const) : [side]) {
      try {
        this.ipt(s, ["-F", "kx52-dl"]);
      } catch {
        // the namespace is gone
      }
      this.delayLines.get(s)?.kill("SIGTERM");
      this.delayLines.delete(s);
      this.applied.delete(`delay:${s}`);
    }
  }

  /**
   * netem on `side`'s egress (delay, jitter, loss, duplication, corruption, reordering). Throws
   * when the kernel has no netem: callers check `faultSupport().netemMissing` first and skip.
   */
  netem(spec: NetemSpec, side: Side): void {
    const why = faultSupport().netemMissing;
    if (why !== undefined) throw new Error(`netem: ${why}`);
    const a: string[] = [];
    if (spec.delayMs !== undefined) {
      a.push("delay", `${spec.delayMs}ms`);
      if (spec.jitterMs !== undefined) a.push(`${spec.jitterMs}ms`);
    }
    if (spec.lossPct !== undefined) a.push("loss", `${spec.lossPct}%`);
    if (spec.duplicatePct !== undefined) a.push("duplicate", `${spec.duplicatePct}%`);
    if (spec.corruptPct !== undefined) a.push("corrupt", `${spec.corruptPct}%`);
    if (spec.reorderPct !== undefined) a.push("reorder", `${spec.reorderPct}%`);
    const h = this.hosts[side];
    run("tc", ["-n", h.ns, "qdisc", "replace", "dev", h.dev, "root", "netem", ...a]);
    this.applied.add(`netem:${side}`);
  }

  /** Faults in force now, by name. */
  faults(): string[] {
    return [...this.applied].sort();
  }

  /** Bytes and packets each data end has sent and received (from the kernel's counters). */
  counters(side: Side): { txBytes: number; rxBytes: number; txPackets: number } {
    const h = this.hosts[side];
    const read = (f: string): number =>
      Number(run("ip", ["netns", "exec", h.ns, "cat", `/sys/class/net/${h.dev}/statistics/${f}`]));
    return { txBytes: read("tx_bytes"), rxBytes: read("rx_bytes"), txPackets: read("tx_packets") };
  }

  /** Packets our drop rule on `side`'s INPUT has dropped (iptables' counter). */
  dropped(side: Side): number {
    const out = run("ip", [
      "netns",
      "exec",
      this.hosts[side].ns,
      "iptables",
      "-w",
      "5",
      "-L",
      "kx52-in",
      "-v",
      "-n",
      "-x",
    ]);
    let n = 0;
    for (const line of out.split("\n").slice(2)) {
      const pkts = Number(line.trim().split(/\s+/)[0]);
      if (Number.isFinite(pkts)) n += pkts;
    }
    return n;
  }

  /**
   * Bytes the TCP sockets on `side`'s data address still have to send (Send-Q, from `ss`): after
   * a heal, what the old connections queued during the partition is still delivered, seconds
   * later, as TCP's backed-off retransmissions resume.
   */
  unsent(side: Side): number {
    const h = this.hosts[side];
    const out = run("ip", ["netns", "exec", h.ns, "ss", "-tnH", "state", "established"]);
    let n = 0;
    for (const line of out.split("\n")) {
      const f = line.trim().split(/\s+/);
      // Recv-Q Send-Q Local:Port Peer:Port (state filtered, so no State column).
      if (f.length >= 4 && f[2]!.startsWith(`${h.address}:`)) n += Number(f[1]) || 0;
    }
    return n;
  }

  /** True while both namespaces exist. */
  exists(): boolean {
    const list = run("ip", ["netns", "list"]);
    return list.includes(this.hosts.p.ns) && list.includes(this.hosts.d.ns);
  }

  /**
   * `side`'s host vanishes at once, as a host that dies does (its processes are the caller's to
   * kill): its namespace is deleted, and its end of the data link leaves with it for the root
   * namespace, down and without an address, so the other host keeps its device (as it keeps its
   * NIC when a machine on its switch dies) and nothing answers at the gone host's address. Its
   * management link goes with the namespace. `rebuild` brings the host back; `destroy` is
   * still needed.
   */
  vanish(side: Side): void {
    const h = this.hosts[side];
    try {
      run("ip", ["-n", h.ns, "link", "set", h.dev, "netns", "1"]);
      run("ip", ["link", "set", h.dev, "down"]);
    } catch {
      // gone already
    }
    try {
      run("ip", ["netns", "del", h.ns]);
    } catch {
      // gone already
    }
  }

  /**
   * A host that vanished comes back: its namespace, its end of the data link as at the start
   * (the other host's end and iptables rules never left), and its management link. Faults
   * applied on its side before are gone with it.
   */
  rebuild(side: Side): void {
    run("ip", ["netns", "add", this.hosts[side].ns]);
    this.moveDataEnd(side);
    this.hookChains(side);
    this.makeMgmt(side);
    this.applied.delete(`cap:${side}`);
    this.applied.delete(`netem:${side}`);
    this.applied.delete(`down:${side}`);
  }

  private remove(): void {
    for (const h of Object.values(this.hosts)) {
      try {
        run("ip", ["netns", "del", h.ns]);
      } catch {
        // not there
      }
    }
    // A management veth's root end goes with its peer's namespace, a data end that vanished
    // with a host is in the root namespace: delete them anyway if left.
    for (const dev of [...this.mgmtDevs, this.hosts.p.dev, this.hosts.d.dev]) {
      try {
        run("ip", ["link", "del", dev]);
      } catch {
        // not there
      }
    }
  }

  /** Removes both namespaces (their veths, qdiscs and iptables rules with them). Idempotent. */
  destroy(): void {
    if (this.destroyed) return;
    this.destroyed = true;
    for (const c of this.delayLines.values()) c.kill("SIGKILL");
    this.delayLines.clear();
    this.remove();
    this.applied.clear();
  }
}
