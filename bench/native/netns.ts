/**
 * Two network namespaces joined by a veth pair, made (and removed) by the
 * caller: the only "hosts" a cross-host test talks to.
 */
import { execFileSync } from "node:child_process";

export interface NetnsPair {
  names: [string, string];
  devices: [string, string];
  addresses: [string, string];
  /** The command prefix that runs a program inside namespace i. */
  prefix(i: 0 | 1): string[];
  destroy(): void;
}

function ip(...args: string[]): void {
  execFileSync("ip", args, { stdio: "pipe" });
}

/** True when this process may create network namespaces (root with iproute2). */
export function canCreateNetns(): boolean {
  if (process.getuid?.() !== 0) return false;
  try {
    execFileSync("ip", ["-V"], { stdio: "pipe" });
    return true;
  } catch {
    return false;
  }
}

/**
 * `addresses`: the two ends' IPv4 addresses (a /24), by default from 198.18.0.0/15, the range
 * RFC 2544 sets aside for benchmarks: UCX 1.22 and later ignore an interface whose only address
 * is link-local (169.254/16), so link-local ends would leave UCX no TCP device but `lo`.
 */
export function createNetnsPair(
  tag: string,
  addresses: [string, string] = ["198.18.77.1", "198.18.77.2"],
): NetnsPair {
  const id = `${tag}${process.pid % 10000}`;
  const names: [string, string] = [`kvx-${id}-a`, `kvx-${id}-b`];
  const devices: [string, string] = [`kva${process.pid % 100000}`, `kvb${process.pid % 100000}`];
  // Addresses inside namespaces this process made: traffic never leaves them.
  const destroy = (): void => {
    for (const n of names) {
      try {
        ip("netns", "del", n);
      } catch {
        // already gone
      }
    }
  };
  destroy();
  try {
    ip("netns", "add", names[0]);
    ip("netns", "add", names[1]);
    ip("link", "add", devices[0], "type", "veth", "peer", "name", devices[1]);
    for (const i of [0, 1] as const) {
      ip("link", "set", devices[i], "netns", names[i]);
      ip("-n", names[i], "addr", "add", `${addresses[i]}/24`, "dev", devices[i]);
      ip("-n", names[i], "link", "set", devices[i], "up");
      ip("-n", names[i], "link", "set", "lo", "up");
    }
  } catch (err) {
    destroy();
    throw err;
  }
  return {
    names,
    devices,
    addresses,
    prefix: (i) => ["ip", "netns", "exec", names[i]],
    destroy,
  };
}
