/**
 * The simulated engine as a process (`kvxfer sim-engine`, engine-main.ts): its
 * flags, its `SimEngine`, and the router's control requests over JSON lines on
 * stdin/stdout until `exit`, end of stdin, SIGTERM or SIGINT.
 */
import { createInterface } from "node:readline";

import { pino } from "pino";

import { stderrSink } from "../src/sidecar/index.js";
import { SimEngine } from "./engine.js";
import {
  type SimEngineConfig,
  SIM_ENGINE_USAGE,
  parseSimEngineArgs,
  type ControlRequest,
} from "./engine-input.js";

/**
 * Runs a simulated engine until `exit`, end of stdin, SIGTERM or SIGINT; resolves with the
 * process exit code once its KV files are removed. The caller exits the process with it.
 */
export async function runSimEngine(argv: readonly string[]): Promise<number> {
  const write = (obj: Record<string, unknown>): void => {
    process.stdout.write(JSON.stringify(obj) + "\n");
  };
  process.stdout.on("error", () => undefined); // a driver that went away must not crash us
  let cfg: SimEngineConfig;
  try {
    cfg = parseSimEngineArgs(argv);
  } catch (err) {
    const e = err as { code?: string; message: string };
    write({ event: "error", code: e.code ?? "ERR_USAGE", message: e.message });
    process.stderr.write(`${e.message}\n${SIM_ENGINE_USAGE}\n`);
    return 2;
  }
  const log = pino(
    { name: "sim-engine", level: cfg.logLevel, base: { engineId: cfg.engineId, pid: process.pid } },
    // Never blocks, like the sidecar's (src/sidecar/log-sink.ts).
    stderrSink(),
  );
  const engine = new SimEngine(cfg, log, write);
  const onExit = (): void => engine.removeFiles();
  process.on("exit", onExit);

  let finish!: (code: number) => void;
  const done = new Promise<number>((resolve) => (finish = resolve));
  let exitCode: number | undefined;
  const shutdown = (code: number): void => {
    if (exitCode !== undefined) return;
    exitCode = code;
    void engine.stop().then(
      () => finish(code),
      (err: unknown) => {
        log.error({ err }, "shutdown failed");
        finish(code === 0 ? 1 : code);
      },
    );
  };
  const onTerm = (): void => shutdown(143);
  const onInt = (): void => shutdown(130);
  process.once("SIGTERM", onTerm);
  process.once("SIGINT", onInt);

  let ready = false;
  const pending: ControlRequest[] = [];
  const serve = (req: ControlRequest): void => {
    const id = req.id;
    engine.handle(req).then(
      (result) => {
        write({ id, result });
        if (req.op === "exit") shutdown(0);
      },
      (err: unknown) => {
        const e = err as { code?: unknown; message?: unknown };
        write({
          id,
          error: {
            code: typeof e?.code === "string" ? e.code : "ERR_INTERNAL",
            message: typeof e?.message === "string" ? e.message : String(err),
          },
        });
      },
    );
  };
  const lines = createInterface({ input: process.stdin });
  lines.on("line", (line) => {
    if (line.trim() === "") return;
    let req: ControlRequest;
    try {
      req = JSON.parse(line) as ControlRequest;
      if (typeof req !== "object" || req === null) throw new Error("not an object");
    } catch (err) {
      write({
        id: null,
        error: { code: "ERR_BAD_REQUEST", message: `bad JSON line: ${(err as Error).message}` },
      });
      return;
    }
    if (ready) serve(req);
    else pending.push(req);
  });
  // End of stdin stops the engine, but not before its start has an answer: an engine started
  // with stdin closed still registers (or says why it could not, exit code 1).
  let stdinClosed = false;
  lines.on("close", () => {
    stdinClosed = true;
    if (ready) shutdown(0);
  });

  try {
    write(await engine.start());
    ready = true;
    for (const req of pending.splice(0)) serve(req);
    if (stdinClosed) shutdown(0);
  } catch (err) {
    const e = err as { code?: unknown; message?: unknown };
    const error = {
      code: typeof e?.code === "string" ? e.code : "ERR_START",
      message: typeof e?.message === "string" ? e.message : String(err),
    };
    // One line for whoever reads stderr (the JSON event is for a driver); no stack trace.
    if (exitCode === undefined)
      process.stderr.write(`kvxfer sim-engine: ${error.code}: ${error.message}\n`);
    write({ event: "error", ...error });
    for (const req of pending.splice(0)) write({ id: req.id, error });
    shutdown(1);
  }
  const code = await done;
  lines.close();
  process.off("SIGTERM", onTerm);
  process.off("SIGINT", onInt);
  process.off("exit", onExit);
  return code;
}
