/**
 * kvxfer await <addr> <transfer-id> [--timeout MS] [--side prefill|decode] [--json]:
 * waits for one transfer's terminal event.
 * Exit: 0 KV_READY or RELEASED, 1 FAILED, EXPIRED or ABORTED, 2 usage,
 * 3 the timeout passed first, 4 any other error (unreachable, NOT_FOUND, ...).
 */
import * as grpc from "@grpc/grpc-js";
import { isServiceError } from "../api/client.js";
import {
  type CliIo,
  UsageError,
  formatEvent,
  openClientCommand,
  output,
  toJson,
} from "./grpc-client.js";

export async function runAwait(argv: string[], io: CliIo = {}): Promise<number> {
  const { out, err } = output(io);
  const cmd = openClientCommand("await", argv, err, {
    options: {
      timeout: { type: "string" },
      side: { type: "string" },
      json: { type: "boolean", default: false },
    },
    positionals: 2,
    check: (values, [, transferId]) => {
      if (transferId === undefined || transferId === "")
        throw new UsageError("missing the transfer id");
      let timeoutMs = 30_000;
      if (values.timeout !== undefined) {
        timeoutMs = Number(values.timeout);
        if (!Number.isFinite(timeoutMs) || timeoutMs <= 0)
          throw new UsageError(
            `--timeout must be a positive number of ms, got '${values.timeout}'`,
          );
      }
      if (values.side !== undefined && values.side !== "prefill" && values.side !== "decode")
        throw new UsageError(`--side must be prefill or decode, got '${values.side}'`);
      return { transferId, timeoutMs };
    },
  });
  if (cmd === undefined) return 2;
  const { client, values } = cmd;
  const { transferId, timeoutMs } = cmd.args;
  try {
    const side = values.side as "prefill" | "decode" | undefined;
    const ev = await client.awaitTransfer(
      transferId,
      timeoutMs,
      side !== undefined ? { side } : {},
    );
    out(values.json ? toJson(ev) : formatEvent(ev));
    return ev.kind === "KV_READY" || ev.kind === "RELEASED" ? 0 : 1;
  } catch (e) {
    if (isServiceError(e) && e.code === grpc.status.DEADLINE_EXCEEDED) {
      err(`kvxfer await: transfer '${transferId}' has not ended within ${timeoutMs} ms`);
      return 3;
    }
    err(`kvxfer await: ${cmd.explain(e)}`);
    return 4;
  } finally {
    client.close();
  }
}
