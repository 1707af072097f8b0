// The built CLI as a child process, for the CLI tests: output collected, exit status and time
// returned, killed (SIGKILL) past its bound. Asynchronous, so an in-process server can answer it.
import { cliScript } from "../../sim/sidecar-process.js";
import { runNode } from "../run-node.js";

export interface Run {
  status: number | null;
  stdout: string;
  stderr: string;
  ms: number;
}

export async function kvxfer(args: string[], timeoutMs = 20_000): Promise<Run> {
  const t0 = Date.now();
  const r = await runNode([cliScript(), ...args], process.env, timeoutMs);
  return { ...r, ms: Date.now() - t0 };
}
