/**
 * UCX's own programs (ucx_perftest, ucx_info) from the UCX kvxfer is built against: the pinned
 * install scripts/setup-ucx.sh unpacks into .ucx/libucx, run with its libraries, so a reference
 * figure comes from the same UCX as kvxfer's. Without that install, the program on the PATH.
 */
import { existsSync } from "node:fs";
import { join, resolve } from "node:path";

import { packageRoot } from "./report.js";

/** The pinned UCX's prefix (.ucx/libucx), or undefined when it is not installed. */
export function pinnedUcxPrefix(): string | undefined {
  const prefix = resolve(packageRoot(), ".ucx", "libucx");
  return existsSync(join(prefix, "bin", "ucx_perftest")) ? prefix : undefined;
}

/** How to run UCX program `name`: its path and the environment it needs (on top of `env`). */
export function ucxTool(
  name: "ucx_perftest" | "ucx_info",
  env: NodeJS.ProcessEnv = process.env,
): { command: string; env: NodeJS.ProcessEnv } {
  const prefix = pinnedUcxPrefix();
  if (prefix === undefined) return { command: name, env };
  const lib = join(prefix, "lib");
  return {
    command: join(prefix, "bin", name),
    env: {
      ...env,
      LD_LIBRARY_PATH: env.LD_LIBRARY_PATH ? `${lib}:${env.LD_LIBRARY_PATH}` : lib,
    },
  };
}
