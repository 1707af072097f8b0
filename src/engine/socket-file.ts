/**
 * The files of an ipc:// engine endpoint: the socket ZeroMQ binds and the lock beside it that
 * proves a live holder, each removed only while it is still the file this process made.
 */
import { lstatSync, unlinkSync } from "node:fs";
import { connect, createServer, type Server } from "node:net";

/** The path of an `ipc://` endpoint, or undefined for any other transport. */
export function ipcPath(endpoint: string): string | undefined {
  return endpoint.startsWith("ipc://") ? endpoint.slice("ipc://".length) : undefined;
}

/**
 * Whether something accepts connections on the unix socket at `path`: true when a connect
 * succeeds, false when nothing listens (ECONNREFUSED: a file left by a process that died;
 * ENOENT), rejects on anything else or after `timeoutMs`.
 */
export function socketLive(path: string, timeoutMs = 1000): Promise<boolean> {
  return new Promise((resolve, reject) => {
    const s = connect({ path });
    const timer = setTimeout(() => {
      s.destroy();
      reject(new Error(`no answer from ${path} within ${timeoutMs} ms`));
    }, timeoutMs);
    s.once("connect", () => {
      clearTimeout(timer);
      s.destroy();
      resolve(true);
    });
    s.once("error", (err: NodeJS.ErrnoException) => {
      clearTimeout(timer);
      s.destroy();
      if (err.code === "ECONNREFUSED" || err.code === "ENOENT") resolve(false);
      else reject(err);
    });
  });
}

/** Listens on the unix socket `path`; rejects with the listen error (EADDRINUSE: it exists). */
export function listenLock(path: string): Promise<Server> {
  return new Promise((resolve, reject) => {
    // Nothing is said on the lock: a connection only proves its holder alive.
    const server = createServer((c) => c.destroy());
    server.once("error", reject);
    server.listen({ path, exclusive: true }, () => {
      server.off("error", reject);
      server.on("error", () => undefined);
      server.unref();
      resolve(server);
    });
  });
}

/** (device, inode) of `path`, or undefined when it does not exist. */
export function fileId(path: string): string | undefined {
  try {
    const st = lstatSync(path, { bigint: true });
    return `${st.dev}:${st.ino}`;
  } catch {
    return undefined;
  }
}

/** Removes `path` if it is still the file `id` (not one another process made since). */
export function unlinkIfSame(path: string, id: string | undefined): void {
  if (id === undefined || fileId(path) !== id) return;
  try {
    unlinkSync(path);
  } catch {
    // already gone
  }
}
