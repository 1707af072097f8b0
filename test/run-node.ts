// One Node script as a child process, its output collected, killed past a bound.
import { spawn } from "node:child_process";

export interface NodeRun {
  status: number | null;
  stdout: string;
  stderr: string;
}

/** `node <args>`; SIGKILLed past `timeoutMs` (then `status` is null). */
export function runNode(
  args: string[],
  env: NodeJS.ProcessEnv = process.env,
  timeoutMs = 20_000,
): Promise<NodeRun> {
  return new Promise((resolve, reject) => {
    const child = spawn(process.execPath, args, { stdio: ["ignore", "pipe", "pipe"], env });
    let stdout = "";
    let stderr = "";
    child.stdout.on("data", (b: Buffer) => (stdout += b.toString()));
    child.stderr.on("data", (b: Buffer) => (stderr += b.toString()));
    const timer = setTimeout(() => child.kill("SIGKILL"), timeoutMs);
    child.on("error", reject);
    child.on("close", (status) => {
      clearTimeout(timer);
      resolve({ status, stdout, stderr });
    });
  });
}
