// The built CLI as a child process, for the CLI tests: output collected, exit status and time
// returned, killed (SIGKILL) past its bound. Asynchronous, so an in-process server can answer it.
import { spawn } from "node:child_process";

import { cliScript } from "../../sim/sidecar-process.js";

export interface Run {
  status: number | null;
  stdout: string;
  stderr: string;
  ms: number;
}

export function kvxfer(args: string[], timeoutMs = 20_000): Promise<Run> {
  const t0 = Date.now();
  return new Promise((resolve, reject) => {
    const child = spawn(process.execPath, [cliScript(), ...args], {
      stdio: ["ignore", "pipe", "pipe"],
    });
    let stdout = "";
    let stderr = "";
    child.stdout.on("data", (b: Buffer) => (stdout += b.toString()));
    child.stderr.on("data", (b: Buffer) => (stderr += b.toString()));
    const timer = setTimeout(() => child.kill("SIGKILL"), timeoutMs);
    child.on("error", reject);
    child.on("close", (status) => {
      clearTimeout(timer);
      resolve({ status, stdout, stderr, ms: Date.now() - t0 });
    });
  });
}
